"""A straightforward pure-Python implementation of the ``ema`` strategy: the executable spec.

It restates the rules of the foundation issue (SGLang adaptive speculative decoding, PRs #21599
and #24055) line by line, with no attention to speed. It is the oracle the tests compare the
compiled ``specdial._core`` policy against on random traces (docs/design.md invariant 5), and the
baseline the Python benchmark times it against. It takes configs already validated by
:class:`specdial.AdaptiveConfig` (``json.loads(config.to_json())``); it does no validation itself.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


class RefSlot:
    """One slot. ``ema`` is an EMA of accepted drafts per request (bonus token excluded)."""

    def __init__(self, initial_steps: int, cfg: dict[str, Any]) -> None:
        self.candidates: list[int] = sorted(set(cfg["candidate_steps"]))
        self.alpha = float(cfg["ema_alpha"])
        self.interval = int(cfg["update_interval"])
        self.warmup = int(cfg["warmup_batches"])
        self.down = float(cfg["down_hysteresis"])
        self.up = float(cfg["up_hysteresis"])
        self.ceiling_coeff = float(cfg["ceiling_coeff"])
        if initial_steps in self.candidates:
            self.index = self.candidates.index(initial_steps)
        else:
            self.index = len(self.candidates) // 2
        self.ema = float(self.candidates[self.index] - 1)
        self.count = 0

    @property
    def current_steps(self) -> int:
        return self.candidates[self.index]

    def update(self, accepted: Sequence[int]) -> int | None:
        """Feeds one verify's accepted drafts; returns the new steps if they changed."""
        if len(accepted) == 0:
            return None
        if self.current_steps > 0:
            mean = sum(int(a) for a in accepted) / len(accepted)
            self.ema = (1 - self.alpha) * self.ema + self.alpha * mean
        self.count += 1
        if self.count > self.warmup and (self.count - self.warmup) % self.interval == 0:
            return self._recompute()
        return None

    def _recompute(self) -> int | None:
        c = self.candidates
        old = self.index
        i = old
        if c[i] == 0:
            if i + 1 < len(c):
                i += 1
                if c[i] > 0 and self.ema < 0:
                    self.ema = c[i] - 1.0
        else:
            while i > 0 and self.ema <= (0.5 if c[i - 1] == 0 else c[i - 1] - 0.5) + self.down:
                i -= 1
            if i == old:
                while i + 1 < len(c) and self.ema > c[i] - 0.5 + self.up:
                    i += 1
            if self.ceiling_coeff > 0:
                ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
                if c[i] > ceiling and c[i] <= c[old]:
                    while i > 0 and c[i] > ceiling:
                        i -= 1
        self.index = i
        return c[i] if c[i] != c[old] else None


class RefParams:
    """Slots keyed by batch-size lower bound, with the router (graph padding, then largest bound <=)."""

    def __init__(self, initial_steps: int, canonical: dict[str, Any]) -> None:
        self.bounds = sorted(int(k) for k in canonical if k.isdigit())
        self.slots = [RefSlot(initial_steps, canonical[str(b)]) for b in self.bounds]
        self.graph_bs: list[int] | None = None

    def set_cuda_graph_bs(self, sizes: list[int] | None) -> None:
        self.graph_bs = sorted(set(sizes)) if sizes is not None else None

    def _slot(self, batch_size: int) -> RefSlot:
        padded = batch_size
        if self.graph_bs is not None:
            padded = next((g for g in self.graph_bs if g >= batch_size), batch_size)
        below = [i for i, b in enumerate(self.bounds) if b <= padded]
        return self.slots[below[-1] if below else 0]

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self._slot(batch_size).current_steps

    def on_verify_complete(self, accepted: Sequence[int], batch_size: int) -> int | None:
        return self._slot(batch_size).update(accepted)
