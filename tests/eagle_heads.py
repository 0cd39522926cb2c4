"""Small EAGLE-1 and EAGLE-3 heads saved in the layouts published checkpoints use.

Layouts (tensor names and config fields as SGLang's and vLLM's loaders read them):

- EAGLE-1 ``sglang``: ``LlamaForCausalLMEagle``, ``fc.weight`` + ``fc.bias``, ``layers.0.*``
  without ``input_layernorm``, plus the ``embed_tokens.weight`` the EAGLE reference code saves.
- EAGLE-1 ``vllm``: ``EagleLlamaForCausalLM``, ``fc.weight`` only (no bias), ``layers.0.*``.
- EAGLE-1 ``llama-label``: the ``sglang`` tensors under ``LlamaForCausalLM`` (how many heads are
  published; SGLang/vLLM rename the label when the algorithm is named).
- EAGLE-3 ``sglang``: ``LlamaForCausalLMEagle3`` with ``draft_vocab_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (output of layer i) or no ids (the default
  layers); ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
- EAGLE-3 ``vllm``: ``Eagle3LlamaForCausalLM`` with top-level ``eagle_aux_hidden_state_layer_ids``
  (input of layer i) and ``norm_before_residual``; ``layers.0.*`` instead of ``midlayer.*``.
- EAGLE-3 ``speculators``: ``Eagle3Speculator``, ``speculators_model_type: "eagle3"``, the Llama
  fields in ``transformer_layer_config``, ``target_hidden_size``, ``speculators_config``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdial.models import Eagle3Head, Eagle3Spec, EagleHead, LlamaForCausalLM, ModelConfig


def llama_fields(cfg: ModelConfig, **over) -> dict:
    """HF Llama config fields of a one-layer head shaped like ``cfg`` (overridable)."""
    d = {"model_type": "llama", "hidden_act": "silu", "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
         "num_attention_heads": cfg.num_attention_heads,
         "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
         "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": None,
         "eos_token_id": None}
    d.update(over)
    return d


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# --------------------------------------------------------------------------- EAGLE-1
EAGLE1_LAYOUTS = ("sglang", "vllm", "llama-label")


def eagle1_head(target: LlamaForCausalLM, layout: str) -> EagleHead:
    """An un-initialised published-layout EAGLE-1 head for ``target`` (no input norm)."""
    cfg = ModelConfig.from_dict({**llama_fields(target.config), "architectures": ["X"]})
    return EagleHead(cfg, target.embed_tokens, target.lm_head, input_norm=False,
                     fc_bias=layout != "vllm").eval()


def save_eagle1(head: EagleHead, path: Path, layout: str) -> Path:
    arch = {"sglang": "LlamaForCausalLMEagle", "vllm": "EagleLlamaForCausalLM",
            "llama-label": "LlamaForCausalLM"}[layout]
    tensors = dict(head.state_dict())
    if layout != "vllm":
        tensors["embed_tokens.weight"] = head.embed_tokens.weight  # the reference code saves it
    return write_checkpoint(path, {**llama_fields(head.config), "architectures": [arch]},
                            tensors)


# --------------------------------------------------------------------------- EAGLE-3
EAGLE3_LAYOUTS = ("sglang", "vllm", "speculators")


def eagle3_head(target: LlamaForCausalLM, aux_layers: tuple[int, ...], *,
                draft_vocab: list[int] | None = None, norm_before_residual: bool = False,
                fc_bias: bool = False, own_embedding: bool = False,
                **llama_over) -> Eagle3Head:
    """An un-initialised EAGLE-3 head for ``target`` drafting over ``draft_vocab`` (target ids,
    in draft-id order; None: the full vocabulary, identity map)."""
    tc = target.config
    cfg = ModelConfig.from_dict({**llama_fields(tc, **llama_over), "architectures": ["X"]})
    vd = tc.vocab_size if draft_vocab is None else len(draft_vocab)
    spec = Eagle3Spec(tuple(aux_layers), tc.hidden_size, vd, norm_before_residual, fc_bias)
    head = Eagle3Head(cfg, spec, target.embed_tokens, own_embedding=own_embedding)
    if draft_vocab is not None:
        head.set_vocab_map(torch.tensor(draft_vocab) - torch.arange(vd))
    return head.eval()


def save_eagle3(head: Eagle3Head, path: Path, layout: str, *, ids: list[int] | None = None,
                embed_tokens: bool = False) -> Path:
    """Write ``head`` in ``layout``; ``ids``: the aux layer ids the config states, in that
    layout's convention (None: no ids, the default layers). ``embed_tokens``: also save the
    embedding the head uses (its own, or the shared target one)."""
    spec, cfg = head.spec, head.config
    vd, v = spec.draft_vocab_size, cfg.vocab_size
    mapping = head.draft_to_target.cpu()
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[mapping] = True
    tensors = {"d2t": mapping - torch.arange(vd), "t2d": t2d}
    for name, t in head.state_dict().items():
        if layout != "sglang" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        tensors[name] = t
    if embed_tokens:
        tensors["embed_tokens.weight"] = head.embed_tokens.weight
    fields = llama_fields(cfg)
    extra: dict = {"draft_vocab_size": vd}
    if spec.target_hidden_size != cfg.hidden_size or layout == "speculators":
        extra["target_hidden_size"] = spec.target_hidden_size
    if layout == "sglang":
        if spec.norm_before_residual:
            raise ValueError("SGLang's layout has no norm_before_residual")
        if spec.fc_bias:
            extra["bias"] = True
        if ids is not None:
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids,
                                     "use_aux_hidden_state": True}
        config = {**fields, "architectures": ["LlamaForCausalLMEagle3"], **extra}
    else:
        extra["norm_before_residual"] = spec.norm_before_residual
        if ids is not None:
            extra["eagle_aux_hidden_state_layer_ids"] = ids
        if layout == "vllm":
            config = {**fields, "architectures": ["Eagle3LlamaForCausalLM"], **extra}
        else:
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "speculators_version": "0.1.0", "transformer_layer_config": fields,
                      "speculators_config": {
                          "algorithm": "eagle3", "default_proposal_method": "greedy",
                          "proposal_methods": [{"proposal_type": "greedy",
                                                "speculative_tokens": 3}],
                          "verifier": {"name_or_path": "tiny-target",
                                       "architectures": ["LlamaForCausalLM"]}},
                      **extra}
    return write_checkpoint(path, config, tensors)


# random heads of the published EAGLE-3 layouts for an 8-layer target (conftest's ``deep``)
# layout, config ids (the layout's convention; None: default), and head options
EAGLE3_CASES = {
    "sglang-default": ("sglang", None, dict(fc_bias=True)),
    "sglang-ids": ("sglang", [0, 3, 6], {}),
    "vllm": ("vllm", [1, 4, 7], dict(norm_before_residual=True, own_embedding=True)),
    "speculators": ("speculators", [0, 3, 6],
                    dict(norm_before_residual=True, own_embedding=True, hidden_size=48,
                         intermediate_size=96, num_attention_heads=3, num_key_value_heads=1)),
}
EXPECTED_AUX = {"sglang-default": (2, 4, 5), "sglang-ids": (1, 4, 7), "vllm": (1, 4, 7),
                "speculators": (0, 3, 6)}


def build_eagle3(target: LlamaForCausalLM, path: Path, case: str, seed: int = 40) -> Path:
    """A random EAGLE-3 head of ``case`` for ``target`` saved in its layout; returns the path."""
    layout, ids, opts = EAGLE3_CASES[case]
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(target.config.vocab_size, generator=gen)[:100].tolist()
    head = eagle3_head(target, EXPECTED_AUX[case], draft_vocab=vocab, **opts)
    randomize(head, seed)
    return save_eagle3(head, path, layout, ids=ids, embed_tokens=opts.get("own_embedding", False))


# --------------------------------------------------------------------------- exact heads
def sharp_key(head_dim: int, scale: float = 1e4) -> torch.Tensor:
    """A constant query = key vector whose rotary score peaks at relative distance 0 by far
    more than float32 ``exp`` can resolve (see :func:`sharp_margin`)."""
    return torch.full((head_dim,), (scale / 2) ** 0.5)


def sharp_margin(key: torch.Tensor, theta: float, max_distance: int) -> float:
    """Smallest score gap (after the 1/sqrt(d) scale) between distance 0 and distances
    ``1..max_distance`` for query = key = ``key`` under rotary embedding with base ``theta``."""
    d = key.numel()
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pair = (key[: d // 2].double() ** 2 + key[d // 2:].double() ** 2)
    dist = torch.arange(1, max_distance + 1, dtype=torch.float64)
    gap = (pair[None, :] * (1 - torch.cos(dist[:, None] * inv[None, :]))).sum(1)
    return float(gap.min()) * d ** -0.5


def exact_eagle3_head(target: LlamaForCausalLM, draft_vocab: list[int]) -> Eagle3Head:
    """An EAGLE-3 head whose greedy drafts are the target's greedy tokens (up to float
    rounding), for a target built like ``tests/test_eagle3_engine.py``'s ``exact`` fixture:
    embedding entries +-1 with column 0 = +1, ``rms_norm_eps`` 0, layer 0's input norm and the
    final norm weight 1, layers 1..3 adding nothing (``o_proj``, ``down_proj`` zero).

    Then the target's next token at ``p`` is ``argmax lm_head(norm(r_p))`` with ``r_p`` the
    output of layer 0, and the head (``norm_before_residual``; aux = inputs of layers 1, 2, 3,
    all equal to ``r``, and ``fc`` reads the first, so its features are ``r_{p-1}``) computes
    ``r_p`` exactly in exact arithmetic: attention heads
    0..3 replay the target's layer-0 attention on ``input_layernorm(embed) = embed``; heads
    4..7 attend only to the current position (a constant rotary query/key whose score gap,
    over 1000, makes every other weight exactly 0 in float32) and copy ``embed - hidden_norm(h)``
    slice by slice into the output, so the residual ``hidden_norm(h)`` cancels and the
    post-attention residual is the target's ``embed + attn``; then the target's post-attention
    norm and MLP. The head's norm and ``lm_head`` rows are the target's final norm and LM head
    rows of ``draft_vocab``, which must contain every token the target emits in the test.
    """
    tc = target.config
    h, hd, th = tc.hidden_size, tc.head_dim, tc.num_attention_heads
    assert th * hd == h and th % tc.num_key_value_heads == 0
    heads = 2 * th
    # eps 1e-30: exact on the +-1 embeddings (1 + 1e-30 rounds to 1) but no 0 * inf = NaN for
    # the zero features of position 0
    head = eagle3_head(target, (1, 2, 3), draft_vocab=draft_vocab, norm_before_residual=True,
                       num_attention_heads=heads, num_key_value_heads=heads, rms_norm_eps=1e-30)
    t0 = target.layers[0]
    group = th // tc.num_key_value_heads
    key = sharp_key(hd)
    attn = head.midlayer.self_attn
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        q, k, v, o = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                      attn.o_proj.weight)
        for j in range(th):  # replicas of the target's heads (kv head j // group)
            rows, kv_rows = slice(j * hd, (j + 1) * hd), slice((j // group) * hd,
                                                              (j // group + 1) * hd)
            q[rows, :h] = t0.self_attn.q_proj.weight[rows]
            k[rows, :h] = t0.self_attn.k_proj.weight[kv_rows]
            v[rows, :h] = t0.self_attn.v_proj.weight[kv_rows]
            o[:, rows] = t0.self_attn.o_proj.weight[:, rows]
        for s in range(th):  # sharp heads: slice s of embed - hidden_norm(h)
            rows, dims = slice((th + s) * hd, (th + s + 1) * hd), torch.arange(s * hd, (s + 1) * hd)
            q[rows, 0] = key
            k[rows, 0] = key
            v[rows][torch.arange(hd), dims] = 1.0
            v[rows][torch.arange(hd), h + dims] = -1.0
            o[dims, (th + s) * hd + torch.arange(hd)] = 1.0
        m = head.midlayer
        m.input_layernorm.weight.fill_(1.0)
        m.hidden_norm.weight.fill_(1.0)
        m.post_attention_layernorm.weight.copy_(t0.post_attention_layernorm.weight)
        m.mlp.load_state_dict(t0.mlp.state_dict())
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[torch.tensor(draft_vocab)])
        head.fc.weight[:, :h] = torch.eye(h)
    return head


def exact_eagle1_head(target: LlamaForCausalLM, layout: str) -> EagleHead:
    """A published-layout EAGLE-1 head (no input norm) equal to the ``exact`` target's next-token
    function: ``fc`` passes the embedding, the decoder layer is the target's layer 0 (whose input
    norm is the identity on +-1 embeddings with eps 0), logits via the shared LM head of the
    un-normed output (the final norm's weight is 1: a positive scale, argmax unchanged)."""
    head = eagle1_head(target, layout)
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        state = {k: v for k, v in target.layers[0].state_dict().items()
                 if not k.startswith("input_layernorm")}
        head.layers[0].load_state_dict(state)
    return head


def perturb(module: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """``module`` plus ``scale * N(0, 1)`` on its own parameters (partial acceptance)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.15) -> torch.nn.Module:
    """Norms ``1 + 0.2 N(0, 1)``, other parameters ``scale * N(0, 1)`` (own parameters only)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else scale * noise)
    return module
