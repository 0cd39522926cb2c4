"""Published EAGLE-1 and EAGLE-3 heads through ``Engine(model_path=..., draft_model_path=...)``
and the CLI (issue 15): greedy output identical to target-only decoding at fixed steps 0/1/3/7,
under forced step schedules (zero-step intervals with and without the skipped extend), and
adaptive; heads equal to the target's next-token function accepting every draft; EAGLE-3 with
emulated CUDA graphs, including a head whose features are narrower than the target's hidden
state (static buffers sized by the drafter); ``--draft-model-path`` and SGLang's
``--speculative-draft-model-path``.

Heads are saved by tests/eagle_heads.py in the exact layouts published checkpoints use.
"""

from __future__ import annotations

import json
import shutil

import pytest

from greedy import greedy
from specdial.server.flags import resolve_compat
import torch
import transformers

from conftest import PROMPTS, _randomize
from eagle_heads import (build_eagle3, eagle1_head, exact_eagle1_head, perturb, randomize,
                         save_eagle1, save_eagle3, sharp_key, sharp_margin)
from specdial.builtin import BUILTIN_DIR
from specdial.cli import build_parser, main
from specdial.engine import Engine

N = 33
KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8, log_interval_s=None)
SCHEDULES = {"7-0-3": [7, 0, 3], "zeros-then-jump": [0, 0, 0, 5, 0, 0, 2, 7, 1]}
#: switches quickly: EMA of the last verify, updated every iteration, no warm-up
SWITCHING = {"1": {"candidate_steps": [0, 1, 3, 7], "ema_alpha": 1.0, "update_interval": 1,
                   "warmup_batches": 0, "down_hysteresis": 0.0}}


def generate(engine: Engine, max_new_tokens=N, prompts=PROMPTS):
    with engine:
        out = engine.generate(input_ids=prompts,
                              sampling_params=greedy(max_new_tokens))
        stats = engine.stats()
        assert stats.kv_pages_used == 0 and engine.scheduler.rows_in_use == 0
        graphs = engine.graph_stats()
    return out, graphs


def reference(path) -> list[list[int]]:
    out, _ = generate(Engine(str(path), **KW))
    return [o["output_ids"] for o in out]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny, deep, exact):
    """name -> (target dir, head dir, target-only greedy outputs, algorithm)."""
    root = tmp_path_factory.mktemp("published_heads")
    deep_path, _, deep_target = deep
    refs = {"tiny": reference(tiny.path), "deep": reference(deep_path)}
    exact_ref = reference(exact.path)
    assert exact_ref == [g[:N] for g in exact.greedy]  # the engine agrees with transformers
    refs["exact"] = exact_ref
    out = {}
    for case in ("sglang-default", "vllm", "speculators"):
        out[f"eagle3-{case}"] = ("deep", build_eagle3(deep_target, root / case, case), "EAGLE3")
    out["eagle3-noisy"] = ("exact", save_eagle3(exact.eagle3_noisy, root / "noisy", "vllm",
                                                ids=[1, 2, 3]), "EAGLE3")
    for layout in ("sglang", "vllm", "llama-label"):
        head = randomize(eagle1_head(tiny.target, layout), 50)
        out[f"eagle1-{layout}"] = ("tiny", save_eagle1(head, root / f"e1-{layout}", layout),
                                   "EAGLE")
    noisy1 = perturb(exact_eagle1_head(exact.target, "sglang"), 0.01, 51)
    out["eagle1-noisy"] = ("exact", save_eagle1(noisy1, root / "e1-noisy", "sglang"), "EAGLE")
    paths = {"tiny": tiny.path, "deep": deep_path, "exact": exact.path}
    return {name: (paths[t], head, refs[t], algo) for name, (t, head, algo) in out.items()}


@pytest.fixture(scope="module")
def exact_heads(tmp_path_factory, exact):
    """name -> head dir of heads equal to the exact target's next-token function."""
    root = tmp_path_factory.mktemp("exact_heads")
    assert sharp_margin(sharp_key(16), exact.target.config.rope_theta, 256) > 200
    return {"eagle3-vllm": save_eagle3(exact.eagle3_same, root / "v", "vllm", ids=[1, 2, 3]),
            "eagle3-speculators": save_eagle3(exact.eagle3_same, root / "s", "speculators",
                                              ids=[1, 2, 3]),
            "eagle1-sglang": save_eagle1(exact_eagle1_head(exact.target, "sglang"), root / "1s",
                                         "sglang"),
            "eagle1-vllm": save_eagle1(exact_eagle1_head(exact.target, "vllm"), root / "1v",
                                       "vllm")}


def engine(heads, name, **kw) -> tuple[Engine, list[list[int]]]:
    target, head, ref, algo = heads[name]
    eng = Engine(str(target), draft_model_path=str(head), **kw, **KW)
    assert eng.speculative_algorithm == algo
    return eng, ref


ALL = ["eagle3-sglang-default", "eagle3-vllm", "eagle3-speculators", "eagle3-noisy",
       "eagle1-sglang", "eagle1-vllm", "eagle1-llama-label", "eagle1-noisy"]


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
@pytest.mark.parametrize("name", ALL)
def test_fixed_steps_lossless(heads, name, steps):
    eng, ref = engine(heads, name, speculative_adaptive=False, speculative_num_steps=steps)
    out, _ = generate(eng)
    assert [o["output_ids"] for o in out] == ref
    for o in out:
        m = o["meta_info"]
        assert m["spec_steps_histogram"] == {steps: m["spec_verify_ct"]}
    if name.endswith("noisy") and steps:  # partial acceptance: extends of several lengths
        lens = [o["meta_info"]["spec_accept_length"] for o in out]
        assert max(lens) > 1.0 and min(lens) < steps + 1, lens


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", ["eagle3-vllm", "eagle3-noisy", "eagle1-noisy"])
def test_step_schedules_lossless(heads, name, schedule, skip):
    eng, ref = engine(heads, name, steps_schedule=SCHEDULES[schedule],
                      skip_zero_step_draft_extend=skip, drafter_max_steps=7)
    out, _ = generate(eng)
    assert [o["output_ids"] for o in out] == ref
    assert set(out[2]["meta_info"]["spec_steps_histogram"]) <= set(SCHEDULES[schedule])


@pytest.mark.parametrize("name", ["eagle3-speculators", "eagle3-noisy", "eagle1-sglang"])
def test_adaptive_lossless(heads, name):
    eng, ref = engine(heads, name)  # the default adaptive config
    assert [o["output_ids"] for o in generate(eng)[0]] == ref
    eng, ref = engine(heads, name, speculative_adaptive_config=SWITCHING, speculative_initial_steps=3,
                      skip_zero_step_draft_extend=True)
    out, _ = generate(eng, max_new_tokens=N)
    assert [o["output_ids"] for o in out] == ref
    if name == "eagle3-noisy":
        hists = [o["meta_info"]["spec_steps_histogram"] for o in out]
        assert len(set().union(*hists)) >= 2, hists  # the policy switched steps


@pytest.mark.parametrize("steps", [1, 3, 7])
@pytest.mark.parametrize("name", ["eagle3-vllm", "eagle3-speculators", "eagle1-sglang",
                                  "eagle1-vllm"])
def test_exact_heads_accept_every_draft(exact, exact_heads, name, steps):
    verifies = 4
    n = 1 + verifies * (steps + 1)  # prefill token + full verifies: no request is capped
    eng = Engine(str(exact.path), draft_model_path=str(exact_heads[name]),
                 speculative_adaptive=False, speculative_num_steps=steps, **KW)
    out, _ = generate(eng, max_new_tokens=n)
    for o, g in zip(out, exact.greedy):
        assert o["output_ids"] == g[:n]
        m = o["meta_info"]
        assert m["spec_verify_ct"] == verifies and m["spec_accept_length"] == steps + 1


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", ["eagle3-vllm", "eagle1-vllm"])
def test_exact_heads_after_a_zero_step_interval(exact, exact_heads, name, skip):
    """Steps 3, 0, 0, 0, 0, 3, 3: the drafts after the gap are all accepted, whether the
    drafter stayed warm or caught up in one extend."""
    eng = Engine(str(exact.path), draft_model_path=str(exact_heads[name]),
                 steps_schedule=[3, 0, 0, 0, 0, 3, 3], skip_zero_step_draft_extend=skip,
                 drafter_max_steps=3, **KW)
    out, _ = generate(eng, max_new_tokens=17)  # emits 4, 1, 1, 1, 1, 4, 4
    for o, g in zip(out, exact.greedy):
        assert o["output_ids"] == g[:17]
        assert o["meta_info"]["spec_steps_histogram"] == {3: 3, 0: 4}


@pytest.mark.parametrize("name", ["eagle3-speculators", "eagle3-noisy"])
def test_eagle3_emulated_graphs_equal_eager(heads, name):
    """Graph runners (emulated on the CPU) replay draft, verify and extend for EAGLE-3; the
    speculators head's features are 48 wide (target hidden 64): the static feature buffers are
    sized by the drafter."""
    graphs = dict(cuda_graph_bs=[1, 2, 4], cuda_graph_mode="emulate")
    extends = 0
    for spec in (dict(speculative_adaptive=False, speculative_num_steps=3),
                 dict(speculative_adaptive_config=SWITCHING, speculative_initial_steps=1)):
        eng, ref = engine(heads, name, **spec, **graphs)
        buffers = next(iter(eng.worker.graph_runners.values())).buffers
        assert buffers.draft_first_hidden.shape[1] == eng.drafter.feature_size
        assert buffers.extend_hidden.shape[1] == eng.drafter.feature_size
        out, stats = generate(eng)
        assert [o["output_ids"] for o in out] == ref
        assert stats["replays"]["draft"] > 0 and stats["replays"]["verify"] > 0
        assert not stats["eager"], stats  # every pass of every iteration replayed a graph
        extends += stats["replays"]["extend"]
    assert extends > 0
    assert eng.drafter.feature_size == (48 if name == "eagle3-speculators" else 64)


# --------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    """A random 4-layer Llama with the built-in tokenizer and an EAGLE-3 head for it in
    SGLang's layout (aux ids [0, 1, 2]: outputs of layers 0..2)."""
    target_dir = tmp_path_factory.mktemp("cli_target")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = transformers.LlamaForCausalLM(config)
    _randomize(hf, 60)
    hf.save_pretrained(target_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUILTIN_DIR / "target" / f, target_dir / f)
    from eagle_heads import eagle3_head
    from specdial.models import load_model

    target = load_model(target_dir)
    vocab = torch.randperm(4096, generator=torch.Generator().manual_seed(61))[:1000].tolist()
    head = randomize(eagle3_head(target, (1, 2, 3), draft_vocab=vocab), 62)
    return target_dir, save_eagle3(head, tmp_path_factory.mktemp("cli_head"), "sglang",
                                   ids=[0, 1, 2])


def test_generate_with_a_published_eagle3_head(cli_dirs, capsys):
    target, head = cli_dirs
    common = ["generate", "def add(a, b):", "--model-path", str(target), "--max-new-tokens",
              "12", "--json", "--max-running-requests", "2", "--temperature", "0"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    for flag in ("--draft-model-path", "--speculative-draft-model-path"):
        assert main([*common, flag, str(head), "--no-speculative-adaptive",
                     "--speculative-num-steps", "3"]) == 0
        spec = json.loads(capsys.readouterr().out)
        assert spec["speculative_algorithm"] == "EAGLE3"
        assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
        assert spec["meta_info"]["spec_steps_histogram"] == {"3": spec["meta_info"][
            "spec_verify_ct"]}
    assert main([*common, "--draft-model-path", str(head), "--speculative-algorithm",
                 "EAGLE"]) == 2
    assert "does not match" in capsys.readouterr().err
    args = resolve_compat(build_parser().parse_args(
        ["serve", "--speculative-draft-model-path", str(head), "--speculative-algorithm", "EAGLE3"]))
    assert args.draft_model_path == str(head) and args.speculative_algorithm == "EAGLE3"


def test_eagle3_in_bfloat16(heads):
    """bf16 weights, features and KV: the run completes, frees everything, and starts like the
    float32 reference (later tokens may flip at bf16 near-ties, see test_engine_greedy)."""
    eng, ref = engine(heads, "eagle3-vllm", dtype="bfloat16", speculative_adaptive=False,
                      speculative_num_steps=3)
    assert eng.drafter.module.fc.weight.dtype == torch.bfloat16
    assert eng.worker.hidden is not None and eng.worker.hidden.dtype == torch.bfloat16
    out, _ = generate(eng)
    for o, r in zip(out, ref):
        assert len(o["output_ids"]) == N and o["output_ids"][:2] == r[:2]
