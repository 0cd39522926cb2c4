"""Model parity with transformers, paged batching, kv_only, the EAGLE head and loading."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specdial.attention import TorchAttentionBackend
from specdial.models import (EagleHead, ForwardBatch, ModelConfig, load_eagle_head, load_model,
                             load_tokenizer, save_eagle_head)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
            max_position_embeddings=256)
CONFIGS = {
    "llama_gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                                  rope_scaling=LLAMA3_ROPE)),
    "llama_bias": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                 tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
}


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf(path, name="llama_gqa", seed=0):
    """Random tiny transformers model saved to ``path``; returns it (float32, eval)."""
    kind, extra = CONFIGS[name]
    cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    config = cls(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    model = model_cls(config).eval()
    with torch.no_grad():  # larger, non-trivial weights: norms and biases too
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].float()


class Seqs:
    """Host-side bookkeeping of a few sequences over scattered KV slots."""

    def __init__(self, num_slots, seed=0):
        self.free = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens, self.slots = [], []

    def add(self):
        self.tokens.append([])
        self.slots.append([])
        return len(self.tokens) - 1

    def batch(self, backend, new, device="cpu"):
        """``new``: list of (seq, token list). Appends them and returns a ForwardBatch."""
        ids, pos, loc, qo, kv, idx = [], [], [], [], [], []
        for s, toks in new:
            start = len(self.tokens[s])
            fresh = [self.free.pop() for _ in toks]
            self.tokens[s] += toks
            self.slots[s] += fresh
            ids += toks
            pos += range(start, start + len(toks))
            loc += fresh
            qo.append(len(toks))
            kv.append(len(self.tokens[s]))
            idx += self.slots[s]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(t(ids), t(pos), t(loc), backend.plan(t(qo), t(kv), t(idx)))


def single_batch(backend, ids):
    seqs = Seqs(64)
    return seqs.batch(backend, [(seqs.add(), list(ids))])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf = make_hf(tmp_path, name)
    model = load_model(tmp_path)
    c = model.config
    if name in ("llama_tied", "llama_bias"):
        assert model.lm_head.weight is model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.embed_tokens.weight
    assert (c.rope_scaling is not None) == (name == "llama3_rope")
    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    backend = TorchAttentionBackend()
    pool = model.make_kv_pool(64)
    with torch.inference_mode():
        hidden = model(single_batch(backend, ids.tolist()), pool, backend)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (40, c.hidden_size) and logits.dtype == torch.float32
    assert _rel_err(logits, hf_logits(hf, ids)) < 1e-4


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_paged_batched_decode_matches_full_sequences(tmp_path, device):
    hf = make_hf(tmp_path, "llama3_rope")
    model = load_model(tmp_path, device=device)
    backend = TorchAttentionBackend(device)
    pool = model.make_kv_pool(96)
    gen = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 128, (n,), generator=gen).tolist()  # noqa: E731
    seqs = Seqs(96, seed=3)
    a, b, c = seqs.add(), seqs.add(), seqs.add()
    steps = [[(a, rand(5)), (b, rand(11)), (c, rand(2))]]  # prefill all at once
    steps += [[(a, rand(1)), (b, rand(1)), (c, rand(1))] for _ in range(3)]  # decode
    steps += [[(a, rand(3)), (b, rand(2)), (c, rand(4))]]  # multi-token (verify-like)
    steps += [[(b, rand(1)), (c, rand(1))], [(a, rand(1)), (c, rand(1))]]  # partial batches
    got = {a: [], b: [], c: []}
    with torch.inference_mode():
        for step in steps:
            batch = seqs.batch(backend, step, device)
            logits = model.compute_logits(model(batch, pool, backend)).cpu()
            for (s, toks), part in zip(step, logits.split([len(t) for _, t in step])):
                got[s].append(part)
    for s in (a, b, c):
        ref = hf_logits(hf, seqs.tokens[s])
        assert _rel_err(torch.cat(got[s]), ref) < 1e-4, f"sequence {s}"


def test_kv_only_and_input_embeds(tmp_path):
    make_hf(tmp_path, "llama_gqa")
    model = load_model(tmp_path)
    backend = TorchAttentionBackend()
    full, cheap = model.make_kv_pool(64), model.make_kv_pool(64)
    ids = list(range(3, 20))
    with torch.inference_mode():
        batch = single_batch(backend, ids)
        hidden = model(batch, full, backend)
        assert model(batch, cheap, backend, kv_only=True) is None
        assert torch.equal(full.k_buffer, cheap.k_buffer)
        assert torch.equal(full.v_buffer, cheap.v_buffer)
        embeds = model.embed_tokens(batch.input_ids)
        torch.testing.assert_close(model(batch, full, backend, input_embeds=embeds), hidden)


def _eagle_config(target):
    return dataclasses.replace(target.config, architecture="SpecdialEagleHead", num_hidden_layers=1)


def test_eagle_head_shares_target_and_round_trips(tmp_path):
    make_hf(tmp_path / "target", "llama_gqa")
    target = load_model(tmp_path / "target")
    torch.manual_seed(5)
    head = EagleHead(_eagle_config(target), target.embed_tokens, target.lm_head)
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert sorted({k.split(".")[0] for k in head.state_dict()}) == ["fc", "layers"]
    assert head.fc.weight.shape == (64, 128) and head.fc.bias is not None

    save_eagle_head(head, tmp_path / "eagle")
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["SpecdialEagleHead"] and cfg["num_hidden_layers"] == 1
    keys = set(load_file(tmp_path / "eagle" / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)

    loaded = load_eagle_head(tmp_path / "eagle", target)
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head
    backend = TorchAttentionBackend()
    ids = list(range(5, 17))
    with torch.inference_mode():
        batch = single_batch(backend, ids)
        feats = target(batch, target.make_kv_pool(64), backend)
        pools = [head.make_kv_pool(64) for _ in range(3)]
        assert pools[0].k_buffer.shape[0] == 1
        out = head(batch, pools[0], backend, hidden_states=feats)
        out2 = loaded(batch, pools[1], backend, hidden_states=feats)
        assert loaded(batch, pools[2], backend, hidden_states=feats, kv_only=True) is None
    assert out.shape == (len(ids), 64)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(loaded.compute_logits(out2), head.compute_logits(out))
    assert torch.equal(pools[1].k_buffer, pools[2].k_buffer)


def test_sharded_checkpoint_and_bf16(tmp_path):
    kind, extra = CONFIGS["qwen2"]
    hf = make_hf(tmp_path / "one", "qwen2")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    model = load_model(tmp_path / "sharded")
    ids = list(range(1, 30))
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        logits = model.compute_logits(model(single_batch(backend, ids), model.make_kv_pool(64), backend))
        ref = hf_logits(hf, ids)
        assert _rel_err(logits, ref) < 1e-4
        half = load_model(tmp_path / "sharded", dtype=torch.bfloat16)
        assert half.embed_tokens.weight.dtype == torch.bfloat16
        assert half.rotary.inv_freq.dtype == torch.float32
        pool = half.make_kv_pool(64)
        assert pool.dtype == torch.bfloat16
        logits16 = half.compute_logits(half(single_batch(backend, ids), pool, backend))
        assert logits16.dtype == torch.float32 and _rel_err(logits16, ref) < 0.1


def _rewrite_weights(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_loading_errors(tmp_path):
    make_hf(tmp_path, "llama_gqa")
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM"):
        load_model(tmp_path)
    cfg_file.write_text(json.dumps(cfg))

    name = "model.layers.1.mlp.up_proj.weight"
    original = load_file(tmp_path / "model.safetensors")
    _rewrite_weights(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({name: torch.zeros(128, 63)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\[128, 63\].*\[128, 64\]"):
        load_model(tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({**original, "model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.extra\.weight"):
        load_model(tmp_path)
    _rewrite_weights(tmp_path, lambda t: (t.pop("model.extra.weight"),
                                          t.update({"model.rotary_emb.inv_freq": torch.zeros(8)})))
    load_model(tmp_path)  # rotary buffers are tolerated

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_dict({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="'linear'"):
        ModelConfig.from_dict({**cfg, "rope_parameters": None,
                               "rope_scaling": {"type": "linear", "factor": 2.0}})

    target = load_model(tmp_path)
    other = dataclasses.replace(_eagle_config(target), vocab_size=100)
    with pytest.raises(ValueError, match="vocab 100"):
        EagleHead(other, target.embed_tokens, target.lm_head)


def test_config_parsing_v4_layout():
    c = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **TINY, "num_attention_heads": 4,
                               "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **{
                                   k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
                               "eos_token_id": [7, 9], "bos_token_id": 1})
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert c.eos_token_ids == (7, 9) and c.eos_token_id == 7 and c.bos_token_id == 1
    assert not c.qkv_bias and not c.o_bias
    q = dataclasses.replace(c, architecture="Qwen2ForCausalLM")
    assert q.qkv_bias and not q.o_bias
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_load_tokenizer(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    ids = loaded.encode("hello world")
    ids = ids.ids if hasattr(ids, "ids") else ids
    assert list(ids)[-2:] == [1, 2]
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")

    def fail(*args, **kwargs):
        raise OSError("no AutoTokenizer here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    fallback = load_tokenizer(tmp_path)  # tokenizers.Tokenizer from tokenizer.json
    assert isinstance(fallback, Tokenizer) and fallback.encode("hello world").ids == [1, 2]
