"""The datasets of the serving benchmarks users know (vLLM's ``vllm bench serve``, SGLang's
``bench_serving``): ShareGPT conversations and random token sequences.

- ``sharegpt`` (``--dataset sharegpt --dataset-path FILE``): a JSON list (or JSONL) of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``;
  each conversation whose first two turns are a human prompt and a reply gives one request:
  the prompt, and as its output length the reply's token count (``--sharegpt-output-len``
  overrides it), as both tools do. Conversations with fewer than 2 turns, or whose prompt or
  reply tokenizes to fewer than 4 tokens, are skipped (both tools' filter), as are prompts the
  engine cannot take (too long for its context).
- ``random`` (``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``):
  requests of uniformly random token ids, input and output lengths each drawn uniformly from
  ``[len * (1 - ratio), len * (1 + ratio)]`` (vLLM's rule), seeded. Needs the vocabulary size
  (token ids in ``[0, V)``).

Both produce :class:`~specdial.bench.datasets.BenchRequest` s with a per-request
``max_new_tokens``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

from specdial.bench.datasets import BenchRequest, DatasetError

__all__ = ["SERVING_DATASETS", "random_requests", "sharegpt_requests"]

#: ``--dataset`` names served by this module.
SERVING_DATASETS = ("sharegpt", "random")
_MIN_TOKENS = 4


def _conversations(path: Path) -> list[Any]:
    if not path.is_file():
        raise DatasetError(f"ShareGPT file not found: {path} (--dataset-path)")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: neither a JSON list nor JSON lines ({e})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a list of conversations")
    return data


def sharegpt_requests(path: str | Path, num_prompts: int, *, encode: Callable[[str], list[int]],
                      seed: int = 0, output_len: int | None = None,
                      fits: Callable[[int, int], bool] = lambda p, o: True) -> list[BenchRequest]:
    """``num_prompts`` requests from the ShareGPT file ``path`` (module docstring), shuffled
    with ``seed``. ``encode``: text -> token ids (the engine's tokenizer); ``fits(prompt_len,
    output_len)``: whether the engine can take it. Raises :class:`DatasetError` for a missing or
    malformed file, or when no conversation is usable."""
    if num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    convs = _conversations(Path(path))
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    for i in order:
        turns = convs[i].get("conversations") if isinstance(convs[i], dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        ids = encode(prompt)
        n_out = output_len if output_len is not None else len(encode(reply))
        if len(ids) < _MIN_TOKENS or n_out < (1 if output_len is not None else _MIN_TOKENS):
            continue
        if not fits(len(ids), n_out):
            continue
        out.append(BenchRequest(len(out), "sharegpt", prompt, tuple(ids), max_new_tokens=n_out))
        if len(out) == num_prompts:
            return out
    if not out:
        raise DatasetError(f"{path}: no usable conversation (a human prompt and a reply of "
                           f">= {_MIN_TOKENS} tokens that fit the context)")
    while len(out) < num_prompts:  # wrap around, as the built-in sets do
        r = out[len(out) % len(out)]
        out.append(BenchRequest(len(out), r.workload, r.prompt, r.input_ids,
                                max_new_tokens=r.max_new_tokens))
    return out


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, rng.randint(max(lo, 1), max(hi, 1)))


def random_requests(num_prompts: int, *, vocab_size: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` random-token requests (module docstring). Raises :class:`DatasetError`
    for lengths below 1 or a ratio outside ``[0, 1)``."""
    if num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise DatasetError(f"--random-input-len and --random-output-len must be >= 1, got "
                           f"{input_len} and {output_len}")
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        n_in = _length(rng, input_len, range_ratio)
        n_out = _length(rng, output_len, range_ratio)
        ids = tuple(rng.randrange(vocab_size) for _ in range(n_in))
        out.append(BenchRequest(i, "random", None, ids, max_new_tokens=n_out))
    return out
