"""The policy cache (issue 26): what the goodput policy learned is saved at shutdown per
machine, model, drafter, dtype and threads, and seeds the next engine; a corrupt, stale or
other-version file is ignored with a warning; ``policy_cache=False`` neither reads nor writes."""

from __future__ import annotations

import json
import logging

import pytest

from specdial.engine import Engine
from specdial.engine.policy_cache import FORMAT, default_cache_dir

KW = dict(max_running_requests=2, kv_cache_tokens=1024, log_interval_s=None)
PARAMS = {"max_new_tokens": 24, "temperature": 0}


def _run(cache_dir, **kw):
    engine = Engine(policy_cache_dir=str(cache_dir), **KW, **kw)
    status = engine.stats().policy_cache
    seeded = engine.scheduler.export_policy_state()
    out = engine.generate("def fibonacci(n):", PARAMS)
    engine.shutdown()
    return status, json.loads(seeded), out


def test_a_second_engine_starts_from_what_the_first_learned(tmp_path):
    status, fresh, first = _run(tmp_path)
    assert status == "none" and fresh["cost"]["observations"] == 0
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left behind
    saved = json.loads(files[0].read_text())
    assert saved["format"] == FORMAT and saved["key"]["threads"] >= 1
    learned = saved["state"]["cost"]["observations"]
    assert learned > 0 and saved["state"]["version"] >= 1
    status, seeded, second = _run(tmp_path)
    assert status == "loaded"
    assert seeded["cost"] == saved["state"]["cost"]  # the cost model it starts from
    assert second["output_ids"] == first["output_ids"]  # still lossless (greedy)
    again = json.loads(files[0].read_text())["state"]["cost"]["observations"]
    assert again > learned  # the second run added to it


@pytest.mark.parametrize("damage, why", [
    (lambda text: text[: len(text) // 2], "corrupt"),
    (lambda text: text.replace('"version": 1', '"version": 999', 1), "version"),
    (lambda text: text.replace('"format": 1', '"format": 0', 1), "format"),
    (lambda text: text.replace('"threads": ', '"threads": 1000', 1), "stale"),
])
def test_a_damaged_file_is_ignored_with_a_warning(tmp_path, caplog, damage, why):
    _run(tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_text(damage(path.read_text()))
    with caplog.at_level(logging.WARNING, logger="specdial.engine"):
        status, seeded, out = _run(tmp_path)
    assert status.startswith("ignored") and why in status, status
    assert seeded["cost"]["observations"] == 0  # started fresh
    assert any("policy cache" in r.message and "ignored" in r.message for r in caplog.records)
    assert out["meta_info"]["completion_tokens"] == PARAMS["max_new_tokens"]
    # and the engine wrote a good file in its place
    assert json.loads(path.read_text())["format"] == FORMAT


def test_off_neither_reads_nor_writes(tmp_path):
    _run(tmp_path)
    (path,) = tmp_path.iterdir()
    before = path.read_text()
    status, seeded, _ = _run(tmp_path, policy_cache=False)
    assert status == "off" and seeded["cost"]["observations"] == 0
    assert path.read_text() == before


def test_only_the_goodput_policy_is_cached(tmp_path):
    engine = Engine(policy_cache_dir=str(tmp_path), speculative_adaptive=False, **KW)
    assert engine.stats().policy_cache.startswith("n/a")
    engine.generate("x = 1", PARAMS)
    engine.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="policy_cache"):
        Engine(policy_cache="yes")
    with pytest.raises(ValueError, match="policy_cache_dir"):
        Engine(policy_cache_dir=3)


def test_default_directory_follows_the_user_cache_rule(tmp_path, monkeypatch):
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "specdial" / "policy"
    monkeypatch.setenv("HOME", str(tmp_path))
    # a relative XDG_CACHE_HOME is ignored (the XDG rule)
    assert default_cache_dir({"XDG_CACHE_HOME": "rel"}) == tmp_path / ".cache" / "specdial" / "policy"
