"""Proofs with teeth (issue 25): a claim listed as established by Z3 is one whose
obligations notice when its predicate is weakened. Each claim's predicate is
replaced by ``True`` and, where it has a bound or a conjunct to give up, by a
variant one step weaker; some obligation that establishes the claim, or
refutes a rule against one that does, must then fail.

The induction alone cannot notice (``True`` is inductive); what notices is a
refutation whose conclusion is the claim alone, with a bug that lands one step
past the claim's boundary (``SENTINELS`` and the pool refutations in
spec/prove.py, the historical refutations of the lemmas).
"""
from __future__ import annotations

import pytest

from kvspec.spec import effects, pool_effects, prove
from kvspec.spec.logic import And, If, Implies, Min, Not, Or


def _stats_ordered_one_off(r):
    stats = effects.has_stats(r)
    return If(stats, And(r.prompt_len >= r.num_cached, r.num_cached + 1 >= r.num_external,
                         r.num_external >= 0), r.num_external == 0)


def _cached_le_computed_one_off(r):
    never_disturbed = And(effects.has_stats(r), r.num_preemptions == 0, r.num_recoveries == 0)
    waiting = Or(effects.is_waiting(r), r.status == effects.LOADING)
    return Implies(never_disturbed, And(
        Implies(r.status == effects.RUNNING, r.num_cached <= r.num_computed + 1),
        Implies(waiting, Min(r.num_cached, r.num_tokens - 1) <= r.num_computed + 1)))


def _served_one_past(groups, load, recovered, p):
    """``is_recovery_served`` admitting one position more: the first failed one."""
    import z3

    from kvspec.spec.reads import is_read_by_step
    bounds = zip(groups, load.first_present, load.first_invalid)
    return And(recovered <= load.cut + 1, z3.ForAll([p], And(*[
        Implies(is_read_by_step(g, recovered, p), And(present <= p, p < invalid + 1))
        for g, present, invalid in bounds])))


def _pool_each(pred):
    def entry(p):
        return And(*[pred(p, b) for b in range(len(p.ref))])
    return entry


def _holders(p, b):
    return sum(If(h[b], 1, 0) for h in p.holds)


#: claim -> (what its predicate is in the obligations, one step weaker or None
#: with why not). A per-request entry is a function of the Counters; a pool entry
#: of the Pool; a lemma's predicate is replaced in spec/prove.py by name.
WEAKENINGS = {
    "stats_are_ordered": ({"request": ["stats_are_ordered"]},
                          {"request": {"stats_are_ordered": _stats_ordered_one_off}}),
    "stats_set_exactly_once": ({"request": ["stats_set_exactly_once"]}, {"request": {
        "stats_set_exactly_once":
            lambda r: r.num_stats_sets <= If(effects.has_stats(r), 1, 0) + 1}}),
    "cached_le_computed": ({"request": ["cached_le_computed"]},
                           {"request": {"cached_le_computed": _cached_le_computed_one_off}}),
    "computed_within_tokens": (
        {"request": ["computed_within_tokens", "waiting_with_work"],
         "lemma": ["is_boundary_within_tokens"]},
        {"request": {
            "computed_within_tokens": lambda r: And(
                0 <= effects.get_real_computed(r),
                effects.get_real_computed(r) <= r.num_tokens + 1),
            "waiting_with_work": lambda r: Implies(effects.is_waiting(r),
                                                   r.num_computed <= r.num_tokens)},
         "lemma": {"is_boundary_within_tokens": lambda r, boundary, samples: And(
             boundary >= 0, boundary <= r.num_tokens)}}),
    "blocks_cover_computed": ({"request": ["blocks_cover_computed"]}, {"request": {
        "blocks_cover_computed":
            lambda r: r.num_blocks * r.block_size + 1 >= r.num_computed}}),
    "running_request_has_stats": ({"request": ["running_request_has_stats"]}, {"request": {
        # one case off: requests that loaded KV are let off
        "running_request_has_stats": lambda r: Implies(
            And(r.status == effects.RUNNING, r.num_hits == 0), effects.has_stats(r))}}),
    "unscheduled_request_has_no_output": (
        {"request": ["unscheduled_request_has_no_output"]}, {"request": {
            "unscheduled_request_has_no_output": lambda r: Implies(
                Or(Not(effects.has_stats(r)),
                   And(effects.is_waiting(r), r.num_preemptions == 0)),
                r.num_tokens <= r.prompt_len + 1)}}),
    "preempted_means_preempted": ({"request": ["preempted_means_preempted"]}, {"request": {
        "preempted_means_preempted": lambda r: Implies(r.status == effects.PREEMPTED,
                                                       r.num_preemptions >= 0)}}),
    "ref_count_is_holders": ({"pool": ["ref_count_is_holders"]}, {"pool": {
        "ref_count_is_holders": _pool_each(lambda p, b: And(
            p.ref[b] >= _holders(p, b), p.ref[b] <= _holders(p, b) + 1))}}),
    "free_queue_is_free_blocks": ({"pool": ["free_queue_is_free_blocks"]}, {"pool": {
        # one direction off: a block at zero references may stay out of the queue
        "free_queue_is_free_blocks": _pool_each(
            lambda p, b: Implies(p.free[b], p.ref[b] == 0))}}),
    "no_caching_of_invalid_blocks": ({"pool": ["no_caching_of_invalid_blocks"]}, {"pool": {
        # one conjunct off: a cached block need not be valid, only loaded
        "no_caching_of_invalid_blocks": _pool_each(
            lambda p, b: Implies(p.cached[b], Not(p.loading[b])))}}),
    "no_load_into_free_blocks": ({"pool": ["no_load_into_free_blocks"]},
                                 "a single implication: True is its only weakening"),
    "every_group_serves_computed": ({"lemma": ["is_recovery_served"]},
                                    {"lemma": {"is_recovery_served": _served_one_past}}),
    "placeholders_match_in_flight": ({"lemma": ["is_placeholders_match"]}, {"lemma": {
        "is_placeholders_match": lambda r, boundary, samples: And(
            r.num_placeholders >= prove.get_shares(r), r.num_placeholders <= prove.get_shares(r) + 1)}}),
    "placeholders_nonnegative": (
        {"lemma": ["is_placeholders_nonnegative"], "request": ["placeholders_nonnegative"]},
        {"lemma": {"is_placeholders_nonnegative":
                   lambda r, boundary, samples: r.num_placeholders >= -1},
         "request": {"placeholders_nonnegative": lambda r: r.num_placeholders >= -1}}),
}


def _patch(monkeypatch, replace: dict) -> None:
    """Replace the named entries (by ``True`` when given as a list)."""
    def as_map(names):
        return names if isinstance(names, dict) else {n: None for n in names}
    request, pool = as_map(replace.get("request", [])), as_map(replace.get("pool", []))
    if request:
        real = effects.request_invariants

        def weakened(r):
            found = real(r)
            live = r.status != effects.FINISHED
            for name, fn in request.items():
                assert name in found, name
                value = True if fn is None else fn(r)
                found[name] = value if name == "preempted_means_preempted" else \
                    Implies(live, value)
            return found
        monkeypatch.setattr(prove, "request_invariants", weakened)
    if pool:
        real_pool = pool_effects.pool_invariants

        def weakened_pool(p):
            found = real_pool(p)
            for name, fn in pool.items():
                assert name in found, name
                found[name] = True if fn is None else fn(p)
            return found
        monkeypatch.setattr(pool_effects, "pool_invariants", weakened_pool)
    for name, fn in as_map(replace.get("lemma", [])).items():
        assert hasattr(prove, name), name
        monkeypatch.setattr(prove, name, (lambda *a: True) if fn is None else fn)


def _guarding(claim: str) -> list[str]:
    """The refutations that speak against an obligation establishing ``claim``."""
    establishing = set(prove.claims_established()[claim])
    return [name for name, ob in prove.OBLIGATIONS.items()
            if ob.kind == "refutation" and ob.refutes_rule_of in establishing]


def _failing(claim: str) -> list[str]:
    return [name for name in _guarding(claim)
            if not prove.check(prove.OBLIGATIONS[name], timeout_ms=20_000).ok]


def test_every_claim_z3_establishes_has_its_weakenings():
    assert set(WEAKENINGS) == set(prove.claims_established())


@pytest.mark.parametrize("claim", sorted(WEAKENINGS))
def test_as_stated_every_guarding_refutation_holds(claim):
    assert _guarding(claim), f"no refutation speaks against the proofs of {claim}"
    assert _failing(claim) == []


@pytest.mark.parametrize("claim", sorted(WEAKENINGS))
def test_a_claim_weakened_to_true_fails_an_obligation(claim, monkeypatch):
    _patch(monkeypatch, WEAKENINGS[claim][0])
    assert _failing(claim), f"{claim} replaced by True: every obligation still passes"


ONE_OFF = sorted(c for c, (_, v) in WEAKENINGS.items() if not isinstance(v, str))


@pytest.mark.parametrize("claim", ONE_OFF)
def test_a_claim_one_step_weaker_fails_an_obligation(claim, monkeypatch):
    _patch(monkeypatch, WEAKENINGS[claim][1])
    assert _failing(claim), f"{claim} one step weaker: every obligation still passes"
