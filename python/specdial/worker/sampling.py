"""Token selection of speculative decoding: the kernels (processing, sampling, acceptance).

Pieces, in the order the worker uses them:

- :class:`SamplingParams` (:mod:`specdial.worker.sampling_params`): one request's validated
  sampling options (``from_dict`` for API input); the request validation lives there, apart
  from these kernels.
- :class:`BatchSampling` (:mod:`specdial.worker.batch_sampling`): the same options as per-row
  tensors, built once per batch composition. Both names are re-exported here.
- :func:`target_probs`: temperature, then top-k and min-p, then top-p, then softmax (vLLM's
  order), vectorized over the batch; greedy rows (temperature 0) become a one-hot at the argmax.
  The processors that depend on a request's own tokens (repetition / frequency / presence
  penalties, ``min_tokens``) run before it, on the raw logits, per draft position:
  :mod:`specdial.worker.processors` (``BatchSampling.processors``).
- :func:`sample` / :func:`sample_from_probs`: one token per row (the drafter's draws, plain decode).
- Seeded rows (a request with a ``seed``): their random numbers come from the counter-based
  source of :mod:`specdial.worker.seeded_noise`, keyed by (seed, position of the token being
  decided), never from the shared generator; so a seeded row draws the same numbers whatever
  other rows share the batch.
- :func:`speculative_accept`: the verify step. Greedy rows accept the longest prefix of drafts
  equal to the target argmax. Unseeded sampling rows use the rejection rule of Leviathan,
  Kalman, Matias 2023 ("Fast Inference from Transformers via Speculative Decoding",
  Algorithm 1) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with
  Speculative Sampling", Algorithm 2): accept draft ``x_i`` with probability
  ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection emit a token from
  ``norm(max(0, p_i - q_i))``; if all ``k`` drafts are accepted emit the bonus token from
  ``p_k``. Seeded rows use coupled draws (the Gumbel-max / exponential-race coupling): the
  drafter and the target draw the token at sequence position ``t`` with the same noise
  ``E_t`` (key (seed, ``t``)), the target's draw there is ``argmax(p_t / E_t)``, and a draft is
  accepted exactly when it equals that draw; so the emitted tokens are the target's own seeded
  draws, the tokens plain decoding emits, whatever the drafts, the drafter or the steps. Both
  rules leave the emitted tokens distributed exactly as ``p`` (docs/design.md invariant 2; greedy
  rows give invariant 1).

Conventions: ``B`` requests, ``k`` drafts per request (``0`` = plain decoding), ``V`` vocabulary
size. Logits and probabilities are float32, tokens int64, all on one device. Every random draw
of an unseeded row goes through the ``torch.Generator`` passed in (it must live on the tensors'
device), in a fixed amount that depends only on shapes and the flags of :class:`BatchSampling`,
never on data: results are reproducible for a given generator state. Seeded rows (see
``BatchSampling.seeded_rows``) draw from keys instead: the per-step functions then need the
``positions`` of the tokens they decide (a ``ValueError`` without them); in a mixed batch the
generator still fills every row and the seeded rows are overwritten (``index_copy_``), so the
hashing costs only ``[S, V]`` per decided position for ``S`` seeded rows. No ``.item()`` and no
host sync inside the per-step functions (:func:`target_probs`, :func:`sample`,
:func:`speculative_accept`); Python-level branches only look at shapes and the Python ``bool``
flags of :class:`BatchSampling`.
"""

from __future__ import annotations

import math

import torch

from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.sampling_params import (MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
                                             MIN_REPETITION_PENALTY, MIN_TEMPERATURE,
                                             SamplingParams)
from specdial.worker.seeded_noise import PURPOSE_TOKEN, draw_keys, seeded_exponentials

__all__ = [
    "MAX_REPETITION_PENALTY",
    "MAX_TEMPERATURE",
    "MIN_REPETITION_PENALTY",
    "MIN_TEMPERATURE",
    "PURPOSE_TOKEN",
    "BatchSampling",
    "SamplingParams",
    "sample",
    "sample_from_probs",
    "speculative_accept",
    "target_probs",
]

#: Below this total mass the rejection residual ``max(0, p - q)`` is treated as empty (rounding
#: noise only) and the emitted token is drawn from ``p`` instead.
_RESIDUAL_EPS = 1e-6

def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot float32 at ``logits.argmax(-1)`` (first index among ties), same shape."""
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def target_probs(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """Processed distribution per row and position: ``[B, n, V]`` float32 -> ``[B, n, V]``.

    Order (vLLM's): temperature (``logits / T``), then top-k (keep the tokens whose scaled
    logit is ``>=`` the k-th largest; ties at the k-th value are all kept) and min-p (keep the
    tokens whose probability is ``>= min_p`` times the most likely one's; vLLM applies it before
    top-k, which gives the same set since both keep the most likely tokens and min-p's ratio is
    unchanged by renormalization), then top-p on the renormalized distribution (keep the
    smallest prefix of tokens, in decreasing probability, whose mass is ``>= top_p``; the most
    likely token is always kept, also when ``top_p`` is below float32's smallest positive value
    and rounds to 0; ties in the order broken by lower token id; rows with ``top_p == 1`` are
    not filtered), then softmax. ``logits`` are the raw logits after the history-dependent
    processors (:mod:`specdial.worker.processors`), when the batch has any. Filtered tokens get probability exactly 0. Greedy rows (temperature 0) give a
    one-hot at the argmax of the raw logits (first index among ties). Each row uses its own
    options; there is no Python loop over rows.

    Apply the same function to the drafter's logits to get the ``q`` it samples drafts from.
    Raises ``ValueError`` if ``logits`` is not 3-D or its batch size differs from ``sampling``.
    """
    if logits.dim() != 3 or logits.shape[0] != sampling.batch_size:
        raise ValueError(f"target_probs: logits must be [B={sampling.batch_size}, n, V], "
                         f"got {list(logits.shape)}")
    logits = logits.float()
    if sampling.all_greedy:
        return _one_hot_argmax(logits)
    b, n, v = logits.shape
    greedy = sampling.greedy_mask.view(b, 1, 1)
    temperature = torch.where(greedy, 1.0, sampling.temperature.view(b, 1, 1))
    x = logits / temperature
    if sampling.any_top_k or sampling.any_top_p or sampling.any_min_p:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        if sampling.any_top_k:
            k = sampling.top_k.view(b, 1, 1)
            k = torch.where((k <= 0) | greedy, v, k.clamp(max=v))
            kth = sorted_x.gather(-1, (k - 1).expand(b, n, 1))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)
        if sampling.any_min_p:
            assert sampling.min_p is not None
            sorted_p = sorted_x.softmax(-1)
            floor = sampling.min_p.view(b, 1, 1) * sorted_p[..., :1]  # 0 on greedy rows
            sorted_x = sorted_x.masked_fill(sorted_p < floor, -math.inf)
        if sampling.any_top_p:
            sorted_p = sorted_x.softmax(-1)
            mass_before = sorted_p.cumsum(-1) - sorted_p
            top_p = torch.where(greedy, 1.0, sampling.top_p.view(b, 1, 1))
            drop = (mass_before >= top_p) & (top_p < 1.0)
            drop[..., 0] = False  # the most likely token, whatever top_p rounded to
            sorted_x = sorted_x.masked_fill(drop, -math.inf)
        probs = torch.empty_like(sorted_x).scatter_(-1, order, sorted_x.softmax(-1))
    else:
        probs = x.softmax(-1)
    return torch.where(greedy, _one_hot_argmax(logits), probs)


def _seeded_keys(sampling: BatchSampling, positions: torch.Tensor | None,
                 what: str) -> torch.Tensor:
    """Token-draw keys ``[S]`` / ``[S, n]`` of the seeded rows at ``positions`` (``[B]`` /
    ``[B, n]`` int64, every row; only the seeded rows are read)."""
    if positions is None:
        raise ValueError(f"{what}: the batch has seeded rows, so the positions of the tokens "
                         "being decided are required")
    if positions.shape[0] != sampling.batch_size:
        raise ValueError(f"{what}: positions must have {sampling.batch_size} rows, got "
                         f"{list(positions.shape)}")
    assert sampling.seeds is not None and sampling.seeded_rows is not None
    positions = positions.to(device=sampling.seeds.device, dtype=torch.int64)
    if sampling.all_seeded:
        return draw_keys(sampling.seeds, positions, PURPOSE_TOKEN)
    rows = sampling.seeded_rows
    return draw_keys(sampling.seeds.index_select(0, rows), positions.index_select(0, rows),
                     PURPOSE_TOKEN)


def _merge_seeded(noise: torch.Tensor | None, seeded: torch.Tensor,
                  sampling: BatchSampling) -> torch.Tensor:
    """``noise`` (``[B, ...]``: the generator's draws, or any per-row values) with the seeded
    rows replaced in place by ``seeded`` (``[S, ...]``); None: ``seeded`` (all rows seeded)."""
    if noise is None:  # all_seeded: rows are 0..B-1 in order
        return seeded
    assert sampling.seeded_rows is not None
    return noise.index_copy_(0, sampling.seeded_rows, seeded.to(noise.dtype))


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None, *,
                      sampling: BatchSampling | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from non-negative weights ``[..., V]`` (need not be normalized) -> int64.

    Exponential race: ``argmax(w / E)`` with ``E ~ Exp(1)`` i.i.d. picks token ``i`` with
    probability ``w_i / sum(w)`` and never a zero-weight token; no host sync (unlike
    ``torch.multinomial`` validation) and one ``[..., V]`` draw from ``generator``.

    Seeded rows (``sampling`` given with ``any_seeded``; then ``probs`` is ``[B, V]``): ``E``
    of row ``b`` is ``-log(u)`` of the counter-based uniforms of key (seed ``b``,
    ``positions[b]``, ``PURPOSE_TOKEN``) (:mod:`specdial.worker.seeded_noise`), independent of
    the other rows; ``positions`` ``[B]`` int64 is the sequence index of the token drawn. The
    drafter draws its proposal for position ``t`` with the same key as the target's token at
    ``t`` (the coupling :func:`speculative_accept` relies on). The generator is then used only
    when some row is unseeded.
    """
    noise = None
    if sampling is None or not sampling.all_seeded:
        noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    if sampling is not None and sampling.any_seeded:
        if probs.dim() != 2:
            raise ValueError(f"sample_from_probs: seeded rows need probs [B, V], got "
                             f"{list(probs.shape)}")
        keys = _seeded_keys(sampling, positions, "sample_from_probs")
        noise = _merge_seeded(noise, seeded_exponentials(keys, probs.shape[-1]), sampling)
    assert noise is not None
    return (probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)


def sample(logits: torch.Tensor, sampling: BatchSampling,
           generator: torch.Generator | None,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: ``[B, V]`` float32 logits -> ``[B]`` int64.

    Greedy rows take the argmax; the others draw from :func:`target_probs`. Draws ``[B, V]``
    exponentials from ``generator`` unless ``sampling.all_greedy`` or ``all_seeded``.
    ``positions`` ``[B]`` int64: sequence index of the token each row samples (the first token
    after a prompt of ``P`` tokens is at ``P``); required when ``sampling.any_seeded``, else
    ignored.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got {list(logits.shape)}")
    argmax = logits.argmax(-1)
    if sampling.all_greedy:
        return argmax
    tokens = sample_from_probs(target_probs(logits.unsqueeze(1), sampling).squeeze(1), generator,
                               sampling=sampling, positions=positions)
    return torch.where(sampling.greedy_mask, argmax, tokens)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row: ``[B, k]`` bool -> ``[B]`` int64 in 0..k."""
    return accept.to(torch.int64).cumprod(-1).sum(-1)


#: Most hashed noise elements :func:`_coupled_draws` materializes at once (each int64
#: intermediate of the hash is 8 bytes per element: 128 MiB per temporary at this size).
_COUPLED_NOISE_ELEMENTS = 1 << 24


def _coupled_draws(p: torch.Tensor, sampling: BatchSampling,
                   positions: torch.Tensor | None) -> torch.Tensor:
    """The seeded rows' own target draws ``[S, n]`` int64 from ``p`` ``[B, n, V]``: at column
    ``i`` the exponential race ``argmax(p_i / E)`` with ``E`` keyed (seed, ``positions + i``),
    the draw plain decoding makes for that position (``positions`` ``[B]`` int64). Columns
    are hashed in chunks of at most :data:`_COUPLED_NOISE_ELEMENTS` noise elements (one chunk
    unless ``S x n x V`` is large), bounding the memory of large batches and vocabularies."""
    b, n, v = p.shape
    cols = None if positions is None else (
        positions.to(device=p.device, dtype=torch.int64)[:, None]
        + torch.arange(n, device=p.device))
    keys = _seeded_keys(sampling, cols, "speculative_accept")  # [S, n]
    if not sampling.all_seeded:
        assert sampling.seeded_rows is not None
        p = p.index_select(0, sampling.seeded_rows)
    step = max(1, _COUPLED_NOISE_ELEMENTS // max(1, keys.shape[0] * v))
    tiny = torch.finfo(torch.float32).tiny
    return torch.cat([(p[:, c:c + step] / seeded_exponentials(keys[:, c:c + step], v)
                       .clamp_min_(tiny)).argmax(-1) for c in range(0, n, step)], 1)


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: BatchSampling,
    generator: torch.Generator | None,
    positions: torch.Tensor | None = None,
    limits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``k`` drafts per request against the target; return what to emit.

    Inputs:
      - ``draft_tokens`` ``[B, k]`` int64 in ``[0, V)``; ``k`` may be 0 (plain decoding).
      - ``draft_probs`` ``[B, k, V]`` float32: the distribution ``q_i`` each draft token was
        actually sampled from (the drafter's logits through :func:`target_probs` with the same
        ``sampling``), or ``None`` for a greedy/deterministic drafter, in which case ``q_i`` is a
        one-hot at the draft token and the acceptance probability is ``p_i(x_i)``. (That rule is
        lossless for any drafter, only with lower acceptance than passing the real ``q``.)
        Read by the unseeded sampling rows only.
      - ``target_logits`` ``[B, k + 1, V]`` float32: the verify forward's logits; position ``i``
        is the target's prediction for draft ``i`` and position ``k`` for the bonus token.
      - ``generator``: on the tensors' device; when some row samples without a seed
        (``sampling.any_unseeded``) this draws ``[B, k]`` uniforms and then ``[B, V]``
        exponentials, else nothing.
      - ``positions`` ``[B]`` int64: sequence index of draft 1 (``L + 1`` when ``x_L`` is the
        last emitted token); required when ``sampling.any_seeded``, else ignored.
      - ``limits`` ``[B]`` int64 in ``0..k`` or None: verify budgets (issue 28; :func:`_capped`).

    Returns ``(accepted, out_tokens)``: ``accepted`` ``[B]`` int64 in ``0..k`` (accepted drafts,
    bonus excluded; at most ``limits``) and ``out_tokens`` ``[B, k + 1]`` int64 where
    ``out_tokens[b, :accepted[b] + 1]`` are the emitted tokens (the accepted drafts, then the
    correction or bonus token) and later entries are ``-1``. Every row emits at least one token.

    Rules:
      - Greedy rows (docs/design.md invariant 1): accept the longest prefix of drafts equal to the
        target argmax, then emit the target argmax at the first mismatch (or at position ``k``).
        The output equals target-only greedy decoding.
      - Seeded rows (coupled draws; the Gumbel-max trick, e.g. Gumbel 1954, and its use as a
        shared-noise coupling of drafter and target): the target's own draw at column ``i`` is
        ``y_i = argmax(p_i / E_i)`` with ``E_i ~ Exp(1)^V`` keyed (seed, ``positions + i``),
        an exact sample of ``p_i``; the drafter drew its draft for that position with the same
        ``E_i`` (:meth:`specdial.worker.drafters.Drafter.draft`). Accept the longest prefix of
        drafts equal to the ``y_i``, then emit ``y`` at the first mismatch (or the bonus
        ``y_k``). The emitted tokens are exactly the seeded plain-decoding tokens, so they do
        not depend on the drafts, the drafter, ``k`` or the batch; distinct positions use
        independent noise, so they are distributed exactly as ``p``. The acceptance is
        ``P(argmax q/E = argmax p/E) = sum_x 1 / sum_y max(p(y)/p(x), q(y)/q(x))``, below
        rejection sampling's ``1 - TV(p, q)`` (the price of the guarantee).
      - Unseeded sampling rows (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
        Algorithm 2): with ``p_i`` = ``target_probs(target_logits)[:, i]``, accept draft ``x_i``
        when ``u_i * q_i(x_i) < p_i(x_i)`` for ``u_i ~ U[0, 1)`` (probability
        ``min(1, p_i(x_i) / q_i(x_i))``, no division); the accepted count is the leading run of
        accepts (cumulative product). At the first rejection ``j`` emit a token from
        ``norm(max(0, p_j - q_j))``, or from ``p_j`` when that residual's mass is below 1e-6
        (only rounding noise: rejection then had near-zero probability); after ``k`` accepts emit
        the bonus from ``p_k``. Emitted tokens are then distributed exactly as ``p``
        (docs/design.md invariant 2).

    Vectorized over the batch (seeded rows: ``[S, k + 1, V]`` hashed noise); no ``.item()``.
    Raises ``ValueError`` on inconsistent shapes, a non-int64 ``draft_tokens`` or seeded rows
    without ``positions`` (shape checks only; token values are not checked on device).
    """
    b, k, _ = _check_accept_inputs(draft_tokens, draft_probs, target_logits, sampling)
    target_logits = target_logits.float()
    # greedy and seeded rows accept while the drafts equal the target's argmax / seeded draw
    choice = target_logits.argmax(-1)  # [B, k+1]
    p = None
    if sampling.any_seeded:
        p = target_probs(target_logits, sampling)  # [B, k+1, V]
        choice = _merge_seeded(choice, _coupled_draws(p, sampling, positions), sampling)
    accepted = _capped(_accepted_prefix(draft_tokens == choice[:, :k]), limits)
    if sampling.all_greedy or not sampling.any_unseeded:
        return accepted, _emitted_choices(choice, accepted)
    last = choice.gather(1, accepted[:, None]).squeeze(1)
    p = target_probs(target_logits, sampling) if p is None else p
    rejection, drawn = _rejection_sample(draft_tokens, draft_probs, p, generator, limits)
    exact = _exact_rows(sampling)
    accepted = torch.where(exact, accepted, rejection)
    last = torch.where(exact, last, drawn)
    return accepted, _emitted(draft_tokens, accepted, last)


def _emitted_choices(choice: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """:func:`_emitted` of a batch without unseeded sampling rows: ``choice`` ``[B, k + 1]``
    (the target's argmax or seeded draw per column), ``accepted`` ``[B]`` -> ``[B, k + 1]``,
    ``choice`` up to column ``accepted`` and ``-1`` after. The accepted drafts equal those
    choices and the choice after them is the correction or bonus token, so this is the same
    tensor in 2 ops instead of a gather and ``_emitted``'s 6."""
    cols = torch.arange(choice.shape[1], device=choice.device)
    return torch.where(cols <= accepted[:, None], choice, -1)


def _capped(accepted: torch.Tensor, limits: torch.Tensor | None) -> torch.Tensor:
    """``accepted`` ``[B]`` at most each row's verify budget ``limits`` (None: unchanged).

    Row ``b`` of :func:`speculative_accept` is verified as if it had drafted only its first
    ``limits[b]`` tokens: its drafts and target columns beyond are never read for what it
    emits (they may hold anything: skipped draft levels, a packed verify's repeated columns),
    and after ``limits[b]`` accepts it emits the bonus token of column ``limits[b]`` (the
    target's choice, or a draw from ``p`` there), exactly what a batch at ``k = limits[b]``
    emits. The draws from the generator keep their ``[B, k]`` / ``[B, V]`` shapes."""
    return accepted if limits is None else torch.minimum(accepted, limits)


def _exact_rows(sampling: BatchSampling) -> torch.Tensor:
    """``[B]`` bool: the rows whose emitted tokens are the target's own choices (greedy rows,
    and seeded rows with their coupled draws)."""
    if not sampling.any_seeded:
        return sampling.greedy_mask
    assert sampling.seeded_mask is not None
    return sampling.greedy_mask | sampling.seeded_mask


def _check_accept_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_logits: torch.Tensor,
                         sampling: BatchSampling) -> tuple[int, int, int]:
    """``(B, k, V)`` of :func:`speculative_accept`'s inputs; ``ValueError`` naming the input
    whose shape (or ``draft_tokens``' dtype) is wrong."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.int64:
        raise ValueError(f"speculative_accept: draft_tokens must be [B, k] int64, got "
                         f"{list(draft_tokens.shape)} {draft_tokens.dtype}")
    b, k = draft_tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (b, k + 1):
        raise ValueError(f"speculative_accept: target_logits must be [B={b}, k+1={k + 1}, V], "
                         f"got {list(target_logits.shape)}")
    v = target_logits.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, v):
        raise ValueError(f"speculative_accept: draft_probs must be [B={b}, k={k}, V={v}] or "
                         f"None, got {list(draft_probs.shape)}")
    if sampling.batch_size != b:
        raise ValueError(f"speculative_accept: sampling has {sampling.batch_size} rows, "
                         f"draft_tokens has {b}")
    return b, k, v


def _rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      p: torch.Tensor,
                      generator: torch.Generator | None,
                      limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule of the unseeded rows (Leviathan et al. 2023, Algorithm 1) over every
    row: ``(accepted [B] int64, last token [B] int64)``. Draws ``[B, k]`` uniforms, then
    ``[B, V]`` exponentials from ``generator`` (in that order: results depend on it).
    ``limits``: per-row verify budgets (:func:`speculative_accept`)."""
    b, k = draft_tokens.shape
    u = torch.rand((b, k), generator=generator, device=p.device)
    p_x = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        draft_probs = draft_probs.float()
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    rejection = _capped(_accepted_prefix(u * q_x < p_x), limits)
    residual = _residual(draft_tokens, draft_probs, p, rejection, limits)
    return rejection, sample_from_probs(residual, generator)


def _residual(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, p: torch.Tensor,
              rejection: torch.Tensor, limits: torch.Tensor | None = None) -> torch.Tensor:
    """Distribution ``[B, V]`` of the last emitted token: ``norm(max(0, p_j - q_j))`` at the
    first rejection ``j`` (``p_j`` when that mass is below :data:`_RESIDUAL_EPS`), ``p_k``
    after all accepts (``q`` is taken as 0 there, so the residual is ``p_k`` itself); a row
    with a verify budget ``limits[b]`` has all accepted after ``limits[b]``."""
    b, k = draft_tokens.shape
    v = p.shape[2]
    p_j = p.gather(1, rejection.view(b, 1, 1).expand(b, 1, v)).squeeze(1)  # [B, V]
    if k == 0:
        return p_j
    has_draft = (rejection < (k if limits is None else limits))[:, None]
    j = rejection.clamp(max=k - 1)
    if draft_probs is None:
        x_j = draft_tokens.gather(1, j[:, None])
        q_j = torch.zeros_like(p_j).scatter_(1, x_j, has_draft.float())
    else:
        q_j = draft_probs.gather(1, j.view(b, 1, 1).expand(b, 1, v)).squeeze(1)
        q_j = q_j * has_draft
    residual = (p_j - q_j).clamp_min(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > _RESIDUAL_EPS, residual, p_j)


def _emitted(draft_tokens: torch.Tensor, accepted: torch.Tensor,
             last: torch.Tensor) -> torch.Tensor:
    """``[B, k + 1]``: the accepted drafts, then ``last``, then ``-1``."""
    b, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)
    acc = accepted[:, None]
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], dim=1)
    return torch.where(pos < acc, drafts, torch.where(pos == acc, last[:, None], -1))
