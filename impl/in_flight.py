"""Async scheduling: what the reference scheduler keeps about steps in flight.

Under async scheduling step N+1 is scheduled before step N's output is back.
Two things follow, each kept here:

- **Output placeholders.** A request that samples in a step owns one
  placeholder per token the step will produce until the output arrives, so
  ``num_computed_tokens - num_output_placeholders`` stays the boundary of known
  tokens (#27644). A preemption, or a load failure that cuts the request back,
  makes its output still in flight stale: it owns no placeholders and rolls
  nothing back. It is dropped when it arrives (the request samples those
  positions again) after a load failure or a forced reset, and after a
  preemption when the connector requires KV delivery; otherwise (a best-effort
  cache, a consumer, no connector) it is delivered, and the preempted request
  resumes only once it drained, or it would sample a position that output
  still brings (vLLM's ``drop_stale_output``).
- **Placeholder drafts.** With spec decode the drafter runs on the worker
  after each step, so the scheduler plans the next step with ``-1`` drafts,
  as if every draft in flight were accepted. When the output comes back the
  rejected drafts come off both ``num_computed_tokens`` and the placeholders;
  the worker has already run the next step at positions shifted down by them.
- **Fenced frees.** A block freed while a step in flight may still write it is
  held back until that step's output is processed: a connector's load is not
  ordered with the compute stream, and would be overwritten (vLLM's
  ``defer_block_free``).
"""
from __future__ import annotations

import attrs

from kvspec.spec.arith import (compute_placeholders_after_output,
                               compute_placeholders_after_schedule)

#: a draft the scheduler reserves before the worker has proposed it (vLLM's -1)
DRAFT_PLACEHOLDER = -1


@attrs.define
class InFlightBook:
    #: steps scheduled, and steps whose output was processed
    scheduled_seq: int = 0
    processed_seq: int = 0
    #: request id -> the last step (scheduled_seq) that ran it
    last_step: dict[str, int] = attrs.Factory(dict)
    #: request id -> its steps in flight whose output is stale
    stale: dict[str, int] = attrs.Factory(dict)
    #: requests whose stale output is delivered rather than dropped
    deliver: set[str] = attrs.Factory(set)
    #: (step, blocks) freed under a step in flight, oldest first
    fenced: list[tuple[int, list]] = attrs.Factory(list)
    #: request id -> (step, num_computed_tokens it started from) per step in flight
    starts: dict[str, list[tuple[int, int]]] = attrs.Factory(dict)

    # -- steps ---------------------------------------------------------------
    def on_schedule(self, requests: dict, plan_tokens: dict[str, int],
                    spec_tokens: dict[str, list[int]], num_drafts: int) -> None:
        """Placeholders of the step just scheduled (before ``num_computed_tokens``
        advances); remembers which step last ran each request. A sampling step
        also reserves ``num_drafts`` placeholder drafts (-1) for the next step:
        the worker's drafter proposes them from this step's output, which the
        scheduler has not seen when it schedules the next step."""
        self.scheduled_seq += 1  # one per schedule(), as one output per step comes back
        for rid, n in plan_tokens.items():
            request = requests[rid]
            held = request.num_output_placeholders
            chunk = request.num_computed_tokens + n < request.num_tokens + held
            request.num_output_placeholders = compute_placeholders_after_schedule(
                held, len(spec_tokens.get(rid, ())), chunk)
            request.spec_token_ids = [] if chunk else [DRAFT_PLACEHOLDER] * num_drafts
            self.last_step[rid] = self.scheduled_seq
            self.starts.setdefault(rid, []).append((self.scheduled_seq,
                                                    request.num_computed_tokens))

    def is_in_flight(self, request_id: str) -> bool:
        return self.last_step.get(request_id, 0) > self.processed_seq

    def num_in_flight(self, request_id: str) -> int:
        """Steps in flight that run the request (with more than two in flight,
        not every step between its last one and the oldest need run it)."""
        return sum(step > self.processed_seq for step, _ in self.starts.get(request_id, ()))

    def get_oldest_start(self, request_id: str) -> int | None:
        """Where the oldest step in flight of the request started (None: none
        in flight): what it reads, a failure it reports may still concern."""
        live = [start for step, start in self.starts.get(request_id, ())
                if step > self.processed_seq]
        return min(live) if live else None

    def on_output(self) -> list:
        """A step's output is back: the blocks fenced behind it may go."""
        self.processed_seq += 1
        for rid in list(self.starts):
            self.starts[rid] = [e for e in self.starts[rid] if e[0] > self.processed_seq]
            if not self.starts[rid]:
                del self.starts[rid]
        ready = [blocks for step, blocks in self.fenced if step <= self.processed_seq]
        self.fenced = [(step, blocks) for step, blocks in self.fenced
                       if step > self.processed_seq]
        return ready

    # -- output ----------------------------------------------------------------
    def take_stale(self, request_id: str) -> str | None:
        """None when this output of the request is fresh; else "drop" or
        "deliver" (and one stale step counted drained)."""
        left = self.stale.get(request_id, 0)
        if left <= 0:
            return None
        self.stale[request_id] = left - 1
        return "deliver" if request_id in self.deliver else "drop"

    def has_deliverable_stale(self, request_id: str) -> bool:
        """Stale output still in flight will be delivered: resuming now could
        sample a position it brings."""
        return self.stale.get(request_id, 0) > 0 and request_id in self.deliver

    def make_stale(self, request, drop: bool = True) -> None:
        """Its output in flight is stale: dropped (``drop``) or delivered when it
        arrives. It owns no placeholders, and no placeholder drafts (nothing it
        sampled will be drafted from). A share still dropping stays dropped:
        its positions may have been sampled again already."""
        rid = request.request_id
        undrained_drop = self.stale.get(rid, 0) > 0 and rid not in self.deliver
        self.stale[rid] = self.num_in_flight(rid)
        if drop or undrained_drop:
            self.deliver.discard(rid)
        else:
            self.deliver.add(rid)
        request.num_output_placeholders = 0
        request.spec_token_ids = []

    @staticmethod
    def return_share(request, num_drafts: int, num_sampled: int) -> None:
        request.num_output_placeholders = compute_placeholders_after_output(
            request.num_output_placeholders, num_drafts, num_sampled, False)

    def forget(self, request_id: str) -> None:
        """The request is gone (its blocks freed or fenced already)."""
        self.stale.pop(request_id, None)
        self.deliver.discard(request_id)
        self.last_step.pop(request_id, None)
        self.starts.pop(request_id, None)

    # -- fenced frees -----------------------------------------------------------
    def fence(self, request_id: str, blocks: list, tables=None) -> None:
        """Hold ``blocks`` until the request's step in flight is back.
        ``tables``: for a whole request's free, its block ids per group (a
        failure that step reports is placed by position in them)."""
        if tables is not None:
            blocks = FencedTables(blocks, tables)
        self.fenced.append((self.last_step[request_id], blocks))

    def get_fenced_block_ids(self) -> tuple[int, ...]:
        return tuple(b.block_id for _, blocks in self.fenced for b in blocks)


class FencedTables(list):
    """A fenced request's blocks, with its block ids per group (``tables``)."""

    def __init__(self, blocks, tables) -> None:
        super().__init__(blocks)
        self.tables = tables
