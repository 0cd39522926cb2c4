"""Llama-family models, the EAGLE and EAGLE-3 heads, and checkpoint loading."""

from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig
from specdial.models.drafter_loader import (
    EAGLE3_ARCHITECTURES,
    EAGLE_ARCHITECTURES,
    infer_draft_algorithm,
    load_drafter,
    load_engine_modules,
    load_eagle3_head,
    load_eagle_head,
    resolve_draft_algorithm,
    save_eagle_head,
)
from specdial.models.eagle import EagleHead
from specdial.models.eagle3 import Eagle3Head, Eagle3Spec
from specdial.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from specdial.models.loader import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer

__all__ = ["ForwardBatch", "ModelConfig", "EagleHead", "Eagle3Head", "Eagle3Spec",
           "LlamaForCausalLM", "Qwen2ForCausalLM", "SUPPORTED_ARCHITECTURES",
           "EAGLE_ARCHITECTURES", "EAGLE3_ARCHITECTURES", "load_model", "load_eagle_head",
           "load_eagle3_head", "load_drafter", "load_engine_modules", "infer_draft_algorithm",
           "resolve_draft_algorithm", "save_eagle_head", "load_tokenizer"]
