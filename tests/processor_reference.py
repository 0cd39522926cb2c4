"""Test-local reference of the sampling controls, written out one request and one token at a
time in float64 from the rules' sources (not from specdial's code):

- ``min_tokens`` (vLLM): while fewer than ``min_tokens`` tokens were generated, the EOS and
  stop token ids cannot be sampled;
- ``logit_bias`` (OpenAI, vLLM): logit + bias for each (token id, bias) entry, after
  ``min_tokens`` and before the penalties (vLLM V1's order);
- ``repetition_penalty`` (vLLM, HF transformers): tokens of the prompt or the generated text:
  positive logit / r, else logit * r;
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): logit - f * count - a * [count > 0]
  over the generated tokens;
- temperature, then top-k (ties at the k-th value kept), min-p (probability >= min_p * max),
  then top-p on the renormalized distribution (smallest prefix by decreasing probability, ties
  by lower id, with mass >= top_p). Greedy (temperature 0): one-hot at the processed argmax.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def ref_logits(logits: Sequence[float], prompt: Sequence[int], generated: Sequence[int],
               sp: dict[str, Any], stop_ids: Sequence[int] = ()) -> np.ndarray:
    """The processed logits [V] float64 of the next token after ``prompt + generated``."""
    x = np.array(logits, dtype=np.float64)
    if len(generated) < sp.get("min_tokens", 0):
        for t in stop_ids:
            x[t] = -math.inf
    for t, bias in (sp.get("logit_bias") or {}).items():
        x[int(t)] += bias
    r = sp.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(generated):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    f, a = sp.get("frequency_penalty", 0.0), sp.get("presence_penalty", 0.0)
    for t in set(generated):
        x[t] -= f * list(generated).count(t) + a
    return x


def ref_shape(x: np.ndarray, sp: dict[str, Any]) -> np.ndarray:
    """Temperature, top-k, min-p, top-p of processed logits ``x`` -> probabilities [V]."""
    v = len(x)
    t = sp.get("temperature", 0.0)
    if t == 0:
        out = np.zeros(v)
        out[int(np.argmax(x))] = 1.0  # first index among ties
        return out
    x = x / t
    keep = np.isfinite(x)
    k = sp.get("top_k", -1)
    if 0 < k < v:
        kth = np.sort(x)[::-1][k - 1]
        keep &= x >= kth
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    min_p = sp.get("min_p", 0.0)
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    top_p = sp.get("top_p", 1.0)
    if top_p < 1:
        order = sorted(range(v), key=lambda i: (-p[i], i))
        mass, kept = 0.0, []
        for i in order:
            if p[i] == 0:
                break
            kept.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(np.isin(np.arange(v), kept), p, 0.0)
        p /= p.sum()
    return p


def ref_probs(logits: Sequence[float], prompt: Sequence[int], generated: Sequence[int],
              sp: dict[str, Any], stop_ids: Sequence[int] = ()) -> np.ndarray:
    """The distribution [V] float64 plain decoding samples the next token from."""
    return ref_shape(ref_logits(logits, prompt, generated, sp, stop_ids), sp)
