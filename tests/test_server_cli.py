"""`specdial generate` and `specdial serve --help`, and the typed options behind them.

``generate`` runs the real Engine on a tiny random Llama (hidden 64, 2 layers) saved with the
built-in models' tokenizer (vocabulary 4096), so prompts are text."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from specdial.builtin import BUILTIN_DIR
from specdial.cli import main
from specdial.server.config import (EngineArgs, GenerateConfig, ServeConfig,
                                    add_dataclass_arguments)
from timeouts import scaled

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = "def add(a, b):\n    return"


def save_tiny_model(path: Path, *, seed: int, perturb_of: Path | None = None,
                    noise: float = 0.01) -> Path:
    """A random 2-layer Llama (hidden 64, vocabulary of the built-in tokenizer) saved with that
    tokenizer in ``path``. ``perturb_of``: start from that checkpoint plus ``noise * N(0, 1)``
    instead (a draft model that agrees with it often; ``noise=0``: an identical copy)."""
    if perturb_of is not None:
        model = transformers.LlamaForCausalLM.from_pretrained(perturb_of)
        scale = noise
    else:
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.LlamaForCausalLM(config)
        scale = 0.0
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if perturb_of is not None:
                p.add_(scale * noise)
            else:
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(BUILTIN_DIR / "target" / f, path / f)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("server_tiny_target"), seed=10)
    draft = save_tiny_model(tmp_path_factory.mktemp("server_tiny_draft"), seed=11,
                            perturb_of=target)
    return target, draft


def test_generate_prints_the_completion_and_statistics(tiny_dirs, capsys):
    target, _ = tiny_dirs
    assert main(["generate", PROMPT, "--model-path", str(target), "--max-new-tokens", "8",
                 "--max-running-requests", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("--- prompt (", "completion (8 tokens, finish: length)", PROMPT,
                  "--- speculation: off ---", "policy             off", "start-up", "generation",
                  "tokens/s", "why runs differ"):
        assert label in out, out
    # nothing about verifies or acceptance when speculation is off (issue 26)
    assert "verif" not in out and "acceptance" not in out and not out.startswith("\n"), out


def test_generate_explains_policy_cache_and_compares_without_speculation(tiny_dirs, capsys,
                                                                          tmp_path):
    target, draft = tiny_dirs
    common = ["generate", PROMPT, "--model-path", str(target), "--draft-model-path", str(draft),
              "--max-new-tokens", "12", "--max-running-requests", "2", "--temperature", "0",
              "--policy-cache-dir", str(tmp_path)]
    assert main(common) == 0
    first = capsys.readouterr().out
    for label in ("--- speculation: DRAFT ---", "policy             adaptive goodput, candidate "
                  "steps per batch-size slot: 1+: 0-7", "policy cache       none",
                  "acceptance length", "tokens per verify with drafts (accepted drafts + 1)",
                  "verifies", "steps histogram", "start-up"):
        assert label in first, first
    assert "no speculation" not in first
    assert main([*common, "--compare-no-spec"]) == 0
    second = capsys.readouterr().out
    assert "policy cache       loaded" in second, second  # the first run's costs seeded it
    assert "no speculation" in second and "same text" in second and "speed-up" in second
    assert main([*common, "--json", "--no-policy-cache", "--compare-no-spec"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy_cache"] == "off" and report["startup_seconds"] > 0
    assert report["no_spec"]["same_text"] is True and report["prompt"] == PROMPT


def test_generate_json_with_a_draft_model_is_lossless(tiny_dirs, capsys):
    target, draft = tiny_dirs
    common = [PROMPT, "--model-path", str(target), "--max-new-tokens", "12", "--json",
              "--max-running-requests", "2", "--temperature", "0"]
    assert main(["generate", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "--draft-model-path", str(draft),
                 "--no-speculative-adaptive", "--speculative-num-steps", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["speculative_algorithm"] == "DRAFT" and plain["speculative_algorithm"] is None
    assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
    m = spec["meta_info"]
    assert m["spec_steps_histogram"] == {"2": m["spec_verify_ct"]}
    assert 1.0 <= m["spec_accept_length"] <= 3.0 and spec["seconds"] > 0


def test_generate_bad_options_exit_2(tiny_dirs, capsys, tmp_path):
    target, _ = tiny_dirs
    assert main(["generate", "x", "--model-path", str(target), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "x", "--model-path", str(tmp_path / "missing")]) == 2
    assert "--model-path" in capsys.readouterr().err  # checked before loading (issue 13)
    with pytest.raises(SystemExit):
        main(["generate", "x", "--dtype", "float64"])


@pytest.mark.parametrize("command, cls", [("serve", ServeConfig), ("generate", GenerateConfig)])
def test_help_documents_every_option(command, cls):
    exe = Path(sys.executable).with_name("specdial")
    proc = subprocess.run([str(exe), command, "--help"], capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    help_text = " ".join(proc.stdout.split())
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue  # Python-only (EngineConfig's seed and test hooks)
        if not f.metadata.get("positional"):
            assert "--" + f.name.replace("_", "-") in help_text, f.name
        first_words = " ".join(f.metadata["help"].split()[:4])
        assert first_words in help_text, (f.name, first_words)
    if command == "serve":
        for flag in ("--no-speculative-adaptive", "--host", "--port", "--served-model-name",
                     "--record-trace", "--max-queued-requests", "--kv-cache-tokens"):
            assert flag in help_text


def test_engine_kwargs_are_the_engine_config():
    from specdial.config import EngineConfig

    # the command line's defaults are EngineConfig's: nothing defaulted twice
    assert EngineArgs().engine_kwargs() == EngineConfig().to_dict()
    cfg = ServeConfig(model_path="/m", speculative_algorithm="NONE", max_queued_requests=4,
                      record_trace="t.jsonl", port=1)
    kw = cfg.engine_kwargs()
    assert kw["speculative_algorithm"] is None and kw["max_queued_requests"] == 4
    assert kw["record_trace"] == "t.jsonl" and kw["model_path"] == "/m"
    assert "port" not in kw and "log_level" not in kw
    assert kw["max_running_requests"] == EngineConfig().max_running_requests
    assert ServeConfig(speculative_algorithm="STANDALONE").engine_kwargs()[
        "speculative_algorithm"] == "DRAFT"
    assert ServeConfig().model_name() == "specdial-default"
    assert ServeConfig(model_path="/m").model_name() == "/m"
    assert ServeConfig(served_model_name="x").model_name() == "x"


def test_process_options_log_interval_and_cpu_threads(tiny_dirs, capsys):
    import torch

    assert ServeConfig(log_interval_s=0).engine_kwargs()["log_interval_s"] is None  # off
    assert ServeConfig(log_interval_s=2.5).engine_kwargs()["log_interval_s"] == 2.5
    assert ServeConfig(cpu_threads=1).engine_kwargs()["cpu_threads"] == 1  # an Engine option
    before = torch.get_num_threads()
    try:
        ServeConfig(cpu_threads=1).configure_process()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    target, _ = tiny_dirs
    for flag, value in (("--cpu-threads", "0"), ("--log-interval-s", "-1")):
        assert main(["generate", "x", "--model-path", str(target), flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_options_parse_into_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, ServeConfig)
    args = parser.parse_args(["--no-speculative-adaptive", "--speculative-num-steps", "2",
                              "--port", "8001", "--shutdown-timeout", "1.5"])
    cfg = ServeConfig(**vars(args))
    assert cfg.speculative_adaptive is False and cfg.speculative_num_steps == 2
    assert cfg.port == 8001 and cfg.shutdown_timeout == 1.5 and cfg.host == "127.0.0.1"


@pytest.mark.parametrize("flag, value", [
    ("--port", "70000"), ("--port", "-1"), ("--shutdown-timeout", "-5"),
    ("--shutdown-timeout", "inf"), ("--shutdown-timeout", "nan"), ("--log-interval-s", "inf"),
    ("--cpu-threads", "0"), ("--max-body-bytes", "0"), ("--body-read-timeout", "0"),
    ("--body-read-timeout", "nan"), ("--max-json-depth", "0"), ("--max-json-depth", "100000"),
    ("--max-prompts", "0"), ("--max-stop-strings", "-1"), ("--max-stop-chars", "0"),
    ("--max-prompt-chars", "0"), ("--api-key", ""), ("--allowed-hosts", ",")])
def test_serve_bad_server_options_exit_2_before_loading(flag, value, capsys, monkeypatch):
    def never(self):
        raise AssertionError("the engine must not be built")

    monkeypatch.setattr(ServeConfig, "build_engine", never)
    assert main(["serve", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err, err


def test_serve_bad_engine_options_exit_2(tiny_dirs, capsys, tmp_path, monkeypatch):
    target, draft = tiny_dirs
    bad = tmp_path / "BAD.json"
    bad.write_text("{not json")
    for args, words in (
            (["--context-length", "0"], "context_length"),
            (["--no-speculative-adaptive", "--speculative-adaptive-config", str(bad)],
             "BAD.json: adaptive config is not valid JSON"),
            (["--draft-model-path", str(draft), "--no-speculative-adaptive",
              "--speculative-adaptive-config", str(bad)], "BAD.json")):
        assert main(["serve", "--model-path", str(target), *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (args, err)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--model-path", str(target), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device" in err and "CUDA is not available" in err and "Traceback" not in err


def test_serve_check_accepts_good_server_options():
    ServeConfig(port=1, shutdown_timeout=0).check()
    ServeConfig(port=0).check()  # the OS picks a free port
    ServeConfig(port=65535, shutdown_timeout=2.5, log_interval_s=0).check()


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(name):
    # before: `--served-model-name ''` served 'specdial-default', the flag silently dropped
    with pytest.raises(ValueError, match="--served-model-name must be a non-empty name"):
        ServeConfig(served_model_name=name).check()
    assert ServeConfig(served_model_name="m").model_name() == "m"


def test_serve_access_options_and_the_api_key_environment_variable():
    loopback = {"localhost", "127.0.0.1", "::1"}
    cfg = ServeConfig()
    sec = cfg.security_config({})
    assert sec.api_key is None and set(sec.allowed_hosts) == loopback
    assert sec.allowed_origins == ()
    assert cfg.security_config({"SPECDIAL_API_KEY": "k1"}).api_key == "k1"
    assert cfg.security_config({"SPECDIAL_API_KEY": ""}).api_key is None  # empty: unset
    assert ServeConfig(api_key="k2").security_config({"SPECDIAL_API_KEY": "k1"}).api_key == "k2"
    assert ServeConfig(host="0.0.0.0").security_config({}).allowed_hosts is None
    sec = ServeConfig(allowed_hosts="api.example, LOCALHOST",
                      allowed_origins="http://a.example,http://b.example").security_config({})
    assert sec.allowed_hosts == ("api.example", "localhost")
    assert sec.allowed_origins == ("http://a.example", "http://b.example")
    limits = ServeConfig(max_body_bytes=10, body_read_timeout=2.5, max_json_depth=3,
                         max_prompts=4, max_stop_strings=5, max_stop_chars=6,
                         max_prompt_chars=7).server_limits()
    assert (limits.max_body_bytes, limits.body_read_timeout_s, limits.max_json_depth,
            limits.max_prompts, limits.max_stop_strings, limits.max_stop_chars,
            limits.max_prompt_chars) == (10, 2.5, 3, 4, 5, 6, 7)


def test_serve_help_describes_the_shutdown():
    exe = Path(sys.executable).with_name("specdial")
    proc = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True,
                          timeout=scaled(120))
    help_text = " ".join(proc.stdout.split())
    assert "new connections are refused" in help_text
    assert "already-open connections get 503" in help_text
