"""Reading safetensors checkpoints into modules built on the meta device.

A checkpoint is ``model.safetensors`` or a sharded ``model.safetensors.index.json`` beside a
Hugging Face ``config.json``. :func:`checkpoint_index` maps tensor names to files,
:func:`tensor_shapes` reads their shapes from the headers, :func:`build_on_meta` builds a module
without memory and :func:`assign_weights` checks the checkpoint against it and assigns each
tensor once, in the requested dtype and device (a tensor-parallel module's shard only). The
target's loader (:mod:`specdial.models.loader`) and the drafters' loader
(:mod:`specdial.models.drafter_loader`) share them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from specdial.models.layers import refuse_
from specdial.models.tensor_parallel import param_shard, read_shard

__all__ = ["assign_weights", "build_on_meta", "checkpoint_index", "read_config", "read_tensor",
           "tensor_shapes"]


def read_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict; ``FileNotFoundError`` when it is missing."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg) as f:
        return json.load(f)


def checkpoint_index(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """The stored shape of every tensor in ``files`` (name -> file), read from the headers only;
    ``ValueError`` naming tensors the index lists but no shard holds."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in files:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise ValueError(f"tensors listed in the index but absent from the shards: {missing[:8]}")
    return shapes


def assign_weights(model: nn.Module, files: dict[str, Path], names: dict[str, str | None],
            dtype: torch.dtype, device: torch.device | str,
            ckpt_name: Callable[[str], str] = lambda p: p) -> None:
    """Check the checkpoint against ``model`` and assign its tensors.

    ``files``: every checkpoint tensor and its file; ``names``: checkpoint name -> parameter
    name of ``model`` for the tensors to load (None: a name the layout does not allow);
    tensors absent from ``names`` are skipped. ``ckpt_name``: the checkpoint name expected
    for a parameter (error messages). A tensor-parallel module's parameter (see
    :func:`specdial.models.tensor_parallel.shard_modules_`) is checked against its full shape
    and only its shard is read (a slice read). Raises ``ValueError`` naming missing,
    unexpected, duplicated or mis-shaped tensors (by checkpoint name).
    """
    def listing(items: list[str]) -> str:
        return f"{items[:8]}" + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")

    # named_parameters() lists a tied lm_head once, under embed_tokens
    shards = {n: param_shard(model, n) for n, _ in model.named_parameters()}
    expected = {n: shards[n].full if shards[n] else tuple(t.shape)  # type: ignore[union-attr]
                for n, t in model.named_parameters()}
    shapes = tensor_shapes(files)
    unexpected = sorted(c for c, p in names.items() if p is None or p not in expected)
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {listing(unexpected)}")
    present: dict[str, str] = {}
    for ckpt, param in names.items():
        assert param is not None
        if param in present:
            raise ValueError(f"tensors {present[param]!r} and {ckpt!r} both hold {param!r}")
        present[param] = ckpt
    missing = sorted(ckpt_name(p) for p in set(expected) - set(present))
    if missing:
        raise ValueError(f"tensors missing from checkpoint: {listing(missing)}")
    for param, ckpt in present.items():
        if shapes[ckpt] != expected[param]:
            raise ValueError(f"tensor {ckpt!r} has shape {list(shapes[ckpt])}, "
                             f"expected {list(expected[param])}")
    by_file: dict[Path, list[str]] = {}
    for param, ckpt in present.items():
        by_file.setdefault(files[ckpt], []).append(param)
    for file, params in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for param in params:
                shard = shards[param]
                tensor = (f.get_tensor(present[param]) if shard is None
                          else read_shard(f, present[param], shard)).to(device=device, dtype=dtype)
                owner, _, attr = param.rpartition(".")
                setattr(model.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))
    refuse_(model)


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    """One checkpoint tensor, as stored, on the CPU."""
    with safe_open(str(files[name]), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


M = TypeVar("M", bound=nn.Module)


def build_on_meta(cls: type[M], *args: Any, **kwargs: Any) -> M:
    """``cls(*args, **kwargs)`` built on the meta device: no memory and no random
    initialisation until :func:`assign_weights` gives every parameter its tensor."""
    with torch.device("meta"):
        return cls(*args, **kwargs)
