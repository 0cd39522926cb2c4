"""Shared tiny models for the engine tests (float32, CPU, built once per session).

- ``tiny``: a random 2-layer HF Llama saved with ``save_pretrained`` (and the same checkpoint
  loaded into specdial), no EOS so greedy runs go to ``max_new_tokens``.
- drafters: a random 1-layer draft model (acceptance ~1.0), the target with slightly perturbed
  weights (partial acceptance), the target itself (every draft accepted), a random EAGLE head.
- ``tiny1``: a 1-layer target whose final norm weight is 1 plus an EAGLE head that reproduces it
  exactly under greedy decoding (fc picks the embedding, same decoder layer; argmax is
  invariant to the final RMSNorm's positive scale), i.e. an EAGLE drafter accepting everything,
  and a perturbed copy of that head (partial acceptance).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import transformers

import timeouts
from specdial.models import EagleHead, LlamaForCausalLM, load_model
from specdial.models.eagle import EAGLE_ARCHITECTURE


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeout-scale", type=float, default=None,
                     help="multiply every timeout of the tests by this factor (default "
                          f"{timeouts.DEFAULT_TIMEOUT_SCALE}, or ${timeouts.ENV}; tests/timeouts.py)")


def pytest_configure(config: pytest.Config) -> None:
    value = config.getoption("--timeout-scale")
    if value is not None:
        timeouts.set_scale(value)
# The policy cache (specdial.engine.policy_cache) of every engine and CLI run in the suite goes
# to a fresh directory, never the user's: an engine seeded by an earlier run on this machine
# would make tests of a fresh policy depend on what ran before.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="specdial-test-cache-")


@pytest.fixture(scope="module", autouse=True)
def _policy_cache_per_module(tmp_path_factory):
    """A fresh policy cache directory for each test module (before its module fixtures: autouse
    comes first within a scope): a built-in engine's goodput policy would otherwise start from
    what another module's engine measured, under that moment's load, and which modules ran
    before (``pytest tests/x.py`` or the whole suite) would decide its first choices."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("policy-cache")))
        yield

# Tiny CPU models: intra-op threads only add overhead (about 15x slower on a shared 2-core box).
torch.set_num_threads(1)

VOCAB = 192
PROMPTS = [[5, 17, 3], [9, 1, 44, 120, 7, 7, 30, 2, 66], list(range(100, 117))]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights (as tests/test_models.py): norms 1 + 0.2 N(0,1), others 0.15 N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


def _perturbed(module: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """``module`` plus ``scale * N(0, 1)`` on every parameter it owns (shared ones untouched)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module.eval()


def _save_hf(path, layers: int, seed: int):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model, seed)
    if layers == 1:
        with torch.no_grad():
            model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    return model


def eagle_config(target: LlamaForCausalLM):
    return dataclasses.replace(target.config, architecture=EAGLE_ARCHITECTURE, num_hidden_layers=1)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    hf = _save_hf(path, layers=2, seed=0)
    target = load_model(path)
    draft_path = tmp_path_factory.mktemp("tiny_draft")
    _save_hf(draft_path, layers=1, seed=1)
    draft_random = load_model(draft_path)
    torch.manual_seed(2)
    eagle_random = EagleHead(eagle_config(target), target.embed_tokens, target.lm_head)
    _randomize(eagle_random, 3)
    return SimpleNamespace(path=path, hf=hf, target=target, draft_path=draft_path,
                           draft_random=draft_random, draft_same=load_model(path),
                           draft_noisy=_perturbed(load_model(path), 0.01, 5),
                           eagle_random=eagle_random.eval())


@pytest.fixture(scope="session")
def tiny1(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target_1layer")
    hf = _save_hf(path, layers=1, seed=4)
    target = load_model(path)
    head = EagleHead(eagle_config(target), target.embed_tokens, target.lm_head)
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
        head.fc.bias.zero_()
    head.layers[0].load_state_dict(target.layers[0].state_dict())
    noisy = EagleHead(eagle_config(target), target.embed_tokens, target.lm_head)
    noisy.load_state_dict(head.state_dict())
    return SimpleNamespace(path=path, hf=hf, target=target, eagle_same=head.eval(),
                           eagle_noisy=_perturbed(noisy, 0.003, 6))


def _save_exact(path, seed: int):
    """A 4-layer HF Llama built for exact EAGLE heads (tests/eagle_heads.py): embedding entries
    +-1 with column 0 = +1, ``rms_norm_eps`` 0, layer 0's input norm and the final norm weight
    1, layers 1..3 adding nothing (``o_proj`` and ``down_proj`` zero); layer 0 and the LM head
    random, so the next-token function is a non-trivial function of the whole prefix."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = torch.randn(VOCAB, 64, generator=gen).sign()
        emb[:, 0] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def exact(tmp_path_factory):
    """The exact-head target (``_save_exact``), its greedy continuations of ``PROMPTS`` from
    transformers (40 tokens), a draft vocabulary holding every token they contain plus others
    (120 of 192, shuffled), an EAGLE-3 head reproducing the target (``eagle3_same``) and a
    perturbed copy (``eagle3_noisy``, partial acceptance)."""
    from eagle_heads import exact_eagle3_head, perturb

    path = tmp_path_factory.mktemp("exact_target")
    hf = _save_exact(path, seed=20)
    target = load_model(path)
    with torch.no_grad():
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0, len(p):]
                  .tolist() for p in PROMPTS]
    used = sorted({t for g in greedy for t in g})
    gen = torch.Generator().manual_seed(21)
    others = [t for t in torch.randperm(VOCAB, generator=gen).tolist() if t not in used]
    vocab = used + others[: max(0, 120 - len(used))]
    vocab = [vocab[i] for i in torch.randperm(len(vocab), generator=gen).tolist()]
    same = exact_eagle3_head(target, vocab)
    noisy = exact_eagle3_head(target, vocab)
    perturb(noisy, 0.003, 22)
    return SimpleNamespace(path=path, hf=hf, target=target, greedy=greedy, draft_vocab=vocab,
                           eagle3_same=same.eval(), eagle3_noisy=noisy.eval())


DEEP_LAYERS = 8  # SGLang's / vLLM's default EAGLE-3 aux layers (2, 4, 5) are distinct


@pytest.fixture(scope="session")
def deep(tmp_path_factory):
    """A random 8-layer HF Llama (hidden 64, vocabulary 192): ``(path, hf model, specdial
    model)``."""
    path = tmp_path_factory.mktemp("deep_target")
    hf = _save_hf(path, layers=DEEP_LAYERS, seed=30)
    return path, hf, load_model(path)
