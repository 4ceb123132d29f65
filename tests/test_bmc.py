"""Bounded model checking: clean on the reference, and its shortest
counterexamples on mutants replay with `kvspec replay`."""
import pytest

from kvspec.harness.bmc import bmc, bmc_config
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


def test_bmc_explores_the_installed_vllm():
    """The vLLM target copies (it shares the imported modules and patched
    classes; ``kvspec bmc --target vllm`` once failed: a module cannot be
    pickled), and a copy goes on apart from the original."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bmc on the vllm target skipped")
    import copy

    from kvspec.harness.runner import Runner
    result = bmc("vllm", depth=4)
    assert result.counterexample is None and result.exhausted and result.states > 50
    runner = Runner("vllm", bmc_config())
    runner.apply({"op": "add", "id": "a", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2})
    twin = copy.deepcopy(runner)
    twin.apply({"op": "step"})
    assert twin.obs.requests["a"].num_computed_tokens == 5
    assert runner.target.observe().requests["a"].num_computed_tokens == 0
    assert twin.target.m is runner.target.m and twin.target.scheduler is not runner.target.scheduler


def test_a_counterexample_copies_whole():
    """A runner keeps its lost-performance breaks (Counterexample): copying a
    runner copies them (Exception's own copy rebuilt one from its message alone)."""
    import copy
    import pickle

    from kvspec.harness.steplog import Counterexample
    from kvspec.spec.registry import Violation
    found = Counterexample([Violation("claim", "what broke")], runner=("a", "snapshot"))
    for twin in (copy.deepcopy(found), pickle.loads(pickle.dumps(found))):
        assert twin.violations == found.violations and twin.runner == found.runner
        assert str(twin) == str(found)
