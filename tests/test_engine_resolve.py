"""Issue 26 (part A): the GPU user's path (``device`` / ``dtype`` ``auto``, ``float16`` /
``half``, model ids through the local Hugging Face cache) and one meaning per flag
(``speculative_num_steps`` bounds adaptation, configs without ``strategy``, the seed, the
CPU threads, list parsing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdial.engine.resolve as resolve
from specdial import AdaptiveConfig, ConfigError, Engine
from specdial.builtin import builtin_model_path
from specdial.cli import build_parser
from specdial.cli_serve import _defaults
from specdial.config import EngineConfig
from specdial.engine.loading import resolve_placement
from specdial.engine.policy_setup import cap_candidates
from specdial.server.config import GenerateConfig, ServeConfig, config_from_args
from specdial.server.flags import resolve_compat
from timeouts import scaled

TARGET = builtin_model_path("target")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")


def parsed(cls, argv):
    args = build_parser().parse_args(argv)
    resolve_compat(args, _defaults(cls))
    cfg = config_from_args(cls, args)
    cfg.flag_names = dict(getattr(args, "_flag_names", {}))
    return cfg


# ------------------------------------------------------------------ device and dtype
@needs_no_cuda
def test_serve_picks_cpu_and_float32_by_itself():
    cfg = parsed(ServeConfig, ["serve", "--model-path", str(TARGET)])
    ec = cfg.engine_config()
    assert (ec.device, ec.dtype) == ("auto", "auto")
    assert resolve_placement(ec.device, ec.dtype, TARGET) == (torch.device("cpu"), torch.float32)


def _checkpoint(tmp_path: Path, dtype: str | None) -> Path:
    d = tmp_path / f"ckpt-{dtype}"
    d.mkdir()
    d.joinpath("config.json").write_text(json.dumps({"torch_dtype": dtype} if dtype else {}))
    return d


def test_auto_picks_cuda_and_the_checkpoint_dtype_with_a_fake_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "cuda_available", lambda: True)
    assert resolve.resolve_device_name("auto") == "cuda"
    dev, dtype = resolve_placement("auto", "auto", _checkpoint(tmp_path, "bfloat16"))
    assert (dev.type, dtype) == ("cuda", torch.bfloat16)
    assert resolve_placement("auto", "auto", _checkpoint(tmp_path, "float16"))[1] == torch.float16
    # a float32 checkpoint (or none named) runs in a half type on a GPU, as vLLM does
    assert resolve_placement("auto", "auto", _checkpoint(tmp_path, None))[1] == torch.bfloat16
    # an explicit dtype wins; float16 / half are accepted
    assert resolve_placement("auto", "half", TARGET)[1] == torch.float16
    assert resolve_placement("cpu", "auto", TARGET) == (torch.device("cpu"), torch.float32)


@needs_no_cuda
def test_device_cuda_without_cuda_is_a_one_line_error(capsys):
    from specdial.cli import main

    assert main(["generate", "x", "--device", "cuda", "--log-level", "error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdial: error:") and "CUDA" in err[0], err


@pytest.mark.parametrize("name, canonical", [("half", "float16"), ("float16", "float16"),
                                             ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_spellings(name, canonical):
    assert resolve.canonical_dtype(name) == canonical
    assert EngineConfig(dtype=name).dtype == name
    assert parsed(ServeConfig, ["serve", "--dtype", name]).engine_config().dtype == name
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")


# ------------------------------------------------------------------ model ids
def _hf_cache(tmp_path: Path, repo: str, source: Path = TARGET) -> Path:
    """A Hugging Face hub cache under ``tmp_path/hub`` holding ``repo`` with the files of
    ``source`` (``models--org--name/snapshots/<hash>/`` and ``refs/main``)."""
    org, name = repo.split("/")
    root = tmp_path / "hub" / f"models--{org}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = root / "snapshots" / commit
    shutil.copytree(source, snap)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snap = _hf_cache(tmp_path, "specdial-test/tiny")
    _hf_cache(tmp_path, "specdial-test/tiny-eagle", builtin_model_path("eagle"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network
    return snap


def test_a_model_id_in_the_local_cache_loads_by_its_id(hf_cache):
    assert resolve.resolve_model_dir("specdial-test/tiny") == hf_cache
    cfg = parsed(ServeConfig, ["serve", "specdial-test/tiny", "--log-interval-s", "0"])
    cfg.check()  # the id resolves before any model loads
    assert cfg.model_name() == "specdial-test/tiny"
    with Engine(model_path="specdial-test/tiny", draft_model_path="specdial-test/tiny-eagle",
                max_running_requests=2, log_interval_s=None) as engine:
        assert engine.speculative_algorithm == "EAGLE"
        out = engine.generate("def f(x):", {"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 4
    assert engine.device.type in ("cpu", "cuda")


def test_a_missing_id_names_the_flag_the_user_passed(hf_cache):
    for argv, flag in ((["serve", "org/none"], "MODEL"), (["serve", "--model", "org/none"],
                                                        "--model"),
                       (["serve", "--model-path", "org/none"], "--model-path"),
                       (["serve", "--speculative-draft-model-path", "org/none"],
                        "--speculative-draft-model-path")):
        cfg = parsed(ServeConfig, argv)
        with pytest.raises(ValueError) as e:
            cfg.check()
        msg = str(e.value)
        assert msg.startswith(f"{flag} org/none:") and "'org/none'" in msg, msg
        assert "HF_HUB_OFFLINE" in msg and "huggingface-cli download org/none" in msg
    with pytest.raises(ValueError, match="model_path ./nowhere: no such directory"):
        resolve.resolve_model_dir("./nowhere")


def test_serve_with_a_missing_id_fails_in_one_line(tmp_path):
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "specdial.cli", "serve", "org/none"],
                       capture_output=True, text=True, timeout=scaled(120), env=env)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("specdial: error: MODEL org/none:"), r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ one meaning per flag
def test_speculative_num_steps_bounds_the_adaptive_candidates():
    capped = cap_candidates(AdaptiveConfig.default(), 3)
    assert capped.candidate_steps == [0, 1, 2, 3] and capped.strategy == "goodput"
    ema = cap_candidates(AdaptiveConfig.ema_default(), 4)  # slots [1,3,5,7] [0,1,3] [0,1] [0]
    slots = json.loads(ema.to_json())
    assert [slots[k]["candidate_steps"] for k in ("1", "8", "32", "64")] == [
        [1, 3], [0, 1, 3], [0, 1], [0]]
    assert slots["1"]["down_hysteresis"] == -0.25  # the slot's other settings kept
    assert cap_candidates(AdaptiveConfig.from_dict({"1": {"candidate_steps": [5, 7]}}),
                          2).candidate_steps == [2]  # a slot left empty gets the bound
    with pytest.raises(ConfigError, match="speculative_num_steps=0"):
        cap_candidates(AdaptiveConfig.from_dict(
            {"strategy": "throughput_aware", "1": {"candidate_steps": [1, 3]}}), 0)


def test_speculative_num_steps_3_never_runs_more_than_3_steps():
    """The issue's case: --speculative-num-steps 3 (or num_speculative_tokens 3) with the
    adaptive default config went to 4 and beyond; now the steps never exceed 3."""
    for argv in (["--speculative-num-steps", "3"],
                 ["--speculative-config", '{"num_speculative_tokens": 3}']):
        kw = parsed(GenerateConfig, ["generate", "x", *argv]).engine_kwargs()
        assert kw["speculative_num_steps"] == 3 and kw["speculative_adaptive"] is True
    with Engine(speculative_num_steps=3, max_running_requests=4, log_interval_s=None) as engine:
        assert max(engine.scheduler.candidate_steps) == 3
        assert max(engine.stats().steps_per_slot.values()) <= 3
        outs = engine.generate(["def fibonacci(n):", "class Stack:", "import os", "for i in"],
                               {"max_new_tokens": 48, "temperature": 0})
    hist: dict[int, int] = {}
    for o in outs:
        for k, n in o["meta_info"]["spec_steps_histogram"].items():
            hist[k] = hist.get(k, 0) + n
    assert hist and max(hist) <= 3, hist


def test_a_config_without_strategy_is_sglangs_ema_format(tmp_path):
    """The documented rule: a config file (or dict) without ``strategy`` is SGLang's format,
    whose only strategy is ema; no config at all is the goodput default."""
    path = tmp_path / "sglang.json"
    path.write_text('{"1": {"candidate_steps": [1, 3, 5]}, "8": {"candidate_steps": [0, 1]}}')
    assert AdaptiveConfig.from_file(path).strategy == "ema"
    assert AdaptiveConfig.from_dict({"candidate_steps": [0, 1, 2]}).strategy == "ema"
    assert AdaptiveConfig.default().strategy == "goodput"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "without a `strategy` key is SGLang's EMA format" in readme
    help_text = " ".join(EngineConfig.__dataclass_fields__["speculative_adaptive_config"]
                         .metadata["help"].split())
    assert "without a strategy key is SGLang's EMA format" in help_text


def test_seed_means_the_engine_sampling_seed_everywhere():
    serve = parsed(ServeConfig, ["serve", "--seed", "7"])
    assert serve.engine_config().seed == 7
    import dataclasses

    assert dataclasses.asdict(serve)["seed"] == 7  # what /server_info reports
    from specdial.bench.cli import BenchConfig

    bench = parsed(BenchConfig, ["bench", "--seed", "5", "--arrival-seed", "9"])
    assert bench.engine_config().seed == 5 and bench.arrival_seed == 9
    with pytest.raises(ConfigError, match="seed"):
        EngineConfig(seed=-1)


def test_cpu_threads_is_an_engine_option():
    before = torch.get_num_threads()
    try:
        with Engine(cpu_threads=1, max_running_requests=1, log_interval_s=None) as engine:
            assert torch.get_num_threads() == 1 and engine.config.cpu_threads == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)


@pytest.mark.parametrize("cmd", [["serve"], ["generate", "x"], ["bench"],
                                 ["policy", "replay", "--trace", "t.jsonl"]])
def test_cuda_graph_bs_parses_spaces_and_commas_alike(cmd):
    parser = build_parser()
    spaced = parser.parse_args([*cmd, "--cuda-graph-bs", "1", "2", "4"]).cuda_graph_bs
    commas = parser.parse_args([*cmd, "--cuda-graph-bs", "1,2,4"]).cuda_graph_bs
    assert spaced == commas == [1, 2, 4]


def test_disable_cuda_graph_has_no_negation(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve", "--disable-cuda-graph"]).disable_cuda_graph is True
    assert parser.parse_args(["serve"]).disable_cuda_graph is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-disable-cuda-graph"])
    assert "--no-disable-cuda-graph" not in parser._subparsers._group_actions[0].choices[
        "serve"].format_help()


def test_chunked_prefill_size_is_apart_from_the_budget():
    cfg = parsed(ServeConfig, ["serve", "--chunked-prefill-size", "8",
                               "--max-prefill-tokens", "64"]).engine_config()
    assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (8, 64)
    outs = []
    for chunk in (8, None):  # prefilled in chunks of 8 tokens, or in one piece
        with Engine(chunked_prefill_size=chunk, max_running_requests=2,
                    log_interval_s=None) as engine:
            assert engine.scheduler.config.chunked_prefill_size == chunk
            outs.append(engine.generate(input_ids=list(range(5, 40)), sampling_params={
                "max_new_tokens": 6, "temperature": 0})["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_compare_noskip_suffix_and_simulate_default():
    from specdial.bench.compare import parse_configurations

    confs = parse_configurations("fixed-0,fixed-0+noskip,fixed-0+skip")
    assert [c.engine_overrides().get("skip_zero_step_draft_extend") for c in confs] == [
        None, False, True]
    parser = build_parser()
    assert parser.parse_args(["policy", "simulate"]).skip_zero_step_draft_extend is True
    assert parser.parse_args(["policy", "simulate", "--no-skip-zero-step-draft-extend"]
                             ).skip_zero_step_draft_extend is False


def test_distributed_check_ends_with_a_verdict():
    from specdial.launch.check import verdict

    line, code = verdict({"target_prefill": (1e-7, 2e-7), "hidden": (1e-6, 5e-6)}, 1e-4, 2)
    assert code == 0 and line.startswith("PASS:") and "hidden" in line
    line, code = verdict({"target_prefill": (1e-2, 3e-3), "hidden": (1e-6, 5e-6)}, 1e-4, 2)
    assert code == 1 and line.startswith("FAIL:") and "target_prefill" in line


@needs_no_cuda
@pytest.mark.parametrize("argv, needle", [
    (["serve", "--device", "cuda", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
      "--dist-init-addr", "127.0.0.1:5999"], "node 1: --device cuda, but CUDA is not available"),
    (["serve", "--speculative-adaptive-config", "/no/such/config.json"],
     "cannot read adaptive config /no/such/config.json"),
    (["generate", "x", "--speculative-adaptive-config", "/no/such/config.json"],
     "cannot read adaptive config"),
    (["bench", "--speculative-adaptive-config", "/no/such/config.json"],
     "cannot read adaptive config"),
])
def test_foreseeable_failures_are_one_line_errors(argv, needle, capsys):
    from specdial.cli import main

    assert main([*argv, "--log-level", "error"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("specdial: error: ") and needle in err[0], err


@needs_no_cuda
def test_a_rank_without_its_gpu_says_so_in_one_line():
    from specdial.launch.rank import device_problem

    assert device_problem("cpu", 3) is None
    assert "CUDA is not available" in device_problem("cuda", 0)


def test_sampling_defaults_are_said_in_the_help_and_the_readme():
    """The documented rule: SGLang's temperature 1.0 (or the model's generation_config.json)
    wherever a request leaves it unset, greedy for ``specdial bench`` as for SGLang's and
    vLLM's benchmarks; each --help says so."""
    from specdial.bench.cli import BenchConfig

    gen = " ".join(GenerateConfig.__dataclass_fields__["temperature"].metadata["help"].split())
    assert "generation_config.json" in gen and "else 1.0" in gen, gen
    assert GenerateConfig().temperature is None
    bench = " ".join(BenchConfig.__dataclass_fields__["temperature"].metadata["help"].split())
    assert "greedy" in bench and "default to 1.0" in bench, bench
    assert BenchConfig().temperature == 0.0
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "**Sampling defaults.**" in readme
