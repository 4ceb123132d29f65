"""bench/drivers.py: the modes issue 30's benches compare side by side measure
the same workload, and the observe-only mode reads the state the Runner reads."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from drivers import BareDriver, CheckedDriver, ObserveDriver, compare  # noqa: E402


def test_observe_only_steps_as_bare_does_and_observes_what_the_runner_does():
    bare, observed = BareDriver("impl", 4, (1, 999)), ObserveDriver("impl", 4, (1, 999))
    checked = CheckedDriver("impl", 4, (1, 999))
    for _ in range(30):
        for d in (bare, observed, checked):
            d.step()
    # the same requests, in the same states: observing changes nothing
    assert observed.target.observe() == bare.target.observe()
    # and what it reads is the Runner's own observation of the same run
    assert observed.target.observe().requests == checked.runner.obs.requests


def test_compare_reports_every_mode_and_its_ratio_to_bare():
    row = compare("impl", 2, 0.05, (1, 999))
    for mode in ("bare", "checked", "no_claims", "observe_only"):
        assert row[mode]["steps"] > 0, (mode, row[mode])
    for ratio in ("checked_over_bare", "no_claims_over_bare", "observe_only_over_bare"):
        assert 0 < row[ratio], (ratio, row)
