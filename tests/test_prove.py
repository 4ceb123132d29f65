"""Z3 obligations: all hold and none is vacuous; names never serve two roles;
every lemma refutes its historical rule; the refutations' counterexamples
replay on their mutants; and a planted vacuous obligation fails the command."""
import json

import attrs
import pytest
import z3
from typer.testing import CliRunner

from kvspec.harness.replay import replay_trace
from kvspec.harness.z3_traces import TRACE_BUILDERS, is_seed_kind, write_trace
from kvspec.spec import arith, historical, prove
from kvspec.spec.effects import ALL_SHAPES, Counters, request_invariants
from kvspec.spec.groups import compute_recovered_computed
from kvspec.spec.prove import (CARD_CLAIMS, OBLIGATIONS, Goal, NameClash, Obligation, Symbols,
                               check, check_all, claims_established)
from kvspec.spec.registry import REGISTRY
from kvspec.spec.state import GroupSpec

RESULTS = {r.name: r for r in check_all()}


def test_every_obligation_holds_and_none_is_vacuous():
    bad = [(r.name, r.status, r.vacuous, r.counterexample) for r in RESULTS.values() if not r.ok]
    assert not bad
    assert not [r.name for r in RESULTS.values() if r.vacuous]


def test_a_name_serves_one_role():
    s = Symbols()
    s.int("state", "num_external")
    with pytest.raises(NameClash):
        s.int("parameter", "num_external")  # the defect that made 8 obligations vacuous


@pytest.mark.parametrize("name", sorted(OBLIGATIONS))
def test_every_constant_of_an_obligation_has_one_role(name):
    goal = OBLIGATIONS[name].build()  # builds through Symbols: a clash raises here
    seen = set()
    for hypothesis, conclusion in goal.cases:
        seen |= _constants(hypothesis) | _constants(conclusion)
    assert seen <= set(goal.symbols.roles), seen - set(goal.symbols.roles)
    state = {n for n, r in goal.symbols.roles.items() if r == "state"}
    params = {n for n, r in goal.symbols.roles.items() if r == "parameter"}
    assert not state & params


def _constants(expr) -> set[str]:
    found, todo = set(), [expr]
    while todo:
        e = todo.pop()
        if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            found.add(str(e))
        elif z3.is_quantifier(e):
            todo.append(e.body())
        else:
            todo.extend(e.children())
    return found


def test_a_planted_vacuous_obligation_is_reported_and_fails_the_command(monkeypatch):
    def unsatisfiable():
        s = Symbols()
        x = s.int("parameter", "x")
        return Goal(((z3.And(x > 0, x < 0), x == 7),), s)  # "proves" anything
    planted = Obligation("planted_vacuous", "lemma", unsatisfiable, "planted")
    result = check(planted)
    assert result.status == "proved" and result.vacuous and not result.ok
    monkeypatch.setitem(OBLIGATIONS, "planted_vacuous", planted)
    from kvspec.cli import app
    out = CliRunner().invoke(app, ["prove", "--json", "--only", "planted_vacuous",
                                   "--only", "lemma_hit_leaves_a_token"])
    assert out.exit_code == 1
    report = json.loads(out.stdout)
    assert report["vacuous"] == ["planted_vacuous"]
    rows = {row["name"]: row for row in report["obligations"]}
    assert rows["planted_vacuous"]["vacuous"] is True
    assert rows["lemma_hit_leaves_a_token"]["vacuous"] is False


def test_every_lemma_refutes_a_historical_rule():
    lemmas = {n for n, ob in OBLIGATIONS.items() if ob.kind == "lemma"}
    refuted = {ob.refutes_rule_of for ob in OBLIGATIONS.values() if ob.kind == "refutation"}
    assert lemmas <= refuted, lemmas - refuted
    for name, ob in OBLIGATIONS.items():
        if ob.kind == "refutation":
            assert ob.refutes_rule_of in OBLIGATIONS, name
            assert RESULTS[name].status == "refuted" and not RESULTS[name].vacuous


def test_the_card_claims_are_established_by_z3():
    established = claims_established()
    for claim in CARD_CLAIMS:
        assert established.get(claim), claim
        assert claim in REGISTRY
    for claim in established:  # labels come from obligations, and name real claims
        assert claim in REGISTRY, claim


def test_every_step_shape_has_an_induction_obligation():
    for shape in ALL_SHAPES:
        assert f"step_{prove.shape_name(shape)}" in OBLIGATIONS


def test_pre_34616_counterexample_is_of_the_seed_kind():
    result = RESULTS["refute_pre_34616_rounding"]
    assert result.status == "refuted" and is_seed_kind(result.counterexample)


@pytest.mark.parametrize("name", sorted(TRACE_BUILDERS))
def test_refutation_replays_on_mutant_and_passes_on_impl(name, tmp_path):
    result = RESULTS[name]
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


@pytest.mark.parametrize("values", [(2, 5, 6, 3, 2, 1, 0, 1, 4, 1, 0), (3, 5, 5, 0, 2, 1, 1, 0, 4, 1, 0),
                                    (0, 5, 5, 0, -1, 0, 0, 0, 4, 0, 0), (2, 5, 6, 3, 2, 1, 0, 1, 4, 0, 0)])
def test_logic_helpers_agree_on_concrete_and_symbolic_values(values):
    concrete = Counters(*values)
    symbolic = Counters(*[z3.IntVal(v) for v in values])
    for name, value in request_invariants(concrete).items():
        assert z3.is_true(z3.simplify(request_invariants(symbolic)[name])) == bool(value), name


def test_lowering_policies_include_vllms_choice():
    """vLLM 0.32 keeps the stats after a load failure; the spec admits it."""
    assert "none" in prove.LOWERING_POLICIES
    assert RESULTS["lemma_lowering_is_admissible"].ok


def test_fields_of_counters_are_all_state_constants():
    goal = OBLIGATIONS["step_compute+sample"].build()
    for field in attrs.fields(Counters):
        assert goal.symbols.roles[f"s.{field.name}"] == "state"


# -- async scheduling: output placeholders ------------------------------------

ASYNC_LEMMAS = {"lemma_placeholders_track_in_flight_steps": (prove.PLACEHOLDER_REFUTATIONS,
                                                             prove.is_placeholders_of_in_flight),
                "lemma_real_boundary_within_known_tokens": (prove.BOUNDARY_REFUTATIONS,
                                                            prove.is_boundary_within_tokens)}


def _first_failing_prefix(rules, values, conclusion):
    """Play every scenario prefix on plain ints: the first whose guards hold and
    whose conclusion fails, or None."""
    start = prove.AsyncRequest(values["s.num_tokens"], values["s.num_computed"], 0)
    steps = [prove.InFlight(values[f"step{i}.num_drafts"], values[f"step{i}.num_sampled"])
             for i in (1, 2, 3)]
    for events in prove.get_scenario_prefixes():
        chunks = [values.get(f"chunk{i}.num_new", 1) for i in (1, 2)]
        guards, r, boundary, samples = prove.play_scenario(rules, start, steps,
                                                         (values["resume.num_hits"], chunks),
                                                         events)
        if guards and not conclusion(r, boundary, samples):
            return events
    return None


def test_async_placeholder_worked_example():
    """Drafts 2 then 1, one token sampled then two, prefix-cache hits 3 on resume:
    the spec's rules on plain ints (as the runtime claims evaluate them)."""
    values = {"s.num_tokens": 5, "s.num_computed": 4, "step1.num_drafts": 2,
              "step1.num_sampled": 1, "step2.num_drafts": 1, "step2.num_sampled": 2,
              "step3.num_drafts": 0, "step3.num_sampled": 1, "resume.num_hits": 3}
    for refutations, conclusion in ASYNC_LEMMAS.values():
        assert _first_failing_prefix(prove.ASYNC_RULES, values, conclusion) is None
    # SSDPD: S 3 placeholders; S 5; D (2 drafts rejected, 1 token) 2; P 0; D stale 0
    assert arith.compute_placeholders_after_schedule(0, 2, False) == 3
    assert arith.compute_placeholders_after_output(5, 2, 1, False) == 2
    assert arith.compute_placeholders_after_output(0, 1, 2, True) == 0
    stale_decrementing = prove.PLACEHOLDER_REFUTATIONS[
        "refute_stale_output_decrements_placeholders"][0]
    # #47900: step 1's stale output takes 3 off the zeroed count
    assert _first_failing_prefix(stale_decrementing, values,
                                 prove.is_placeholders_of_in_flight) == "SPD"


@pytest.mark.parametrize("lemma", sorted(ASYNC_LEMMAS))
def test_async_refutations_replay_on_plain_ints(lemma):
    """Each refutation's counterexample, played on plain ints, fails its lemma's
    conclusion under the historical rule and passes under the spec's rules."""
    refutations, conclusion = ASYNC_LEMMAS[lemma]
    assert RESULTS[lemma].ok
    for name, (rules, _) in refutations.items():
        assert OBLIGATIONS[name].refutes_rule_of == lemma
        cex = RESULTS[name].counterexample
        assert _first_failing_prefix(rules, cex, conclusion) is not None, name
        assert _first_failing_prefix(prove.ASYNC_RULES, cex, conclusion) is None, name


# -- KV cache groups: recovery of a hybrid request -----------------------------------

def _first_failing_layout(rule, values):
    """The first hybrid layout whose failed load ``values`` describes, played on
    plain ints, where the count ``rule`` keeps fails the recovery lemma's
    conclusion (every read position enumerated), or None."""
    def value(role, name):
        return values[name]
    for groups in filter(lambda groups: prove.is_layout(groups, value), prove.HYBRID_LAYOUTS):
        load = prove.failed_load(groups, value)
        if not prove.is_failed_load(groups, load):
            continue
        kept = rule(groups, load.cut, load.first_present, load.first_invalid)
        reads_valid = all(prove.is_read_valid(g, kept, fp, fi, p)
                          for g, fp, fi in zip(groups, load.first_present, load.first_invalid)
                          for p in range(kept))  # a step from ``kept`` reads nothing past it
        if not (kept <= load.cut and reads_valid):
            return groups
    return None


def test_group_recovery_refutation_replays_on_plain_ints():
    """Not replayed as a trace (no entry in ``TRACE_BUILDERS``): the reference recovers
    a hybrid request to 0 (impl/scheduler.py ``_restart_from_zero``), so no mutant
    keeps a cut the full-attention group alone serves, and the trace builders of
    kvspec/harness/z3_traces.py read single-group counterexamples. Instead Z3's
    counterexample (seed 003, #35223) is played on plain ints: its failed load
    fits one layout, the historical rule's count fails there and the spec's and
    the reference's counts pass."""
    name = "refute_recovery_cut_by_full_attention_alone"
    lemma = OBLIGATIONS[name].refutes_rule_of
    assert lemma == "lemma_recovery_cut_served_by_every_group" and RESULTS[lemma].ok
    cex = RESULTS[name].counterexample
    assert _first_failing_layout(historical.recovered_computed_by_full_attention, cex)
    for rule in prove.RECOVERY_RULES.values():
        assert _first_failing_layout(rule, cex) is None


def test_group_recovery_worked_example():
    """Full attention and a sliding window of 2 tokens, block size 1, 5 tokens
    computed: the window gave back positions 0 to 2, and the full-attention
    group's load failed at position 1. A step from the cut reads position 0 in
    the window, which it gave back: the spec recovers to 0, the historical rule
    keeps the cut."""
    groups = (GroupSpec(1), GroupSpec(1, "sliding_window", 2))
    values = {"s.num_computed": 5, "cut": 1, "block_size": 1, "window_block_size": 1,
              "sliding_window": 2, "num_groups": 2, "full_attention.first_present": 0,
              "full_attention.first_invalid": 1, "sliding_window.first_present": 3,
              "sliding_window.first_invalid": 5}
    assert _first_failing_layout(historical.recovered_computed_by_full_attention,
                                 values) == groups
    assert compute_recovered_computed(groups, 1, (0, 3), (1, 5)) == 0
    assert _first_failing_layout(compute_recovered_computed, values) is None
