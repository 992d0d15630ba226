"""`make soak` fails when memory grows more than 2 % between minute 3 and the end: a leak fails it, warm-up does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[2] / "scripts" / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _samples(gateway, server, models, times=(30, 60, 180, 300, 420, 540, 660, 780, 900)):
    return [(t, {"gateway": g, "tritonserver": s + m, "tritonserver process": s, "model instances": m})
            for t, g, s, m in zip(times, gateway, server, models, strict=True)]


# a start-up climb to minute 3, then: the gateway creeps 1 MB every 2 minutes; the server is flat but one
# sample caught the allocator handing memory back; the model instances are flat
SAMPLES = _samples(gateway=(150, 190, 200, 201, 202, 203, 204, 205, 206),
                   server=(40, 45, 50, 50, 50, 44, 50, 50, 50),
                   models=(2000, 2900, 3000, 3000, 3000, 3000, 3000, 3000, 3000))


def test_growth_is_the_fitted_line_from_minute_three_to_the_end():
    growth = soak.growth_pct(SAMPLES, 180)
    assert growth["gateway"] == pytest.approx(100 * 6 / 200)  # a steady creep reads in full
    assert growth["model instances"] == pytest.approx(0.0)  # the start-up climb is outside the window
    assert abs(growth["tritonserver process"]) < 2.0  # one low sample does not decide it (endpoints alone: 0 %)
    assert abs(growth["tritonserver"]) < 0.1


def test_a_dip_just_before_the_end_is_not_read_as_flat():
    dip = _samples(gateway=(100, 100, 100, 103, 106, 109, 112, 115, 100),
                   server=(50,) * 9, models=(3000,) * 9)
    assert soak.growth_pct(dip, 180)["gateway"] > 2.0  # endpoints alone would say 0 %


def test_more_than_two_percent_fails_and_names_who_grew():
    assert soak.grew_too_much(soak.growth_pct(SAMPLES, 180), 2.0) == ["gateway"]
    assert soak.grew_too_much({"gateway": 1.9, "tritonserver": 2.0}, 2.0) == []
    assert soak.grew_too_much({"gateway": 0.0, "tritonserver": 2.1, "tritonserver process": 0.0}, 2.0) == \
        ["tritonserver"]
    # the server process alone is shown, not judged: a 55 MB process moves 2 % on one allocator step
    assert soak.grew_too_much({"gateway": 0.0, "tritonserver": 0.1, "tritonserver process": 4.6}, 2.0) == []


def test_too_few_samples_after_minute_three_is_no_verdict():
    assert soak.growth_pct(SAMPLES[:4], 180) is None


@pytest.mark.parametrize(("text", "seconds"), [("15m", 900), ("90s", 90), ("90", 90), ("1h30m", 5400)])
def test_durations_in_locust_form(text, seconds):
    assert soak.duration_s(text) == seconds
