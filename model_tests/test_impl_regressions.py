"""Counterexamples the fuzzer once found on the reference implementation itself,
kept after the fix: each must now pass."""
from pathlib import Path

import pytest

from kvspec.harness.replay import replay_trace

TRACES = sorted((Path(__file__).parent / "impl_regressions").glob("*.json"))


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_fixed_counterexample_passes(path):
    assert not replay_trace(path, "impl").violations
