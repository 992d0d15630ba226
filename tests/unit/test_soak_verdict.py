"""`make soak` fails when memory grows more than 2 % between minute 3 and the end (issue 11)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[2] / "scripts" / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

# (seconds, gateway MB, triton MB): a start-up climb, then a slow creep of the gateway
SAMPLES = [(30, 150, 900), (60, 190, 950), (150, 200, 990), (180, 203, 1000), (600, 206, 1005), (900, 208, 1010)]


def test_growth_is_measured_from_minute_three_to_the_end():
    gateway, triton = soak.growth_pct(SAMPLES, 180)
    assert gateway == pytest.approx(100 * 5 / 203)
    assert triton == pytest.approx(1.0)


def test_more_than_two_percent_fails_and_names_who_grew():
    assert soak.grew_too_much(soak.growth_pct(SAMPLES, 180), 2.0) == ["gateway"]
    assert soak.grew_too_much((1.9, 2.0), 2.0) == []
    assert soak.grew_too_much((0.0, 6.9), 2.0) == ["tritonserver"]


def test_too_few_samples_after_minute_three_is_no_verdict():
    assert soak.growth_pct(SAMPLES[:4], 180) is None


@pytest.mark.parametrize(("text", "seconds"), [("15m", 900), ("90s", 90), ("90", 90), ("1h30m", 5400)])
def test_durations_in_locust_form(text, seconds):
    assert soak.duration_s(text) == seconds
