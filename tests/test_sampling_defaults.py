"""The documented sampling-default rule (specdial.engine.sampling_defaults) is what each entry
point applies when a request leaves ``temperature`` unset."""
from __future__ import annotations

import json

import pytest

from specdial.bench.cli import BenchConfig, CompareConfig
from specdial.engine import sampling_defaults as sd
from specdial.server.config import GenerateConfig
from specdial.worker.sampling import SamplingParams
from test_server_api import live, post  # noqa: F401 - the fake-engine server fixture


def test_unset_temperature_is_sglangs_everywhere_but_bench():
    assert sd.SGLANG_DEFAULTS["temperature"] == sd.DEFAULT_TEMPERATURE == 1.0
    assert sd.request_defaults()["temperature"] == 1.0


def test_bench_is_greedy_like_bench_serving():
    assert BenchConfig().temperature == sd.BENCH_TEMPERATURE == 0.0
    assert CompareConfig().temperature == 0.0


def test_offline_entry_points_default_to_sglangs_temperature():
    assert GenerateConfig().temperature is None  # unset: the engine's defaults apply
    assert GenerateConfig().sampling_params() == {"max_new_tokens": 128}
    # The internal request type stays greedy when built bare (warm-up, graph capture).
    assert SamplingParams().temperature == 0.0


def test_with_defaults_adds_only_what_the_request_leaves_unset():
    defaults = sd.request_defaults()
    assert defaults == {"temperature": 1.0}
    mine = {"max_new_tokens": 3}
    assert sd.with_defaults(mine, defaults) == {"max_new_tokens": 3, "temperature": 1.0}
    assert mine == {"max_new_tokens": 3}  # the caller's dict is not changed
    assert sd.with_defaults(None, defaults) == {"temperature": 1.0}
    assert sd.with_defaults({"temperature": 0}, defaults) == {"temperature": 0}
    assert sd.with_defaults([1], defaults) == [1]  # refused later, by SamplingParams.from_dict
    model = sd.request_defaults({"temperature": 0.6, "top_k": 20})
    assert sd.with_defaults({"top_k": 5}, model) == {"temperature": 0.6, "top_k": 5}


def _generation_config(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_model_defaults_come_from_generation_config_json(tmp_path):
    assert sd.model_sampling_defaults(None) == {}
    assert sd.model_sampling_defaults(tmp_path) == {}  # no file
    d = _generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=None,
                           max_length=4096, bos_token_id=1)
    assert sd.model_sampling_defaults(d) == {"temperature": 0.6, "top_p": 0.9}
    assert sd.model_sampling_defaults(d, "openai") == {}
    # do_sample false is greedy (Hugging Face generate, SGLang), whatever temperature says
    d = _generation_config(tmp_path, do_sample=False, temperature=0.7, repetition_penalty=1.1)
    assert sd.model_sampling_defaults(d) == {"temperature": 0.0, "repetition_penalty": 1.1}
    # no do_sample: the sampling fields stand (SGLang keeps them too)
    d = _generation_config(tmp_path, top_k=20, min_p=0.05)
    assert sd.model_sampling_defaults(d) == {"top_k": 20, "min_p": 0.05}


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", "expected a JSON object"),
    ("{not json", "not readable as JSON"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"),
])
def test_a_bad_generation_config_is_refused_naming_the_file(tmp_path, content, words):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=words) as e:
        sd.model_sampling_defaults(tmp_path)
    assert "generation_config.json" in str(e.value)


def test_sampling_defaults_mode_is_checked():
    with pytest.raises(ValueError, match="sampling_defaults.*allowed: model, openai"):
        sd.model_sampling_defaults(None, "vllm")


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


def _tiny_engine(model_dir, **kw):
    from specdial.engine import Engine

    return Engine(model_path=str(model_dir), max_running_requests=2, kv_cache_tokens=256,
                  page_size=8, seed=0, log_interval_s=None, policy_cache=False, **kw)


def test_the_targets_generation_config_gives_the_engines_defaults(tiny, tmp_path):
    """``do_sample: false`` in the target's generation_config.json makes an unset temperature
    greedy (SGLang's ``--sampling-defaults model``); ``openai`` ignores the file."""
    import shutil

    model = shutil.copytree(tiny.path, tmp_path / "target")
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False,
                                                              "temperature": 0.6}))
    prompt = [5, 17, 3, 99, 42]

    def ids(engine, **sp):
        return engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 24, "ignore_eos": True, **sp})["output_ids"]

    with _tiny_engine(model) as engine:
        assert engine.sampling_defaults == {"temperature": 0.0}
        unset, greedy = ids(engine, seed=11), ids(engine, temperature=0)
        sampled = ids(engine, seed=11, temperature=1.0)
    assert unset == greedy != sampled
    with _tiny_engine(model, sampling_defaults="openai") as engine:
        assert engine.sampling_defaults == {"temperature": 1.0}
        assert ids(engine, seed=11) == sampled
    with pytest.raises(ValueError, match="sampling_defaults"):
        _tiny_engine(model, sampling_defaults="vllm")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}),
])
def test_server_routes_leave_unset_fields_to_the_engines_defaults(live, path, body):
    r = post(live, path, body)
    assert r.status_code == 200, r.text
    params = live.engine.submitted[max(live.engine.submitted)]["received"]
    assert not {"temperature", "top_p"} & set(params), params
    r = post(live, path, {**body, "temperature": 0.5} if path != "/generate" else
             {**body, "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}})
    assert live.engine.submitted[max(live.engine.submitted)]["received"]["temperature"] == 0.5
