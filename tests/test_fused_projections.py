"""Fused projections (issue 29's per-op cuts): one matmul for q/k/v and one for gate/up over
weights stored once, transposed, that the HF-named modules view.

The fused storage must follow every way the weights change (construction, loading, ``.to()``,
in-place edits, ``load_state_dict``), the forward must compute what the separate modules
compute, and gradients (training the built-in models) must reach the modules.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specdial.attention import TorchAttentionBackend
from specdial.models import (EagleHead, ForwardBatch, LlamaForCausalLM, ModelConfig,
                             load_eagle_head, load_model, save_eagle_head)
from specdial.models.layers import MLP, Attention, LMHead, RMSNorm, fuse_linears_, refuse_

CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 100}


def _model(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig.from_dict({**CFG, **extra})).eval()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def assert_fused(model: torch.nn.Module) -> None:
    """Every fused tensor equals its modules' parameters and shares their memory."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            ws = (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight)
            assert torch.equal(m.qkv_t, torch.cat(ws).t())
            assert all(_shares(w, m.qkv_t) for w in ws)
            assert _shares(m.kv_t, m.qkv_t) and m.kv_t.shape[1] == 2 * m.k_proj.out_features
            if m.qkv_bias is not None:
                bs = (m.q_proj.bias, m.k_proj.bias, m.v_proj.bias)
                assert torch.equal(m.qkv_bias, torch.cat(bs))
                assert all(_shares(b, m.qkv_bias) for b in bs)
            if m.o_t is not None:
                assert _shares(m.o_t, m.o_proj.weight) and m.o_t.is_contiguous()
            n += 1
        elif isinstance(m, MLP):
            ws = (m.gate_proj.weight, m.up_proj.weight)
            assert torch.equal(m.gate_up_t, torch.cat(ws).t())
            assert all(_shares(w, m.gate_up_t) for w in ws)
            assert m.gate_up_t.is_contiguous()
            n += 1
    assert n, "no fused module found"
    for m in model.modules():  # LM heads: row-major values, transposed storage (on the CPU)
        if isinstance(m, LMHead) and m.weight.device.type == "cpu":
            assert m.weight.t().is_contiguous(), "LM head weight not stored transposed"


def _batch(backend, ids):
    t = len(ids)
    r = torch.arange(t)
    meta = backend.plan(torch.tensor([t]), torch.tensor([t]), r)
    return ForwardBatch(torch.tensor(ids), r, r.clone(), meta)


def _forward(model, ids, grad=False):
    backend = TorchAttentionBackend()
    pool = model.make_kv_pool(32)
    with torch.set_grad_enabled(grad):
        return model.compute_logits(model(_batch(backend, ids), pool, backend)), pool


def test_fused_storage_follows_the_parameters(tmp_path):
    model = _model(attention_bias=True, mlp_bias=False)
    assert_fused(model)
    attn = model.layers[0].self_attn
    with torch.no_grad():  # in-place edits reach the fused storage (tests' helpers do this)
        attn.k_proj.weight[3].add_(1.0)
        attn.v_proj.bias.add_(0.5)
        model.layers[1].mlp.up_proj.weight.mul_(2.0)
    assert_fused(model)
    other = _model(attention_bias=True)
    other.load_state_dict(model.state_dict())  # copies in place
    assert_fused(other)
    assert torch.equal(_forward(other, [1, 2, 3])[0], _forward(model, [1, 2, 3])[0])
    copied = copy.deepcopy(model)  # clones each parameter: fuse_ runs again
    assert_fused(copied)
    with torch.no_grad():
        for p in copied.parameters():
            p.add_(0.5)
    assert_fused(copied)
    double = _model().to(torch.float64)  # a move copies each parameter: fuse_ runs again
    assert_fused(double)
    assert double.layers[0].self_attn.qkv_t.dtype == torch.float64
    assert set(model.state_dict()) == set(_model(attention_bias=True).state_dict())
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()  # transformers' names


def test_replaced_parameters_are_refused():
    model = _model()
    attn = model.layers[1].self_attn
    attn.q_proj.weight = torch.nn.Parameter(torch.randn_like(attn.q_proj.weight))
    assert not _shares(attn.q_proj.weight, attn.qkv_t)  # stale until refused
    refuse_(model)
    assert_fused(model)


def test_fused_forward_equals_the_modules_and_trains():
    """The inference path (fused matmuls, residual added by the GEMM) against the modules'
    path taken where gradients are enabled; gradients reach every projection."""
    for extra in ({}, {"attention_bias": True, "mlp_bias": True}):
        model = _model(**extra)
        ids = [5, 7, 11, 13, 17, 19]
        with torch.inference_mode():
            fused, fused_pool = _forward(model, ids)
        modules, pool = _forward(model, ids, grad=True)
        torch.testing.assert_close(fused, modules.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_pool.k_buffer, pool.k_buffer, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_pool.v_buffer, pool.v_buffer, rtol=1e-5, atol=1e-5)
        modules.logsumexp(-1).sum().backward()
        for name, p in model.named_parameters():
            if "proj" in name:
                assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mlp_takes_leading_dims_and_adds_the_residual():
    mlp = _model().layers[0].mlp
    x, r = torch.randn(2, 3, 64), torch.randn(3, 64)
    with torch.no_grad():
        ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), ref)  # [B, T, H]: the modules' path
        torch.testing.assert_close(mlp(x[0], r), r + ref[0], rtol=1e-5, atol=1e-6)


def test_fuse_linears_errors_and_layout():
    a, b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 5, bias=False)
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        fuse_linears_((a, b))
    with pytest.raises(ValueError, match="one in_features"):
        fuse_linears_((a, torch.nn.Linear(4, 3)))
    c = torch.nn.Linear(8, 5)
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = torch.cat([a(x), c(x)], -1)
        wt, bias = fuse_linears_((a, c))
        assert wt.shape == (8, 8) and wt.is_contiguous() and bias.shape == (8,)
        torch.testing.assert_close(torch.addmm(bias, x, wt), want)
        torch.testing.assert_close(torch.cat([a(x), c(x)], -1), want)  # views, same values


def test_rms_norm_float32_is_the_formula():
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64))
        x = 3 * torch.randn(5, 64)
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)


def test_loaded_model_is_fused(tmp_path):
    model = _model(tie_word_embeddings=True)
    cfg = {**CFG, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    assert_fused(loaded)
    with torch.inference_mode():
        assert torch.equal(_forward(loaded, [3, 1, 4])[0], _forward(model, [3, 1, 4])[0])


def test_biased_eagle_head_saves_and_loads_fused(tmp_path):
    """Saving writes each module's own tensor (views of the fused storage, copied out) under
    transformers' names; loading fuses again."""
    target = _model(tie_word_embeddings=True)
    cfg = ModelConfig.from_dict({**CFG, "num_hidden_layers": 1, "attention_bias": True,
                                 "mlp_bias": True, "tie_word_embeddings": True})
    torch.manual_seed(3)
    head = EagleHead(cfg, target.embed_tokens, target.lm_head).eval()
    save_eagle_head(head, tmp_path)
    loaded = load_eagle_head(tmp_path, target)
    assert_fused(loaded)
    for (n, a), (m, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    backend = TorchAttentionBackend()
    hidden = torch.randn(3, 64)
    outs = []
    for h in (head, loaded):
        with torch.inference_mode():
            outs.append(h(_batch(backend, [4, 5, 6]), h.make_kv_pool(8), backend,
                          hidden_states=hidden))
    assert torch.equal(outs[0], outs[1])


def _lm_head_ok(model: LlamaForCausalLM, tied: bool) -> None:
    """The LM head is stored transposed, the tie is one Parameter, logits are the head's
    formula and the embedding looks up the same rows as a row-major copy."""
    head, emb = model.lm_head, model.embed_tokens
    assert isinstance(head, LMHead) and head.weight.t().is_contiguous()
    assert (head.weight is emb.weight) == tied
    x, ids = torch.randn(5, 64, dtype=head.weight.dtype), torch.tensor([0, 7, 99, 7])
    with torch.no_grad():
        torch.testing.assert_close(head(x), x @ head.weight.contiguous().t())
        assert torch.equal(emb(ids), emb.weight.contiguous()[ids])


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_stored_transposed_keeps_the_tie(tmp_path, tied):
    """Issue 29: the LM head's weight stored ``[hidden, vocab]`` on the CPU. The tie stays
    one Parameter through construction, in-place edits, ``load_state_dict``, ``.to()``,
    deepcopy and loading; a replaced Parameter is laid out again by ``refuse_``."""
    model = _model(tie_word_embeddings=tied)
    _lm_head_ok(model, tied)
    ids = [3, 1, 4, 1, 5]
    before = _forward(model, ids)[0]
    with torch.no_grad():  # an in-place edit of the embedding reaches the logits when tied
        model.embed_tokens.weight[:, 0].add_(0.25)
    after = _forward(model, ids)[0]
    assert not torch.equal(before, after)
    _lm_head_ok(model, tied)
    other = _model(tie_word_embeddings=tied)
    other.load_state_dict(model.state_dict())  # in place: the layout stays
    _lm_head_ok(other, tied)
    assert torch.equal(_forward(other, ids)[0], after)
    for copy_ in (copy.deepcopy(model), _model(tie_word_embeddings=tied).to(torch.float64)):
        _lm_head_ok(copy_, tied)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().contiguous())
    refuse_(model)
    assert model.lm_head.weight.t().is_contiguous()
    cfg = {**CFG, "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({("" if k.startswith("lm_head") else "model.") + k: v.contiguous()
               for k, v in other.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    _lm_head_ok(loaded, tied)
    assert torch.equal(_forward(loaded, ids)[0], after)
    assert loaded.state_dict()["lm_head.weight"].shape == (100, 64)  # transformers' shape


def test_lm_head_layout_follows_the_device():
    """Row-major off the CPU (cuBLAS takes either layout; strided embedding rows would be
    uncoalesced on a GPU); the meta device is left alone."""
    with torch.device("meta"):
        head = LMHead(8, 16)
    assert head.weight.is_contiguous()
    head = LMHead(8, 16)
    assert head.weight.t().is_contiguous() and not head.weight.is_contiguous()
    if torch.cuda.is_available():
        assert head.to("cuda").weight.is_contiguous()


def test_rotary_table_is_the_formula():
    """The CPU rotary table (issue 29: one index_select per forward) gives the formula's
    values bit for bit, grows past its first size, and negative positions take the formula."""
    from specdial.models.layers import RotaryEmbedding

    cfg = ModelConfig.from_dict({**CFG, "max_position_embeddings": 64, "rope_theta": 500000.0})
    rot = RotaryEmbedding(cfg)
    first = rot.table_len
    for dtype in (torch.float32, torch.bfloat16):
        for pos in ([0], [5, 6, 7, 8], [first - 1], [3, first + 10, 1], [2 * first + 7]):
            p = torch.tensor(pos)
            cos, sin = rot(p, dtype)
            want = rot.rotation(p, dtype)
            assert cos.shape == sin.shape == (len(pos), 1, 16) and cos.dtype == dtype
            assert torch.equal(cos, want[:, :1]) and torch.equal(sin, want[:, 1:])
            emb = p.float()[:, None] * rot.inv_freq[None, :]
            emb = torch.cat([emb, emb], -1)  # transformers' cos / rotate_half sin
            assert torch.equal(cos[:, 0], emb.cos().to(dtype))
            assert torch.equal(sin[:, 0, 8:], emb.sin().to(dtype)[:, 8:])
            assert torch.equal(sin[:, 0, :8], -emb.sin().to(dtype)[:, :8])
    assert rot.table_len == 4 * first and rot.table(torch.float32).shape[0] == 4 * first
    cos, _ = rot(torch.tensor([-1, 2]), torch.float32)
    assert torch.equal(cos, rot.rotation(torch.tensor([-1, 2]), torch.float32)[:, :1])
