"""``specdial.Engine``: offline generation over a static batch (issue 3's Engine API).

``Engine(...).generate(...)`` admits every prompt, prefills them together, then runs decode
iterations over the unfinished requests until all finish. Each iteration's ``steps`` comes from
the Rust adaptive policy (:class:`specdial._core.AdaptiveSpeculativeParams`, SGLang PRs #21599 /
#24055: per-batch-size slots, EMA of accepted drafts, hysteresis) or is fixed. The
continuous-batching scheduler of a later issue replaces these internals, not this API.

Output dicts follow SGLang's offline ``Engine.generate``: ``text``, ``output_ids`` and
``meta_info`` with ``prompt_tokens``, ``completion_tokens``, ``finish_reason``
(``{"type": "length", "length": n}`` or ``{"type": "stop", "matched": token_id}``),
``spec_verify_ct`` (decode iterations the request took part in, trivial verifies at
``steps = 0`` included), ``spec_accept_length`` (completion tokens emitted by verifies per
verify, bonus included: ``(completion_tokens - 1) / spec_verify_ct``, the first token coming
from prefill; 0.0 without verifies) and ``spec_steps_histogram`` (``{steps: iterations}``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specdial._core import (AdaptiveConfig, AdaptiveSpeculativeParams, ConfigError, KvPagePool,
                            validate_initial_steps)
from specdial.models import LlamaForCausalLM, load_eagle_head, load_model, load_tokenizer
from specdial.models.eagle import EAGLE_ARCHITECTURE
from specdial.models.config import ModelConfig
from specdial.worker.drafters import DEFAULT_MAX_STEPS, Drafter, make_drafter
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker

_DEFAULT: Any = object()
ALGORITHMS = ("EAGLE", "DRAFT", None)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FIXED_DEFAULT_STEPS = 3

StepsSchedule = Callable[[int, int], int] | Sequence[int]


def _check_choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    _check_choice("dtype", dtype, list(DTYPES))
    return DTYPES[str(dtype)]


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'); got {device!r}")
    return dev


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    eos: frozenset[int]
    row: int = -1
    output: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    verify_ct: int = 0
    hist: dict[int, int] = field(default_factory=dict)

    def append(self, tokens: Sequence[int]) -> None:
        """Append emitted tokens until one finishes the request (SGLang order: length first,
        then EOS unless ``ignore_eos``, then ``stop_token_ids``); later ones are dropped."""
        p = self.params
        for t in tokens:
            self.output.append(t)
            if len(self.output) >= p.max_new_tokens:
                self.finish = {"type": "length", "length": p.max_new_tokens}
            elif (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                self.finish = {"type": "stop", "matched": t}
            if self.finish is not None:
                return


class Engine:
    """Offline speculative-decoding engine (static batches; see the module docstring).

    Arguments (issue 3, "Engine API"):

    - ``model_path``: local HF Llama/Qwen2 directory. ``None`` means the built-in models, which
      arrive in a later issue: raises ``NotImplementedError`` for now.
    - ``draft_model_path``: a draft model directory (same tokenizer) or an EAGLE head directory
      (:func:`specdial.models.load_eagle_head` layout).
    - ``speculative_algorithm``: ``"EAGLE"``, ``"DRAFT"`` or ``None``. Default: with a user
      model, no speculation unless ``draft_model_path`` is given (then inferred from its
      config); with the built-in models, EAGLE. Anything else: ``ValueError``.
    - ``speculative_num_steps``: ``None`` = adaptive: the middle of the candidates' union
      (``union[len // 2]``, 3 for the default config); fixed: 3. Adaptive with a value that is
      a candidate of no slot, or any candidate (fixed value) above the drafter's
      ``max_steps``: :class:`specdial.ConfigError`.
    - ``speculative_adaptive`` / ``speculative_adaptive_config`` (an ``AdaptiveConfig``, a dict,
      a JSON file path, or None for the default).
    - ``skip_zero_step_draft_extend``: skip the drafter extend at ``steps = 0`` (it then catches
      up in one batched extend when steps turn positive).
    - ``device`` ``"cpu"``/``"cuda"``; ``dtype`` ``"float32"``/``"bfloat16"``.
    - keyword-only: ``max_running_requests`` (batch capacity; larger generate calls run in
      waves), ``kv_cache_tokens`` (KV slots; default ``max_running_requests *
      context_length`` capped at 65536), ``page_size``, ``context_length`` (default the
      target's ``max_position_embeddings``), ``seed`` (the engine's sampling generator),
      ``drafter_max_steps``, and the test hook ``steps_schedule``: a sequence (iteration
      ``i`` uses ``schedule[i % len]``) or a callable ``(iteration, batch_size) -> steps``
      replacing the policy; runtime states are then built for every steps value
      ``0..drafter_max_steps``.
    """

    def __init__(self, model_path: str | os.PathLike[str] | None = None,
                 draft_model_path: str | os.PathLike[str] | None = None,
                 speculative_algorithm: str | None = _DEFAULT,
                 speculative_num_steps: int | None = None, speculative_adaptive: bool = True,
                 speculative_adaptive_config: Any = None,
                 skip_zero_step_draft_extend: bool = False, device: str = "cpu",
                 dtype: str = "float32", *, max_running_requests: int = 32,
                 kv_cache_tokens: int | None = None, page_size: int = 16,
                 context_length: int | None = None, seed: int = 0,
                 drafter_max_steps: int = DEFAULT_MAX_STEPS,
                 steps_schedule: StepsSchedule | None = None) -> None:
        if speculative_algorithm is not _DEFAULT:
            _check_choice("speculative_algorithm", speculative_algorithm, ALGORITHMS)
        torch_dtype, dev = _dtype(dtype), _device(device)
        if model_path is None:
            raise NotImplementedError("model_path=None selects the built-in models, which are not "
                                      "available yet (a later issue); pass model_path=<local HF "
                                      "checkpoint directory>")
        model_dir = Path(model_path)
        draft_dir = None if draft_model_path is None else Path(draft_model_path)
        algo = speculative_algorithm
        if algo is _DEFAULT:
            algo = None
            if draft_dir is not None:
                arch = ModelConfig.from_file(draft_dir).architecture
                algo = "EAGLE" if arch == EAGLE_ARCHITECTURE else "DRAFT"
        if algo is not None and draft_dir is None:
            raise ValueError(f"speculative_algorithm={algo!r} needs draft_model_path (a draft "
                             "model or EAGLE head directory)")
        if algo is None and draft_dir is not None:
            raise ValueError("draft_model_path is given but speculative_algorithm is None")
        target = load_model(model_dir, dtype=torch_dtype, device=dev)
        drafter_module: torch.nn.Module | None = None
        if algo == "EAGLE" and draft_dir is not None:
            drafter_module = load_eagle_head(draft_dir, target, torch_dtype, dev)
        elif algo == "DRAFT" and draft_dir is not None:
            drafter_module = load_model(draft_dir, dtype=torch_dtype, device=dev)
        try:
            tokenizer = load_tokenizer(model_dir)
        except FileNotFoundError:
            tokenizer = None
        self._setup(target, drafter_module, tokenizer, algo, speculative_num_steps,
                    speculative_adaptive, speculative_adaptive_config,
                    skip_zero_step_draft_extend, max_running_requests=max_running_requests,
                    kv_cache_tokens=kv_cache_tokens, page_size=page_size,
                    context_length=context_length, seed=seed,
                    drafter_max_steps=drafter_max_steps, steps_schedule=steps_schedule)

    @classmethod
    def from_modules(cls, target: LlamaForCausalLM,
                     drafter: torch.nn.Module | Drafter | None = None, tokenizer: Any = None, *, speculative_algorithm: str | None = _DEFAULT,
                     speculative_num_steps: int | None = None, speculative_adaptive: bool = True,
                     speculative_adaptive_config: Any = None,
                     skip_zero_step_draft_extend: bool = False, **kwargs: Any) -> "Engine":
        """An Engine over already-built modules (tests, notebooks). ``drafter``: an
        :class:`EagleHead` (EAGLE), a :class:`LlamaForCausalLM` (DRAFT), a :class:`Drafter`, or
        None. The algorithm is inferred from it; an explicit ``speculative_algorithm`` that
        disagrees raises ``ValueError``. Device and dtype are the modules' own; ``kwargs`` are
        the keyword-only options of :class:`Engine` (``max_running_requests``, ...)."""
        if speculative_algorithm is not _DEFAULT:
            _check_choice("speculative_algorithm", speculative_algorithm, ALGORITHMS)
        wrapped = make_drafter(drafter, target,
                               max_steps=kwargs.get("drafter_max_steps", DEFAULT_MAX_STEPS))
        inferred = None if wrapped is None else (
            "EAGLE" if wrapped.needs_target_hidden else "DRAFT")
        if speculative_algorithm is not _DEFAULT and speculative_algorithm != inferred:
            raise ValueError(f"speculative_algorithm={speculative_algorithm!r} does not match "
                             f"the drafter given ({type(drafter).__name__})")
        self = cls.__new__(cls)
        self._setup(target, wrapped, tokenizer, inferred, speculative_num_steps,
                    speculative_adaptive, speculative_adaptive_config,
                    skip_zero_step_draft_extend, **kwargs)
        return self

    def _setup(self, target: LlamaForCausalLM, drafter: Any, tokenizer: Any, algorithm: str | None,
               num_steps: int | None, adaptive: bool, adaptive_config: Any, skip_zero: bool, *,
               max_running_requests: int = 32, kv_cache_tokens: int | None = None,
               page_size: int = 16, context_length: int | None = None, seed: int = 0,
               drafter_max_steps: int = DEFAULT_MAX_STEPS,
               steps_schedule: StepsSchedule | None = None) -> None:
        self.target, self.tokenizer = target.eval(), tokenizer
        self.speculative_algorithm = algorithm
        self.drafter = make_drafter(drafter, target, max_steps=drafter_max_steps)
        if self.drafter is not None:
            self.drafter.module.eval()
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                      or num_steps < 0):
            raise ConfigError(f"speculative_num_steps must be None or an int >= 0, "
                              f"got {num_steps!r}")
        self.params: AdaptiveSpeculativeParams | None = None
        self.fixed_steps: int | None
        self.steps_schedule = steps_schedule
        max_steps = self.drafter.max_steps if self.drafter is not None else 0
        if self.drafter is None:
            if num_steps:
                raise ConfigError(f"speculative_num_steps={num_steps} needs a drafter "
                                  "(speculative_algorithm is None)")
            self.fixed_steps, step_values = 0, [0]
        elif steps_schedule is not None:
            self.fixed_steps, step_values = None, list(range(max_steps + 1))
        elif adaptive:
            config = self._adaptive_config(adaptive_config)
            union = config.candidate_steps
            initial = union[len(union) // 2] if num_steps is None else num_steps
            validate_initial_steps(config, initial)
            if union[-1] > max_steps:
                raise ConfigError(f"candidate steps {union[-1]} exceeds what the drafter supports "
                                  f"(max_steps={max_steps})")
            self.params = AdaptiveSpeculativeParams(initial, config)
            self.fixed_steps, step_values = None, union
        else:
            steps = FIXED_DEFAULT_STEPS if num_steps is None else num_steps
            if steps > max_steps:
                raise ConfigError(f"speculative_num_steps={steps} exceeds what the drafter "
                                  f"supports (max_steps={max_steps})")
            self.fixed_steps, step_values = steps, [steps]
        self.context_length = context_length or target.config.max_position_embeddings
        if kv_cache_tokens is None:
            kv_cache_tokens = min(max_running_requests * self.context_length, 65536)
        self.kv_alloc = KvPagePool(-(-kv_cache_tokens // page_size), page_size)
        self.worker = SpecWorker(target, self.drafter, self.kv_alloc,
                                 max_running_requests=max_running_requests,
                                 context_length=self.context_length, step_values=step_values,
                                 skip_zero_step_draft_extend=skip_zero)
        self.device = self.worker.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        eos = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._rid = itertools.count()
        self._iteration = 0
        self._closed = False

    @staticmethod
    def _adaptive_config(cfg: Any) -> AdaptiveConfig:
        if cfg is None:
            return AdaptiveConfig.default()
        if isinstance(cfg, AdaptiveConfig):
            return cfg
        if isinstance(cfg, dict):
            return AdaptiveConfig.from_dict(cfg)
        if isinstance(cfg, (str, os.PathLike)):
            return AdaptiveConfig.from_file(cfg)
        raise ConfigError("speculative_adaptive_config must be an AdaptiveConfig, a dict, a file "
                          f"path or None; got {type(cfg).__name__}")

    # ----------------------------------------------------------------- public API
    def generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                 input_ids: list[int] | list[list[int]] | None = None) -> Any:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts).

        ``prompt``: a str or list of str (needs a tokenizer), or ``input_ids``: a list of ints
        or a list of lists; exactly one of the two. ``sampling_params``: a dict (shared) or a
        list of dicts (one per prompt) with keys of :class:`SamplingParams`. Raises
        ``ValueError`` for an unknown sampling key or bad value, an empty prompt, token ids
        outside the vocabulary, a prompt plus ``max_new_tokens`` above ``context_length``;
        :class:`~specdial.worker.worker.KVCacheFullError` when the KV cache runs out.
        """
        if self._closed:
            raise RuntimeError("Engine is shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        ids: list[list[int]]
        if isinstance(prompt, str):
            single, ids = True, [self._encode(prompt)]
        elif prompt is not None:
            single, ids = False, [self._encode(p) for p in prompt]
        else:
            assert input_ids is not None
            single = not input_ids or not isinstance(input_ids[0], (list, tuple))
            seqs: list[Any] = [input_ids] if single else list(input_ids)
            ids = [[int(t) for t in x] for x in seqs]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(d) for d in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        vocab = self.target.config.vocab_size
        for i, (x, p) in enumerate(zip(ids, params)):
            if not x or min(x) < 0 or max(x) >= vocab:
                raise ValueError(f"prompt {i}: needs 1+ token ids in [0, {vocab})")
            if len(x) + p.max_new_tokens > self.context_length:
                raise ValueError(f"prompt {i}: {len(x)} tokens + max_new_tokens "
                                 f"{p.max_new_tokens} exceed context_length {self.context_length}")
        seeds = [p.seed for p in params if p.seed is not None]
        if seeds:  # batch-level reproducibility; per-request streams are not separate yet
            self.generator.manual_seed(seeds[0])
        reqs = [_Request(next(self._rid), x, p, self.eos_token_ids) for x, p in zip(ids, params)]
        wave = self.worker.max_bs
        with torch.inference_mode():
            for i in range(0, len(reqs), wave):
                self._run(reqs[i:i + wave])
        out = [self._result(r) for r in reqs]
        return out[0] if single else out

    def shutdown(self) -> None:
        """Release the models and KV buffers; later ``generate`` calls raise."""
        self._closed = True
        self.worker = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- internals
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass input_ids instead of prompt")
        enc = self.tokenizer.encode(text)
        return list(getattr(enc, "ids", enc))

    def _steps_for(self, batch_size: int) -> int:
        sched = self.steps_schedule
        i, self._iteration = self._iteration, self._iteration + 1
        if sched is not None:
            return int(sched(i, batch_size) if callable(sched) else sched[i % len(sched)])
        if self.params is not None:
            return self.params.decide(batch_size).steps
        return self.fixed_steps  # type: ignore[return-value]

    def _run(self, reqs: list[_Request]) -> None:
        """Prefill ``reqs`` together, then decode until every one has finished."""
        worker = self.worker
        sampling = BatchSampling.from_params([r.params for r in reqs], self.device)
        rows, first = worker.prefill([r.rid for r in reqs], [r.prompt for r in reqs], sampling,
                                     self.generator)
        running = reqs
        try:
            for r, row, tok in zip(reqs, rows.tolist(), first.tolist()):
                r.row = row
                r.append([tok])
            while running:
                done = [r for r in running if r.finish is not None]
                if done:
                    worker.release(np.array([r.row for r in done], np.int64))
                    for r in done:
                        r.row = -1
                    running = [r for r in running if r.finish is None]
                    if not running:
                        break
                    sampling = BatchSampling.from_params([r.params for r in running], self.device)
                steps = self._steps_for(len(running))
                out = worker.decode(steps, np.array([r.row for r in running], np.int64),
                                    sampling, self.generator)
                if self.params is not None:
                    self.params.on_verify_complete(out.accepted,  # type: ignore[arg-type]
                                                   len(running))  # numpy: a buffer
                for b, r in enumerate(running):
                    r.verify_ct += 1
                    r.hist[steps] = r.hist.get(steps, 0) + 1
                    r.append(out.tokens_of(b).tolist())
        finally:
            left = [r.row for r in reqs if r.row >= 0]
            if left:
                worker.release(np.array(left, np.int64))
                for r in reqs:
                    r.row = -1

    def _result(self, r: _Request) -> dict[str, Any]:
        text = ""
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(r.output, skip_special_tokens=True)
            except TypeError:
                text = self.tokenizer.decode(r.output)
        n = len(r.output)
        return {"text": text, "output_ids": list(r.output), "meta_info": {
            "prompt_tokens": len(r.prompt), "completion_tokens": n, "finish_reason": r.finish,
            "spec_verify_ct": r.verify_ct,
            "spec_accept_length": (n - 1) / r.verify_ct if r.verify_ct else 0.0,
            "spec_steps_histogram": dict(sorted(r.hist.items()))}}
