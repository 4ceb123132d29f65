"""Z3 obligations: lemmas of token arithmetic stated against an independent
description and refuted for every historical rule, induction of the
per-request invariants over every step shape of ``spec/effects.py``, and
induction of the pool invariants (no caching of invalid blocks among them)
over every pool action of ``spec/pool_effects.py``.

No obligation can pass by accident:
- every obligation is a list of cases (hypothesis, conclusion); before the
  conclusion is checked, each hypothesis must be satisfiable, or the
  obligation is *vacuous* and fails;
- every Z3 constant is made through ``Symbols`` with a role (state, parameter,
  position, ...), and one name can serve one role only: a parameter named like
  a state field would *be* that field;
- a lemma is a function of the rule it speaks about; the same statement is
  refuted for each historical rule in ``spec/historical.py``.

Every obligation evaluates the spec's own functions (``arith``, ``predicates``,
``effects``, ``pool_effects``) on Z3 terms: there is no second encoding to drift.
"""
from __future__ import annotations

import time
from typing import Callable

import attrs
import z3

from kvspec.spec import arith, historical
from kvspec.spec.async_model import (ASYNC_RULES, ASYNC_SCENARIOS, AsyncRequest, AsyncRules,
                                     InFlight, get_scenario_prefixes, get_shares, play_scenario)
from kvspec.spec.effects import (ALL_SHAPES, PRIMITIVES, Counters, Params, Primitive,
                                 get_real_computed,
                                 is_initial, is_stats_step_ok, request_invariants)
from kvspec.spec.groups import compute_read_start, compute_recovered_computed, is_windowed
from kvspec.spec.logic import And, If, Implies, Or
from kvspec.spec.predicates import is_admissible_lowering, is_first_cached_count
from kvspec.spec.reads import is_read_by_step
from kvspec.spec.state import GroupSpec


class NameClash(ValueError):
    """One Z3 name asked for in two roles."""


class Symbols:
    """Z3 constants by role. Z3 identifies a constant by its name, so a name may
    serve one role only (the defect that once made eight obligations vacuous: a
    parameter ``num_external`` that *was* the state field ``num_external``)."""

    def __init__(self) -> None:
        self.roles: dict[str, str] = {}
        self.consts: dict[str, z3.ExprRef] = {}

    def _make(self, role: str, name: str, sort: Callable):
        if self.roles.setdefault(name, role) != role:
            raise NameClash(f"{name!r} is used as {self.roles[name]} and as {role}")
        if name not in self.consts:
            self.consts[name] = sort(name)
        return self.consts[name]

    def int(self, role: str, name: str):
        return self._make(role, name, z3.Int)

    def bool(self, role: str, name: str):
        return self._make(role, name, z3.Bool)


@attrs.frozen
class Goal:
    """Under each hypothesis its conclusion holds (or, for a refutation, fails)."""

    cases: tuple[tuple[object, object], ...]
    symbols: Symbols

    @property
    def claim(self):
        return And(*[Implies(h, c) for h, c in self.cases])


@attrs.frozen
class Obligation:
    name: str
    kind: str            # "lemma", "induction" or "refutation"
    build: Callable[[], Goal]
    doc: str
    #: the catalogue's claims this obligation establishes (registry names)
    establishes: tuple[str, ...] = ()
    #: for a refutation: the lemma or induction whose historical rule it refutes
    refutes_rule_of: str | None = None


@attrs.define
class Result:
    name: str
    kind: str
    status: str          # "proved", "refuted", "unknown"
    expected: str
    seconds: float
    vacuous: bool = False
    counterexample: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == self.expected and not self.vacuous


OBLIGATIONS: dict[str, Obligation] = {}

#: the design card's three headline claims: each must be established by Z3
CARD_CLAIMS = ("cached_le_computed", "stats_set_exactly_once", "no_caching_of_invalid_blocks")


def register(name: str, kind: str, build: Callable[[], Goal], doc: str, establishes=(),
             refutes_rule_of: str | None = None) -> None:
    # a second obligation under one name would silently replace the first
    assert name not in OBLIGATIONS, f"two obligations named {name}"
    OBLIGATIONS[name] = Obligation(name, kind, build, " ".join(doc.split()),
                                   tuple(establishes), refutes_rule_of)


def lemma(rule_of=None, establishes=()):
    """Register ``fn`` (building a goal from its keyword ``rule``) as a lemma
    and, for every ``name: rule`` in ``rule_of``, a refutation of that rule."""
    def decorate(fn):
        register(fn.__name__, "lemma", fn, fn.__doc__ or "", establishes)
        for name, (rule, why) in (rule_of or {}).items():
            # bounded: one counterexample is all a refutation needs, and a small
            # one replays as a short trace (kvspec/harness/z3_traces.py)
            register(name, "refutation", lambda rule=rule: fn(rule=rule, bounded=True),
                     f"{why} Expected: refuted, by the statement of {fn.__name__}.",
                     refutes_rule_of=fn.__name__)
        return fn
    return decorate


def non_negative(*terms):
    return And(*[t >= 0 for t in terms])


# -- lemmas --------------------------------------------------------------------

@lemma(rule_of={"refute_full_hit_counts_every_token": (
    historical.hit_counting_every_token,
    "A hit of the whole prompt counted in full leaves no token to compute (the "
    "sync full-prompt hit of #30320).")})
def lemma_hit_leaves_a_token(rule=arith.compute_num_computed_after_hit, bounded=False):
    """After a (sync or async) hit of ``local + external`` tokens, stated over
    positions: every position counted as computed was a hit, every hit but the
    request's last token is counted, and the last token never is (it is
    recomputed so the request can sample)."""
    s = Symbols()
    local, ext, n = (s.int("parameter", x) for x in ("local", "external", "num_tokens"))
    pos = s.int("position", "p")
    c = rule(local, ext, n)
    hit = lambda p: And(p >= 0, p < local + ext)  # noqa: E731
    counted = lambda p: And(p >= 0, p < c)  # noqa: E731
    pre = And(non_negative(local, ext), n >= 1, local + ext <= n)
    post = And(c >= 0,
               z3.ForAll([pos], Implies(counted(pos), And(hit(pos), pos < n - 1))),
               z3.ForAll([pos], Implies(And(hit(pos), pos < n - 1), counted(pos))))
    return Goal(((pre, post),), s)


def _delivered_positions_goal(s: Symbols, finish, bounded: bool) -> Goal:
    """Issue an async load of ``external`` tokens after ``local`` hits and finish
    it: the positions counted are exactly the delivered ones, less the last
    token of the prompt."""
    c = _counters(s, "state")
    params_for = _shape_params(s, ("issue_async_load", "finish_async_load"))
    issue = params_for(0, PRIMITIVES["issue_async_load"])
    g1, loading = PRIMITIVES["issue_async_load"].fn(c, issue)
    g2, done = finish(loading, params_for(1, PRIMITIVES["finish_async_load"]))
    pos = s.int("position", "p")
    delivered = lambda p: And(p >= 0, p < issue.num_local + issue.num_external)  # noqa: E731
    counted = lambda p: And(p >= 0, p < done.num_computed)  # noqa: E731
    # every counted position was delivered, and is not the request's last token;
    # every delivered one but the last token is counted
    post = And(z3.ForAll([pos], Implies(counted(pos), And(delivered(pos),
                                                          pos < c.num_tokens - 1))),
               z3.ForAll([pos], Implies(And(delivered(pos), pos < c.num_tokens - 1),
                                        counted(pos))))
    # what vLLM allocates for the load: just enough blocks for the hits
    exact_blocks = issue.num_blocks == arith.cdiv(issue.num_local + issue.num_external,
                                                  c.block_size)
    pre = And(*request_invariants(c).values(), g1, g2, exact_blocks)
    if bounded:  # a fresh request, no local hits, a small prompt
        pre = And(pre, c.num_cached < 0, issue.num_local == 0, c.block_size >= 2,
                  c.block_size <= 4, c.num_tokens <= 12)
    return Goal(((pre, post),), s)


@lemma(rule_of={
    "refute_pre_34616_rounding": (
        historical.act_finish_async_load_pre_34616,
        "The pre-#34616 rule counts the whole allocated blocks after an async load; "
        "it counts positions nobody delivered when the external hits end mid-block "
        "before the prompt end (seed 000's case)."),
    "refute_async_load_rounding_down": (
        historical.act_finish_async_load_rounding_down,
        "A finished async load that counts only whole blocks drops delivered tokens."),
    "refute_async_load_counting_every_token": (
        historical.act_finish_async_load_counting_every_token,
        "A finished async load of the whole prompt that counts every token leaves "
        "nothing to compute and nothing to sample from.")})
def lemma_async_load_counts_delivered_tokens(rule=None, bounded=False):
    """Issuing an async load (``issue_async_load``) and finishing it
    (``finish_async_load``) counts as computed exactly the positions the hits
    delivered (``[0, local + external)``), less the last token of the request:
    stated over positions, not as the arithmetic of the rule (#34616)."""
    s = Symbols()
    return _delivered_positions_goal(s, rule or PRIMITIVES["finish_async_load"].fn, bounded)


@lemma(rule_of={"refute_truncate_past_first_invalid": (
    historical.act_recover_keeping_failed_block,
    "Recovery that keeps the failed block counted (cuts after it instead of before).")})
def lemma_recovery_keeps_only_valid_tokens(rule=None, bounded=False):
    """After ``recover`` for a load failure at ``first_invalid_block``, every
    position still counted lies in a block before the failed one. Stated over
    positions and block indices (for block sizes 1 to 8), about the model's own
    recover primitive, the one the runtime conformance check holds targets to."""
    s = Symbols()
    c = _counters(s, "state")
    params = _shape_params(s, ("recover",))(0, PRIMITIVES["recover"])
    p, k = s.int("position", "p"), s.int("position", "k")
    guard, after = (rule or PRIMITIVES["recover"].fn)(c, params)
    cases = []
    for size in range(2, 5) if bounded else range(1, 9):
        in_block = And(k * size <= p, p < (k + 1) * size)
        post = z3.ForAll([p, k], Implies(And(p >= 0, p < after.num_computed, in_block),
                                         k < params.first_invalid_block))
        pre = And(*request_invariants(c).values(), guard, c.block_size == size)
        cases.append((And(pre, c.num_computed <= 12) if bounded else pre, post))
    return Goal(tuple(cases), s)


@lemma(rule_of={"refute_reference_truncation_past_first_invalid": (
    historical.truncate_after_first_invalid,
    "The reference's truncation rule cutting after the first failed block.")})
def lemma_reference_truncation_is_admitted(rule=arith.compute_truncated_computed,
                                           bounded=False):
    """The reference's truncation (``compute_truncated_computed``, which
    impl/scheduler.py applies) is a choice the recover primitive admits, and it
    keeps every computed token before the failed block (nothing valid is
    recomputed needlessly)."""
    s = Symbols()
    c = _counters(s, "state")
    first = s.int("parameter", "first_invalid")
    kept = rule(first, c.block_size, c.num_computed)
    guard, _ = PRIMITIVES["recover"].fn(c, Params(first_invalid_block=first, num_valid=kept,
                                                  num_cached=c.num_cached,
                                                  num_external=c.num_external))
    pre = And(*request_invariants(c).values(), Or(c.status == 2, c.status == 1), first >= 0,
              first * c.block_size < c.num_computed, first * c.block_size < c.num_tokens)
    if bounded:
        pre = And(pre, c.block_size >= 2, c.block_size <= 4, c.num_computed <= 12)
    return Goal(((pre, And(guard, kept == first * c.block_size)),), s)


@lemma(rule_of={"refute_first_external_uncapped": (
    historical.first_external_uncapped,
    "The external count recorded as the connector's whole answer, even where the "
    "scheduling did not count all of it (a full-prompt hit)."),
    "refute_first_external_zero": (
    historical.first_external_zero,
    "The external count never recorded.")})
def lemma_first_external_counts_external_positions(rule=arith.compute_first_external,
                                                   bounded=False):
    """The external part of the first stats is the number of counted positions
    the connector delivered: the positions of ``[local, local + external)`` under
    the cached count, stated over positions."""
    s = Symbols()
    local, ext, cached, p = (s.int("parameter", "local"), s.int("parameter", "external"),
                             s.int("parameter", "cached"), s.int("position", "p"))
    recorded = rule(cached, local, ext)
    from_connector = lambda q: And(q >= local, q < local + ext, q < cached)  # noqa: E731
    post = And(recorded >= 0, z3.ForAll([p], from_connector(p) == And(p >= local,
                                                                     p < local + recorded)))
    pre = And(non_negative(local, ext), cached >= local, cached <= local + ext)
    return Goal(((pre, post),), s)


@lemma(rule_of={"refute_first_cached_count_past_hits": (
    historical.first_cached_count_past_hits,
    "A full-prompt count recorded for hits one short of the prompt.")})
def lemma_first_cached_count_is_the_hits(rule=None, bounded=False):
    """The cached count a first scheduling may record (``is_first_cached_count``)
    never exceeds the hits and never falls below the prefix the scheduling starts
    from."""
    s = Symbols()
    cached, hits, n = (s.int("parameter", x) for x in ("cached", "hits", "num_tokens"))
    admitted = (rule or is_first_cached_count)(cached, hits, n)
    pre = And(hits >= 0, n >= 1, hits <= n, admitted)
    return Goal(((pre, And(cached <= hits, cached >= arith.Min(hits, n - 1))),), s)


@lemma(rule_of={"refute_sample_without_rollback": (
    historical.act_sample_without_rollback,
    "Rejected drafts that keep counting as computed.")})
def lemma_spec_decode_rollback(rule=None, bounded=False):
    """After a step that computed every known token and ``d`` drafts of which
    ``a`` were accepted (``sample``), the computed tokens are exactly the known
    ones: every accepted draft counts, and the new token is left to compute."""
    s = Symbols()
    c = _counters(s, "state")
    drafts, accepted = s.int("parameter", "a0.num_drafts"), s.int("parameter", "a0.num_accepted")
    guard, after = (rule or PRIMITIVES["sample"].fn)(
        c, Params(num_drafts=drafts, num_accepted=accepted))
    pre = And(_well_formed(c), guard)
    post = And(get_real_computed(after) == after.num_tokens - 1,
               after.num_computed >= c.num_tokens)
    return Goal(((pre, post),), s)


#: the lowering policies vLLM releases and the reference use (docs/spec.md)
LOWERING_POLICIES = {
    "both (kvspec reference)": arith.compute_lowered_stats,
    "none": lambda cached, external, valid: (cached, external),
    "external only": arith.compute_external_lowered,
}


@lemma(rule_of={"refute_lowering_cached_only": (
    historical.lower_cached_only,
    "Lowering the cached count to the kept prefix and not the external count "
    "breaks the stats' order (the shape of #36859).")})
def lemma_lowering_is_admissible(rule=None, bounded=False):
    """Each way of lowering the stats after a failure that a correct scheduler may
    take (the reference lowers both, local hits surviving first; a release may
    lower only the external count, or not lower) keeps them ordered and never
    raises them, for every number of tokens kept."""
    s = Symbols()
    prompt, cached, ext, valid = (s.int("parameter", x) for x in
                                  ("prompt_len", "cached", "external", "valid"))
    pre = And(prompt >= cached, cached >= ext, ext >= 0, valid >= 0, valid <= prompt)
    rules = [rule] if rule is not None else list(LOWERING_POLICIES.values())
    cases = []
    for policy in rules:
        new_cached, new_ext = policy(cached, ext, valid)
        cases.append((pre, is_admissible_lowering(cached, ext, new_cached, new_ext)))
    return Goal(tuple(cases), s)


# -- KV cache groups: recovery of a hybrid request -----------------------------------
#
# A hybrid request's load fails: each group holds valid KV for an interval of
# positions, ``[first_present, first_invalid)``, and the cut is the start of the
# first failed block over all groups. Under the "fail" policy the request is
# finished and no count is kept; under "recompute" a rule picks the count it
# keeps. What that count must achieve is stated over positions, apart from the
# rule's arithmetic (``is_served``).

def _hybrid_layouts() -> tuple[tuple[GroupSpec, ...], ...]:
    """The layouts the recovery lemma covers: full attention with a sliding
    window of 1 to 9 tokens, with a last-state group, and with both; block sizes
    1 to 4, one per layout, and full attention beside a window whose blocks are
    twice or half its own (block sizes 1 to 4)."""
    layouts = []
    for size in range(1, 5):
        full, state = GroupSpec(size), GroupSpec(size, "last_state")
        windows = [GroupSpec(size, "sliding_window", w) for w in range(1, 10)]
        layouts += [(full, window) for window in windows] + [(full, state)]
        layouts += [(full, window, state) for window in windows]
    for full_size, window_size in [(1, 2), (2, 4), (2, 1), (4, 2)]:
        layouts += [(GroupSpec(full_size), GroupSpec(window_size, "sliding_window", w))
                    for w in range(1, 10)]
    return tuple(layouts)


HYBRID_LAYOUTS = _hybrid_layouts()


def restart_from_zero(groups, cut, first_present, first_invalid):
    """The reference's recovery of a hybrid request (impl/scheduler.py
    ``_restart_from_zero``): it recomputes from the start."""
    return 0


#: the recovery rules a correct scheduler may take for a hybrid request
RECOVERY_RULES = {
    "per-group cut (spec/groups.py)": compute_recovered_computed,
    "restart from zero (kvspec reference)": restart_from_zero,
}


@attrs.frozen
class FailedLoad:
    """A hybrid request after a failed load. Per group, in layout order: the
    first position it still holds (a windowed group gave back the blocks before
    it) and the first position it holds no valid KV for (its failed block's
    start). ``cut``: the start of the first failed block over all groups."""

    num_computed: object
    cut: object
    first_present: tuple
    first_invalid: tuple


def failed_load(groups, value) -> FailedLoad:
    """The failed load's quantities by name, from ``value(role, name)``: Z3
    constants (``Symbols.int``) or a counterexample's ints."""
    def per_group(field):
        return tuple(value("parameter", f"{g.kind}.{field}") for g in groups)
    return FailedLoad(value("state", "s.num_computed"), value("parameter", "cut"),
                      per_group("first_present"), per_group("first_invalid"))


def is_layout(groups, value):
    """Names the layout in a counterexample: block sizes (the window's: 0 if
    none), window (0: none), groups."""
    window = next((g for g in groups if g.kind == "sliding_window"), None)
    return And(value("parameter", "block_size") == groups[0].block_size,
               value("parameter", "window_block_size") == (window.block_size if window else 0),
               value("parameter", "sliding_window") == (window.sliding_window if window else 0),
               value("parameter", "num_groups") == len(groups))


def is_block_start(position, block_size):
    return And(position >= 0, position % block_size == 0)


def is_group_after_failed_load(group, num_computed, first_present, first_invalid):
    """What one group holds: block-aligned bounds; full attention every block
    from 0, a windowed group at least what a step from ``num_computed`` reads;
    its valid KV ends at its failed block (at or past ``num_computed`` if none
    failed)."""
    held = (first_present <= compute_read_start(group, num_computed) if is_windowed(group)
            else first_present == 0)
    return And(is_block_start(first_present, group.block_size),
               is_block_start(first_invalid, group.block_size),
               held, first_present <= first_invalid)


def is_failed_load(groups, load: FailedLoad):
    """Some group's load failed under the computed prefix, and the cut is the
    first failed block's start over all groups."""
    bounds = zip(groups, load.first_present, load.first_invalid)
    return And(load.num_computed >= 1,
               *[is_group_after_failed_load(g, load.num_computed, p, f) for g, p, f in bounds],
               Or(*[f < load.num_computed for f in load.first_invalid]),
               *[load.cut <= f for f in load.first_invalid],
               Or(*[load.cut == f for f in load.first_invalid]))


def is_read_valid(group, recovered, first_present, first_invalid, p):
    """If a step from ``recovered`` reads position ``p`` in ``group``, the group
    holds ``p`` and its KV there is valid."""
    return Implies(is_read_by_step(group, recovered, p),
                   And(first_present <= p, p < first_invalid))


def is_recovery_served(groups, load: FailedLoad, recovered, p):
    """Nothing at or past the first failed block counts as computed, and every
    position the next step reads is held and valid in every group."""
    bounds = zip(groups, load.first_present, load.first_invalid)
    every_group = And(*[is_read_valid(g, recovered, fp, fi, p) for g, fp, fi in bounds])
    return And(recovered <= load.cut, z3.ForAll([p], every_group))


@lemma(rule_of={"refute_recovery_cut_by_full_attention_alone": (
    historical.recovered_computed_by_full_attention,
    "Seed 003 (#35223's review of the per-group recovery): the cut at the first failed "
    "block kept where the full-attention group serves it, no other group asked; a "
    "sliding-window or last-state group that gave back the blocks a step from the cut "
    "reads is left without them."),
    "sentinel_every_group_serves_computed": (
        historical.recovered_one_past_cut,
        "A cut one token late: the first failed position counts as computed, one past "
        "what every group serves.")}, establishes=("every_group_serves_computed",))
def lemma_recovery_cut_served_by_every_group(rule=None, bounded=False):
    """After a failed load of a hybrid request (full attention with a sliding
    window of 1 to 9 tokens, with a last-state group, or with both; block sizes
    1 to 4, the window's blocks also twice or half full attention's), whatever each group gave back before it and wherever each group's
    load failed: the count a recovery rule keeps (``compute_recovered_computed``,
    and the reference's restart from zero) never reaches the first failed block,
    and every position the next step reads from it is held and valid in every
    group. Stated over positions, with each kind's read window written out
    (``spec/reads.py``), not through ``is_served`` or ``compute_read_start``. Protects the
    recovery part of ``every_group_serves_computed``: a cut counted by the
    full-attention group alone leaves a window behind it empty (seed 003,
    #35223). Under the "fail" policy the request is finished: no count is kept."""
    s = Symbols()
    p = s.int("position", "p")
    rules = [rule] if rule is not None else list(RECOVERY_RULES.values())
    cases = []
    for groups in HYBRID_LAYOUTS:
        load = failed_load(groups, s.int)
        pre = And(is_layout(groups, s.int), is_failed_load(groups, load))
        if bounded:  # a small counterexample
            pre = And(pre, load.num_computed <= 8)
        post = And(*[is_recovery_served(groups, load, keep(groups, load.cut, load.first_present,
                                                           load.first_invalid), p)
                     for keep in rules])
        cases.append((pre, post))
    return Goal(tuple(cases), s)


# -- async scheduling: output placeholders ----------------------------------------
#
# The model is spec/async_model.py; what its rules must achieve is stated here:
# the placeholders are the shares (1 + drafts) of the sampling steps in flight
# whose output is not stale, and the real boundary stays within the known tokens.

def _async_parameters(s: Symbols, bounded: bool):
    """The request between steps in sync (no placeholders, its computed prefix
    within its tokens), the steps it may schedule with their ranges, and the hits
    it may resume from; every case has them all, so a counterexample is whole."""
    k = s.int("parameter", "num_spec_tokens")
    r = AsyncRequest(s.int("state", "s.num_tokens"), s.int("state", "s.num_computed"), 0)
    most = max(events.count("S") for events in ASYNC_SCENARIOS)
    steps = [InFlight(*(s.int("parameter", f"step{i}.{x}") for x in ("num_drafts", "num_sampled")))
             for i in range(1, most + 1)]
    hits = s.int("parameter", "resume.num_hits")
    chunks = [s.int("parameter", f"chunk{i}.num_new") for i in range(1, 3)]
    ranges = [k >= 0, r.num_tokens >= 1, r.num_computed >= 0, r.num_computed <= r.num_tokens,
              hits >= 0]
    ranges += [And(x.num_drafts >= 0, x.num_drafts <= k, x.num_sampled >= 1,
                   x.num_sampled <= x.num_drafts + 1) for x in steps]
    if bounded:  # a small counterexample
        ranges += [k <= 3, r.num_tokens <= 8]
    return And(*ranges), r, steps, (hits, chunks)


def _async_goal(rules: AsyncRules, bounded: bool, conclude, scenarios=None,
                no_drafts: bool = False) -> Goal:
    """One case per prefix of the scenarios (``scenarios``: those event strings
    only): ``conclude(request, boundary, samples)`` after its last event;
    ``no_drafts``: every step drafts nothing (a sentinel's single share)."""
    s = Symbols()
    ranges, start, steps, hits = _async_parameters(s, bounded)
    if no_drafts:
        ranges = And(ranges, s.int("parameter", "num_spec_tokens") == 0)
    cases = []
    for events in scenarios or get_scenario_prefixes():
        guards, r, boundary, samples = play_scenario(rules, start, steps, hits, events)
        conclusion = conclude(r, boundary, samples)  # plain True where the rules give constants
        cases.append((And(ranges, guards), z3.BoolVal(conclusion) if isinstance(conclusion, bool)
                      else conclusion))
    return Goal(tuple(cases), s)


def is_placeholders_match(r: AsyncRequest, boundary, samples):
    """The placeholders are the shares of the steps in flight whose output is not
    stale (``placeholders_match_in_flight``)."""
    return r.num_placeholders == get_shares(r)


def is_placeholders_nonnegative(r: AsyncRequest, boundary, samples):
    return r.num_placeholders >= 0


def is_placeholders_of_in_flight(r: AsyncRequest, boundary, samples):
    """The step just scheduled (if any) samples, and the placeholders are the
    shares of the steps in flight whose output is not stale, never negative."""
    return And(samples, is_placeholders_match(r, boundary, samples),
               is_placeholders_nonnegative(r, boundary, samples))


def is_boundary_within_tokens(r: AsyncRequest, boundary, samples):
    """The real boundary exposed counts positions whose KV is computed: a prefix
    of the known tokens short of the last one, whose KV only the step that
    samples the next token computes."""
    return And(boundary >= 0, boundary <= r.num_tokens - 1)


PLACEHOLDER_REFUTATIONS = {
    "refute_stale_output_decrements_placeholders": (
        attrs.evolve(ASYNC_RULES, output=historical.placeholders_after_stale_output_decrementing),
        "#47900: the output of a preempted request's step in flight, applied like fresh "
        "output, takes its share off placeholders the preemption zeroed: they go negative."),
    "refute_preemption_keeps_placeholders": (
        attrs.evolve(ASYNC_RULES, preempt=historical.preempt_keeping_placeholders),
        "#48245: a preemption that keeps the placeholders of its steps in flight; their "
        "stale output gives none back, so the count stays above what is in flight."),
    "refute_output_forgets_rejected_drafts": (
        attrs.evolve(ASYNC_RULES, output=historical.placeholders_after_output_forgetting_rejected),
        "Delivery that takes off the appended tokens but not the rejected drafts: the "
        "placeholders of a step with a rejection outlive it."),
    "refute_chunk_owns_a_share": (
        attrs.evolve(ASYNC_RULES, schedule=historical.placeholders_after_schedule_ignoring_chunk),
        "A prefill chunk that reserves a placeholder like a sampling step: no output "
        "ever gives it back."),
    "refute_running_new_tokens_without_placeholders": (
        attrs.evolve(ASYNC_RULES, new_tokens=historical.running_new_tokens_without_placeholders),
        "The sync scheduler's count under async scheduling: a second step in flight "
        "stops short of the placeholder positions, samples nothing and owns no share."),
}

BOUNDARY_REFUTATIONS = {
    "refute_placeholder_snapshot_before_increment": (
        attrs.evolve(ASYNC_RULES, boundary=historical.real_computed_snapshot_before_increment),
        "#27644 review (seed 002): a scheduled step's boundary read with the placeholder "
        "count from before the increment exposes its draft positions, whose tokens are "
        "not known, as real."),
    "refute_real_boundary_with_kept_placeholders": (
        attrs.evolve(ASYNC_RULES, preempt=historical.preempt_keeping_placeholders),
        "#48245: placeholders kept through a preemption put the real boundary below 0."),
}


@lemma(rule_of=PLACEHOLDER_REFUTATIONS,
       establishes=("placeholders_nonnegative", "placeholders_match_in_flight"))
def lemma_placeholders_track_in_flight_steps(rule=ASYNC_RULES, bounded=False):
    """Under async scheduling with up to two steps in flight (each with its own
    drafts, 0 to ``num_spec_tokens``, and sampling 1 to drafts + 1 tokens, or a
    prefill chunk that samples nothing), across scheduling, in-order delivery, a
    preemption followed by the stale delivery of what was in flight, and a
    resume: every sampling step samples, and after every event the placeholders
    are exactly the shares (1 + drafts) of the sampling steps in flight whose
    output is not stale, hence never negative. Protects the placeholder count
    against stale output decrementing it (#47900), a preemption keeping it
    (#48245), and a chunk reserving a share."""
    return _async_goal(rule, bounded, is_placeholders_of_in_flight)


#: Sentinels of the placeholder claims (see SENTINELS): one step in flight with no
#: drafts, so the bug misses by exactly one placeholder, and the claim alone concluded.
ASYNC_SENTINELS = {
    "sentinel_async_placeholders_nonnegative": (
        attrs.evolve(ASYNC_RULES, output=historical.placeholders_after_stale_output_decrementing),
        "SPD", "is_placeholders_nonnegative",
        "#47900 with one step and no drafts: its stale output takes one placeholder off "
        "the zero the preemption left."),
    "sentinel_placeholders_match_in_flight": (
        attrs.evolve(ASYNC_RULES, preempt=historical.preempt_keeping_placeholders),
        "SP", "is_placeholders_match",
        "#48245 with one step and no drafts: the preemption keeps the one placeholder its "
        "stale step no longer owns."),
    "sentinel_real_boundary_within_known_tokens": (
        attrs.evolve(ASYNC_RULES, boundary=historical.real_computed_snapshot_before_increment),
        "S", "is_boundary_within_tokens",
        "#27644 with one step and no drafts: the boundary read before the step's own "
        "placeholder counts the last known token, whose KV the step has not computed yet."),
}


def _by_name(name: str):
    """This module's predicate ``name`` as it is when a goal is built (a test
    weakens it in place, tests/test_prove_teeth.py)."""
    return lambda *args: globals()[name](*args)


def _register_async_sentinels() -> None:
    for name, (rules, events, conclusion, why) in ASYNC_SENTINELS.items():
        register(name, "refutation",
                 lambda rules=rules, events=events, conclusion=conclusion: _async_goal(
                     rules, True, _by_name(conclusion), scenarios=(events,), no_drafts=True),
                 f"{why} Expected: refuted, by {conclusion} alone.",
                 refutes_rule_of="lemma_real_boundary_within_known_tokens"
                 if conclusion == "is_boundary_within_tokens"
                 else "lemma_placeholders_track_in_flight_steps")


@lemma(rule_of=BOUNDARY_REFUTATIONS, establishes=("computed_within_tokens",))
def lemma_real_boundary_within_known_tokens(rule=ASYNC_RULES, bounded=False):
    """In the setting of ``lemma_placeholders_track_in_flight_steps``, from a
    request whose computed prefix is within its tokens: the real boundary
    ``compute_real_computed(num_computed, placeholders)``, the only one the prefix
    cache and a connector's store may use, is never negative and stops short of
    the last known token (whose KV the step sampling the next one computes), after
    every event, the boundary a scheduled step exposes included (#27644)."""
    return _async_goal(rule, bounded, is_boundary_within_tokens)


# -- induction over the step shapes ---------------------------------------------

FIELDS = [f.name for f in attrs.fields(Counters)]


def _counters(s: Symbols, role: str, prefix: str = "s.") -> Counters:
    return Counters(**{f: s.int(role, prefix + f) for f in FIELDS})


def _well_formed(c: Counters):
    return request_invariants(c)["well_formed"]


def _shape_params(s: Symbols, shape) -> Callable[[int, Primitive], Params]:
    def params_for(i: int, prim: Primitive) -> Params:
        return Params(**{p: s.int("parameter", f"a{i}.{p}") for p in prim.params})
    return params_for


#: request_invariants names -> the catalogue claims they are part of
INVARIANT_CLAIMS = {
    "stats_are_ordered": "stats_are_ordered", "stats_set_exactly_once": "stats_set_exactly_once",
    "cached_le_computed": "cached_le_computed", "computed_within_tokens": "computed_within_tokens",
    "waiting_with_work": "computed_within_tokens", "blocks_cover_computed": "blocks_cover_computed",
    "running_request_has_stats": "running_request_has_stats",
    "unscheduled_request_has_no_output": "unscheduled_request_has_no_output",
    "preempted_means_preempted": "preempted_means_preempted",
    "loaded_prefix_is_the_hits": "cached_le_computed",
    "placeholders_nonnegative": "placeholders_nonnegative",
}


def shape_name(shape) -> str:
    return "+".join(shape)


def _step_goal(shape, replaced=None, bounds=None, entry=None) -> Goal:
    """Invariants before and every guard of ``shape`` imply the invariants after
    (only ``entry`` of them, for a sentinel); ``replaced`` swaps a primitive's
    effect for a historical one."""
    s = Symbols()
    before = _counters(s, "state")
    params_for = _shape_params(s, shape)
    guards, after = [], before
    for i, name in enumerate(shape):
        prim = PRIMITIVES[name]
        effect = (replaced or {}).get(name, prim.fn)
        guard, after = effect(after, params_for(i, prim))
        guards.append(guard)
    hypothesis = And(*request_invariants(before).values(), *guards,
                     bounds(before) if bounds else True)
    conclusion = And(*request_invariants(after).values(),
                     is_stats_step_ok(before, after, "recover" in shape))
    if entry is not None:
        conclusion = request_invariants(after)[entry]
    return Goal(((hypothesis, conclusion),), s)


def _register_steps() -> None:
    claims = sorted(set(INVARIANT_CLAIMS.values()))
    register("initial_state", "induction", _initial_goal,
             "A request as add_request leaves it satisfies every per-request invariant.",
             claims)
    for shape in ALL_SHAPES:
        register(f"step_{shape_name(shape)}", "induction", lambda shape=shape: _step_goal(shape),
                 f"Every per-request invariant, and stats recorded once and only lowered by a "
                 f"failure, hold after the step shape {' then '.join(shape)} whenever they "
                 f"held before and every guard holds.", claims)
    for name, (shape, prim, fn, why) in STEP_REFUTATIONS.items():
        register(name, "refutation", lambda shape=shape, prim=prim, fn=fn:
                 _step_goal(shape, {prim: fn}, _small_request),
                 f"{why} Expected: refuted, by the induction step "
                 f"step_{shape_name(shape)}.", refutes_rule_of=f"step_{shape_name(shape)}")


def _small_request(c: Counters):
    """Bounds for a refutation's counterexample, so that it replays as a short trace."""
    return And(c.prompt_len <= 3, c.num_tokens <= 6, c.block_size == 2)


def _initial_goal() -> Goal:
    s = Symbols()
    c = _counters(s, "state")
    return Goal(((is_initial(c), And(*request_invariants(c).values())),), s)


STEP_REFUTATIONS = {
    "refute_stats_reset_on_reschedule": (
        ("schedule_waiting", "keep_prefilling"), "schedule_waiting",
        historical.act_schedule_waiting_resetting_stats,
        "#36859: a re-scheduling that re-sets the external count while the cached "
        "count keeps its first value."),
    "refute_recover_lowering_cached_only": (
        ("compute", "recover"), "recover", historical.act_recover_lowering_cached_only,
        "Recovery that lowers the cached count but not the external one."),
    "refute_recover_raising_stats": (
        ("compute", "recover"), "recover", historical.act_recover_raising_stats,
        "Recovery that raises the external count (a guard that admits any ordered pair)."),
}

#: Sentinels: a bug that leaves a request one step past a claim's boundary, and a
#: refutation that concludes that claim's entry of ``request_invariants`` alone.
#: The induction alone cannot tell a claim from a weaker one (``True`` is
#: inductive too); a sentinel can: weaken the claim's predicate to ``True`` or
#: one past its bound and the bug is no longer refuted, so ``kvspec prove``
#: fails (tests/test_prove_teeth.py). Bounds pin the state before the bug within
#: the claim, stated apart from its predicate, so that a weakened predicate cannot
#: start the bug past the boundary already. name -> (entry, shape, primitive
#: replaced, bug, bounds, why)
SENTINELS = {
    "sentinel_stats_are_ordered": (
        "stats_are_ordered", ("schedule_waiting", "sample"), "schedule_waiting",
        historical.act_schedule_waiting_recording_whole_external, None,
        "A full-prompt hit whose external count keeps the recomputed token: one more "
        "external than cached (0.18.1's full-async-hit-external-exceeds-cached)."),
    "sentinel_stats_set_exactly_once": (
        "stats_set_exactly_once", ("schedule_waiting", "keep_prefilling"), "schedule_waiting",
        historical.act_schedule_waiting_recording_again,
        lambda c: c.num_stats_sets <= 1,
        "A re-scheduling after preemption that records the stats a second time (#36859's "
        "family)."),
    "sentinel_cached_le_computed": (
        "cached_le_computed", ("finish_async_load",), "finish_async_load",
        historical.act_finish_async_load_dropping_last_loaded,
        lambda c: c.num_cached <= c.num_computed,
        "A finished load that gives back its last loaded token on a partial hit: one "
        "hit reported that is not computed."),
    "sentinel_computed_within_tokens": (
        "waiting_with_work", ("finish_async_load",), "finish_async_load",
        historical.act_finish_async_load_counting_every_token,
        lambda c: c.num_computed <= c.num_tokens,
        "A finished full-prompt load that counts the last token too: nothing left to "
        "compute (#30320 on the async path)."),
    "sentinel_blocks_cover_computed": (
        "blocks_cover_computed", ("compute", "keep_prefilling"), "compute",
        historical.act_compute_one_token_uncovered, None,
        "Slots asked for every scheduled token but the last."),
    "sentinel_running_request_has_stats": (
        "running_request_has_stats", ("schedule_loaded", "keep_prefilling"), "schedule_loaded",
        historical.act_schedule_loaded_without_stats, lambda c: c.num_hits >= 1,
        "A loaded request that runs without recording its stats."),
    "sentinel_unscheduled_request_has_no_output": (
        "unscheduled_request_has_no_output", ("preempt",), "preempt",
        historical.act_preempt_uncounted,
        lambda c: c.num_tokens <= c.prompt_len + 1,
        "A preemption left uncounted: a request that sampled one token waits as if "
        "it never ran."),
    "sentinel_preempted_means_preempted": (
        "preempted_means_preempted", ("finish_async_load",), "finish_async_load",
        historical.act_finish_async_load_waking_as_preempted, None,
        "A finished load that wakes a never-preempted request as PREEMPTED."),
    "sentinel_placeholders_nonnegative": (
        "placeholders_nonnegative", ("sample_stale",), "sample_stale",
        historical.act_sample_stale_returning_share, lambda c: c.num_placeholders == 0,
        "#47900: a preempted request's stale output takes its share off the "
        "placeholders the preemption zeroed."),
}


def _register_sentinels() -> None:
    for name, (entry, shape, prim, fn, bounds, why) in SENTINELS.items():
        induction = f"step_{shape_name(shape)}"
        assert induction in OBLIGATIONS, induction
        register(name, "refutation", lambda e=entry, shape=shape, prim=prim, fn=fn, b=bounds:
                 _step_goal(shape, {prim: fn}, b, e),
                 f"{why} Expected: refuted, by the entry {entry} of {induction}'s "
                 "conclusion alone.", refutes_rule_of=induction)


_register_steps()
_register_sentinels()
_register_async_sentinels()


# -- induction over the block pool ------------------------------------------------

def _symbolic_pool(s: Symbols):
    from kvspec.spec.pool_effects import NUM_BLOCKS, NUM_REQUESTS, Pool
    blocks = range(NUM_BLOCKS)
    flags = {f: tuple(s.bool("state", f"{f}_{b}") for b in blocks)
             for f in ("free", "cached", "valid", "loading")}
    holds = tuple(tuple(s.bool("state", f"holds_{r}_{b}") for b in blocks)
                  for r in range(NUM_REQUESTS))
    return Pool(holds=holds, ref=tuple(s.int("state", f"ref_{b}") for b in blocks), **flags)


def _choices(params):
    from kvspec.spec.pool_effects import NUM_BLOCKS, NUM_REQUESTS
    ranges = {"r": range(NUM_REQUESTS), "b": range(NUM_BLOCKS), "ok": (True, False)}
    if not params:
        return [()]
    return [(first, *rest) for first in ranges[params[0]] for rest in _choices(params[1:])]


def _pool_goal(action: str, invariant: str, effect=None, bounds=None) -> Goal:
    from kvspec.spec.pool_effects import POOL_ACTIONS, pool_invariants
    s = Symbols()
    pool = _symbolic_pool(s)
    fn, params = POOL_ACTIONS[action]
    before = And(*pool_invariants(pool).values(), bounds(pool) if bounds else True)
    cases = []
    for choice in _choices(params):
        guard, after = (effect or fn)(pool, *choice)
        cases.append((And(before, guard), pool_invariants(after)[invariant]))
    return Goal(tuple(cases), s)


POOL_REFUTATIONS = {
    "refute_async_caches_before_load": (
        "issue_async_load", "no_caching_of_invalid_blocks", historical.act_issue_async_load_caching,
        "Review of #34616: async-load blocks cached when the load is issued."),
    "refute_failed_block_stays_cached": (
        "sync_load", "no_caching_of_invalid_blocks",
        historical.act_sync_load_keeping_failed_cached,
        "Review of #34616: a block whose load failed stays in the prefix cache."),
    "refute_free_keeps_references": (
        "free", "ref_count_is_holders", historical.act_free_keeping_references,
        "A free that forgets to drop the blocks' reference counts.",
        # from exact counts (stated apart from the predicate): one holder too many
        lambda pool: And(*[pool.ref[b] == sum(If(h[b], 1, 0) for h in pool.holds)
                           for b in range(len(pool.ref))])),
    "refute_free_under_load": (
        "free", "no_load_into_free_blocks", historical.act_free_under_load,
        "#46240: an aborted request's blocks freed while its load still writes them."),
    "refute_free_leaves_blocks_unqueued": (
        "free", "free_queue_is_free_blocks", historical.act_free_leaving_blocks_unqueued,
        "A free that drops the counts but never queues a block that reaches zero: it "
        "leaks."),
}


def _register_pool() -> None:
    from kvspec.spec.pool_effects import NUM_BLOCKS, NUM_REQUESTS, POOL_ACTIONS
    for action in POOL_ACTIONS:
        for invariant in ("ref_count_is_holders", "free_queue_is_free_blocks",
                          "no_caching_of_invalid_blocks", "no_load_into_free_blocks"):
            register(f"pool_{invariant}_under_{action}", "induction",
                     lambda a=action, i=invariant: _pool_goal(a, i),
                     f"{invariant} holds after the pool action {action} (every request, "
                     f"block and outcome) over a symbolic pool of {NUM_REQUESTS} requests and "
                     f"{NUM_BLOCKS} blocks with unbounded counts, when the pool invariants "
                     f"held before.", (invariant,))
    for name, (action, invariant, effect, why, *bounds) in POOL_REFUTATIONS.items():
        register(name, "refutation", lambda a=action, i=invariant, e=effect, b=bounds:
                 _pool_goal(a, i, e, *b),
                 f"{why} Expected: refuted, by pool_{invariant}_under_{action}.",
                 refutes_rule_of=f"pool_{invariant}_under_{action}")


_register_pool()


# -- running ------------------------------------------------------------------

def is_vacuous(goal: Goal, timeout_ms: int) -> bool:
    """Whether some case's hypothesis has no model (or none found in time)."""
    for hypothesis, _ in goal.cases:
        solver = z3.Solver()
        solver.set("timeout", timeout_ms)
        solver.add(hypothesis)
        if solver.check() != z3.sat:
            return True
    return False


def check(ob: Obligation, timeout_ms: int = 10_000) -> Result:
    expected = "refuted" if ob.kind == "refutation" else "proved"
    start = time.perf_counter()
    goal = ob.build()
    vacuous = is_vacuous(goal, timeout_ms)
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(z3.Not(goal.claim))
    outcome = solver.check()
    seconds = time.perf_counter() - start
    if outcome == z3.unsat:
        return Result(ob.name, ob.kind, "proved", expected, seconds, vacuous)
    if outcome == z3.sat:
        model = solver.model()
        cex = {k: _value(model.eval(v, model_completion=True))
               for k, v in goal.symbols.consts.items()
               if goal.symbols.roles[k] in ("state", "parameter")}
        return Result(ob.name, ob.kind, "refuted", expected, seconds, vacuous, cex)
    return Result(ob.name, ob.kind, "unknown", expected, seconds, vacuous)


def _value(term):
    if z3.is_int_value(term):
        return term.as_long()
    if z3.is_true(term) or z3.is_false(term):
        return z3.is_true(term)
    return str(term)


def check_all(names=None, timeout_ms: int = 10_000) -> list[Result]:
    return [check(ob, timeout_ms) for name, ob in OBLIGATIONS.items()
            if names is None or name in names]


def claims_established() -> dict[str, list[str]]:
    """Catalogue claim -> the obligations (proved kinds) that establish it."""
    found: dict[str, list[str]] = {}
    for ob in OBLIGATIONS.values():
        for claim in ob.establishes:
            found.setdefault(claim, []).append(ob.name)
    return found
