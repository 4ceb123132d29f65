"""Steps scheduled and executed whose output the scheduler has not seen:
``EngineCore.step_with_batch_queue``'s batch queue. Synchronous scheduling is
the same queue of depth 1, its one step delivered at once.

The queue keeps the placeholder ghost (``placeholders_match_in_flight``) by
its own count of each step's shares, apart from ``spec/arith.py``'s rules,
which the reference's bookkeeping (``impl/in_flight.py``) uses."""
from __future__ import annotations

import attrs

from kvspec.harness.env import draft_token
from kvspec.spec import history
from kvspec.spec.arith import compute_num_rejected
from kvspec.spec.history import Ghost
from kvspec.spec.state import Observation, StepView


@attrs.define
class InFlight:
    """One step in the queue."""

    step: StepView
    #: the state right before and right after it was scheduled
    before: Observation
    mid: Observation
    report: object  # kvspec.spec.oracle.ExecReport
    sampled: dict[str, tuple[int, ...]]
    #: requests preempted after this step was scheduled: their output is stale
    stale: set[str] = attrs.Factory(set)
    #: per request that samples in this step, the tokens it will sample if every
    #: draft is accepted (1 + drafts): the placeholders it owns until delivered
    shares: dict[str, int] = attrs.Factory(dict)
    #: the connector's answers before it was scheduled, and those its schedule got
    answers_before: dict = attrs.Factory(dict)
    asked: list = attrs.Factory(list)


def get_num_rejected(job: InFlight, rid: str) -> int:
    """Drafts of the request that this step's output rejects (0 if it samples nothing)."""
    drafts = len(job.step.scheduled_spec_decode_tokens.get(rid, ()))
    if not drafts or rid not in job.sampled:
        return 0
    return compute_num_rejected(drafts, len(job.sampled[rid]))


def is_cut(rid: str, job: InFlight, before: Observation, after: Observation) -> bool:
    """Its computed count fell at this delivery by more than its rejected drafts."""
    was, now = before.requests.get(rid), after.requests.get(rid)
    if was is None or now is None:
        return False
    return now.num_computed_tokens < was.num_computed_tokens - get_num_rejected(job, rid)


@attrs.define
class BatchQueue:
    depth: int
    ghost: Ghost
    jobs: list[InFlight] = attrs.Factory(list)

    def __len__(self) -> int:
        return len(self.jobs)

    def push(self, job: InFlight) -> None:
        self.jobs.append(job)

    def pop_oldest(self) -> InFlight:
        return self.jobs.pop(0)

    def get_pending_tokens(self) -> dict[str, tuple[int, ...]]:
        """Tokens sampled by steps in flight that the scheduler has not seen: the
        worker feeds them to the next step (stale output excluded)."""
        pending: dict[str, tuple[int, ...]] = {}
        for job in self.jobs:
            for rid, tokens in job.sampled.items():
                if rid not in job.stale:
                    pending[rid] = pending.get(rid, ()) + tokens
        return pending

    def get_in_flight_ids(self) -> set[str]:
        """Requests with output still in flight that is not stale."""
        return {rid for job in self.jobs for rid in job.step.num_scheduled_tokens
                if rid not in job.stale}

    def get_rejected(self, rid: str) -> int:
        """Drafts of its steps in flight (output not stale) that their output rejects."""
        return sum(get_num_rejected(job, rid) for job in self.jobs if rid not in job.stale)

    def get_shares(self, rid: str) -> int:
        """What the steps in flight will sample for ``rid``, stale output aside."""
        return sum(job.shares.get(rid, 0) for job in self.jobs if rid not in job.stale)

    def get_worker_view(self, step: StepView, a: dict, obs: Observation,
                        pending: dict) -> StepView:
        """The step as the worker runs it. The scheduler planned it as if every
        draft of the step in flight were accepted; the worker has that step's
        output, so it runs each request from its real boundary, shifted down by
        the drafts rejected there, and fills the placeholder drafts (-1) with
        its drafter's proposals: ``drafts`` of them (the rest stay -1, as vLLM
        pads drafts a grammar rejects), each guessed for its real position."""
        starts, drafts = dict(step.num_computed_before), dict(step.scheduled_spec_decode_tokens)
        for rid in step.num_scheduled_tokens:
            starts[rid] -= self.get_rejected(rid)
            if drafts.get(rid):
                first = obs.requests[rid].num_tokens + len(pending.get(rid, ()))
                drafts[rid] = tuple(draft_token(rid, first + k, k) if k < a.get("drafts", 0)
                                    and token < 0 else token
                                    for k, token in enumerate(drafts[rid]))
        return attrs.evolve(step, num_computed_before=starts,
                            scheduled_spec_decode_tokens=drafts)

    # -- the placeholder ghost ----------------------------------------------------
    def process_scheduled(self, step: StepView, mid: Observation) -> dict[str, int]:
        """A preempted request's output in flight turns stale and owns none; a
        step that schedules a request up to its last known token (and the
        placeholder positions) samples, and owns a share of 1 + its drafts."""
        self.drop_output(step.preempted_req_ids)
        shares, owned = {}, {}
        for rid, n in step.num_scheduled_tokens.items():
            held = self.get_shares(rid)
            if step.num_computed_before[rid] + n >= mid.requests[rid].num_tokens + held:
                shares[rid] = 1 + len(step.scheduled_spec_decode_tokens.get(rid, ()))
            owned[rid] = held + shares.get(rid, 0)
        history.process_placeholders(self.ghost, owned)
        return shares

    def drop_output(self, request_ids) -> None:
        """Their output still in flight is stale (a preemption, or a recovery cut
        back under it): it is dropped, and they own no placeholders."""
        history.process_placeholders(self.ghost, {rid: 0 for rid in request_ids})
        for rid in request_ids:
            for job in self.jobs:
                if rid in job.step.num_scheduled_tokens:
                    job.stale.add(rid)

    def process_delivered(self, job: InFlight, before: Observation,
                          after: Observation) -> None:
        """A step's output returns its share. A running request that read KV a
        load failure invalidated, or that recovery cut back (which blocks of a
        holder of a failed block count is the scheduler's choice), has its
        output of this step and of every later step in flight computed on top
        of the failure: it is discarded, so it owns no placeholders."""
        history.process_placeholders(self.ghost, {
            rid: self.get_shares(rid) for rid in job.sampled
            if rid not in job.stale and rid in self.ghost.placeholders})
        readers = set(job.report.garbage_readers) - job.stale
        cut = {rid for rid in before.running if rid in readers or is_cut(rid, job, before, after)}
        self.drop_output(cut)
