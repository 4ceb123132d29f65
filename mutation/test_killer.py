"""The spec-driven suite that judges a mutated reference scheduler: the
hand-written scenarios, bounded model checking to depth 5, and a fixed-seed
Hypothesis run of the state machine. A mutant is killed when any spec check fails."""
from hypothesis import HealthCheck, settings, seed

from kvspec.harness.bmc import bmc
from kvspec.harness.machine import KVSpecMachine


def test_bmc_depth_5():
    result = bmc("impl", depth=5)
    assert result.counterexample is None, result.counterexample


@seed(20261122)
class KillerMachine(KVSpecMachine):
    target_name = "impl"


TestKillerMachine = KillerMachine.TestCase
TestKillerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      derandomize=False, database=None,
                                      suppress_health_check=list(HealthCheck))
