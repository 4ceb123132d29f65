"""One model of what a step may do to one request's counters.

Primitive actions are guard plus effect over a ``Counters`` record; every field
an effect does not name stays unchanged (``attrs.evolve``). A *step shape* is
the short sequence of primitives one request takes within one runner action
(one ``schedule`` + worker + ``update_from_output``; an abort; an arrival).

Two checkers read this one model, so the transitions Z3 reasons about are the
transitions the runtime checks:

- Z3 (``spec/prove.py``) proves every per-request invariant inductive over
  every step shape, and that the stats are set once and only ever lowered;
- the runner (``kvspec/harness/conformance.py``) maps every request transition
  a target makes into ``Counters`` before and after, reads the primitives'
  parameters off the observation (tokens scheduled, drafts, tokens appended,
  the connector's answers, the failed blocks) and requires some shape to admit
  it; a transition no shape admits is reported as ``transition_admitted_by_model``.

The model is loose where a correct scheduler may choose: how many blocks it
holds (at least enough for what it counts), how far recovery cuts back (to at
most the first failed block: recomputing from zero is correct too), how it
lowers the stats after a failure (any lowering that keeps them ordered), and a
waiter resuming over blocks another request recomputed (never past what it had
computed before the failure). It is tight where correctness lives: what rejected
drafts give back, that stats are recorded once, that a failed block under the
counted prefix is cut back. It is also tight where vLLM's contract with the
connector lives, which is not KV safety: a scheduling starts at the hits the
connector was asked for, and a finished load counts what it delivered. A
scheduler that counted less would corrupt no KV, but would throw away transfers
the connector made (and may have freed its copy after) and report hits it did
not use; the review of issue 9 asked for both to be caught.
"""
from __future__ import annotations

import itertools
from typing import Callable

import attrs

from kvspec.spec.arith import (compute_computed_after_rejection, compute_first_external,
                               compute_num_computed_after_hit)
from kvspec.spec.logic import And, If, Implies, Min, Not, Or
from kvspec.spec.predicates import (is_admissible_lowering, is_blocks_cover_computed,
                                    is_cached_le_computed, is_computed_within_tokens,
                                    is_placeholders_nonnegative,
                                    is_first_cached_count, is_preempted_counted,
                                    is_running_with_stats, is_stats_ordered,
                                    is_unscheduled_without_output, is_waiting_with_work)

WAITING, LOADING, RUNNING, PREEMPTED, FINISHED = 0, 1, 2, 3, 4
STATUS_NAMES = ("WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED")


@attrs.frozen
class Counters:
    status: object
    prompt_len: object
    num_tokens: object
    num_computed: object
    num_cached: object        # -1 until the stats are recorded
    num_external: object
    num_preemptions: object
    num_blocks: object        # blocks in the (full-attention) block table
    block_size: object
    #: positions scheduled whose tokens a step in flight will sample (async
    #: scheduling; a synchronous step returns them within the step)
    num_placeholders: object = 0
    #: ghost: how many times the stats were recorded
    num_stats_sets: object = 0
    #: ghost: how many load failures cut the request back
    num_recoveries: object = 0
    #: ghost: the hits (local + external) its async load was issued for
    num_hits: object = 0
    #: ghost: the computed prefix before its last recovery (a waiter never resumes past it)
    num_resume_limit: object = 0


#: the ghost fields: the model keeps them, no target shows them
GHOST_FIELDS = ("num_stats_sets", "num_recoveries", "num_hits", "num_resume_limit")
OBSERVED_FIELDS = ("status", "prompt_len", "num_tokens", "num_computed", "num_cached",
                   "num_external", "num_preemptions", "num_blocks", "num_placeholders")


def has_stats(c: Counters):
    return c.num_cached >= 0


def is_waiting(c: Counters):
    return Or(c.status == WAITING, c.status == PREEMPTED)


def get_waiting_status(c: Counters):
    """Where a request goes back to wait: PREEMPTED once it has been preempted."""
    return If(c.num_preemptions >= 1, PREEMPTED, WAITING)


def is_chunk(num_tokens, end, num_new, num_drafts):
    """``num_new`` tokens scheduled up to ``end``: at least one, never past the
    known tokens plus the drafts, and drafts only at the very end."""
    return And(num_new >= 1, num_drafts >= 0, end <= num_tokens + num_drafts,
               Implies(num_drafts > 0, end == num_tokens + num_drafts))


def get_known(c: Counters):
    """The positions a step may schedule up to: the tokens, and the placeholder
    positions the steps in flight will fill."""
    return c.num_tokens + c.num_placeholders


def get_real_computed(c: Counters):
    """The computed prefix whose tokens are known (placeholders aside)."""
    return c.num_computed - c.num_placeholders


def compute_placeholders_scheduled(c: Counters, end, num_drafts):
    """A step that reaches every known position samples: it owns one
    placeholder and one per draft until its output is back. A prefill chunk
    that stops short samples nothing and owns none. (Stated here, apart from
    the reference's ``spec/arith.py``.)"""
    return If(end >= get_known(c), c.num_placeholders + 1 + num_drafts, c.num_placeholders)


def request_invariants(r: Counters) -> dict:
    """The per-request invariants of the catalogue, by name, for a live request
    (the concrete checks in ``spec/invariants.py`` use the same predicates)."""
    stats, live = has_stats(r), r.status != FINISHED
    never_disturbed = And(stats, r.num_preemptions == 0, r.num_recoveries == 0)
    claims = {
        "stats_are_ordered": If(stats, is_stats_ordered(r.prompt_len, r.num_cached,
                                                        r.num_external), r.num_external == 0),
        "stats_set_exactly_once": r.num_stats_sets == If(stats, 1, 0),
        "cached_le_computed": Implies(never_disturbed, is_cached_le_computed(
            r.status == RUNNING, Or(is_waiting(r), r.status == LOADING), r.num_cached,
            r.num_computed, r.num_tokens)),
        "computed_within_tokens": is_computed_within_tokens(get_real_computed(r), r.num_tokens),
        "placeholders_nonnegative": is_placeholders_nonnegative(r.num_placeholders),
        # a step in flight samples at the last known position: what the
        # placeholders hold is exactly the positions past the known tokens
        # (the oldest step's output can then be applied)
        "placeholders_are_the_tail": Implies(
            r.num_placeholders >= 1,
            And(r.status == RUNNING, r.num_computed == get_known(r) - 1)),
        "waiting_with_work": is_waiting_with_work(is_waiting(r), r.num_computed, r.num_tokens),
        "blocks_cover_computed": is_blocks_cover_computed(r.num_blocks, r.block_size,
                                                          r.num_computed),
        "running_request_has_stats": is_running_with_stats(r.status == RUNNING, stats),
        # the strengthenings the induction needed (docs/proofs.md)
        "unscheduled_request_has_no_output": is_unscheduled_without_output(
            stats, And(Or(is_waiting(r), r.status == LOADING), r.num_preemptions == 0),
            r.num_tokens, r.prompt_len),
        # an untouched load holds exactly its hits (the last token aside once finished)
        "loaded_prefix_is_the_hits": Implies(
            r.num_recoveries == 0,
            And(Implies(r.status == LOADING, r.num_computed == r.num_hits),
                Implies(And(is_waiting(r), r.num_computed >= 1),
                        r.num_computed == Min(r.num_hits, r.num_tokens - 1)))),
    }
    claims = {name: Implies(live, claim) for name, claim in claims.items()}
    claims["preempted_means_preempted"] = is_preempted_counted(r.status == PREEMPTED,
                                                               r.num_preemptions)
    # shape facts the invariants above need to be inductive
    claims["well_formed"] = And(
        r.status >= WAITING, r.status <= FINISHED, r.prompt_len >= 1,
        r.num_tokens >= r.prompt_len, r.block_size >= 1, r.num_preemptions >= 0,
        r.num_blocks >= 0, r.num_recoveries >= 0, r.num_hits >= 0, r.num_resume_limit >= 0,
        r.num_hits <= r.num_tokens, r.num_resume_limit <= r.num_tokens,
        Implies(r.num_preemptions >= 1, stats))
    return claims


def is_initial(r: Counters):
    """A request as ``add_request`` leaves it."""
    return And(r.status == WAITING, r.num_tokens == r.prompt_len, r.prompt_len >= 1,
               r.num_computed == 0, r.num_cached == -1, r.num_external == 0,
               r.num_preemptions == 0, r.num_blocks == 0, r.block_size >= 1,
               r.num_stats_sets == 0, r.num_recoveries == 0, r.num_hits == 0,
               r.num_resume_limit == 0, r.num_placeholders == 0)


def is_stats_step_ok(before: Counters, after: Counters, may_lower):
    """Stats, once recorded, stay as they are; only a load failure (``may_lower``)
    may change them, and only downwards. The two-state form of
    ``stats_set_exactly_once``, shared with the runtime claim; stated apart from
    the recover primitive's own guard (``is_admissible_lowering``), so a guard
    that let stats rise would be refuted here."""
    unchanged = And(after.num_cached == before.num_cached,
                    after.num_external == before.num_external)
    never_raised = And(after.num_cached <= before.num_cached,
                       after.num_external <= before.num_external, after.num_cached >= 0)
    return If(has_stats(before), If(may_lower, never_raised, unchanged), True)


# -- primitives ----------------------------------------------------------------

class Params:
    """A primitive's parameters, by name."""

    def __init__(self, **values) -> None:
        self.__dict__.update(values)


@attrs.frozen
class Primitive:
    name: str
    fn: Callable
    params: tuple[str, ...]
    doc: str


PRIMITIVES: dict[str, Primitive] = {}


def primitive(*params: str):
    def register(fn):
        name = fn.__name__.removeprefix("act_")
        PRIMITIVES[name] = Primitive(name, fn, params, (fn.__doc__ or "").strip())
        return fn
    return register


def record_stats(c: Counters, records, num_local, num_external, num_cached,
                 first_external=compute_first_external):
    """Guard and effect of recording the stats for ``num_local + num_external``
    hits, where ``records`` says the step records them (only a request that has
    none does): the cached count per ``is_first_cached_count``, the external part
    the connector's answer less what that count leaves out (``first_external``:
    a historical rule may be put in its place)."""
    first = And(records, Not(has_stats(c)))
    external = first_external(num_cached, num_local, num_external)
    guard = Implies(first, is_first_cached_count(num_cached, num_local + num_external,
                                                 c.num_tokens))
    return guard, dict(num_cached=If(first, num_cached, c.num_cached),
                       num_external=If(first, external, c.num_external),
                       num_stats_sets=c.num_stats_sets + If(first, 1, 0))


@primitive("num_local", "num_external", "num_new", "num_drafts", "num_blocks", "num_cached")
def act_schedule_waiting(c: Counters, p, first_external=compute_first_external):
    """A waiting request with nothing computed is scheduled. It starts at its
    hits (local, then external, leaving the last token), computes ``num_new``
    tokens, and records its stats if it never had them."""
    start = compute_num_computed_after_hit(p.num_local, p.num_external, c.num_tokens)
    end = start + p.num_new
    stats_guard, stats = record_stats(c, True, p.num_local, p.num_external, p.num_cached,
                                      first_external)
    guard = And(is_waiting(c), c.num_computed == 0, p.num_local >= 0, p.num_external >= 0,
                p.num_local + p.num_external <= c.num_tokens,
                is_chunk(get_known(c), end, p.num_new, p.num_drafts),
                is_blocks_cover_computed(p.num_blocks, c.block_size, end), stats_guard)
    return guard, attrs.evolve(c, status=RUNNING, num_computed=end, num_blocks=p.num_blocks,
                               num_placeholders=compute_placeholders_scheduled(c, end, p.num_drafts),
                               **stats)


@primitive("num_local", "num_new", "num_drafts", "num_blocks", "num_cached")
def act_schedule_loaded(c: Counters, p):
    """A waiting request whose async load finished is scheduled from the loaded
    prefix; if it has no stats yet, it records the load's hits (``num_local``
    local, the rest of ``num_hits`` external): the hits it was issued for
    (vLLM), or the prefix the load delivered (the reference; a failure may have
    cut it)."""
    end = c.num_computed + p.num_new
    stats_guard, stats = record_stats(c, True, p.num_local, c.num_hits - p.num_local,
                                      p.num_cached)
    delivered = And(Not(has_stats(c)), p.num_cached == c.num_computed)
    # (a failure may have cut the loaded prefix below the local hits it started from)
    guard = And(is_waiting(c), c.num_computed >= 1, p.num_local >= 0, p.num_local <= c.num_hits,
                is_chunk(get_known(c), end, p.num_new, p.num_drafts),
                is_blocks_cover_computed(p.num_blocks, c.block_size, end),
                Or(stats_guard, delivered))
    return guard, attrs.evolve(c, status=RUNNING, num_computed=end, num_blocks=p.num_blocks,
                               num_placeholders=compute_placeholders_scheduled(c, end, p.num_drafts),
                               **stats)


@primitive("num_new", "num_drafts", "num_blocks")
def act_compute(c: Counters, p):
    """A running request is scheduled for ``num_new`` more tokens (its scheduled
    drafts included); under async scheduling, past the placeholders of its
    steps in flight."""
    end = c.num_computed + p.num_new
    guard = And(c.status == RUNNING, is_chunk(get_known(c), end, p.num_new, p.num_drafts),
                is_blocks_cover_computed(p.num_blocks, c.block_size, end))
    return guard, attrs.evolve(c, num_computed=end, num_blocks=p.num_blocks,
                               num_placeholders=compute_placeholders_scheduled(c, end, p.num_drafts))


@primitive("num_valid")
def act_resume_waiter(c: Counters, p):
    """A request cut back by a load failure resumes over blocks another request
    has recomputed since: its computed prefix grows without computing, never past
    what it had computed before the failure. (Whether that KV is really there is
    the data oracle's to check.)"""
    guard = And(Or(c.status == RUNNING, is_waiting(c)), c.num_recoveries >= 1,
                p.num_valid > c.num_computed, p.num_valid <= c.num_resume_limit,
                p.num_valid <= c.num_tokens - 1,
                is_blocks_cover_computed(c.num_blocks, c.block_size, p.num_valid))
    return guard, attrs.evolve(c, num_computed=p.num_valid)


@primitive("num_local", "num_external", "num_blocks", "records", "num_cached")
def act_issue_async_load(c: Counters, p):
    """A waiting request with nothing computed gets blocks for its hits and waits
    for the external part in WAITING_FOR_REMOTE_KVS; the target of the load is
    local + external hits, not a block multiple (#34616). A scheduler may record
    the stats now (``records`` = 1, vLLM) or when the request first runs
    (``records`` = 0, the reference)."""
    target = p.num_local + p.num_external
    stats_guard, stats = record_stats(c, p.records == 1, p.num_local, p.num_external,
                                      p.num_cached)
    guard = And(is_waiting(c), c.num_computed == 0, p.num_local >= 0, p.num_external >= 1,
                target <= c.num_tokens, Or(p.records == 0, p.records == 1),
                is_blocks_cover_computed(p.num_blocks, c.block_size, target), stats_guard)
    return guard, attrs.evolve(c, status=LOADING, num_computed=target, num_blocks=p.num_blocks,
                               num_hits=target, **stats)


@primitive("keeps")
def act_finish_async_load(c: Counters, p):
    """The load is reported finished: the request waits again with the target
    counted, less the last token on a full hit (it is recomputed to sample). A
    load that left nothing to count gives the request's blocks back: one that
    failed on its first block must (``keeps`` = 0); one that loaded a whole
    one-token prompt may instead hold its block until the request runs (vLLM
    does, ``keeps`` = 1)."""
    computed = Min(c.num_computed, c.num_tokens - 1)
    guard = And(c.status == LOADING, Or(p.keeps == 0, p.keeps == 1),
                Implies(p.keeps == 1, c.num_computed >= 1))
    return guard, attrs.evolve(
        c, status=get_waiting_status(c), num_computed=computed,
        num_blocks=If(computed == 0, If(p.keeps == 1, c.num_blocks, 0), c.num_blocks))


@primitive()
def act_release_loaded(c: Counters, p):
    """A waiting request whose load finished gives its blocks back under memory
    pressure; it will recompute. Not while its stats describe this load (recorded
    and never preempted since): it would report hits it threw away."""
    guard = And(is_waiting(c), c.num_computed >= 1,
                Or(Not(has_stats(c)), c.num_preemptions >= 1))
    return guard, attrs.evolve(c, num_computed=0, num_blocks=0)


@primitive()
def act_preempt(c: Counters, p):
    """A running request is preempted: it frees its blocks and starts over; the
    output of its steps in flight is stale and owns no placeholders (#48245)."""
    return c.status == RUNNING, attrs.evolve(c, status=PREEMPTED, num_computed=0, num_blocks=0,
                                             num_placeholders=0,
                                             num_preemptions=c.num_preemptions + 1)


@primitive("num_drafts", "num_accepted")
def act_sample(c: Counters, p):
    """The oldest sampling step in flight computed every known token and
    ``num_drafts`` drafts: the accepted drafts and one new token are appended,
    the rejected drafts stop counting, and its share of placeholders (one and
    its drafts) is returned. Synchronous scheduling is the case of one step in
    flight: its share is all there is."""
    guard = And(c.status == RUNNING, p.num_drafts >= 0, p.num_accepted >= 0,
                p.num_accepted <= p.num_drafts, c.num_placeholders >= 1 + p.num_drafts,
                c.num_computed == get_known(c) - 1)
    return guard, attrs.evolve(
        c, num_tokens=c.num_tokens + p.num_accepted + 1,
        num_computed=compute_computed_after_rejection(c.num_computed, p.num_drafts,
                                                      p.num_accepted),
        num_placeholders=c.num_placeholders - 1 - p.num_drafts)


@primitive("num_sampled")
def act_sample_stale(c: Counters, p):
    """The output of a step scheduled before the request was preempted arrives
    while it waits, nothing computed (vLLM resumes it only once that output has
    drained): its ``num_sampled`` tokens are appended and nothing else
    moves: no rollback, no placeholder returned (the preemption zeroed them;
    vLLM appends stale output on purpose, scheduler.py 2122)."""
    guard = And(p.num_sampled >= 0, is_waiting(c), c.num_preemptions >= 1, c.num_computed == 0)
    return guard, attrs.evolve(c, num_tokens=c.num_tokens + p.num_sampled)


@primitive()
def act_keep_prefilling(c: Counters, p):
    """A partial prefill chunk samples nothing: prompt tokens are left to compute."""
    return And(c.status == RUNNING, get_real_computed(c) < c.num_tokens), c


@primitive("first_invalid_block", "num_valid", "num_cached", "num_external", "keeps")
def act_recover(c: Counters, p):
    """A load failure is reported on a block under the request's computed
    prefix: it keeps at most the tokens before that block (recomputing from zero
    is correct too, and then it may give its blocks back: ``keeps`` 0, as with
    several kinds of KV cache group), and its stats may be lowered in any way
    that keeps them ordered, never raised."""
    first_bad = p.first_invalid_block * c.block_size
    stats_ok = If(has_stats(c),
                  is_admissible_lowering(c.num_cached, c.num_external,
                                         p.num_cached, p.num_external),
                  And(p.num_cached == c.num_cached, p.num_external == c.num_external))
    # a failed block holds loaded positions, so it starts within the known tokens
    guard = And(Or(c.status == RUNNING, c.status == LOADING), p.first_invalid_block >= 0,
                first_bad < c.num_computed, first_bad < c.num_tokens, p.num_valid >= 0,
                p.num_valid <= first_bad, stats_ok)
    keeps = getattr(p, "keeps", 1)
    # (the output of its steps in flight was computed on the failure: it is
    # stale, and owns no placeholders)
    return guard, attrs.evolve(c, num_computed=p.num_valid, num_cached=p.num_cached,
                               num_external=p.num_external, num_placeholders=0,
                               num_blocks=If(And(p.num_valid == 0, keeps == 0), 0, c.num_blocks),
                               num_recoveries=c.num_recoveries + 1,
                               num_resume_limit=Min(c.num_computed, c.num_tokens - 1))


@primitive()
def act_finish(c: Counters, p):
    """The request ends: stopped, length-capped, aborted, or failed by the
    "fail" policy. The per-request model stops here."""
    return c.status != FINISHED, attrs.evolve(c, status=FINISHED)


# -- step shapes -----------------------------------------------------------------

#: what may happen before the scheduler decides: a load reported finished
PRE = ((), ("finish_async_load",))
#: what one schedule() may do to one request
SCHEDULE = ((), ("schedule_waiting",), ("schedule_loaded",), ("compute",),
            ("resume_waiter",), ("resume_waiter", "compute"), ("resume_waiter", "schedule_loaded"),
            ("issue_async_load",), ("preempt",), ("release_loaded",),
            ("release_loaded", "schedule_waiting"))
#: primitives that schedule tokens: the worker's output then speaks about them
COMPUTES = {"schedule_waiting", "schedule_loaded", "compute"}
#: what the worker's output does to a request it ran: a chunk, tokens, a
#: failure it read, a stop (EOS, length) or an end by the "fail" policy
OUTPUT_RAN = (("keep_prefilling",), ("sample",), ("recover",), ("sample", "finish"),
              ("recover", "finish"))
#: ... and to one it did not run: nothing, or a failure of a block it holds
OUTPUT_IDLE = ((), ("recover",), ("recover", "finish"))
#: an abort: the request ends (or had ended)
ABORT_SHAPES = ((), ("finish",))
#: a forced reset_prefix_cache: a running request is preempted (a step shape too,
#: so its obligation is the step's)
RESET_SHAPES = ((), ("preempt",))

#: which statuses each primitive's guard admits, and the status it leaves
_FLOW = {"schedule_waiting": ({WAITING, PREEMPTED}, RUNNING),
         "schedule_loaded": ({WAITING, PREEMPTED}, RUNNING),
         "compute": ({RUNNING}, RUNNING), "resume_waiter": ({RUNNING, WAITING, PREEMPTED}, None),
         "issue_async_load": ({WAITING, PREEMPTED}, LOADING),
         "finish_async_load": ({LOADING}, "waiting"),
         "release_loaded": ({WAITING, PREEMPTED}, None), "preempt": ({RUNNING}, PREEMPTED),
         "keep_prefilling": ({RUNNING}, RUNNING), "sample": ({RUNNING}, RUNNING),
         "sample_stale": ({WAITING, PREEMPTED}, None),
         "recover": ({RUNNING, LOADING}, None),
         "finish": ({WAITING, LOADING, RUNNING, PREEMPTED}, FINISHED)}


def get_status_moves(shape: tuple[str, ...]) -> set[tuple[int, int]]:
    """The (start, end) statuses ``shape`` can take a request between, by the
    statuses each primitive's guard admits (Z3 confirms each shape's guards
    satisfiable: its obligation is not vacuous)."""
    moves = set()
    for start in (WAITING, LOADING, RUNNING, PREEMPTED):
        now = {start}
        for name in shape:
            admits, leaves = _FLOW[name]
            now &= admits
            if not now:
                break
            if leaves == "waiting":
                now = {WAITING, PREEMPTED}
            elif leaves is not None:
                now = {leaves}
        moves |= {(start, end) for end in now}
    return moves


def _is_status_feasible(shape: tuple[str, ...]) -> bool:
    return bool(get_status_moves(shape))


def _build_step_shapes() -> tuple[tuple[str, ...], ...]:
    shapes = []
    for pre, sched in itertools.product(PRE, SCHEDULE):
        ran = bool(sched) and sched[-1] in COMPUTES
        for out in OUTPUT_RAN if ran else OUTPUT_IDLE:
            shape = pre + sched + out
            if shape and shape not in shapes and _is_status_feasible(shape):
                shapes.append(shape)
    return tuple(shapes)


#: every shape one request's counters may take within one step (the empty
#: shape, nothing happened to it, is admitted without a proof obligation)
STEP_SHAPES = _build_step_shapes()

#: async scheduling splits the step: one schedule() ...
SCHEDULE_SHAPES = tuple(pre + sched for pre, sched in itertools.product(PRE, SCHEDULE)
                        if pre + sched and _is_status_feasible(pre + sched))
#: ... and, later, one update_from_output() with the oldest step's output (which
#: may be stale: its request was preempted or cut back since it was scheduled)
STALE = (("sample_stale",), ("sample_stale", "finish"))
OUTPUT_SHAPES = tuple(dict.fromkeys(OUTPUT_RAN + OUTPUT_IDLE[1:] + STALE))

#: every shape the model knows: synchronous steps, the two halves of an async
#: step, and aborts
ALL_SHAPES = tuple(dict.fromkeys(STEP_SHAPES + SCHEDULE_SHAPES + OUTPUT_SHAPES +
                                 tuple(s for s in ABORT_SHAPES if s)))
