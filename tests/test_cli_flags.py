"""Issue 13: SGLang's and vLLM's flag names on ``specdial serve`` / ``generate``
(:mod:`specdial.server.flags`), each alias through the real parser into the Engine's keyword
arguments, the refusals naming specdial's equivalent, and config files validated before any
model loads."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from specdial.cli import build_parser
from specdial.cli_serve import _defaults
from specdial.server.config import GenerateConfig, ServeConfig, config_from_args
from specdial.server.flags import resolve_compat
from test_server_cli import save_tiny_model
from timeouts import scaled


def serve_config(*argv: str) -> ServeConfig:
    args = build_parser().parse_args(["serve", *argv])
    return config_from_args(ServeConfig, resolve_compat(args, _defaults(ServeConfig)))


@pytest.mark.parametrize("argv, field, value", [
    (["--model", "/m"], "model_path", "/m"),
    (["/m"], "model_path", "/m"),  # vLLM's positional `vllm serve MODEL`
    (["--speculative-draft-model-path", "/d"], "draft_model_path", "/d"),
    (["--max-num-seqs", "12"], "max_running_requests", 12),
    (["--max-model-len", "300"], "context_length", 300),
    (["--max-total-tokens", "4096"], "kv_cache_tokens", 4096),
    (["--chunked-prefill-size", "512"], "chunked_prefill_size", 512),  # SGLang's: apart
    (["--max-prefill-tokens", "512"], "max_prefill_tokens", 512),
    (["--speculative-num-draft-tokens", "4"], "speculative_num_steps", 3),
    (["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"],
     "speculative_num_steps", 2),
    (["--speculative-eagle-topk", "1"], "speculative_num_steps", None),
    (["--cuda-graph-bs", "1", "2", "4"], "cuda_graph_bs", [1, 2, 4]),
    (["--cuda-graph-bs", "1,2,8"], "cuda_graph_bs", [1, 2, 8]),
    (["--cuda-graph-max-bs", "16"], "cuda_graph_bs", [1, 2, 4, 8, 12, 16]),
    (["--disable-cuda-graph"], "disable_cuda_graph", True),
    (["--speculative-algorithm", "STANDALONE"], "speculative_algorithm", "DRAFT"),
    (["--dtype", "auto"], "dtype", "auto"),
    (["--chat-template", "{{ messages }}"], "chat_template", "{{ messages }}"),
    (["--data-parallel-size", "2"], "dp_size", 2),  # vLLM's
    (["--load-balance-method", "round_robin"], "load_balance_method", "round_robin"),
    (["--data-parallel-backend", "inprocess"], "data_parallel_backend", "inprocess"),
])
def test_alias_sets_the_specdial_option(argv, field, value):
    cfg = serve_config(*argv)
    assert getattr(cfg, field) == value
    if value is not None and field not in ("chat_template",):
        assert cfg.engine_kwargs()[field] == value


def test_speculative_config_json():
    cfg = serve_config("--speculative-config", json.dumps(
        {"method": "eagle", "model": "/heads/e", "num_speculative_tokens": 4}))
    kw = cfg.engine_kwargs()
    assert kw["speculative_algorithm"] == "EAGLE" and kw["draft_model_path"] == "/heads/e"
    assert kw["speculative_num_steps"] == 4
    assert serve_config("--speculative-config",
                        '{"method": "draft_model"}').speculative_algorithm == "DRAFT"


@pytest.mark.parametrize("argv, message", [
    # --speculative-num-draft-tokens / --speculative-eagle-topk are options of their own now,
    # checked with the engine's options: tests/test_draft_tree_config.py
    (["--model", "/a", "--model-path", "/b"], "conflicts with --model-path"),
    (["--max-num-seqs", "4", "--max-running-requests", "8"], "give one of them"),
    (["--speculative-config", '{"method": "ngram"}'], "method 'ngram' is not supported"),
    (["--speculative-config", '{"draft_tensor_parallel_size": 1}'], "no specdial equivalent"),
    (["--speculative-config", "{"], "not JSON"),
    (["--cuda-graph-max-bs", "8", "--cuda-graph-bs", "1"], "give one of them"),
])
def test_bad_combinations_say_why(argv, message):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        resolve_compat(args, _defaults(ServeConfig))


@pytest.mark.parametrize("flag, instead", [("--mem-fraction-static", "--kv-cache-tokens"),
                                           ("--gpu-memory-utilization", "--kv-cache-tokens"),
                                           ("--max-num-batched-tokens", "--max-prefill-tokens")])
def test_flags_with_another_meaning_are_refused(flag, instead, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, "0.8"])
    assert e.value.code == 2 and instead in capsys.readouterr().err


def test_generate_takes_the_aliases():
    args = build_parser().parse_args(["generate", "hi", "--max-model-len", "64",
                                      "--speculative-num-draft-tokens", "2"])
    cfg = config_from_args(GenerateConfig, resolve_compat(args, _defaults(GenerateConfig)))
    assert cfg.prompt == "hi" and cfg.context_length == 64 and cfg.speculative_num_steps == 1


def test_config_errors_come_before_any_model_loads(tmp_path):
    """A bad adaptive config, model directory or chat template is an error within a second
    (the models of the built-in engine took ~7.6 s to load before the error before)."""
    bad = tmp_path / "cfg.json"
    bad.write_text('{"1": {"candidate_steps": [1, 3], "bogus": 1}}')
    cases = [(["serve", "--speculative-adaptive-config", str(bad)], "bogus"),
             (["generate", "x", "--speculative-adaptive-config", str(bad)], "bogus"),
             (["serve", "--model-path", str(tmp_path)], "no config.json"),
             (["serve", "--chat-template", str(tmp_path / "none.jinja")], "--chat-template"),
             (["serve", "--speculative-num-steps", "0", "--speculative-adaptive-config",
               str(save_cfg(tmp_path, strategy="throughput_aware"))],
              "speculative_num_steps=0")]
    for argv, needle in cases:
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "specdial.cli", *argv], capture_output=True,
                           text=True, timeout=scaled(120))
        elapsed = time.perf_counter() - start
        assert r.returncode == 2 and needle in r.stderr, (argv, r.stderr)
        assert "loading the engine" not in r.stderr
        print(argv[0], needle, f"{elapsed:.2f} s")


def save_cfg(tmp_path, strategy=None):
    path = tmp_path / "ok.json"
    data = {"1": {"candidate_steps": [1, 3]}, **({"strategy": strategy} if strategy else {})}
    path.write_text(json.dumps(data))
    return path


def test_dtype_auto_and_chat_template_reach_the_engine(tmp_path):
    model = save_tiny_model(tmp_path / "m", seed=3)
    cfg = serve_config(str(model), "--dtype", "auto", "--chat-template",
                       "{% for m in messages %}[{{ m.content }}]{% endfor %}>",
                       "--max-model-len", "128", "--log-interval-s", "0")
    engine = cfg.build_engine()
    try:
        assert engine.target.embed_tokens.weight.dtype.is_floating_point
        assert str(engine.target.embed_tokens.weight.dtype) == "torch.float32"  # CPU: float32
        assert engine.context_length == 128
        from specdial.server.chat import render_chat

        assert render_chat(engine.tokenizer, [{"role": "user", "content": "q"}]) == ("[q]>", True)
    finally:
        engine.shutdown()


# ------------------------------------------------- specdial bench: SGLang's bench_serving names
@pytest.mark.parametrize("argv, field, value", [
    (["--max-concurrency", "4"], "concurrency", 4),
    (["--dataset-name", "random"], "dataset", "random"),
    (["--warmup-requests", "3"], "warmup_prompts", 3),
    (["--disable-ignore-eos"], "ignore_eos", False),
    (["--max-num-seqs", "8"], "max_running_requests", 8),  # the server's aliases too
    (["--max-model-len", "256"], "context_length", 256),
    ([], "ignore_eos", True),  # the aliases leave the defaults alone
    ([], "concurrency", None),
])
def test_bench_takes_bench_serving_names(argv, field, value):
    # before: `bench --max-concurrency 4` was "argument {compare,cost-table}: invalid choice:
    # '4'", an error naming neither the flag nor what to use
    assert getattr(build_parser().parse_args(["bench", *argv]), field) == value


@pytest.mark.parametrize("flag, instead", [("--output-file", "--output-json"),
                                           ("--port", "--base-url"),
                                           ("--mem-fraction-static", "--kv-cache-tokens")])
def test_bench_refuses_flags_with_another_meaning(flag, instead, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", flag, "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and instead in err and "invalid choice" not in err


@pytest.mark.parametrize("argv", [["bench", "--no-such-flag", "4"],
                                  ["bench", "--num-prompts", "2", "--no-such-flag=4"],
                                  ["bench", "compare", "--no-such-flag", "4"],
                                  ["generate", "hi", "--no-such-flag", "4"],
                                  ["policy", "simulate", "--no-such-flag", "4"]])
def test_an_unknown_option_is_named(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized option --no-such-flag" in err, err
    assert "invalid choice" not in err


def test_no_subcommand_option_is_an_ambiguous_abbreviation_of_bench_options():
    # argparse matches every --token against `bench`'s options before the subcommand's parser
    # sees it: a registered --output-file made README's `bench cost-table --out FILE` fail
    args = build_parser().parse_args(["bench", "cost-table", "--out", "t.json"])
    assert args.out == "t.json"
    bench = next(a for a in build_parser()._actions if a.nargs == "A...").choices["bench"]
    own = [s for a in bench._actions for s in a.option_strings]
    for sub in next(a for a in bench._actions if a.nargs == "A...").choices.values():
        for flag in (s for a in sub._actions for s in a.option_strings if s.startswith("--")):
            assert flag in own or sum(o.startswith(flag) for o in own) <= 1, flag


def test_known_options_abbreviations_and_positionals_still_parse():
    assert build_parser().parse_args(["bench", "--num-prom", "3"]).num_prompts == 3
    args = build_parser().parse_args(["bench", "--log-level", "error", "compare", "--configs",
                                      "no-spec"])
    assert args.configs == "no-spec"
    assert build_parser().parse_args(["generate", "--x and y"]).prompt == "--x and y"
    assert build_parser().parse_args(["generate", "--", "--x"]).prompt == "--x"
