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

from specdial.engine.config import AUTO

__all__ = ["DTYPES", "auto_dtype", "builtin_dirs", "resolve_device", "torch_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A validated ``dtype`` (see :class:`EngineConfig`) other than ``"auto"`` as torch's."""
    return DTYPES[str(dtype).removeprefix("torch.")]


def auto_dtype(model_dir: Path, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` (vLLM's): float32 on the CPU; on CUDA the checkpoint's ``torch_dtype``
    (``dtype`` in newer configs) from its config.json, float32 when it names none. Raises
    ``ValueError`` for a checkpoint dtype this engine does not run (float16)."""
    if device.type == "cpu":
        return torch.float32
    with open(model_dir / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype='auto': the checkpoint's dtype {name!r} is not supported; "
                         f"pass dtype={' or '.join(map(repr, DTYPES))}")
    return DTYPES[name]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'); got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine "
                             "(use device='cpu')")
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
