"""The SGLang and vLLM flag names that map onto specdial's engine options, and those whose
meaning differs (refused with what to use instead).

Owned here, below both front ends, so that ``specdial serve`` (:mod:`specdial.server.flags`)
and ``specdial bench`` (:mod:`specdial.bench.flags`) take the same names without the bench
importing the server.
"""

from __future__ import annotations

__all__ = ["ALIASES", "DIFFERENT"]

#: alias flag -> canonical attribute
ALIASES: dict[str, str] = {
    "--model": "model_path",
    "--speculative-draft-model-path": "draft_model_path",
    "--max-num-seqs": "max_running_requests",
    "--max-model-len": "context_length",
    "--max-total-tokens": "kv_cache_tokens",
    "--tensor-parallel-size": "tp_size",
    "--data-parallel-size": "dp_size",
}

#: flag whose meaning differs -> what to use instead
DIFFERENT: dict[str, str] = {
    "--mem-fraction-static": "specdial sizes the KV cache in tokens, not as a fraction of GPU "
                             "memory: use --kv-cache-tokens N",
    "--gpu-memory-utilization": "specdial sizes the KV cache in tokens, not as a fraction of "
                                "GPU memory: use --kv-cache-tokens N",
    "--max-num-batched-tokens": "vLLM's budget counts decode tokens too; specdial budgets the "
                                "prompt tokens of a prefill iteration: use "
                                "--max-prefill-tokens N",
}
