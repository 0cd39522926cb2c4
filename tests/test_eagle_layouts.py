"""Published EAGLE head layouts (issue 15): the target's aux hidden states, each layout loading
through the real loader, the EAGLE-3 head's computation against an independent reference built
from the checkpoint tensors and transformers' rotary code, and the loader's errors.

Layouts and their tensor names / config fields: tests/eagle_heads.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conftest import DEEP_LAYERS as LAYERS, PROMPTS, VOCAB
from eagle_heads import (EAGLE1_LAYOUTS, EAGLE3_CASES, EXPECTED_AUX, build_eagle3, eagle1_head,
                         randomize, save_eagle1, write_checkpoint)
from specdial.attention import TorchAttentionBackend
from specdial.models import (Eagle3Head, EagleHead, ForwardBatch, infer_draft_algorithm,
                             load_drafter, load_eagle3_head, load_eagle_head, load_model,
                             resolve_draft_algorithm, save_eagle_head)
from specdial.worker.drafters import Eagle3Drafter, make_drafter

def one_batch(ids: list[int]) -> ForwardBatch:
    backend = TorchAttentionBackend()
    n, ar = len(ids), torch.arange(len(ids))
    return ForwardBatch(torch.tensor(ids), ar, ar, backend.plan(torch.tensor([n]),
                                                                torch.tensor([n]), ar))


def test_aux_hidden_states_match_transformers(deep):
    """Index i < N is the input of layer i (transformers' ``hidden_states[i]``); index N the
    last layer's output before the final norm (transformers gives it after the norm)."""
    _, hf, target = deep
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        batch = one_batch(ids)
        hidden, aux = target.forward_with_aux(batch, target.make_kv_pool(64),
                                              TorchAttentionBackend(), (0, 3, LAYERS))
    h = target.config.hidden_size
    torch.testing.assert_close(aux[:, :h], ref[0][0])
    torch.testing.assert_close(aux[:, h:2 * h], ref[3][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(target.norm(aux[:, 2 * h:]), ref[LAYERS][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden, ref[LAYERS][0], rtol=1e-4, atol=1e-5)
    for bad in ((3, 1), (2, 2), (LAYERS + 1,), ()):
        with pytest.raises(ValueError, match="aux_layers"):
            target.forward_with_aux(batch, target.make_kv_pool(64), TorchAttentionBackend(), bad)


# --------------------------------------------------------------------------- reference
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_eagle3_logits(path, hf, ids: list[int]) -> torch.Tensor:
    """Target-vocabulary logits ``[T, V]`` of an EAGLE-3 checkpoint at every position of
    ``ids`` (features of position p - 1, zeros at 0), computed from the raw tensors, the raw
    config and transformers' hidden states and rotary code, without specdial."""
    raw = json.loads((path / "config.json").read_text())
    fields = raw.get("transformer_layer_config", raw)
    t = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(path / "model.safetensors")
         .items()}
    n_layers, eps = hf.config.num_hidden_layers, fields["rms_norm_eps"]
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None:
        layers = sorted({i + 1 for i in nested})  # SGLang: output of layer i
    else:  # vLLM: input of layer i; default (2, N // 2, N - 3)
        layers = sorted(set(raw.get("eagle_aux_hidden_state_layer_ids")
                            or (2, n_layers // 2, n_layers - 3)))
    nbr = raw.get("norm_before_residual", "speculators_model_type" in raw)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in layers], -1)
        g = aux @ t["fc.weight"].T + (t["fc.bias"] if "fc.bias" in t else 0)
        h = torch.cat([torch.zeros_like(g[:1]), g[:-1]])
        emb = t.get("embed_tokens.weight", hf.model.embed_tokens.weight)
        e = emb[torch.tensor(ids)]
        w = {k[len("midlayer."):]: v for k, v in t.items() if k.startswith("midlayer.")}
        hn = _rms(h, w["hidden_norm.weight"], eps)
        x = torch.cat([_rms(e, w["input_layernorm.weight"], eps), hn], -1)
        residual = hn if nbr else h
        nh, nkv, d = (fields["num_attention_heads"], fields["num_key_value_heads"],
                      fields["head_dim"])
        n = len(ids)
        q = (x @ w["self_attn.q_proj.weight"].T).view(1, n, nh, d).transpose(1, 2)
        k = (x @ w["self_attn.k_proj.weight"].T).view(1, n, nkv, d).transpose(1, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).view(1, n, nkv, d).transpose(1, 2)
        rope = LlamaRotaryEmbedding(transformers.LlamaConfig(**{
            k_: fields[k_] for k_ in ("hidden_size", "num_attention_heads", "head_dim",
                                      "rope_theta", "max_position_embeddings")}))
        cos, sin = rope(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = (q @ k.transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, nh * d)
        r = residual + o @ w["self_attn.o_proj.weight"].T
        m = _rms(r, w["post_attention_layernorm.weight"], eps)
        r = r + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T)
                 * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        logits = _rms(r, t["norm.weight"], eps) @ t["lm_head.weight"].T
        out = torch.full((n, hf.config.vocab_size), float("-inf"))
        out[:, torch.arange(len(t["d2t"])) + t["d2t"]] = logits
    return out


def specdial_eagle3_logits(drafter: Eagle3Drafter, target, ids: list[int]) -> torch.Tensor:
    backend = TorchAttentionBackend()
    with torch.no_grad():
        batch = one_batch(ids)
        _, feats = drafter.run_target(target, batch, target.make_kv_pool(64), backend)
        h = torch.cat([torch.zeros_like(feats[:1]), feats[:-1]])
        drafter.init_kv(64)
        out = drafter.head(batch, drafter.kv, backend, hidden_states=h)
        return drafter.to_target_logits(drafter.compute_logits(out))


@pytest.mark.parametrize("case", list(EAGLE3_CASES))
def test_eagle3_layouts_load_and_match_the_reference(deep, tmp_path, case):
    path_t, hf, target = deep
    path = build_eagle3(target, tmp_path / case, case)
    assert infer_draft_algorithm(path) == "EAGLE3"
    algo, head = load_drafter(path, target)
    assert algo == "EAGLE3" and isinstance(head, Eagle3Head)
    assert head.spec.aux_layers == EXPECTED_AUX[case]
    assert head.spec.draft_vocab_size == 100 and not head.identity_vocab
    layout, _, opts = EAGLE3_CASES[case]
    assert head.spec.norm_before_residual == opts.get("norm_before_residual", False)
    assert (head.embed_tokens is target.embed_tokens) == (not opts.get("own_embedding"))
    assert (head.fc.bias is not None) == opts.get("fc_bias", False)
    drafter = make_drafter(head, target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.feature_size == head.config.hidden_size
    ids = PROMPTS[2] + PROMPTS[1]
    got = specdial_eagle3_logits(drafter, target, ids)
    ref = reference_eagle3_logits(path, hf, ids)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)) and int(finite[0].sum()) == 100
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-4, atol=1e-4)
    # greedy drafts are target ids of the draft vocabulary, mapped through d2t
    tokens = drafter.to_target_ids(drafter.compute_logits(torch.randn(5, head.config.hidden_size)
                                                         ).argmax(-1))
    assert set(tokens.tolist()) <= set(head.draft_to_target.tolist())


def test_eagle3_label_llama_and_model_prefix(deep, tmp_path):
    """A head saved under ``LlamaForCausalLM`` (with SGLang's optional ``model.`` prefix) is
    inferred as EAGLE-3 from its tensors, and loads when EAGLE3 is named."""
    _, _, target = deep
    path = build_eagle3(target, tmp_path / "h", "sglang-ids")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    tensors = load_file(path / "model.safetensors")
    save_file({("model." + k if k.startswith("midlayer.") else k): v for k, v in tensors.items()},
              path / "model.safetensors")
    assert infer_draft_algorithm(path) == "EAGLE3"
    assert resolve_draft_algorithm(path, "EAGLE3") == "EAGLE3"
    with pytest.raises(ValueError, match="does not match"):
        resolve_draft_algorithm(path, "DRAFT")
    assert load_eagle3_head(path, target).spec.aux_layers == (1, 4, 7)


@pytest.mark.parametrize("layout", EAGLE1_LAYOUTS)
def test_eagle1_layouts_load(tiny, tmp_path, layout):
    target = tiny.target
    head = randomize(eagle1_head(target, layout), 41)
    path = save_eagle1(head, tmp_path / layout, layout)
    keys = set(load_file(path / "model.safetensors"))
    assert "layers.0.input_layernorm.weight" not in keys and ("fc.bias" in keys) == (
        layout != "vllm")
    # a LlamaForCausalLM label with a top-level fc.weight is an EAGLE head, not a draft model
    assert infer_draft_algorithm(path) == "EAGLE"
    assert resolve_draft_algorithm(path, "EAGLE") == "EAGLE"
    algo, loaded = load_drafter(path, target)
    assert algo == "EAGLE" and isinstance(loaded, EagleHead) and not loaded.input_norm
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head
    assert isinstance(loaded.layers[0].input_layernorm, torch.nn.Identity)
    backend = TorchAttentionBackend()
    ids = PROMPTS[2]
    with torch.no_grad():
        batch = one_batch(ids)
        feats = target(batch, target.make_kv_pool(64), backend)
        a = head(batch, head.make_kv_pool(64), backend, hidden_states=feats)
        b = loaded(batch, loaded.make_kv_pool(64), backend, hidden_states=feats)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    save_eagle_head(loaded, tmp_path / "resaved")  # written in SGLang's layout, same head
    cfg = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
    again = load_eagle_head(tmp_path / "resaved", target)
    assert all(torch.equal(x, y) for x, y in zip(again.state_dict().values(),
                                                  loaded.state_dict().values()))
    # the reference EAGLE layer: no input norm, x = fc(cat(embed, hidden)), Llama layer
    with torch.no_grad():
        x = head.fc(torch.cat([target.embed_tokens(batch.input_ids), feats], -1))
        layer = head.layers[0]
        attn = layer.self_attn
        torch.testing.assert_close(b, layer(x, *head.rotary(batch.positions, x.dtype), batch,
                                            head.make_kv_pool(64), backend))
        assert attn.q_proj.weight.shape == (64, 64)


def test_loader_errors(deep, tiny, tmp_path):
    _, _, target = deep
    path = build_eagle3(target, tmp_path / "h", "sglang-default")
    cfg = json.loads((path / "config.json").read_text())

    def with_config(**changes):
        (path / "config.json").write_text(json.dumps({**cfg, **changes}))

    with_config(architectures=["MedusaModel"])
    with pytest.raises(ValueError, match=r"MedusaModel.*EagleLlamaForCausalLM.*"
                                         r"LlamaForCausalLMEagle3.*Eagle3Speculator.*"
                                         r"draft models LlamaForCausalLM"):
        infer_draft_algorithm(path)
    with_config(num_hidden_layers=2)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        load_eagle3_head(path, target)
    with_config(eagle_config={"use_aux_hidden_state": False})
    with pytest.raises(ValueError, match="use_aux_hidden_state"):
        load_eagle3_head(path, target)
    with_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 9]})
    with pytest.raises(ValueError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids.*0\.\.8"):
        load_eagle3_head(path, target)
    with_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=r"fc.weight takes 192 inputs.*eagle_config"):
        load_eagle3_head(path, target)
    with_config(eagle_aux_hidden_state_layer_ids="2,4")
    with pytest.raises(ValueError, match="must be a non-empty list"):
        load_eagle3_head(path, target)
    with_config(vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size 100 differs"):
        load_eagle3_head(path, target)
    with_config()
    small = load_model(tiny.path)  # 2 layers: the default (2, 1, -1) is outside the target
    with pytest.raises(ValueError, match=r"default \(2, N // 2, N - 3\) for N = 2"):
        load_eagle3_head(path, small)

    tensors = load_file(path / "model.safetensors")
    bad = dict(tensors)
    bad["d2t"] = bad["d2t"].clone()
    bad["d2t"][1] = bad["d2t"][0] - 1  # draft ids 0 and 1 both map to one target id
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match="same target id"):
        load_eagle3_head(path, target)
    bad["d2t"] = tensors["d2t"]
    bad["t2d"] = ~tensors["t2d"]
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match="t2d"):
        load_eagle3_head(path, target)
    bad = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        load_eagle3_head(path, target)
    bad = {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing.*midlayer\.hidden_norm\.weight"):
        load_eagle3_head(path, target)

    spec = tmp_path / "spec"
    write_checkpoint(spec, {"architectures": ["Eagle3Speculator"],
                            "speculators_model_type": "eagle3", "norm_before_fc": True,
                            "transformer_layer_config": {"model_type": "llama"}}, tensors)
    with pytest.raises(ValueError, match="norm_before_fc"):
        load_eagle3_head(spec, target)
    (spec / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"],
                                                  "speculators_model_type": "mtp"}))
    with pytest.raises(ValueError, match=r"speculators_model_type 'mtp'.*'eagle3'"):
        infer_draft_algorithm(spec)

    eagle1 = save_eagle1(randomize(eagle1_head(tiny.target, "sglang"), 3), tmp_path / "e1",
                         "sglang")
    tensors = load_file(eagle1 / "model.safetensors")
    tensors["layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, eagle1 / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected.*layers\.0\.input_layernorm"):
        load_eagle_head(eagle1, tiny.target)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_eagle3_head(eagle1, tiny.target)
