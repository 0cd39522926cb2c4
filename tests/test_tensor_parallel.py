"""Tensor parallelism on the CPU with gloo: sharded forwards equal the unsharded ones.

Every rank runs as a fresh interpreter (``python -m specdial.launch.rank``), started by
:func:`specdial.distributed.launch_ranks`; rank 0 saves its outputs and the test compares them
with :func:`specdial.launch.check.forward_outputs` at tp 1 in this process. One group
runs all cases, so the ranks start once.
"""

import json

import pytest
import torch
import transformers

from eagle_heads import build_eagle3
from specdial.config import DistConfig
from specdial.launch import launch_ranks
from specdial.launch.check import compare, forward_outputs
from specdial.distributed.group import TensorParallel, free_port
from specdial.models import EagleHead, load_model, save_eagle_head
from specdial.models.tensor_parallel import (_vocab_range, kv_head_range, read_shard,
                                             shard_modules_, slice_shard)
from timeouts import scaled

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=256)
MODELS = {  # name: (kind, fields) — each a case the sharding must get right at tp 2
    "llama_gqa": ("llama", dict(vocab_size=128, num_attention_heads=4, num_key_value_heads=2)),
    "llama_kv1": ("llama", dict(vocab_size=128, num_attention_heads=4, num_key_value_heads=1)),
    "llama_tied_bias": ("llama", dict(vocab_size=128, num_attention_heads=4,
                                      num_key_value_heads=4, tie_word_embeddings=True,
                                      attention_bias=True, mlp_bias=True)),
    "qwen2_odd_vocab": ("qwen2", dict(vocab_size=127, num_attention_heads=4,
                                      num_key_value_heads=2)),
}
RTOL = 1e-5  # float32; observed ~5e-7 (a different summation order in the all-reduce)


def _save(path, name, seed=0, layers=None):
    kind, extra = MODELS[name]
    cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    fields = {**TINY, **extra, **({"num_hidden_layers": layers} if layers else {})}
    config = cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model_cls = (transformers.LlamaForCausalLM if kind == "llama"
                 else transformers.Qwen2ForCausalLM)
    model = model_cls(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory, deep):
    """``{case name: forward_outputs kwargs}`` for every model and drafter kind."""
    root = tmp_path_factory.mktemp("tp_models")
    out = {name: {"model_path": str(_save(root / name, name, seed=i))}
           for i, name in enumerate(MODELS)}
    gqa = out["llama_gqa"]["model_path"]
    draft = _save(root / "draft", "llama_gqa", seed=7, layers=1)
    out["draft_model"] = {"model_path": gqa, "draft_path": str(draft)}
    target = load_model(gqa)
    torch.manual_seed(8)
    head = EagleHead(target.config.__class__(**{**target.config.__dict__,
                                                "architecture": "SpecdialEagleHead",
                                                "num_hidden_layers": 1}),
                     target.embed_tokens, target.lm_head)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.15 * torch.randn_like(p))
    save_eagle_head(head, root / "eagle")
    out["eagle"] = {"model_path": gqa, "draft_path": str(root / "eagle")}
    deep_path, _, deep_model = deep
    for case in ("sglang-ids", "vllm"):
        path = build_eagle3(deep_model, root / f"eagle3-{case}", case)
        out[f"eagle3_{case}"] = {"model_path": str(deep_path), "draft_path": str(path)}
    return out


def test_tp2_outputs_equal_tp1(cases, tmp_path):
    """Llama, Qwen2 (biases, a vocabulary 2 does not divide), GQA with fewer kv heads than
    ranks, tied embeddings with attention and MLP biases, a draft model, an EAGLE-1 head and
    EAGLE-3 heads (own reduced vocabulary; own embedding): logits and hidden states of a
    prefill and a verify-shaped extend match tp 1."""
    names = list(cases)
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}", timeout_s=scaled(60))
    out = tmp_path / "tp2.pt"
    procs = launch_ranks(config, range(2), "specdial.launch.check:run_rank",
                         {"cases": [cases[n] for n in names], "out": str(out)})
    for rank, p in procs.procs.items():
        assert p.wait(scaled(240)) == 0, f"rank {rank} failed"
    procs.close()
    got = torch.load(out)
    for name, result in zip(names, got):
        ref = forward_outputs(**cases[name])
        assert set(ref) == set(result), name
        if "draft_path" in cases[name]:
            assert "draft_extend" in ref
        for key, (_, rel) in compare(ref, result).items():
            assert rel < RTOL, f"{name} {key}: relative difference {rel:.2e}"


def test_shard_ranges():
    """Heads, GQA replication and vocabulary chunks follow the rules in the module doc."""
    tp = [TensorParallel(rank=r, size=4) for r in range(4)]
    assert [kv_head_range(8, t) for t in tp] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(2, t) for t in tp] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, t) for t in tp] == [(0, 1)] * 4
    with pytest.raises(ValueError, match="num_key_value_heads \\(6\\)"):
        kv_head_range(6, tp[0])
    with pytest.raises(ValueError, match="multiple of num_key_value_heads \\(3\\)"):
        kv_head_range(3, tp[0])
    assert [_vocab_range(10, t) for t in tp] == [(0, 3, 0), (3, 6, 0), (6, 9, 0), (9, 10, 2)]


def test_shard_errors_name_the_sizes(cases):
    """Sizes the group cannot split are a ValueError naming the field."""
    from specdial.models.config import ModelConfig
    from specdial.models.llama import LlamaForCausalLM
    cfg = ModelConfig.from_file(cases["llama_gqa"]["model_path"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) must be divisible by "
                                         "tp_size \\(3\\)"):
        shard_modules_(model, TensorParallel(rank=0, size=3))


def test_tied_vocab_shard_is_one_parameter_stored_transposed(cases):
    """A rank's tied vocabulary shard (embedding rows = LM head rows) stays one Parameter,
    stored transposed on the CPU (issue 29's LM head layout), holding this rank's rows."""
    from specdial.models.tensor_parallel import ParallelLMHead
    path = cases["llama_tied_bias"]["model_path"]
    full = load_model(path)
    for rank in range(2):
        model = load_model(path, tp=TensorParallel(rank=rank, size=2))
        head, emb = model.lm_head, model.embed_tokens
        assert isinstance(head, ParallelLMHead) and head.weight is emb.weight
        assert head.weight.t().is_contiguous()
        assert torch.equal(head.weight, slice_shard(full.lm_head.weight, head.shards["weight"]))


def test_slice_reads_match_full_reads(cases):
    """``read_shard`` (safetensors ``get_slice``) equals slicing the fully read tensor,
    rows, columns and padded vocabulary rows alike."""
    from safetensors import safe_open

    from specdial.models.tensor_parallel import Shard
    path = cases["qwen2_odd_vocab"]["model_path"] + "/model.safetensors"
    with safe_open(path, framework="pt") as f:
        for name, shard in (("model.layers.0.self_attn.q_proj.weight", Shard(0, 32, 64, (64, 64))),
                            ("model.layers.0.mlp.down_proj.weight", Shard(1, 64, 128, (64, 128))),
                            ("lm_head.weight", Shard(0, 64, 127, (127, 64), pad=1))):
            full = f.get_tensor(name)
            assert torch.equal(read_shard(f, name, shard), slice_shard(full, shard))


def test_dist_config_validation():
    """Each bad field is named in the error."""
    ok = dict(tp_size=2, rank=0, init_addr="127.0.0.1:1234")
    DistConfig(**ok)
    for bad, field in ((dict(tp_size=0), "tp_size"), (dict(rank=2), "rank"),
                       (dict(init_addr="nohost"), "dist_init_addr"),
                       (dict(timeout_s=0), "dist_timeout"), (dict(nnodes=3), "nnodes"),
                       (dict(nnodes=2, node_rank=1), "node 1"), (dict(device="tpu"), "device")):
        with pytest.raises(ValueError, match=field):
            DistConfig(**{**ok, **bad})
    two_nodes = DistConfig(tp_size=4, rank=3, init_addr="10.0.0.1:5000", nnodes=2, node_rank=1)
    assert list(two_nodes.local_ranks) == [2, 3]
    assert json.loads(json.dumps(two_nodes.__dict__))["node_rank"] == 1
