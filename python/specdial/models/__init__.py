"""Llama-family models, the EAGLE head and checkpoint loading."""

from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig
from specdial.models.eagle import EagleHead
from specdial.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from specdial.models.loader import (
    SUPPORTED_ARCHITECTURES,
    load_eagle_head,
    load_model,
    load_tokenizer,
    save_eagle_head,
)

__all__ = ["ForwardBatch", "ModelConfig", "EagleHead", "LlamaForCausalLM", "Qwen2ForCausalLM",
           "SUPPORTED_ARCHITECTURES", "load_model", "load_eagle_head", "save_eagle_head",
           "load_tokenizer"]
