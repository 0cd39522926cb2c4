"""Where an Engine's models come from and where they run: the device, the dtype (``"auto"``
read from the checkpoint) and the built-in models of ``model_path=None``. Values reach here
already validated by :class:`~specdial.engine.config.EngineConfig`; what needs the machine or
the checkpoint (CUDA present, the checkpoint's dtype, the built-in models installed) is
checked here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdial.config import AUTO
from specdial.engine import resolve as _resolve
from specdial.engine.resolve import canonical_dtype, resolve_device_name

__all__ = ["DTYPES", "auto_dtype", "builtin_dirs", "resolve_device", "resolve_placement",
           "torch_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A validated ``dtype`` (see :class:`EngineConfig`; aliases ``float``, ``half``) other
    than ``"auto"`` as torch's."""
    return DTYPES[canonical_dtype(dtype)]


def auto_dtype(model_dir: Path, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` (vLLM's and SGLang's rule): float32 on the CPU; on CUDA the
    checkpoint's ``torch_dtype`` (``dtype`` in newer configs) from its config.json when it is
    bfloat16 or float16, and bfloat16 (float16 on a GPU without bfloat16) for a float32
    checkpoint or one that names none, as vLLM does for float32 checkpoints. Raises
    ``ValueError`` for a checkpoint dtype this engine does not run."""
    if device.type == "cpu":
        return torch.float32
    with open(model_dir / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype='auto': the checkpoint's dtype {name!r} is not supported; "
                         f"pass dtype={' or '.join(map(repr, DTYPES))}")
    if name == "float32":
        return torch.bfloat16 if _bf16_supported() else torch.float16
    return DTYPES[name]


def _bf16_supported() -> bool:
    """Whether the CUDA device runs bfloat16 (True where torch cannot tell: a fake probe)."""
    if not torch.cuda.is_available():
        return True
    try:
        return bool(torch.cuda.is_bf16_supported())
    except (RuntimeError, AssertionError):
        return True


def resolve_placement(device: Any, dtype: Any, model_dir: Path) -> tuple[torch.device,
                                                                        torch.dtype]:
    """The torch device and dtype of the options ``device`` / ``dtype`` (each possibly
    ``"auto"``: CUDA when present, else the CPU; the checkpoint's dtype on CUDA, float32 on
    the CPU) for the checkpoint at ``model_dir``. ``ValueError`` as :func:`resolve_device`."""
    dev = resolve_device(resolve_device_name(device))
    return dev, (auto_dtype(model_dir, dev) if canonical_dtype(dtype) == AUTO
                 else torch_dtype(dtype))


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device of ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``; resolve
    ``"auto"`` first with :func:`~specdial.engine.resolve.resolve_device_name`). Raises
    ``ValueError`` for another name, CUDA not available, or no device N."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'); got "
                         f"{device!r}")
    if dev.type == "cuda":
        if not _resolve.cuda_available():  # the probe tests replace
            raise ValueError(f"device {device!r}: CUDA is not available on this machine "
                             "(use device='cpu', or 'auto': CUDA when present)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: no such CUDA device ({count} available: "
                             f"cuda:0..cuda:{count - 1})")
    return dev


def builtin_dirs(draft_dir: Path | None, algo: Any) -> tuple[Path, Path | None, Any]:
    """Target, drafter and algorithm of ``model_path=None`` (EAGLE unless told otherwise)."""
    from specdial.builtin import builtin_model_path

    try:
        target = builtin_model_path("target")
        if algo == AUTO:
            algo = "EAGLE" if draft_dir is None else AUTO
        if draft_dir is None and algo in ("EAGLE", "DRAFT"):
            draft_dir = builtin_model_path("eagle" if algo == "EAGLE" else "draft")
    except FileNotFoundError as e:
        raise NotImplementedError(f"model_path=None selects the built-in models, which are not "
                                  f"available: {e}; or pass model_path=<local HF checkpoint "
                                  "directory>") from e
    return target, draft_dir, algo


def resolve_models(cfg: Any) -> tuple[Path, Path | None, str | None, torch.device, torch.dtype]:
    """``(model_dir, draft_dir, algorithm, device, dtype)`` of an :class:`EngineConfig`: model
    ids through the local cache, the built-in models when ``model_path`` is None, the drafter's
    algorithm inferred from its directory when ``speculative_algorithm`` is ``"auto"``.
    ``ValueError`` naming the option when an algorithm has no drafter or a drafter no
    algorithm."""
    from specdial.models import resolve_draft_algorithm  # needs torch modules: loaded late

    draft_dir = (None if cfg.draft_model_path is None
                 else _resolve.resolve_model_dir(cfg.draft_model_path, "draft_model_path"))
    algo = cfg.speculative_algorithm
    if cfg.model_path is None:
        model_dir, draft_dir, algo = builtin_dirs(draft_dir, algo)
    else:
        model_dir = _resolve.resolve_model_dir(cfg.model_path, "model_path")
    dev, dtype = resolve_placement(cfg.device, cfg.dtype, model_dir)
    if algo == AUTO:
        algo = None if draft_dir is None else resolve_draft_algorithm(draft_dir)
    elif algo is not None and draft_dir is not None:
        algo = resolve_draft_algorithm(draft_dir, algo)
    if algo is not None and draft_dir is None:
        raise ValueError(f"speculative_algorithm={algo!r} needs draft_model_path (a draft "
                         "model or EAGLE head directory)")
    if algo is None and draft_dir is not None:
        raise ValueError("draft_model_path is given but speculative_algorithm is None")
    return model_dir, draft_dir, algo, dev, dtype
