"""EngineConfig is the one place the engine's defaults live: the Engine uses exactly them (the
Rust SchedulerConfig gets every value passed, none of its own defaults), the command line shows
them, the lower layers read theirs from it, and bad values are refused naming the field."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import specdial
from specdial.engine import Engine, EngineConfig
from specdial.engine import build
from specdial.engine.args import EngineArgs, add_dataclass_arguments
from specdial.config import config_of_call


def test_the_engine_uses_the_config_defaults(tiny, monkeypatch):
    seen: dict = {}
    real = build.SchedulerConfig

    def recording(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(build, "SchedulerConfig", recording)
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, log_interval_s=None)
    try:
        d = EngineConfig()
        params = set(inspect.signature(specdial.SchedulerConfig).parameters)
        assert set(seen) == params, "every SchedulerConfig value is passed explicitly"
        assert seen["max_running_requests"] == d.max_running_requests == 32
        assert seen["max_queued_requests"] == d.max_queued_requests
        assert seen["max_prefill_tokens"] == d.max_prefill_tokens
        assert seen["page_size"] == d.page_size
        ctx = tiny.target.config.max_position_embeddings  # context_length None: the model's
        assert seen["context_length"] == engine.context_length == ctx
        kv_tokens = min(d.max_running_requests * ctx, 65536)  # kv_cache_tokens None
        assert seen["num_pages"] == -(-kv_tokens // d.page_size)
        assert seen["record_trace"] is False and engine.record_trace is None
        assert seen["skip_zero_step_draft_extend"] is d.skip_zero_step_draft_extend is True
        assert engine.max_running_requests == d.max_running_requests
        assert engine.drafter.max_steps == d.drafter_max_steps
        assert engine.adaptive_config is not None  # speculative_adaptive=True
        assert engine._loop.log_interval_s is None
        assert engine.config == EngineConfig(log_interval_s=None)
    finally:
        engine.shutdown()


def test_lower_layers_read_their_defaults_from_the_config():
    from specdial.config import DEFAULT_TIMEOUT_S
    from specdial.config.parallel import ParallelOptions
    from specdial.worker.drafters import DEFAULT_MAX_STEPS

    d = EngineConfig()
    assert DEFAULT_MAX_STEPS == d.drafter_max_steps
    assert DEFAULT_TIMEOUT_S == d.dist_timeout
    assert d.parallel_options() == ParallelOptions()


def test_the_command_line_defaults_are_the_config_defaults():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineArgs)
    args = parser.parse_args([])
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("cli") is False:
            assert not hasattr(args, f.name), f.name
        else:
            assert getattr(args, f.name) == f.default, f.name
    assert EngineArgs().engine_config() == EngineConfig()


def test_from_modules_refuses_what_cannot_apply(tiny):
    with pytest.raises(ValueError, match="device cannot apply"):
        Engine.from_modules(tiny.target, None, device="cpu")
    with pytest.raises(ValueError, match="tp_size and dp_size must be 1"):
        Engine.from_modules(tiny.target, None, dp_size=2)


def test_positional_and_unknown_engine_arguments():
    assert config_of_call(("m", "d", "EAGLE"), {}).speculative_algorithm == "EAGLE"
    with pytest.raises(TypeError, match="multiple values for argument 'model_path'"):
        config_of_call(("m",), {"model_path": "x"})
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        config_of_call((), {"max_runing_requests": 4})
    with pytest.raises(TypeError, match="at most 9 positional"):
        config_of_call(tuple(range(10)), {})


@pytest.mark.parametrize("bad, match", [
    ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm must be one of"),
    ({"dtype": "int8"}, "dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
    ({"max_running_requests": 0}, "max_running_requests must be an int >= 1"),
    ({"page_size": True}, "page_size must be an int >= 1"),
    ({"context_length": -1}, "context_length must be an int >= 1 or None"),
    ({"speculative_num_steps": -1}, "speculative_num_steps must be None or an int >= 0"),
    ({"cuda_graph_bs": [0]}, "cuda_graph_bs"),
    ({"cuda_graph_mode": "fast"}, "cuda_graph_mode must be one of"),
    ({"disable_cuda_graph": 1}, "disable_cuda_graph must be a bool"),
    ({"tp_size": 0}, "tp_size must be an integer >= 1"),
    ({"dp_size": 2, "tp_size": 2, "data_parallel_backend": "inprocess"},
     "dp_size > 1 with tp_size > 1 needs data_parallel_backend='mp'"),
    ({"load_balance_method": "random"},
     "load_balance_method must be one of 'minimum_tokens', 'shortest_queue', 'round_robin'"),
    ({"data_parallel_backend": "ray"}, "data_parallel_backend must be one of 'mp', 'inprocess'"),
])
def test_bad_values_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_sglang_algorithm_names_mean_what_the_command_line_makes_them():
    """``speculative_algorithm="NONE"`` (SGLang's "no speculation") and ``"STANDALONE"``
    (SGLang's separate draft model) are accepted by the Engine as by the CLI, with the same
    meaning: None and ``"DRAFT"``; the built-in models with ``"NONE"`` decode plainly."""
    assert EngineConfig(speculative_algorithm="NONE").speculative_algorithm is None
    assert EngineConfig(speculative_algorithm="STANDALONE").speculative_algorithm == "DRAFT"
    for name, meaning in (("NONE", None), ("STANDALONE", "DRAFT")):
        args = EngineArgs(speculative_algorithm=name)
        assert args.engine_config().speculative_algorithm == meaning
    with pytest.raises(ValueError, match="'NONE', 'STANDALONE'; got 'none'"):
        EngineConfig(speculative_algorithm="none")
    e = Engine(model_path=None, speculative_algorithm="NONE", log_interval_s=None,
               policy_cache=False)
    try:
        assert e.speculative_algorithm is None and e._parts.drafter is None
        out = e.generate("Hello", {"max_new_tokens": 3, "temperature": 0.0})
        assert len(out["output_ids"]) == 3
        assert set(out["meta_info"]["spec_steps_histogram"]) <= {0}, out["meta_info"]
    finally:
        e.shutdown()
