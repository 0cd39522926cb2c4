"""tests/timeouts.py: one scale factor for every wait of the suite (issue 25)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import conftest
import timeouts


def test_scaled_multiplies_by_the_repository_default_or_the_override():
    assert timeouts.DEFAULT_TIMEOUT_SCALE == 4.0
    assert timeouts.scaled(2.5) == 2.5 * timeouts.SCALE


def test_the_pytest_option_sets_the_scale(monkeypatch):
    monkeypatch.setattr(timeouts, "SCALE", timeouts.SCALE)  # restored after the test
    conftest.pytest_configure(SimpleNamespace(getoption=lambda name: 7.0))
    assert timeouts.scaled(3) == 21.0
    conftest.pytest_configure(SimpleNamespace(getoption=lambda name: None))  # no option: kept
    assert timeouts.SCALE == 7.0


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_a_bad_scale_is_refused(monkeypatch, bad):
    monkeypatch.setattr(timeouts, "SCALE", timeouts.SCALE)
    with pytest.raises(ValueError, match="timeout scale"):
        timeouts.set_scale(bad)
