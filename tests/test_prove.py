"""Z3 obligations: all hold, the historical rules are refuted, and the
refutations' counterexamples replay on their mutants."""
import pytest
import z3

from kvspec.harness.replay import replay_trace
from kvspec.harness.z3_traces import TRACE_BUILDERS, is_seed_kind, write_trace
from kvspec.spec import arith
from kvspec.spec.effects import Counters, request_invariants
from kvspec.spec.prove import OBLIGATIONS, check, check_all
from kvspec.spec.registry import REGISTRY


def test_every_obligation_holds():
    bad = [(r.name, r.status, r.counterexample) for r in check_all() if not r.ok]
    assert not bad


def test_pre_34616_counterexample_is_of_the_seed_kind():
    result = check(OBLIGATIONS["refute_pre_34616_rounding"])
    assert result.status == "refuted" and is_seed_kind(result.counterexample)


@pytest.mark.parametrize("name", sorted(TRACE_BUILDERS))
def test_refutation_replays_on_mutant_and_passes_on_impl(name, tmp_path):
    result = check(OBLIGATIONS[name])
    target, path = write_trace(name, result.counterexample, tmp_path)
    assert replay_trace(path).violations, f"{target} did not fail on Z3's counterexample"
    assert not replay_trace(path, "impl").violations


def test_seed_worked_example_block_size_three():
    """Seed 000: block size 3, prompt a b c d e."""
    # Case 1, external a b c: one block; the old rule and the fixed rule agree on 3.
    assert arith.compute_num_computed_pre_34616(1, 3, 5) == 3
    assert arith.compute_num_computed_after_hit(0, 3, 5) == 3
    # Case 2, external a..f: two blocks, clipped to 5, full hit -> 4 under the old rule;
    # the answer exceeds the prompt (an environment contract violation in kvspec).
    assert arith.compute_num_computed_pre_34616(2, 3, 5) == 4
    # The bug #34616 fixed: external hits end mid-block before the prompt end.
    assert arith.compute_num_computed_pre_34616(2, 3, 7) == 6
    assert arith.compute_num_computed_after_hit(0, 4, 7) == 4


def test_logic_helpers_agree_on_concrete_and_symbolic_values():
    concrete = Counters(2, 5, 6, 3, 2, 1, 0, 1, 4)
    values = request_invariants(concrete)
    x = {f: z3.IntVal(getattr(concrete, f)) for f in
         ("status", "prompt_len", "num_tokens", "num_computed", "num_cached", "num_external",
          "num_preemptions", "num_blocks", "block_size")}
    symbolic = request_invariants(Counters(**x))
    for name, value in values.items():
        assert z3.is_true(z3.simplify(symbolic[name])) == bool(value), name


def test_z3_backed_invariants_are_marked_in_the_registry():
    assert "z3" in REGISTRY["stats_are_ordered"].established_by
    assert "z3" in REGISTRY["unscheduled_request_has_no_output"].established_by


def test_pool_induction_refutes_a_free_that_forgets_the_reference():
    """The pool obligations are not vacuous: a free that keeps the count breaks them."""
    from kvspec.spec import pool_effects
    from kvspec.spec.prove import _pool_induction

    def broken_free(p, r):
        holds = pool_effects._set(p.holds, r, tuple(False for _ in p.holds[r]))
        return True, pool_effects.Pool(holds, p.ref, p.free)

    original = pool_effects.POOL_ACTIONS["free"]
    pool_effects.POOL_ACTIONS["free"] = (broken_free, ("r",))
    try:
        claim, _ = _pool_induction("free", "ref_count_is_holders")()
        solver = z3.Solver()
        solver.add(z3.Not(claim))
        assert solver.check() == z3.sat
    finally:
        pool_effects.POOL_ACTIONS["free"] = original
