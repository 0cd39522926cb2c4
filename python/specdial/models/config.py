"""Model configuration parsed from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ARCH_FROM_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)``; scaling is None or a normalised llama3 dict.

    Accepts transformers v4 (``rope_theta`` + ``rope_scaling``) and v5 (``rope_parameters``)
    layouts. Raises ``ValueError`` naming any rope type other than default/llama3.
    """
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params or None
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: llama3 or none")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling is missing {missing}")
    out: dict[str, Any] = {"rope_type": "llama3"}
    out.update({k: float(scaling[k]) for k in _LLAMA3_KEYS[:3]})
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta), out


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyperparameters.

    ``attention_bias`` follows Llama semantics (bias on q, k, v and o); for Qwen2 the q/k/v
    projections always have a bias and o_proj never does (see :attr:`qkv_bias`,
    :attr:`o_bias`). ``rope_scaling`` is None or ``{"rope_type": "llama3", factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings}``.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.architecture == "Qwen2ForCausalLM"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def eos_token_id(self) -> int | None:
        """First eos id (None if the config has none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse a HF config dict. Raises ``ValueError`` for a missing required field, an
        unsupported rope type, sliding-window attention or inconsistent head counts."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _ARCH_FROM_MODEL_TYPE.get(d.get("model_type", ""), "")
        if not arch:
            raise ValueError("config has neither 'architectures' nor a known 'model_type'")
        other_layers = {t for t in d.get("layer_types") or () if t != "full_attention"}
        if d.get("use_sliding_window") or other_layers:
            raise ValueError(f"{arch}: only full attention is supported, config has "
                             f"{sorted(other_layers) or 'use_sliding_window'}")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"{arch} config is missing {missing}")
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        theta, scaling = _parse_rope(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse ``path`` (a config.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """HF-style config dict (``architectures``, ``rope_theta``/``rope_scaling`` v4 layout)."""
        return {
            "architectures": [self.architecture],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
