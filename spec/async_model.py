"""The async scheduling model of one request: vLLM's AsyncScheduler with a batch
queue of depth 2, at most two steps in flight, each scheduling everything the
request may compute so that it samples, or a prefill chunk that samples nothing.

Its rules (``AsyncRules``) come from ``spec/arith.py`` and each historical
variant replaces one; what they must achieve is stated apart, in the lemmas of
``spec/prove.py``: the placeholders are the shares (1 + drafts) of the sampling
steps in flight whose output is not stale, and the real boundary stays within
the known tokens. Each ``process_*`` function is one event (guard, the request
after it, the boundary it exposes, whether the step samples); a scenario is a
string of events. Written with the ``logic`` helpers: it plays on Z3 terms and
on plain ints alike.
"""
from __future__ import annotations

from typing import Callable

import attrs

from kvspec.spec import arith
from kvspec.spec.logic import And, Not


def compute_preempted(num_computed, num_placeholders):
    """vLLM's ``process_preempt`` under async scheduling: the request starts
    over (as ``effects.act_preempt``) and its placeholders are zeroed, which makes
    the output of every step in flight stale (#48245)."""
    return 0, 0


def compute_scheduled_boundary(num_computed, placeholders_before, placeholders_after):
    """The real boundary a scheduled step exposes (to a connector's store): read
    once the step's own placeholders are counted (#27644)."""
    return arith.compute_real_computed(num_computed, placeholders_after)


@attrs.frozen
class AsyncRules:
    """The rules of async scheduling the placeholder lemmas speak about; each
    historical variant replaces one of them."""

    new_tokens: Callable = arith.compute_running_new_tokens
    schedule: Callable = arith.compute_placeholders_after_schedule
    output: Callable = arith.compute_placeholders_after_output
    preempt: Callable = compute_preempted
    boundary: Callable = compute_scheduled_boundary


ASYNC_RULES = AsyncRules()


@attrs.frozen
class InFlight:
    """A scheduled step whose output has not arrived."""

    num_drafts: object
    num_sampled: object    # what its output will append: the accepted drafts and one token
    is_stale: bool = False  # a preemption came after it was scheduled
    is_chunk: bool = False  # a prefill chunk: it samples nothing and owns no share


@attrs.frozen
class AsyncRequest:
    num_tokens: object
    num_computed: object
    num_placeholders: object
    in_flight: tuple[InFlight, ...] = ()  # oldest first


#: event sequences (every prefix is a case): S schedules a step, C a prefill chunk
#: (part of the prompt, sampling nothing), D delivers the oldest step's output, P
#: preempts, R resumes a preempted request once its stale output drained (vLLM
#: 0.32 does not resume it before)
ASYNC_SCENARIOS = ("SSDD", "SSDSDD", "SPD", "SSPDD", "SSDPD", "SSPDDRSD", "CSDD", "CCDSD",
                   "CPD")

#: what follows an event: (guard, request after, boundary it exposes, whether the step samples)
AsyncEvent = tuple[object, AsyncRequest, object, object]


def process_schedule_step(rules: AsyncRules, r: AsyncRequest, step: InFlight) -> AsyncEvent:
    """Schedule everything the request may compute; vLLM's ``is_prefill_chunk``
    decides whether it samples, which every step of these scenarios must."""
    num_new = rules.new_tokens(r.num_tokens, step.num_drafts, r.num_placeholders,
                               r.num_computed)
    computed = r.num_computed + num_new
    is_chunk = computed < r.num_tokens + r.num_placeholders
    placeholders = rules.schedule(r.num_placeholders, step.num_drafts, is_chunk)
    after = AsyncRequest(r.num_tokens, computed, placeholders, r.in_flight + (step,))
    return (num_new >= 1, after, rules.boundary(computed, r.num_placeholders, placeholders),
            Not(is_chunk))


def process_schedule_chunk(rules: AsyncRules, r: AsyncRequest, num_new) -> AsyncEvent:
    """Schedule ``num_new`` prompt tokens that stop short of the end: a prefill
    chunk, which samples nothing (its placeholders, by ``rules.schedule``, must
    not grow; it is not asked to sample)."""
    computed = r.num_computed + num_new
    placeholders = rules.schedule(r.num_placeholders, 0, True)
    chunk = InFlight(0, 0, is_chunk=True)
    after = AsyncRequest(r.num_tokens, computed, placeholders, r.in_flight + (chunk,))
    # (the scenarios schedule chunks before any sampling step: a request in prefill)
    guard = And(num_new >= 1, computed < r.num_tokens)
    return (guard, after, rules.boundary(computed, r.num_placeholders, placeholders), True)


def process_deliver_oldest(rules: AsyncRules, r: AsyncRequest) -> AsyncEvent:
    """The oldest step's output arrives: its tokens are appended (stale ones too,
    as vLLM 0.32 delivers them), and fresh output rolls back its rejected drafts.
    A chunk's output appends nothing and gives nothing back."""
    if r.in_flight[0].is_chunk:
        after = attrs.evolve(r, in_flight=r.in_flight[1:])
        return True, after, arith.compute_real_computed(r.num_computed, r.num_placeholders), True
    step, accepted = r.in_flight[0], r.in_flight[0].num_sampled - 1
    computed = (r.num_computed if step.is_stale else
                arith.compute_computed_after_rejection(r.num_computed, step.num_drafts, accepted))
    placeholders = rules.output(r.num_placeholders, step.num_drafts, step.num_sampled,
                                step.is_stale)
    after = AsyncRequest(r.num_tokens + step.num_sampled, computed, placeholders, r.in_flight[1:])
    return True, after, arith.compute_real_computed(computed, placeholders), True


def process_preempt(rules: AsyncRules, r: AsyncRequest) -> AsyncEvent:
    computed, placeholders = rules.preempt(r.num_computed, r.num_placeholders)
    stale = tuple(attrs.evolve(step, is_stale=True) for step in r.in_flight)
    after = AsyncRequest(r.num_tokens, computed, placeholders, stale)
    return True, after, arith.compute_real_computed(computed, placeholders), True


def process_resume(r: AsyncRequest, num_hits) -> AsyncEvent:
    """A preempted request, its stale output drained, starts from its prefix-cache
    hits (all but the last token at most)."""
    guard = And(not r.in_flight, num_hits <= r.num_tokens - 1)
    after = attrs.evolve(r, num_computed=num_hits)
    return guard, after, arith.compute_real_computed(num_hits, r.num_placeholders), True


def get_shares(r: AsyncRequest):
    """The independent description: what the steps in flight will sample and give
    back, less the steps whose output is stale."""
    return sum((1 + step.num_drafts for step in r.in_flight
                if not step.is_stale and not step.is_chunk), 0)


def get_scenario_prefixes() -> list[str]:
    return sorted({events[:i] for events in ASYNC_SCENARIOS for i in range(1, len(events) + 1)},
                  key=lambda events: (len(events), events))


def play_scenario(rules: AsyncRules, r: AsyncRequest, steps, hits, events: str) -> tuple:
    """Play ``events`` on ``r``: every event's guard, and what follows the last."""
    guards, steps = [], iter(steps)
    hits, chunks = hits
    chunks = iter(chunks)
    for event in events:
        if event == "S":
            guard, r, boundary, samples = process_schedule_step(rules, r, next(steps))
        elif event == "C":
            guard, r, boundary, samples = process_schedule_chunk(rules, r, next(chunks))
        elif event == "D":
            guard, r, boundary, samples = process_deliver_oldest(rules, r)
        elif event == "P":
            guard, r, boundary, samples = process_preempt(rules, r)
        else:
            guard, r, boundary, samples = process_resume(r, hits)
        guards.append(guard)
    return And(*guards), r, boundary, samples
