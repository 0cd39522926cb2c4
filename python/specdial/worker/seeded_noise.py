"""Counter-based (stateless) random numbers for requests with a ``seed``.

A seeded request must sample the same tokens whatever other requests share its batch, so its
random numbers cannot come from a shared ``torch.Generator`` (whose stream is consumed by the
whole batch). Instead every number it consumes is a pure function of a *key*:

    key(seed, position, purpose) = mix64(mix64(seed + GAMMA) ^ (position * 16 + purpose))
    element i of the draw        = mix64(key + (i + 1) * GAMMA)

``mix64`` is the SplitMix64 output function (Steele, Lea, Flood 2014, "Fast splittable
pseudorandom number generators"; the constants of ``java.util.SplittableRandom``), a bijection
of 64-bit integers with full avalanche, so distinct ``(position, purpose)`` give distinct keys for
one seed, and element ``i`` of a draw is the ``i + 1``-th SplitMix64 output of a generator seeded
with ``key``: a counter-based generator in the sense of Salmon et al. 2011 ("Parallel random
numbers: as easy as 1, 2, 3", Philox/Threefry): no state, every element computable on its own,
so it vectorizes over the batch and the vocabulary without a per-request loop.

- ``position``: the sequence index of the token being decided (prompt tokens are
  ``0..P-1``; the first generated token is ``P``). Every token position of a request is decided
  once, by one draw: the token plain decoding samples there, which the drafter's proposal for
  that position shares (the coupled draws of :func:`specdial.worker.sampling.speculative_accept`:
  a draft is accepted exactly when it equals the target's own draw). Draws for positions beyond
  the tokens a verify emits are never used for the result, and the next iteration draws those
  positions again with the same keys, for the same decision.
- ``purpose``: :data:`PURPOSE_TOKEN` (the ``[V]`` noise of the token at that position: the
  first token after prefill, a plain decode, a draft, every verify position). The other values
  of the 4 purpose bits are free for draws of other kinds.

Arithmetic: torch ``int64`` tensors. Multiplication wraps modulo ``2**64`` (two's complement, as
torch's CPU and CUDA integer kernels do), which is the unsigned arithmetic SplitMix64 needs;
right shifts are made logical by masking the sign-extended bits. Uniforms take the top 23 bits
``m`` and return ``(2m + 1) / 2**24``: exact in float32, strictly inside ``(0, 1)`` (from
``2**-24`` to ``1 - 2**-24``), symmetric around 1/2. Exponentials are ``-log(u)`` (finite, at
most ``24 ln 2``). Tests: tests/test_seeded_sampling.py (reference values from a pure-Python
SplitMix64, chi-square uniformity).
"""

from __future__ import annotations

import torch

__all__ = [
    "PURPOSE_TOKEN",
    "draw_keys",
    "mix64",
    "seed_to_int64",
    "seeded_exponentials",
    "seeded_uniforms",
]

PURPOSE_TOKEN = 3
#: purposes occupy the low 4 bits of the position word
_PURPOSE_BITS = 4


def _int64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _int64(0x9E3779B97F4A7C15)
_M1 = _int64(0xBF58476D1CE4E5B9)
_M2 = _int64(0x94D049BB133111EB)


def seed_to_int64(seed: int) -> int:
    """A request seed in ``[0, 2**64 - 1]`` as the int64 with the same bits (for a tensor)."""
    return _int64(int(seed))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits by ``s`` (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bits, elementwise (any shape, int64 -> int64)."""
    z = z ^ _srl(z, 30)
    z = z * _M1
    z = z ^ _srl(z, 27)
    z = z * _M2
    return z ^ _srl(z, 31)


def draw_keys(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Key of each draw: ``seeds`` ``[S]`` int64 (:func:`seed_to_int64`), ``positions`` ``[S]``
    or ``[S, n]`` int64 (sequence index of the token decided, ``>= 0``), ``purpose`` in
    ``1..15`` (:data:`PURPOSE_TOKEN`) -> int64 keys shaped like ``positions``."""
    if not 0 < purpose < 1 << _PURPOSE_BITS:
        raise ValueError(f"draw_keys: purpose must be in 1..{(1 << _PURPOSE_BITS) - 1}, "
                         f"got {purpose}")
    base = mix64(seeds.to(torch.int64) + GAMMA)
    if positions.dim() == 2:
        base = base[:, None]
    word = (positions.to(torch.int64) << _PURPOSE_BITS) | purpose
    return mix64(base ^ word)


def _unit(z: torch.Tensor) -> torch.Tensor:
    """Top 23 bits of int64 ``z`` -> float32 ``(2m + 1) / 2**24`` in ``(0, 1)``."""
    return (_srl(z, 41) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def seeded_uniforms(keys: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Uniforms in ``(0, 1)`` float32: ``n`` None -> one per key (element 0 of its draw, same
    shape as ``keys``); else ``[*keys.shape, n]`` (elements ``0..n-1``, e.g. over a
    vocabulary)."""
    if n is None:
        return _unit(mix64(keys + GAMMA))
    counters = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device) * GAMMA
    return _unit(mix64(keys[..., None] + counters))


def seeded_exponentials(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``Exp(1)`` noise ``[*keys.shape, n]`` float32: ``-log`` of :func:`seeded_uniforms`."""
    return seeded_uniforms(keys, n).log_().neg_()
