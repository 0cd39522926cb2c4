"""Load Hugging Face checkpoints (local directories) into specdial models.

Weights are read with safetensors from ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (:mod:`specdial.models.checkpoint`). Models are built on the
meta device and every parameter is assigned directly from the checkpoint in the requested dtype
and device, so no random initialisation happens and each tensor is materialised once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdial.distributed.group import TensorParallel
from specdial.models.checkpoint import assign_weights, build_on_meta, checkpoint_index, read_config
from specdial.models.config import ModelConfig
from specdial.models.llama import LlamaForCausalLM
from specdial.models.tensor_parallel import shard_modules_

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


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
    raw = read_config(path)
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs!r} in {path / 'config.json'}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = ModelConfig.from_dict(raw)
    model = build_on_meta(LlamaForCausalLM, config)
    if tp is not None:
        shard_modules_(model, tp)
    files = checkpoint_index(path)
    skip = {c for c in files if c.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        skip.add("lm_head.weight")  # some tied checkpoints still store it

    def param(c: str) -> str | None:
        if c.startswith("lm_head."):
            return c
        return c.removeprefix("model.") if c.startswith("model.") else None

    assign_weights(model, files, {c: param(c) for c in files if c not in skip}, dtype, device,
            lambda p: p if p.startswith("lm_head.") else "model." + p)
    if config.tie_word_embeddings:
        model.tie_lm_head_()  # one Parameter, in the LM head's layout
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
