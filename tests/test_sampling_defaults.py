"""The documented sampling-default rule (specdial.engine.sampling_defaults) is what each entry
point applies when a request leaves ``temperature`` unset."""
from __future__ import annotations

from specdial.bench.cli import BenchConfig, CompareConfig
from specdial.engine import sampling_defaults as sd
from specdial.server import app
from specdial.server.config import GenerateConfig
from specdial.worker.sampling import SamplingParams


def test_server_routes_use_sglangs_temperature():
    assert sd.SGLANG_DEFAULTS["temperature"] == 1.0
    assert app.DEFAULT_TEMPERATURE == sd.SERVER_TEMPERATURE == 1.0


def test_bench_is_greedy_like_bench_serving():
    assert BenchConfig().temperature == sd.BENCH_TEMPERATURE == 0.0
    assert CompareConfig().temperature == 0.0


def test_offline_entry_points_default_to_sglangs_temperature():
    assert sd.OFFLINE_TEMPERATURE == sd.SGLANG_DEFAULTS["temperature"] == 1.0
    assert GenerateConfig().temperature == sd.OFFLINE_TEMPERATURE
    # The internal request type stays greedy when built bare (warm-up, graph capture).
    assert SamplingParams().temperature == 0.0


def test_with_offline_defaults_adds_only_a_missing_temperature():
    mine = {"max_new_tokens": 3}
    assert sd.with_offline_defaults(mine) == {"max_new_tokens": 3, "temperature": 1.0}
    assert mine == {"max_new_tokens": 3}  # the caller's dict is not changed
    assert sd.with_offline_defaults(None) == {"temperature": 1.0}
    assert sd.with_offline_defaults({"temperature": 0}) == {"temperature": 0}
    assert sd.with_offline_defaults([1]) == [1]  # refused later, by SamplingParams.from_dict


def test_offline_engine_samples_when_temperature_is_unset(tiny):
    """A request naming no temperature is sampled at 1.0 (SGLang's ``sgl.Engine``): with a
    seed it gives exactly the tokens of an explicit ``temperature`` 1.0, not the greedy ones."""
    from specdial.engine import Engine

    prompt = [5, 17, 3, 99, 42]
    with Engine.from_modules(tiny.target, max_running_requests=2, kv_cache_tokens=256,
                             page_size=8, seed=0, log_interval_s=None) as engine:
        def ids(**sp):
            out = engine.generate(input_ids=prompt, sampling_params={
                "max_new_tokens": 24, "ignore_eos": True, **sp})
            return out["output_ids"]
        unset, sampled, greedy = ids(seed=11), ids(seed=11, temperature=1.0), ids(temperature=0)
    assert unset == sampled
    assert unset != greedy
