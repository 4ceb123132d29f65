"""Trace-level minimization, run after Hypothesis has shrunk a failure.

Hypothesis shrinks the choices behind a run; it does not know that most actions
of a trace are independent of each other, and a counterexample can come back
with arrivals or fault flags the failure does not need. This pass works on the
trace itself, the way delta debugging does: drop one action, or one argument of
a step, replay, and keep the change when the target still violates one of the
claims the original trace violated. Replays are deterministic, so the result
replays exactly as saved.
"""
from __future__ import annotations

import time

from kvspec.harness.runner import ALL_KINDS, Counterexample, Runner
from kvspec.spec.state import Config

#: step arguments worth trying without, most likely to be noise first
STEP_ARGS = ("drafts", "accept", "eos", "finish_sends", "fail_offset", "fail", "fail_all",
             "finish_loads")


def replay_actions(target: str, config: Config, actions: list[dict],
                   kinds=ALL_KINDS) -> Counterexample | None:
    """Run ``actions`` on a fresh target; the counterexample, or None if all hold."""
    runner = Runner(target, config, kinds)
    try:
        for action in actions:
            runner.apply(action)
    except Counterexample as exc:
        return exc
    return None


def _candidates(actions: list[dict]):
    """Smaller traces: one action less (latest first), then one step argument less."""
    for i in reversed(range(len(actions))):
        if actions[i]["op"] != "drain":
            yield actions[:i] + actions[i + 1:]
    for i, action in enumerate(actions):
        if action["op"] != "step":
            continue
        for key in STEP_ARGS:
            if action.get(key):
                yield actions[:i] + [{k: v for k, v in action.items() if k != key}] + actions[i + 1:]


def minimize(target: str, config: Config, failure: Counterexample, kinds=ALL_KINDS,
             time_limit: float = 20.0) -> Counterexample:
    """The smallest trace reached greedily that still violates one of
    ``failure``'s claims (the original failure if nothing smaller does)."""
    claims = {v.invariant for v in failure.violations}
    best, actions = failure, list(failure.runner.actions)
    deadline = time.monotonic() + time_limit
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for candidate in _candidates(actions):
            if time.monotonic() >= deadline:
                break
            found = replay_actions(target, config, candidate, kinds)
            if found is not None and claims & {v.invariant for v in found.violations}:
                best, actions, improved = found, list(found.runner.actions), True
                break
    return best
