"""The expected history: what the observed state alone does not show (stats as
first recorded, loads in flight at an abort, the tokens the worker sampled, the
placeholders steps in flight own), and the events that write it.

The runner calls a ``process_*`` function as each event happens; these are the
only writers of the ``Ghost``, and the claims only read it (tests/test_claims_pure.py,
tests/test_history.py). Each says what it records and why a claim needs it.
"""
from __future__ import annotations

import attrs

from kvspec.spec.predicates import is_admissible_lowering
from kvspec.spec.registry import Memo
from kvspec.spec.scope import ChangeLog
from kvspec.spec.state import Observation, RequestStatus


@attrs.define
class Ghost:
    """History the state alone does not show."""

    #: stats as first recorded, lowered only by failure recovery
    stats: dict[str, tuple[int, int]] = attrs.Factory(dict)
    #: requests a load failure was reported for (recovery may lower their stats)
    recovered: set[str] = attrs.Factory(set)
    #: requests that finished while their async load was in flight: they may hold
    #: their blocks until the worker reports the load (finished_recving)
    finished_mid_load: set[str] = attrs.Factory(set)
    #: requests live when the healed phase began
    draining: set[str] = attrs.Factory(set)
    #: requests whose async load finished and that have not run since
    just_loaded: set[str] = attrs.Factory(set)
    #: the connector's answer (num_local, num_external) when the stats were set
    first_hits: dict[str, tuple[int, int]] = attrs.Factory(dict)
    #: async scheduling: per request, the placeholders its steps in flight own
    #: (the shares, 1 + drafts, of its sampling steps whose output is not stale),
    #: kept by the harness from the scheduler outputs and the worker's reports
    placeholders: dict[str, int] = attrs.Factory(dict)
    #: per request, position -> the tokens the worker sampled there (a position
    #: is sampled again after a preemption)
    sampled_at: dict[str, dict[int, set[int]]] = attrs.Factory(dict)
    #: the requests whose entries above each event changed, in order: an
    #: incremental check judges them again (``spec/scope.py``)
    touched: ChangeLog = attrs.field(factory=ChangeLog, eq=False, repr=False)
    #: per request, the output tokens ``output_is_the_sampled_sequence`` found
    #: sampled where they stand (what the worker sampled is only ever added
    #: to, so they stay so while the output starts with them): a cache
    checked_outputs: dict = attrs.field(factory=Memo, eq=False, repr=False)


def process_observation(ghost: Ghost, obs: Observation, answers: dict,
                        lowered_ok=frozenset()) -> None:
    """A state the scheduler reached: stats are recorded the first time a
    request has them (with the connector's answer then), lowered only where a
    load failure was reported (``lowered_ok``) and admissibly; requests that
    left are forgotten."""
    for r in obs.requests.values():
        now = (r.num_cached_tokens, r.num_external_computed_tokens)
        first = ghost.stats.get(r.request_id)
        if first is None and r.has_stats:
            ghost.stats[r.request_id] = now
            ghost.touched.add(r.request_id)
            if r.request_id in answers:
                ghost.first_hits[r.request_id] = answers[r.request_id]
        elif (first is not None and r.request_id in lowered_ok and r.has_stats
              and is_admissible_lowering(first[0], first[1], now[0], now[1])):
            ghost.stats[r.request_id] = now  # recovery may lower them
            ghost.touched.add(r.request_id)
    ghost.touched.extend(lowered_ok - ghost.recovered)
    ghost.recovered |= lowered_ok
    if ghost.just_loaded:
        left = {rid for rid in ghost.just_loaded if rid in obs.requests
                and obs.requests[rid].status != RequestStatus.RUNNING}
        ghost.touched.extend(ghost.just_loaded - left)
        ghost.just_loaded = left
    for rid in [rid for rid in ghost.stats if rid not in obs.requests]:
        del ghost.stats[rid]
        ghost.first_hits.pop(rid, None)
        ghost.touched.add(rid)


def process_loads_finished(ghost: Ghost, loaded_ok) -> None:
    """Async loads the worker finished writing: those requests have not run since."""
    ghost.touched.extend(set(loaded_ok) - ghost.just_loaded)
    ghost.just_loaded |= set(loaded_ok)


def process_abort(ghost: Ghost, was) -> None:
    """An abort of ``was`` (its view before): one waiting for its load may hold
    its blocks until the worker reports the load."""
    if was is not None and was.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        ghost.finished_mid_load.add(was.request_id)
        ghost.touched.add(was.request_id)


def process_output_applied(ghost: Ghost, before: Observation, after: Observation,
                           finished_recving) -> None:
    """A step's output applied: a request that ended while its load was in
    flight (an abort, or the "fail" policy) may hold its blocks until the
    worker reports the load."""
    now = {rid for rid, r in after.requests.items() if r.status.is_finished
           and rid not in finished_recving and (
               rid in ghost.finished_mid_load
               or (rid in before.requests
                   and before.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS))}
    ghost.touched.extend(now ^ ghost.finished_mid_load)
    ghost.finished_mid_load = now


def process_sampled(ghost: Ghost, request_id: str, position: int, tokens) -> None:
    """The worker sampled ``tokens`` from ``position`` on (again, after a preemption)."""
    ghost.touched.add(request_id)
    at = ghost.sampled_at.setdefault(request_id, {})
    for k, token in enumerate(tokens):
        at.setdefault(position + k, set()).add(token)


def process_placeholders(ghost: Ghost, owned: dict[str, int]) -> None:
    """What the steps in flight now own, per request (the harness counts the
    shares of its sampling steps whose output is not stale)."""
    ghost.touched.extend(rid for rid, n in owned.items() if ghost.placeholders.get(rid) != n)
    ghost.placeholders.update(owned)


def process_departed(ghost: Ghost, obs: Observation) -> None:
    """Requests that finished or left own no placeholders."""
    for rid in [rid for rid in ghost.placeholders if rid not in obs.requests
                or obs.requests[rid].status.is_finished]:
        del ghost.placeholders[rid]
        ghost.touched.add(rid)


def process_drain(ghost: Ghost, obs: Observation) -> None:
    """The healed phase begins: every request live now must finish."""
    ghost.draining = {r.request_id for r in obs.requests.values() if not r.status.is_finished}
