"""Trace-level minimization, run after Hypothesis has shrunk a failure.

Hypothesis shrinks the choices behind a run; it does not know that most actions
of a trace are independent of each other, and a counterexample can come back
with arrivals or fault flags the failure does not need. This pass works on the
trace itself, the way delta debugging does: drop one action or one argument of a
step, or relax the configuration so requests finish in fewer steps; replay; keep
the change when the target still violates one of the claims the original trace
violated and the step table got shorter. Replays are deterministic, so the
result replays exactly as saved.
"""
from __future__ import annotations

import time

import attrs

from kvspec.harness.runner import ALL_KINDS, Counterexample, Runner
from kvspec.harness.trace import check_semantics
from kvspec.spec.state import Config

#: step arguments worth trying without, most likely to be noise first
STEP_ARGS = ("drafts", "accept", "eos", "finish_sends", "fail_blocks", "fail_group",
             "fail_offset", "fail", "fail_all", "finish_loads")
#: step arguments that name requests
REQUEST_ARGS = ("finish_loads", "fail", "eos", "finish_sends")
#: arrival arguments worth trying without
ADD_FLAGS = ("priority", "none", "send", "offload", "async", "ext")


def replay_actions(target: str, config: Config, actions: list[dict],
                   kinds=ALL_KINDS, design_rules: bool = True,
                   kv: str = "symbolic") -> Counterexample | None:
    """Run ``actions`` on a fresh target; the counterexample, or None if all hold."""
    return Runner(target, config, kinds, design_rules, kv=kv).run(actions)


def _candidates(config: Config, actions: list[dict]):
    """Smaller traces: one action less (latest first), one step argument less, a
    simpler arrival, then a configuration that runs requests in fewer steps.
    Runs of actions go first, halves down to pairs (delta debugging's chunks):
    a long trace then loses its noise in a few replays, not one per action."""
    size = len(actions) // 2
    while size >= 2:
        for hi in range(len(actions), 0, -size):
            candidate = _without_run(actions, max(0, hi - size), hi)
            if len(candidate) < len(actions):
                yield config, candidate
        size //= 2
    for i in reversed(range(len(actions))):
        if actions[i]["op"] != "drain":
            yield config, _without(actions, i)
    for i, action in enumerate(actions):
        if action["op"] == "step":
            for candidate in _without_a_step_argument(actions, i):
                yield config, candidate
    for i, action in enumerate(actions):
        if action["op"] == "add":
            for simpler in _add_simplifications(action):
                yield config, actions[:i] + [simpler] + actions[i + 1:]
    for changes in _config_simplifications(config):
        yield attrs.evolve(config, **changes), actions


def _without_run(actions: list[dict], lo: int, hi: int) -> list[dict]:
    """``actions`` less those from ``lo`` to ``hi`` but the drains (each as
    ``_without`` drops it, the latest first)."""
    for i in reversed(range(lo, hi)):
        if actions[i]["op"] != "drain":
            actions = _without(actions, i)
    return actions


def _without(actions: list[dict], i: int) -> list[dict]:
    """``actions`` less the ``i``-th; an arrival's request also leaves the later
    steps' arguments and aborts that name it (a trace naming a request never
    added is malformed)."""
    if actions[i]["op"] != "add":
        return actions[:i] + actions[i + 1:]
    rid = actions[i]["id"]
    rest = []
    for action in actions[i + 1:]:
        if action["op"] == "abort" and action["id"] == rid:
            continue
        if action["op"] == "step":
            action = {k: ([r for r in v if r != rid] if k in REQUEST_ARGS else v)
                      for k, v in action.items()}
        rest.append(action)
    return actions[:i] + rest


def _add_simplifications(action: dict):
    """An arrival with a flag less, one prompt token less, or a single output."""
    for key in ADD_FLAGS:
        if action.get(key):
            yield {k: v for k, v in action.items() if k != key}
    prompt = action["prompt"]
    if len(prompt) > 1:
        yield {**action, "prompt": prompt[:-1], "ext": min(action.get("ext", 0), len(prompt) - 1)}
    if action.get("max_tokens", 1) > 1:
        yield {**action, "max_tokens": 1}


#: the most requests a relaxed configuration runs at once (the machine draws 1 to 4)
MAX_SEQS = 4


def _config_simplifications(config: Config):
    """No long-prefill cap, FCFS, a larger token budget, more requests at once:
    each makes requests finish in fewer steps, so the healed phase's step table
    gets shorter. Then one KV cache group less (the last), if that still fails."""
    if config.long_prefill_token_threshold:
        yield {"long_prefill_token_threshold": 0}
    if config.policy != "fcfs":
        yield {"policy": "fcfs"}
    if config.max_num_batched_tokens < 2 * config.max_model_len:
        yield {"max_num_batched_tokens": 2 * config.max_model_len}
    if config.max_num_seqs < MAX_SEQS:
        yield {"max_num_seqs": MAX_SEQS}
    if len(config.groups) > 2:
        yield {"groups": config.groups[:-1]}


def _size(failure: Counterexample) -> tuple[int, int]:
    return len(failure.runner.log), len(failure.runner.actions)


def _without_a_step_argument(actions: list[dict], i: int):
    """``actions`` with one argument of step ``i`` less, each in turn."""
    action = actions[i]
    for key in STEP_ARGS:
        if action.get(key):
            less = {k: v for k, v in action.items() if k != key}
            yield actions[:i] + [less] + actions[i + 1:]


def _argument_candidates(actions: list[dict]):
    """One step argument less, or one request less in a step argument naming
    several: a last sweep, once nothing shortens the trace, drops what changes
    nothing (``finish_sends`` of a request with no send) though the step table
    stays as long."""
    for i, action in enumerate(actions):
        if action["op"] != "step":
            continue
        yield from _without_a_step_argument(actions, i)
        for key in REQUEST_ARGS:
            named = action.get(key) or ()
            for rid in named if len(named) > 1 else ():
                less = {**action, key: [r for r in named if r != rid]}
                yield actions[:i] + [less] + actions[i + 1:]


def minimize(target: str, failure: Counterexample, kinds=ALL_KINDS,
             time_limit: float = 20.0, design_rules: bool = True,
             still_new=None) -> Counterexample:
    """The smallest trace reached greedily that still violates one of
    ``failure``'s claims (the original failure if nothing smaller does);
    ``still_new``, if given, must hold of it too (a smaller trace that a known
    finding explains is not kept: the new bug must stay in it)."""
    claims = {v.invariant for v in failure.violations}
    best = failure
    deadline = time.monotonic() + time_limit
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cfg, candidate in _candidates(best.runner.config, list(best.runner.actions)):
            if time.monotonic() >= deadline:
                break
            if check_semantics(cfg, candidate) is not None:
                continue  # e.g. a step still naming a request whose arrival was dropped
            try:
                found = replay_actions(target, cfg, candidate, kinds, design_rules,
                                       kv=failure.runner.kv)
            except (ValueError, TypeError):  # a configuration the target refuses
                continue
            if _still_fails(found, claims, still_new) and _size(found) < _size(best):
                best, improved = found, True
                break
    return _drop_idle_arguments(target, best, claims, kinds, design_rules, deadline, still_new)


def _drop_idle_arguments(target, best, claims, kinds, design_rules, deadline, still_new):
    """The last sweep (``_argument_candidates``): each argument tried once,
    in order, from the trace as it stands; kept when the same claims still
    break and the trace is no longer."""
    i = 0
    while time.monotonic() < deadline:
        candidates = list(_argument_candidates(list(best.runner.actions)))
        if i >= len(candidates):
            return best
        found = replay_actions(target, best.runner.config, candidates[i], kinds, design_rules,
                               kv=best.runner.kv)
        if _still_fails(found, claims, still_new) and _size(found) <= _size(best):
            best = found  # the same position now holds the next argument
        else:
            i += 1
    return best


def _still_fails(found, claims: set[str], still_new) -> bool:
    """A smaller trace keeps the failure: one of the original's claims breaks,
    and (``still_new``) no known finding explains it."""
    return (found is not None and bool(claims & {v.invariant for v in found.violations})
            and (still_new is None or still_new(found)))
