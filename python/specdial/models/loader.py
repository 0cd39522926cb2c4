"""Load Hugging Face checkpoints (local directories) into specdial models.

Weights are read with safetensors from ``model.safetensors`` or a sharded
``model.safetensors.index.json``. Models are built on the meta device and every parameter is
assigned directly from the checkpoint in the requested dtype and device, so no random
initialisation happens and each tensor is materialised once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from specdial.distributed.group import TensorParallel
from specdial.models.config import ModelConfig
from specdial.models.llama import LlamaForCausalLM
from specdial.models.tensor_parallel import param_shard, read_shard, shard_modules_

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def _read_config(path: Path) -> dict[str, Any]:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg) as f:
        return json.load(f)


def _checkpoint_index(path: Path) -> dict[str, Path]:
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


def _tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
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


def _assign(model: nn.Module, files: dict[str, Path], names: dict[str, str | None],
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
    shapes = _tensor_shapes(files)
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


def _read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    """One checkpoint tensor, as stored, on the CPU."""
    with safe_open(str(files[name]), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


M = TypeVar("M", bound=nn.Module)


def _build(cls: type[M], *args: Any, **kwargs: Any) -> M:
    with torch.device("meta"):
        return cls(*args, **kwargs)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Load a local HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` directory.

    Returns the model in eval mode, weights in ``dtype`` on ``device`` (rotary frequencies
    stay float32). ``tp``: this rank's tensor-parallel group; with more than one rank the
    model is sharded (:mod:`specdial.models.tensor_parallel`) and only this rank's shard of
    each tensor is read; also ``ValueError`` when the sizes do not split over the group. Raises ``FileNotFoundError`` without config.json or safetensors weights,
    ``ValueError`` for an unsupported architecture or rope type, and for missing, unexpected
    (rotary ``inv_freq`` buffers excepted) or mis-shaped tensors, naming them.
    """
    path = Path(path)
    raw = _read_config(path)
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs!r} in {path / 'config.json'}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = ModelConfig.from_dict(raw)
    model = _build(LlamaForCausalLM, config)
    if tp is not None:
        shard_modules_(model, tp)
    files = _checkpoint_index(path)
    skip = {c for c in files if c.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        skip.add("lm_head.weight")  # some tied checkpoints still store it

    def param(c: str) -> str | None:
        if c.startswith("lm_head."):
            return c
        return c.removeprefix("model.") if c.startswith("model.") else None

    _assign(model, files, {c: param(c) for c in files if c not in skip}, dtype, device,
            lambda p: p if p.startswith("lm_head.") else "model." + p)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.to(device)
    return model.eval()


def load_tokenizer(path: str | Path):
    """Tokenizer of a local model directory.

    Returns a ``transformers`` fast tokenizer (``AutoTokenizer``, ``use_fast=True``), or, if
    that fails, a ``tokenizers.Tokenizer`` read from ``path/tokenizer.json``. Raises
    ``FileNotFoundError`` when neither works.
    """
    path = Path(path)
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except Exception as auto_error:  # noqa: BLE001 - any failure falls back to tokenizer.json
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer in {path}: AutoTokenizer failed ({auto_error}) "
                                    "and there is no tokenizer.json") from auto_error
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(file))
