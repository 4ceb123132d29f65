"""Conformance: every request transition a target makes is one the Z3 model
admits.

``spec/effects.py`` is the model Z3 proves the per-request invariants over. After
every runner action, each request's counters before and after are mapped into
``Counters``; the primitives' parameters are read off the observation (tokens
and drafts scheduled, tokens appended, the connector's answer, the first failed
block) or, where the model leaves a choice to the scheduler (blocks held, the
prefix recovery keeps, lowered stats), taken from the state after and checked by
the guard. Some step shape must then reproduce the state after exactly; if none
does, the target did something the proofs do not cover: either a bug the other
claims have not caught, or a gap in the model (``transition_admitted_by_model``).
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import attrs

from kvspec.spec.effects import (ABORT_SHAPES, FINISHED, GHOST_FIELDS, LOADING, OBSERVED_FIELDS,
                                 OUTPUT_SHAPES, PREEMPTED, PRIMITIVES, RESET_SHAPES, RUNNING,
                                 SCHEDULE_SHAPES, STATUS_NAMES, STEP_SHAPES, WAITING, Counters,
                                 Params, get_status_moves, is_initial)
from kvspec.spec.registry import invariant
from kvspec.spec.state import RequestStatus, RequestView

_STATUS = {RequestStatus.WAITING: WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS: LOADING,
           RequestStatus.RUNNING: RUNNING, RequestStatus.PREEMPTED: PREEMPTED}


INITIAL_GHOST = {f: 0 for f in GHOST_FIELDS}


def get_model_block_size(groups) -> int:
    """The block the model counts in: the groups' greatest common divisor
    (their one block size, or the hash block of two sizes), so that every
    group's blocks are whole numbers of it."""
    if len(groups) == 1:  # the gcd of one positive size
        return groups[0].block_size
    return math.gcd(*(g.block_size for g in groups))


def get_num_blocks(r: RequestView, groups) -> int:
    """The blocks the model counts: every group's table covers the same
    positions (a group that gave blocks back holds the null block there), so
    the shortest table, in the model's blocks (``get_model_block_size``), is
    what covers the computed prefix in every group."""
    if not r.block_ids:
        return 0
    size = get_model_block_size(groups)
    return min(len(table) * g.block_size // size for g, table in zip(groups, r.block_ids))


def get_counters(r: RequestView, groups, ghost=None) -> Counters:
    """A request as the model sees it; ``ghost``: the model's ghost fields."""
    return Counters(
        status=FINISHED if r.status.is_finished else _STATUS[r.status],
        prompt_len=r.num_prompt_tokens, num_tokens=r.num_tokens,
        num_computed=r.num_computed_tokens, num_cached=r.num_cached_tokens,
        num_external=r.num_external_computed_tokens, num_preemptions=r.num_preemptions,
        num_blocks=get_num_blocks(r, groups), block_size=get_model_block_size(groups),
        num_placeholders=r.num_output_placeholders, **(ghost or INITIAL_GHOST))


@attrs.frozen
class Hints:
    """What the observation says about one request's step: the values of the
    primitives' parameters the environment and the scheduler output fix."""

    num_new: int = 0
    num_drafts: int = 0
    num_appended: int = 0
    #: the connector's answer in this step (num_local, num_external), if asked
    answer: tuple[int, int] | None = None
    #: the answer its async load was issued on
    load_answer: tuple[int, int] | None = None
    #: index of the first block of its table reported invalid in this step
    first_invalid_block: int | None = None
    #: where its scheduling started (num_computed_tokens before the step's tokens)
    start: int | None = None
    #: its stats right after schedule(), before the worker's output could lower them
    scheduled_stats: tuple[int, int] | None = None
    #: the blocks it held right after schedule() (a request that ends gives them back)
    scheduled_blocks: int | None = None
    #: the output applied was scheduled before a preemption: it is stale
    stale: bool = False
    #: stale: where the first step in flight after it that still counts for the
    #: request started (it writes those positions after the failed load landed)
    rewritten_from: int | None = None


def get_params(name: str, hints: Hints, after: Counters, before: Counters) -> Params | None:
    """The parameters of primitive ``name`` for this transition, or None where
    the observation rules it out (no failed block, no answer)."""
    answer = hints.answer or (0, 0)
    # a finished request's counters say little: its stats and blocks are what
    # schedule() left
    ended = after.status == FINISHED
    stats = (after.num_cached, after.num_external) if not ended else \
        hints.scheduled_stats or (before.num_cached, before.num_external)
    # ... and so are the blocks of one that gave them back to recover from zero
    gave_back = ended or (hints.first_invalid_block is not None and after.num_blocks == 0)
    blocks = hints.scheduled_blocks if gave_back and hints.scheduled_blocks is not None \
        else after.num_blocks
    if name in ("schedule_waiting", "issue_async_load"):
        recorded = hints.scheduled_stats or stats
        records = int(recorded[0] >= 0 and before.num_cached < 0)
        return Params(num_local=answer[0], num_external=answer[1], num_new=hints.num_new,
                      num_drafts=hints.num_drafts, num_blocks=blocks,
                      num_cached=recorded[0], records=records)
    if name == "schedule_loaded":
        local = (hints.load_answer or (0, 0))[0]
        recorded = hints.scheduled_stats or stats
        return Params(num_local=local, num_new=hints.num_new, num_drafts=hints.num_drafts,
                      num_blocks=blocks, num_cached=recorded[0])
    if name == "compute":
        return Params(num_new=hints.num_new, num_drafts=hints.num_drafts,
                      num_blocks=blocks)
    if name == "resume_waiter":
        valid = hints.start if hints.start is not None else after.num_computed
        return Params(num_valid=valid)
    if name == "finish_async_load":
        # the state after shows whether a request with nothing counted kept its blocks
        kept = after.status in (WAITING, PREEMPTED) and after.num_computed == 0
        return Params(keeps=int(kept and after.num_blocks > 0))
    if name == "sample":
        return Params(num_drafts=hints.num_drafts, num_accepted=hints.num_appended - 1)
    if name == "sample_stale":
        return Params(num_sampled=hints.num_appended) if hints.stale else None
    if name == "recover":
        if hints.first_invalid_block is None:
            return None
        valid = after.num_computed if after.status != FINISHED else 0
        return Params(first_invalid_block=hints.first_invalid_block, num_valid=valid,
                      num_cached=stats[0], num_external=stats[1],
                      keeps=int(valid > 0 or after.num_blocks > 0))
    return Params()


def run_shape(shape, before: Counters, after: Counters, hints: Hints) -> Counters | None:
    """The model's counters after ``shape``, or None as soon as a guard fails."""
    now = before
    for name in shape:
        params = get_params(name, hints, after, before)
        if params is None:
            return None
        guard, now = PRIMITIVES[name].fn(now, params)
        if not guard:
            return None
    return now


def is_same(model: Counters, observed: Counters) -> bool:
    if observed.status == FINISHED:
        return model.status == FINISHED
    return all(getattr(model, f) == getattr(observed, f) for f in OBSERVED_FIELDS)


def must_recover(before: Counters, hints: Hints) -> bool:
    """A block reported failed lies under the prefix the request counted before
    its tokens of this step: it must be cut back (or ended by the "fail" policy).
    Not yet scheduled in the step: under its real computed prefix, since past it
    lie the positions of later steps, in blocks that may be fresh (a block a
    request gone since held, whose id the failed load reported). Stale (the
    request was cut back or preempted since): under what it counts that no
    later step in flight writes again, since those writes land after the
    failed load and make its positions valid."""
    if hints.first_invalid_block is None:
        return False
    counted = hints.start if hints.start is not None else \
        hints.rewritten_from if hints.rewritten_from is not None else \
        before.num_computed - before.num_placeholders
    return hints.first_invalid_block * before.block_size < counted


def _index(shapes) -> dict[tuple[int, int], tuple]:
    """Shapes by the (start, end) statuses they can move a request between, in order."""
    index: dict[tuple[int, int], list] = {}
    for shape in shapes:
        for move in get_status_moves(shape):
            index.setdefault(move, []).append(shape)
    return {move: tuple(found) for move, found in index.items()}


#: action -> (start status, end status) -> the shapes that can make that move; a
#: synchronous step is one "step", an async one a "schedule" and, later, an
#: "update_from_output" with the oldest step's output
SHAPES_BY_MOVE = {"step": _index(STEP_SHAPES), "schedule": _index(SCHEDULE_SHAPES),
                  "update_from_output": _index(OUTPUT_SHAPES), "abort": _index(ABORT_SHAPES),
                  "reset_prefix_cache": _index(RESET_SHAPES)}


@functools.lru_cache(maxsize=1 << 16)
def find_shape(action: str, before: Counters, after: Counters, hints: Hints):
    """The first shape of ``action`` admitting ``before -> after`` and the model's
    state after it (memoized: counters and hints are values, and fuzzing repeats them)."""
    shapes = SHAPES_BY_MOVE.get(action, {}).get((before.status, after.status), ())
    if must_recover(before, hints):
        shapes = [s for s in shapes if "recover" in s]
    for shape in shapes:
        model = run_shape(shape, before, after, hints)
        if model is not None and is_same(model, after):
            return shape, model
    return None


def describe(c: Counters) -> str:
    stats = f" stats={c.num_cached}/{c.num_external}" if c.num_cached >= 0 else ""
    held = f" placeholders={c.num_placeholders}" if c.num_placeholders else ""
    return (f"{STATUS_NAMES[c.status]} computed={c.num_computed}/{c.num_tokens}{held}{stats} "
            f"blocks={c.num_blocks} preemptions={c.num_preemptions}")


@attrs.define
class ModelBook:
    """The model's ghost per request (stats sets, recoveries), advanced by the
    shape that admitted each transition."""

    ghost: dict[str, dict[str, int]] = attrs.Factory(dict)
    #: the shape that admitted each request's last transition (for reports)
    last_shape: dict[str, tuple[str, ...]] = attrs.Factory(dict)


@attrs.frozen
class Admission:
    """What the model says of one action: the transitions it admits none of,
    and the model's ghost (and last shapes) once the action is done."""

    messages: tuple[str, ...]
    ghost: dict[str, dict[str, int]]
    last_shape: dict[str, tuple[str, ...]]
    witnessed: int

    def get_book(self) -> ModelBook:
        return ModelBook(dict(self.ghost), dict(self.last_shape))


@attrs.define
class ModelStep:
    """One runner action as the conformance claim sees it."""

    action: str                          # "add", "step", "abort", "reset_prefix_cache"
    before: object                       # Observation
    after: object                        # Observation
    hints: dict[str, Hints]
    book: ModelBook
    request_id: str | None = None
    #: requests that left the scheduler during the action, as they ended
    departed: dict = attrs.Factory(dict)
    #: computed once by the runner (compute_admission), which then advances the book
    admission: Admission | None = None
    witnessed: int = 0

    def witness(self, times: int = 1) -> None:
        self.witnessed += times


def compute_admission(m: ModelStep) -> Admission:
    """Judge every request transition of the action against the model, from the
    book as it was before the action; pure: the book is not written."""
    groups = m.after.config.groups
    ghost, shapes = dict(m.book.ghost), dict(m.book.last_shape)
    messages, witnessed = [], 0
    for rid, new in (m.after.requests | m.departed).items():
        old = m.before.requests.get(rid)
        if old is None:
            ghost[rid] = dict(INITIAL_GHOST)
            if not is_initial(get_counters(new, groups)):
                messages.append(f"{rid} arrived as {describe(get_counters(new, groups))}, "
                                "not the initial state")
            continue
        hints = m.hints.get(rid)
        if hints is None and (old is new or old == new):
            # an unchanged request with no hints: its counters are the same on every
            # observed field (``is_same``) and default hints name no failed block
            # (``must_recover`` is False): nothing to judge, as below
            continue
        before = get_counters(old, groups, m.book.ghost.get(rid))
        after = get_counters(new, groups)
        hints = Hints() if hints is None else hints
        if is_same(before, after) and not must_recover(before, hints):
            continue
        witnessed += 1
        found = find_shape(m.action, before, after, hints)
        if found is None:
            messages.append(f"{rid}: {describe(before)} -> {describe(after)} in {m.action} "
                            f"({_hint_text(hints)}) is admitted by no shape of spec/effects.py")
            continue
        shapes[rid], model = found
        ghost[rid] = {f: getattr(model, f) for f in GHOST_FIELDS}
    for rid in [rid for rid in ghost if rid not in m.after.requests]:
        del ghost[rid]
        shapes.pop(rid, None)
    return Admission(tuple(messages), ghost, shapes, witnessed)


@invariant(cites="docs/proofs.md (one model)", kind="model")
def transition_admitted_by_model(m: ModelStep) -> Iterator[str]:
    """Every request transition the target makes is admitted by a step shape of
    the model Z3 proves the per-request invariants over (``spec/effects.py``),
    with the parameters the observation fixes; a new request is in the model's
    initial state.

    Protects the proofs' relevance: a proof about transitions no target makes,
    or silent about ones it does, establishes nothing about the scheduler. A
    violation is either a scheduler bug or a gap in the model. A pure check: the
    runner, not the claim, advances the model's ghost (``compute_admission``)."""
    admission = m.admission if m.admission is not None else compute_admission(m)
    m.witness(admission.witnessed)
    yield from admission.messages


def _hint_text(h: Hints) -> str:
    parts = [f"scheduled {h.num_new}"]
    if h.num_drafts:
        parts.append(f"drafts {h.num_drafts}")
    if h.num_appended:
        parts.append(f"appended {h.num_appended}")
    if h.answer is not None:
        parts.append(f"connector answered local={h.answer[0]} external={h.answer[1]}")
    if h.first_invalid_block is not None:
        parts.append(f"first failed block index {h.first_invalid_block}")
    if h.stale:
        parts.append("stale output")
    return ", ".join(parts)
