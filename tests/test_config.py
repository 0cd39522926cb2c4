"""The adaptive config's Python surface: constructors, defaults, and every error (issue 2)."""

import json
import math

import pytest

import specdial
from specdial import AdaptiveConfig, ConfigError


def canonical(cfg: AdaptiveConfig) -> dict:
    return json.loads(cfg.to_json())


def test_exceptions_are_typed():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(specdial.InternalError, RuntimeError)
    assert ConfigError.__module__ == "specdial"


def test_default_config_is_goodput():
    c = canonical(AdaptiveConfig.default())
    assert c["strategy"] == "goodput" and AdaptiveConfig.default().strategy == "goodput"
    assert c["1"] == {"candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7]}
    assert c["128"] == {"candidate_steps": [0, 1, 2, 3, 4, 5]}
    assert c["256"] == {"candidate_steps": [0, 1, 2, 3]}
    assert c["switch_margin"] == 0.05 and c["min_dwell"] == 8 and c["probe_budget"] == 0.03
    assert AdaptiveConfig.default().profile is None
    assert AdaptiveConfig.from_json(AdaptiveConfig.default().to_json()) == AdaptiveConfig.default()


def test_goodput_and_throughput_aware_from_dict():
    cfg = AdaptiveConfig.from_dict({"strategy": "goodput", "1": {"candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7]}})
    assert cfg.strategy == "goodput" and cfg.candidate_steps == list(range(8))
    ta = AdaptiveConfig.from_dict({"strategy": "throughput_aware", "window_size": 20, "update_interval": 10,
                                   "switch_hysteresis": 0.1, "profile_run_batch_sizes": None,
                                   "max_profile_run_batch_size": 128, "profile_run_n_warmup": 5,
                                   "profile_run_n_measure": 10, "profile_run_seq_len": 128,
                                   "1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [1, 3]}})
    assert ta.strategy == "throughput_aware"
    assert ta.profile == {"profile_run_batch_sizes": None, "max_profile_run_batch_size": 128,
                          "profile_run_n_warmup": 5, "profile_run_n_measure": 10, "profile_run_seq_len": 128}


def test_ema_default_config():
    c = canonical(AdaptiveConfig.ema_default())
    assert c["strategy"] == "ema"
    assert c["1"]["candidate_steps"] == [1, 3, 5, 7] and c["1"]["down_hysteresis"] == -0.25
    assert c["8"]["candidate_steps"] == [0, 1, 3] and c["8"]["down_hysteresis"] == 0.0
    assert c["32"]["candidate_steps"] == [0, 1] and c["64"]["candidate_steps"] == [0]
    for slot in ("1", "8", "32", "64"):
        assert c[slot]["up_hysteresis"] == 0.0 and c[slot]["ceiling_coeff"] == 0.0
        assert c[slot]["ema_alpha"] == 0.2 and c[slot]["update_interval"] == 5 and c[slot]["warmup_batches"] == 10
    assert AdaptiveConfig.ema_default().candidate_steps == [0, 1, 3, 5, 7]


def test_constructors_agree(tmp_path):
    d = {"ema_alpha": 0.3, "1": {"candidate_steps": [5, 1, 1]}, "016": {"candidate_steps": [0, 2], "ema_alpha": 0.9}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(d))
    a, b, c = AdaptiveConfig.from_dict(d), AdaptiveConfig.from_json(json.dumps(d)), AdaptiveConfig.from_file(path)
    assert a == b == c
    assert AdaptiveConfig.from_file(str(path)) == a
    assert a.slot_lower_bounds == [1, 16]
    can = canonical(a)
    assert can["1"]["candidate_steps"] == [1, 5] and can["1"]["ema_alpha"] == 0.3
    assert can["16"]["ema_alpha"] == 0.9
    # The canonical form parses back to the same config.
    assert AdaptiveConfig.from_json(a.to_json()) == a
    # Integer keys in a Python dict are slot keys too.
    assert AdaptiveConfig.from_dict({1: {"candidate_steps": [1, 5]}, 16: {"candidate_steps": [0, 2]}}).slot_lower_bounds == [1, 16]


def test_flat_object_is_slot_one():
    cfg = AdaptiveConfig.from_dict({"candidate_steps": [0, 2], "ema_alpha": 0.5})
    assert cfg.slot_lower_bounds == [1]
    assert canonical(cfg)["1"]["ema_alpha"] == 0.5


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError, match="cannot read adaptive config"):
        AdaptiveConfig.from_file(tmp_path / "nope.json")


def test_file_error_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"1": {"candidate_steps": [40]}}')
    with pytest.raises(ConfigError, match=r"bad\.json: slot \"1\": candidate_steps\[0\]"):
        AdaptiveConfig.from_file(path)


S = {"candidate_steps": [1, 3]}


@pytest.mark.parametrize(
    "cfg, match",
    [
        ([1, 2], "must be a JSON object"),
        ("x", "must be a JSON object"),
        ({}, "no slot"),
        ({"ema_alpha": 0.5}, "no slot"),
        ({"0": S}, 'slot key "0"'),
        ({"8": S, "08": S}, "both mean batch size 8"),
        ({"1": {}}, "candidate_steps is missing"),
        ({"1": {"candidate_steps": []}}, "non-empty list"),
        ({"1": {"candidate_steps": 3}}, "got 3"),
        ({"1": {"candidate_steps": [-1]}}, r"candidate_steps\[0\] must be an integer in 0..=32, got -1"),
        ({"1": {"candidate_steps": [1, 1.0]}}, r"candidate_steps\[1\].*got 1.0"),
        ({"1": {"candidate_steps": [True]}}, "got true"),
        ({"1": {"candidate_steps": [33]}}, "got 33"),
        ({"1": {**S, "ema_alpha": 0}}, r'slot "1": ema_alpha must be in \(0, 1\], got 0'),
        ({"1": {**S, "ema_alpha": 1.01}}, "got 1.01"),
        ({"1": {**S, "ema_alpha": True}}, "ema_alpha must be a number, got true"),
        ({"1": {**S, "ema_alpha": math.nan}}, "ema_alpha must be finite"),
        ({"1": {**S, "down_hysteresis": math.inf}}, "down_hysteresis must be finite"),
        ({"1": {**S, "up_hysteresis": -math.inf}}, "up_hysteresis must be finite"),
        ({"1": {**S, "up_hysteresis": "0.1"}}, "up_hysteresis must be a number"),
        ({"1": {**S, "update_interval": 0}}, "update_interval must be an integer >= 1, got 0"),
        ({"1": {**S, "update_interval": 5.0}}, "update_interval must be an integer >= 1, got 5.0"),
        ({"1": {**S, "update_interval": 2**70}}, "too large"),
        ({"1": {**S, "warmup_batches": -1}}, "warmup_batches must be an integer >= 0"),
        ({"1": {**S, "ceiling_coeff": -1}}, "ceiling_coeff must be >= 0"),
        ({"1": {**S, "ceiling_coeff": None}}, "ceiling_coeff must be a number, got null"),
        ({"1": {**S, "emaalpha": 0.1}}, r'unknown key "emaalpha" in slot "1"; allowed: candidate_steps'),
        ({"1": S, "verbose": True}, r'unknown key "verbose" in adaptive config; allowed: slot keys'),
        ({"1": {**S, "strategy": "ema"}}, "strategy is a global key"),
        ({"1": {"candidate_steps": [0, 1]}, "strategy": "throughput_aware"}, "takes steps > 0"),
        ({"1": S, "strategy": "greedy"}, 'strategy must be one of "ema", "goodput", "throughput_aware"'),
        ({"1": S, "strategy": "goodput", "ema_alpha": 0.2}, 'ema_alpha is a setting of strategy "ema"'),
        ({"1": {**S, "min_dwell": 2}, "strategy": "goodput"}, "global key of strategy \"goodput\""),
        ({"1": S, "strategy": "goodput", "switch_margin": 1.5}, r"switch_margin must be in \[0, 1\)"),
        ({"1": S, "switch_margin": 0.1}, 'switch_margin is a setting of strategy "goodput"'),
        ({"1": [1, 3]}, 'slot "1" must be an object'),
        ({"ema_alpha": 5, "1": {**S, "ema_alpha": 0.5}}, r"ema_alpha must be in \(0, 1\]"),
        ({(1, 2): S}, "unknown key"),
    ],
)
def test_errors_name_key_and_value(cfg, match):
    with pytest.raises(ConfigError, match=match):
        AdaptiveConfig.from_dict(cfg)


def test_json_text_errors():
    with pytest.raises(ConfigError, match="not valid JSON"):
        AdaptiveConfig.from_json("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        AdaptiveConfig.from_json('{"1": {"candidate_steps": [1], "ema_alpha": NaN}}')
    with pytest.raises(ConfigError, match="too large"):
        AdaptiveConfig.from_json('{"1": {"candidate_steps": [1], "warmup_batches": 18446744073709551615}}')


def test_validate_initial_steps():
    specdial.validate_initial_steps(None, 3)
    specdial.validate_initial_steps({"1": {"candidate_steps": [2]}}, 2)
    specdial.validate_initial_steps(AdaptiveConfig.default(), 0)
    specdial.validate_initial_steps(None, 2)  # the default goodput config offers 0..=7
    with pytest.raises(ConfigError, match=r"speculative_num_steps = 2 is a candidate of no slot; candidates: \[0, 1, 3, 5, 7\]"):
        specdial.validate_initial_steps(AdaptiveConfig.ema_default(), 2)
    with pytest.raises(ConfigError):
        specdial.validate_initial_steps(None, -1)
    with pytest.raises(TypeError, match="config must be an AdaptiveConfig, a dict or None"):
        specdial.validate_initial_steps("cfg.json", 3)
