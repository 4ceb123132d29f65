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


def test_pad_clipping_profile_matches_the_targets_draft_count():
    # The profile must keep every positive threshold at or above the padded size.
    from kvspec.harness.accepted_findings import SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD
    from kvspec.harness.vllm_target import MAX_DRAFTS
    assert dict(SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD.avoided_by) == {
        "min_prefill_threshold": 1 + MAX_DRAFTS}
