"""What an observed step fixes about each request for the conformance model
(``spec/conformance.py``'s ``Hints``), and which blocks a step's failed loads
tainted. Pure functions of observations the runner hands in."""
from __future__ import annotations

from kvspec.spec.conformance import Hints, get_model_block_size, get_num_blocks
from kvspec.spec.groups import NULL_BLOCK, compute_tainted_blocks
from kvspec.spec.state import Observation, StepView, WorkerOutcome


def get_tainted_blocks(obs: Observation, report, scheduled: Observation | None,
                       steps_since: list[StepView]) -> set[int]:
    """Blocks the step's failed loads left invalid; with several kinds of group
    the blocks a reader of invalid KV wrote its garbage into, and everything the
    spec counts as failed with them (``compute_tainted_blocks``: a request can
    read another group's block computed on top of a failed one without holding
    the failed block). Not a holder's blocks before its first failed one: the
    hits it only read stay valid for every other holder. ``scheduled``: the
    observation right after the step was scheduled; a request in it that is
    gone since computed on the failed KV all the same, so every block of it
    still fenced behind the step counts, by position (a hit may have shared
    one since; a block given back is fresh to whoever took it).
    ``steps_since``: the step and those after it still in flight; only a
    gone request one of them scheduled computed on the failed KV. One that
    did not (a loader that never ran) gave its blocks back unfenced, and
    another request may have taken one, computed it afresh and had it fenced
    since: the same id, not the same content."""
    bad = set(report.invalid_block_ids)
    if bad and obs.config.is_hybrid:
        groups = obs.config.groups
        holders = [(r.block_ids, r.num_computed_tokens - r.num_output_placeholders)
                   for r in obs.requests.values()]
        fenced = set(obs.pool.fenced)
        ran = {rid for step in steps_since for rid in step.num_scheduled_tokens}
        gone = [tuple(tuple(b if b in fenced else NULL_BLOCK for b in t) for t in r.block_ids)
                for rid, r in (scheduled.requests if scheduled else {}).items()
                if rid not in obs.requests and rid in ran]
        holders += [(tables, max((len(t) * g.block_size for g, t in zip(groups, tables)),
                                 default=0)) for tables in gone]
        bad = compute_tainted_blocks(holders, groups, bad | report.garbage_blocks)
    return bad


def get_invalid_holders(obs: Observation, bad: set[int]) -> set[str]:
    """Requests holding a tainted block (``bad``: ``get_tainted_blocks``)."""
    if not bad:  # (most steps: no load failed)
        return set()
    return {r.request_id for r in obs.requests.values()
            if any(not bad.isdisjoint(table) for table in r.block_ids)}


def get_first_invalid_block(old, tables, bad, groups) -> int | None:
    """The first failed block in any group, in the model's blocks
    (``get_model_block_size``): with several groups the recovery rule is
    stated at the earliest one (spec/groups.py). A request that had ended
    (held for a send) recovers nothing: the taint may reach its blocks, its
    count stays as it was."""
    if old.status.is_finished or not bad:
        return None
    first = min((i * g.block_size for g, t in zip(groups, tables) for i, b in enumerate(t)
                 if b in bad), default=None)
    return None if first is None else first // get_model_block_size(groups)


def compute_hints(before: Observation, mid: Observation, ended: dict, step: StepView,
                  outcome: WorkerOutcome, answers_before: dict, asked: list,
                  tainted=frozenset(), stale=frozenset(), later=()) -> dict[str, Hints]:
    """Per request, what the step fixes; ``ended``: every request after the
    step, departed ones as they ended; ``later``: the steps still in flight
    after it, oldest first (their ``InFlight`` jobs)."""
    answers = {rid: (local, external) for rid, local, external in asked}
    hints = {}
    for rid, new in ended.items():
        old, was = before.requests.get(rid), mid.requests.get(rid)
        if old is None:
            continue
        tables = was.block_ids if was is not None else ()
        hints[rid] = Hints(
            num_new=step.num_scheduled_tokens.get(rid, 0),
            num_drafts=len(step.scheduled_spec_decode_tokens.get(rid, ())),
            num_appended=len(new.output_token_ids) - len(old.output_token_ids),
            answer=answers.get(rid), load_answer=answers_before.get(rid),
            first_invalid_block=get_first_invalid_block(
                old, tables, tainted or outcome.invalid_block_ids, mid.config.groups),
            # (a preemption since the step started it over: that start is gone)
            start=None if rid in stale else step.num_computed_before.get(rid),
            scheduled_stats=None if was is None else (was.num_cached_tokens,
                                                      was.num_external_computed_tokens),
            scheduled_blocks=0 if was is None else get_num_blocks(was, mid.config.groups),
            stale=rid in stale,
            rewritten_from=get_rewritten_from(rid, later) if rid in stale else None)
    return hints


def get_rewritten_from(rid: str, later) -> int | None:
    """Where the first of the ``later`` steps in flight that still counts for
    ``rid`` (its output not stale) started it: that step writes its positions
    from there on after every earlier step's loads landed, failed or not."""
    return next((job.step.num_computed_before[rid] for job in later
                 if rid in job.step.num_computed_before and rid not in job.stale), None)
