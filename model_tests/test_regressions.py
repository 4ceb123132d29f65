"""Every committed counterexample replays: it still fails on the target it was
found on, with the same invariants, and passes on the reference implementation."""
import json
from pathlib import Path

import pytest

from kvspec.harness.replay import replay_trace

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.json"))


def test_there_are_regressions():
    assert REGRESSIONS, "model_tests/regressions/ is empty: run `kvspec zoo --save-regressions`"


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_regression_fails_on_its_target_and_passes_on_impl(path):
    recorded = {v["invariant"] for v in json.loads(path.read_text())["verdict"]}
    replay = replay_trace(path)
    assert {v.invariant for v in replay.violations} == recorded
    assert not replay_trace(path, "impl").violations


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_regression_is_short(path):
    # The bug zoo's bar: a counterexample a reviewer reads in one screen, at most
    # 12 rows of the step table (healed-phase steps included).
    assert len(replay_trace(path).steps) <= 12
