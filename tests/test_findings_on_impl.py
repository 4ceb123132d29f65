"""Every trace of a vLLM finding (docs/findings/) passes on the reference
implementation: the reference does what the finding says vLLM should."""
from pathlib import Path

import pytest

from kvspec.harness.replay import replay_trace

TRACES = sorted((Path(__file__).resolve().parents[1] / "docs" / "findings").glob("*.json"))


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_finding_trace_passes_on_impl(path):
    violations = replay_trace(path, "impl").violations
    assert not violations, violations
