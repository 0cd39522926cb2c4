"""Benchmark prompts: the built-in prompt sets, a user's JSONL file, and the mixed workload.

A dataset is named by ``--dataset``:

- ``code``, ``prose``, ``hard``: ``{name}.jsonl`` of the package's prompt sets (issue 4's prompt
  files, package data in ``specdial/bench/prompts``; ``--prompts-dir`` replaces them);
- ``sharegpt`` and ``random``: :mod:`specdial.bench.serving_datasets`;
- ``mixed``: ``code`` and ``hard`` prompts in phases: ``mix_every`` code requests, then
  ``mix_every`` hard ones, and so on (the adaptive policy meets high- and low-acceptance phases);
- ``mixed-batch`` (issue 28): greedy ``code`` requests and temperature-1.0 ``prose`` requests
  interleaved one by one in arrival order, so every batch mixes high- and low-acceptance
  requests (each request carries its own ``temperature``; ``mix_every`` is ignored);
- any other value: a path to a JSONL file.

Each JSONL line is an object with ``prompt`` (text) or ``input_ids`` (token ids, for engines
without a tokenizer, e.g. the tests' tiny random models); other fields are ignored. Prompts are
shuffled with the seed, then taken in order, wrapping around when ``num_prompts`` exceeds the
file, so every configuration of a comparison sees exactly the same request sequence.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["BUILTIN_DATASETS", "DATASET_NAMES", "BenchRequest", "DatasetError", "build_requests",
           "load_jsonl", "prompts_dir"]

#: Dataset names that resolve to ``{name}.jsonl`` of :func:`prompts_dir`.
BUILTIN_DATASETS = ("code", "prose", "hard")
#: Every name ``specdial bench --dataset`` takes (besides a JSONL path), for its error message:
#: these prompt sets and their mixes, :data:`specdial.bench.serving_datasets.SERVING_DATASETS`
#: and :data:`specdial.bench.prefix_workloads.PREFIX_DATASETS` (modules that import this one).
DATASET_NAMES = (*BUILTIN_DATASETS, "mixed", "mixed-batch", "sharegpt", "random", "multiturn",
                 "generated-shared-prefix")
#: The two prompt sets the ``mixed`` workload alternates between.
MIXED_PHASES = ("code", "hard")
#: ``mixed-batch``: (prompt set, temperature) of the requests it interleaves one by one.
MIXED_BATCH = (("code", 0.0), ("prose", 1.0))


class DatasetError(ValueError):
    """A dataset that cannot be used: missing file, bad JSON, no usable prompt."""


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: ``prompt`` text and/or ``input_ids``; ``workload`` is the prompt
    set it came from (``code``, ``hard``, ... or the file stem), ``index`` its position in the
    request sequence; ``max_new_tokens``: its own output length (ShareGPT, random datasets),
    None for the run's; ``temperature``: its own sampling temperature (``mixed-batch``), None
    for the run's."""

    index: int
    workload: str
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt length in tokens when known (``input_ids`` given), else None."""
        return None if self.input_ids is None else len(self.input_ids)


#: The built-in prompt sets, shipped as package data (in the wheel too).
PACKAGE_PROMPTS = Path(__file__).resolve().parent / "prompts"


def prompts_dir(explicit: str | Path | None = None) -> Path:
    """The directory holding ``code.jsonl``, ``prose.jsonl`` and ``hard.jsonl``: ``explicit``
    if given, else the package's :data:`PACKAGE_PROMPTS`."""
    return PACKAGE_PROMPTS if explicit is None else Path(explicit)


def load_jsonl(path: str | Path, workload: str | None = None) -> list[BenchRequest]:
    """Every usable line of the JSONL file ``path`` (``index`` = line order, ``workload`` =
    ``workload`` or the file stem). Raises :class:`DatasetError` for a missing file, a line
    that is not a JSON object, or a file without any ``prompt`` / ``input_ids``."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"prompt file not found: {path}")
    label = workload or path.stem
    out: list[BenchRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object")
            prompt, ids = obj.get("prompt"), obj.get("input_ids")
            if ids is not None and (not isinstance(ids, list) or not ids
                                    or not all(isinstance(t, int) for t in ids)):
                raise DatasetError(f"{path}:{lineno}: input_ids must be a non-empty list of ints")
            if prompt is not None and not isinstance(prompt, str):
                raise DatasetError(f"{path}:{lineno}: prompt must be a string")
            if not prompt and ids is None:
                continue
            out.append(BenchRequest(len(out), label, prompt or None,
                                    None if ids is None else tuple(ids)))
    if not out:
        raise DatasetError(f"{path}: no line has a 'prompt' or 'input_ids'")
    return out


def _resolve(name: str, directory: Path) -> tuple[Path, str]:
    if name in BUILTIN_DATASETS:
        path = directory / f"{name}.jsonl"
        if not path.is_file():
            raise DatasetError(
                f"built-in prompt set {name!r} not found at {path}; generate it with "
                "`python -m tools.builtin_models.prompts` or pass --prompts-dir / a JSONL path")
        return path, name
    path = Path(name)
    if not path.is_file():
        raise DatasetError(f"--dataset {name!r}: prompt file not found, and not a dataset name; "
                           f"allowed: {', '.join(DATASET_NAMES)}, or a JSONL file")
    return path, path.stem


def _prepare(pool: list[BenchRequest], seed: int,
             keep: Callable[[BenchRequest], BenchRequest | None] | None) -> list[BenchRequest]:
    pool = list(pool)
    random.Random(seed).shuffle(pool)
    if keep is not None:
        pool = [r for r in (keep(x) for x in pool) if r is not None]
    return pool


def build_requests(dataset: str, num_prompts: int, *, seed: int = 0, mix_every: int = 8,
                   directory: str | Path | None = None,
                   keep: Callable[[BenchRequest], BenchRequest | None] | None = None,
                   ) -> list[BenchRequest]:
    """The request sequence of a benchmark run (``num_prompts`` requests, ``index`` 0..n-1).

    ``dataset``: ``code``/``prose``/``hard``/``mixed``/``mixed-batch`` or a JSONL path (module
    docstring).
    ``seed`` shuffles each prompt set; ``mix_every`` is the phase length of ``mixed`` in
    requests. ``keep`` maps each candidate prompt to the request to use (e.g. with token ids
    filled in) or None to drop it (e.g. too long for the context); it runs after the shuffle.
    Raises :class:`DatasetError` when nothing is left.
    """
    if num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    directory = prompts_dir(directory)
    temperatures: Sequence[float | None] = (None,)
    if dataset == "mixed-batch":
        sources: Sequence[list[BenchRequest]] = [
            _prepare(load_jsonl(*_resolve(name, directory)), seed, keep)
            for name, _ in MIXED_BATCH]
        temperatures, mix_every = [t for _, t in MIXED_BATCH], 1
    elif dataset == "mixed":
        if mix_every < 1:
            raise DatasetError(f"mix_every must be >= 1, got {mix_every}")
        phases = []
        for name in MIXED_PHASES:
            path, label = _resolve(name, directory)
            phases.append(_prepare(load_jsonl(path, label), seed, keep))
        sources = phases
    else:
        path, label = _resolve(dataset, directory)
        sources = [_prepare(load_jsonl(path, label), seed, keep)]
        mix_every = num_prompts
    for src in sources:
        if not src:
            raise DatasetError(f"dataset {dataset!r}: no prompt is usable (all too long for "
                               "the context, or text prompts for an engine without tokenizer)")
    out: list[BenchRequest] = []
    cursors = [0] * len(sources)
    while len(out) < num_prompts:
        phase = (len(out) // mix_every) % len(sources)
        src = sources[phase]
        r = src[cursors[phase] % len(src)]
        cursors[phase] += 1
        temp = temperatures[phase] if len(temperatures) > 1 else r.temperature
        out.append(BenchRequest(len(out), r.workload, r.prompt, r.input_ids, r.max_new_tokens,
                                temp))
    return out
