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


def test_offline_engine_and_generate_are_greedy_as_documented():
    assert SamplingParams().temperature == sd.OFFLINE_TEMPERATURE == 0.0
    assert GenerateConfig().temperature == sd.OFFLINE_TEMPERATURE
