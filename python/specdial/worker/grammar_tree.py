"""Grammar masks on draft trees (issue 31 with issue 29's EAGLE-2 trees): lossless, drafts masked.

Every tree node's allowed-token mask is the grammar state after its own path (root ``x_L`` ..
node): the request's matcher advanced along the node's path tokens. A
:class:`TreeGrammar` serves one tree iteration of a batch with constrained rows
(:class:`~specdial.worker.grammar_masks.BatchGrammar`), through small hooks in
:func:`~specdial.worker.tree_draft.draft_tree` and
:func:`~specdial.worker.tree_step.run_tree_iteration`:

- draft level 1 (:meth:`TreeGrammar.mask_root`): the root's drafter logits ``[B, V]`` masked
  with each row's current state, before the top-k that picks level 1;
- draft level ``l >= 2``: :meth:`TreeGrammar.start_level` (before the level's drafter forward)
  starts the copy of the frontier's tokens and parent indices, :meth:`TreeGrammar.mask_level`
  (after it) walks each frontier node's path on the host, fills its mask and masks the
  drafter's logits ``[B, K, V]`` before the top-k; so every drafted node the drafter could
  give positive probability is grammar-valid (a frontier with fewer than ``K`` allowed tokens
  gets ``-inf``-scored filler children: rejected like any disallowed draft);
- verify: :meth:`TreeGrammar.start_verify` (before the target forward) starts the copy of the
  tree, :meth:`TreeGrammar.mask_verify` (after it) masks the target's logits ``[B, N + 1, V]``
  at every column with that column's path mask (frontier nodes reuse their drafting mask;
  the others are filled now), before :func:`~specdial.worker.tree_accept.tree_accept`: greedy
  argmax, the residual rule and the coupled seeded draws all read the masked target, and the
  bonus token is drawn from it; then every matcher is back at the request's state;
- after the iteration's host copy, :meth:`BatchGrammar.advance` accepts the accepted path and
  the bonus token once (the tree step calls it, as the chain does).

Matcher walks: one :class:`PathWalker` per constrained row moves its matcher from the path it
is at to the next one by rolling back to their common prefix and accepting the rest
(xgrammar's ``rollback``), nodes visited in path order so siblings share their prefix. Chosen
over a forked matcher per frontier node (``GrammarMatcher.fork``): measured on the built-in
tokenizer with a JSON schema and 683 tokens of history, a fork costs about 6 us (it copies
the token history) against about 0.8 us for one accept plus one rollback, and paths are at
most ``D <= 7`` tokens. A node whose token the matcher refuses is unreachable (its token has
target probability 0 under its parent's mask, so it is never accepted); it and its
descendants get an all-allowed mask (finite logits, no NaN in rows nobody reads). After a stop
token (``ignore_eos`` past the grammar's end) only stop tokens are allowed, as on a chain.

Host syncs: one per tree level (``D - 1`` for the frontiers of levels ``2 .. D``, one for the
selected tree before the verify), only in batches with a constrained row. Fewer is
impossible while the drafts are masked: the mask at level ``l`` depends on the tokens the
device's top-k picked at level ``l - 1``, the matcher runs on the host, and the level's top-k
needs the mask; the verify masks need the level-``D`` tokens likewise. Each copy is started
before the level's forward and awaited after it (a CUDA event), so the matcher work overlaps
the drafter's and the target's forwards. No per-element tensor work in Python: the loops run
over the constrained rows and their nodes (matcher calls), masks are unpacked and applied on
the device in one step per level.

Logprobs of constrained rows (:meth:`TreeGrammar.logprob_logits`): the target's raw logits
with the column's grammar mask (``-inf`` where disallowed), so the reported distribution is the
masked one and a disallowed token's log-probability is ``-inf`` (the engine leaves ``-inf``
entries out of the top alternatives).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
import xgrammar as xgr

from specdial.worker.grammar import dead_end
from specdial.worker.grammar_masks import BatchGrammar, fill_row, unpack_bitmask
from specdial.worker.tree import DraftTree

__all__ = ["PathWalker", "TreeGrammar", "mask_logits"]

Path = tuple[int, ...]


class PathWalker:
    """One request's matcher walked between paths below its current state (the root).

    ``at``: the tokens the matcher accepted beyond the root (a prefix of the last path
    visited; tokens after a stop token are not accepted by xgrammar, so they are not in it).
    """

    __slots__ = ("matcher", "at", "stops", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int | None = None) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.at: list[int] = []
        self.stops = frozenset(int(t) for t in matcher.stop_token_ids)

    def goto(self, path: Sequence[int]) -> bool:
        """Move the matcher to the state after ``path`` (tokens after the root); False when
        the grammar refuses one of them (the matcher then stays after the longest allowed
        prefix). Past a stop token only stop tokens are allowed (and change nothing)."""
        m, at = self.matcher, self.at
        n, lim = 0, min(len(at), len(path))
        while n < lim and at[n] == path[n]:
            n += 1
        if n < len(at):
            m.rollback(len(at) - n)
            del at[n:]
        for t in path[n:]:
            if m.is_terminated():
                if t not in self.stops:
                    return False
                continue
            if not m.accept_token(int(t)):
                if (t in self.stops and self.vocab_size is not None
                        and dead_end(m, self.vocab_size)):
                    continue  # a dead end's fallback mask allowed it (grammar_masks.fill_row)
                return False
            at.append(int(t))
        return True

    def fill(self, path: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of the int32 ``bitmask`` ``[R, W]``: the allowed tokens after ``path``,
        all ones (-1) when the path is refused (an unreachable node)."""
        if self.goto(path):
            fill_row(self.matcher, bitmask, row)
        else:
            bitmask[row] = -1

    def reset(self) -> None:
        """Back to the root state (every walked token rolled back)."""
        if self.at:
            self.matcher.rollback(len(self.at))
            self.at.clear()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[..., V]`` with ``-inf`` where ``allowed`` (bool, same shape) is False; a
    drafter row that gives every allowed token ``-inf`` (an EAGLE-3 draft vocabulary without
    them) becomes uniform over the allowed tokens instead of a NaN distribution, as on a
    chain (:meth:`~specdial.worker.grammar_masks.GrammarStep.draft_step`)."""
    masked = logits.masked_fill(~allowed, -math.inf)
    none = torch.isneginf(masked).all(-1, keepdim=True)
    return torch.where(none & allowed, 0.0, masked)


def _start_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying ``t`` to the host; ``(host tensor, CUDA event or None)``: wait on the
    event (:func:`_host`) before reading."""
    if t.device.type != "cuda":
        return t.cpu(), None
    host = t.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _host(pending: tuple[torch.Tensor, Any]) -> np.ndarray:
    """The host array of a :func:`_start_copy` (the level's one sync: waits for the copy
    only, not for work queued after it)."""
    host, event = pending
    if event is not None:
        event.synchronize()
    return host.numpy()


def _upload(bitmask: torch.Tensor, device: torch.device, vocab_size: int) -> torch.Tensor:
    """Host int32 bitmask ``[R, W]`` -> bool ``[R, V]`` on ``device`` (no wait on CUDA: the
    copy goes from pinned memory)."""
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    return unpack_bitmask(bitmask.to(device), vocab_size)


class TreeGrammar:
    """One tree iteration's grammar masks for ``grammar``'s constrained rows (module
    docstring). Call order: :meth:`mask_root`, then per level ``2 .. D``
    :meth:`start_level` / :meth:`mask_level`, then :meth:`start_verify` / :meth:`mask_verify`
    (which returns the matchers to the request's state), then :meth:`logprob_logits` if wanted.
    Logits are float, ``V`` = ``grammar.vocab_size``; ``B`` = ``grammar.batch_size``.
    """

    def __init__(self, grammar: BatchGrammar) -> None:
        self.grammar = grammar
        self.walkers = [PathWalker(m, grammar.vocab_size) for m in grammar.matchers]
        #: per constrained row, path -> its int32 mask row (host), filled once per iteration
        self.cache: list[dict[Path, torch.Tensor]] = [{} for _ in grammar.rows]
        #: per constrained row, the paths of the frontier fed last (level 1's parent: the root)
        self.frontier: list[list[Path]] = [[()] for _ in grammar.rows]
        root = xgr.allocate_token_bitmask(grammar.batch_size, grammar.vocab_size)
        for i, b in enumerate(grammar.rows):
            self.walkers[i].fill((), root, b)
            self.cache[i][()] = root[b]
        self.root_bits = root
        self._pending: tuple[torch.Tensor, Any] | None = None
        self.column_mask: torch.Tensor | None = None

    def mask_root(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft level 1: the root's drafter logits ``[B, V]``, masked (current state)."""
        g = self.grammar
        return mask_logits(logits, _upload(self.root_bits, logits.device, g.vocab_size))

    def start_level(self, tokens: torch.Tensor, parent: torch.Tensor) -> None:
        """Before a level's drafter forward: its frontier's tokens ``[B, K]`` int64 and their
        parents' indices in the previous frontier ``[B, K]`` int64
        (:attr:`~specdial.worker.tree.TreeExpansion.frontier_parent`), copied to the host."""
        both = torch.stack([tokens, parent], 0).index_select(1, self.grammar.rows_dev)
        self._pending = _start_copy(both)

    def mask_level(self, logits: torch.Tensor) -> torch.Tensor:
        """After the forward: the frontier's drafter logits ``[B, K, V]``, each node's row
        masked with the state after its path. Raises ``RuntimeError`` without
        :meth:`start_level`."""
        if self._pending is None:
            raise RuntimeError("TreeGrammar.mask_level before start_level")
        host = _host(self._pending)
        self._pending = None
        g = self.grammar
        b, k, v = logits.shape
        bm = xgr.allocate_token_bitmask(b * k, g.vocab_size)
        for i, row in enumerate(g.rows):
            prev = self.frontier[i]
            paths = [prev[int(p)] + (int(t),) for t, p in zip(host[0, i], host[1, i])]
            for j in sorted(range(k), key=paths.__getitem__):  # siblings share a prefix
                self.walkers[i].fill(paths[j], bm, row * k + j)
                self.cache[i][paths[j]] = bm[row * k + j]
            self.frontier[i] = paths
        allowed = _upload(bm, logits.device, g.vocab_size).view(b, k, v)
        return mask_logits(logits, allowed)

    def start_verify(self, tree: DraftTree) -> None:
        """Before the target's verify forward: the tree's tokens and parents to the host."""
        rows = self.grammar.rows_dev
        both = torch.stack([tree.tokens, tree.parents], 0).index_select(1, rows)
        self._pending = _start_copy(both)

    def mask_verify(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits ``[B, N + 1, V]`` (columns root, nodes; processed), each column
        masked with its path's state (kept as :attr:`column_mask` ``[B, N + 1, V]`` bool);
        then every matcher is back at its request's state. Raises ``RuntimeError`` without
        :meth:`start_verify`."""
        if self._pending is None:
            raise RuntimeError("TreeGrammar.mask_verify before start_verify")
        host = _host(self._pending)
        self._pending = None
        g = self.grammar
        b, cols, v = logits.shape
        bm = xgr.allocate_token_bitmask(b * cols, g.vocab_size)
        for i, row in enumerate(g.rows):
            paths: list[Path] = [()]
            for t, p in zip(host[0, i].tolist(), host[1, i].tolist()):
                paths.append(paths[p + 1] + (t,))  # parents precede their children
            cache, base = self.cache[i], row * cols
            for c in sorted(range(cols), key=paths.__getitem__):
                hit = cache.get(paths[c])
                if hit is not None:
                    bm[base + c] = hit
                else:
                    self.walkers[i].fill(paths[c], bm, base + c)
            self.walkers[i].reset()
        self.column_mask = _upload(bm, logits.device, g.vocab_size).view(b, cols, v)
        return logits.masked_fill(~self.column_mask, -math.inf)

    def logprob_logits(self, raw: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The raw target logits of the columns that decided the emitted tokens, ``raw``
        ``[B, D + 1, V]`` gathered at ``columns`` ``[B, D + 1]`` int64
        (:func:`~specdial.worker.tree_accept.path_columns`), masked with those columns'
        grammar masks: the masked target distribution for logprobs. Raises ``RuntimeError``
        before :meth:`mask_verify`."""
        if self.column_mask is None:
            raise RuntimeError("TreeGrammar.logprob_logits before mask_verify")
        allowed = self.column_mask.gather(
            1, columns[:, :, None].expand(-1, -1, self.column_mask.shape[2]))
        return raw.masked_fill(~allowed, -math.inf)

    def reset(self) -> None:
        """Every matcher back at its request's state (idempotent; after a failed iteration)."""
        for w in self.walkers:
            w.reset()
