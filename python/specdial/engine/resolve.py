"""What ``device="auto"``, ``dtype="auto"`` and a Hugging Face model id resolve to.

- :func:`resolve_device_name`: ``"auto"`` (the default, as in vLLM) is ``"cuda"`` when
  :func:`cuda_available`, else ``"cpu"``; any other name is returned unchanged (checked later
  by :func:`specdial.engine.loading.resolve_device`).
- :func:`canonical_dtype`: the dtype names accepted (vLLM's ``--dtype`` spellings): ``auto``,
  ``float32`` / ``float``, ``bfloat16``, ``float16`` / ``half``, or a ``torch.dtype``.
- :func:`resolve_model_dir`: a model or drafter given as a local directory (holding a
  config.json) or as a Hugging Face id (``org/name``), found in the local Hugging Face cache
  (``HF_HUB_CACHE`` / ``HF_HOME``, ``huggingface_hub.snapshot_download(local_files_only=True)``)
  and otherwise downloaded unless the machine is offline (``HF_HUB_OFFLINE=1``), as SGLang and
  vLLM do. Errors name the flag the user passed and the id.

No torch import at module level: the command line checks its options without loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_NAMES", "canonical_dtype", "cuda_available", "hf_offline",
           "resolve_device_name", "resolve_model_dir"]

#: Accepted ``dtype`` spellings -> canonical name ("auto": decided by :func:`auto_dtype`).
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the probe ``device="auto"`` uses; tests replace it)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_device_name(device: Any) -> Any:
    """``"auto"`` -> ``"cuda"`` when :func:`cuda_available`, else ``"cpu"``; anything else
    unchanged."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


def canonical_dtype(dtype: Any) -> str:
    """The canonical name of a ``dtype`` option (see :data:`DTYPE_NAMES`; a ``torch.dtype``
    is read by its name). Raises ``ValueError`` naming the allowed spellings."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPE_NAMES))}; "
                         f"got {dtype!r}")
    return DTYPE_NAMES[name]


def hf_offline() -> bool:
    """Whether the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` truthy, read at
    call time or as ``huggingface_hub`` read it at import)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return bool(constants.HF_HUB_OFFLINE)


def _looks_like_repo_id(value: str) -> bool:
    """``org/name`` or ``name``: no leading ``/``, ``.`` or ``~``, at most one ``/``."""
    return (bool(value) and not value.startswith(("/", ".", "~")) and value.count("/") <= 1
            and "\\" not in value)


def resolve_model_dir(value: str | os.PathLike[str], flag: str = "model_path") -> Path:
    """The local directory of a model given as ``value``: a directory holding a config.json,
    or a Hugging Face id resolved through the local cache (downloaded when not offline).

    ``flag`` is how the caller names the option in errors (``--model-path``, ``MODEL``,
    ``--speculative-draft-model-path``, ``model_path``). Raises ``ValueError``:
    ``"<flag> <value>: ..."`` saying what was tried (a directory without config.json, an id
    not in the cache while offline, a failed download) and what to do."""
    text = os.fspath(value)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {text}: not a model directory (no config.json)")
        return path
    if not _looks_like_repo_id(text):
        raise ValueError(f"{flag} {text}: no such directory (pass a local model directory "
                         "or a Hugging Face id such as Qwen/Qwen2.5-0.5B-Instruct)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ValueError(f"{flag} {text}: no such directory, and huggingface_hub is not "
                         "installed to look it up as a Hugging Face id") from None
    cache = constants.HF_HUB_CACHE
    try:
        snapshot = Path(snapshot_download(text, local_files_only=True))
    except Exception as cached_error:  # not cached, or not a valid id
        if hf_offline():
            raise ValueError(
                f"{flag} {text}: not a local directory, and the Hugging Face id {text!r} is "
                f"not in the local cache ({cache}) while HF_HUB_OFFLINE is set: download it "
                f"first (huggingface-cli download {text}) or pass a local directory "
                f"({type(cached_error).__name__})") from None
        try:
            snapshot = Path(snapshot_download(text))
        except Exception as e:
            raise ValueError(
                f"{flag} {text}: not a local directory, not in the local Hugging Face cache "
                f"({cache}), and downloading the Hugging Face id {text!r} failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; pass a local "
                "directory or download it where the machine may") from None
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"{flag} {text}: the Hugging Face snapshot {snapshot} has no "
                         "config.json (not a model)")
    return snapshot
