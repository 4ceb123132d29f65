"""Bounded model checking: clean on the reference, and its shortest
counterexamples on mutants replay with `kvspec replay`."""
import pytest

from kvspec.harness.bmc import bmc
from kvspec.harness.replay import replay_trace
from kvspec.harness.trace import save_trace


def test_reference_has_no_violation_up_to_depth_5():
    result = bmc("impl", depth=5)
    assert result.counterexample is None and result.exhausted
    assert result.states > 100  # the search really branched


@pytest.mark.parametrize("mutant, invariant", [
    ("stats_reset_on_reschedule", "stats_set_exactly_once"),
    ("shared_block_recomputed_by_all", "failed_block_recomputed_once"),
    ("async_caches_before_load", "no_caching_of_invalid_blocks"),
])
def test_bmc_finds_mutant_and_trace_replays(mutant, invariant, tmp_path):
    result = bmc(f"mutant:{mutant}", depth=5)
    ce = result.counterexample
    assert ce is not None and invariant in {v.invariant for v in ce.violations}
    path = save_trace(tmp_path / "t.json", target=f"mutant:{mutant}", config=ce.runner.config,
                      actions=ce.runner.actions, violations=ce.violations, steps=ce.runner.log)
    assert replay_trace(path).same_as_recorded
    assert not replay_trace(path, "impl").violations
