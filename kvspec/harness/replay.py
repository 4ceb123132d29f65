"""Deterministic replay of a saved trace against any target."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

import attrs

from kvspec.harness.heartbeat import periodic
from kvspec.harness.runner import KV_CLAIM, Runner
from kvspec.harness.targets import UnknownTarget
from kvspec.harness.trace import TraceError, load_trace, short
from kvspec.spec.catalogue import REGISTRY
from kvspec.text import clip, shown


#: what the runner reports besides the registry's claims
RUN_OUTCOMES = ("target_crashed", "kvspec_crashed", "environment_contract", "connector_answer",
                KV_CLAIM)


@attrs.define
class ReplayOutcome:
    target: str
    actions_run: list
    violations: list
    steps: list
    same_as_recorded: bool
    #: the trace's verdict as (claim, message) pairs; None when it records none
    recorded: list | None = None
    #: names in the recorded verdict that are no claim of this kvspec
    unknown_claims: list = attrs.Factory(list)
    #: the configuration the trace ran under
    config: object = None


@attrs.frozen
class ReplayProgress:
    """How far a replay is, for a heartbeat."""

    elapsed: float
    actions_done: int     # the action running now included
    actions_total: int
    steps: int            # scheduler steps so far (a drain takes many)


def replay_trace(path: Path, target: str | None = None,
                 heartbeat: Callable[[ReplayProgress], None] | None = None,
                 heartbeat_every: float = 10.0, ignore=frozenset(),
                 on_start: Callable[[Runner], None] | None = None) -> ReplayOutcome:
    """Replay the trace at ``path`` on its own target or on ``target``;
    ``heartbeat``, if given, is called every ``heartbeat_every`` seconds from a
    background thread while the replay runs. ``ignore``: claims left unchecked,
    to see what a known violation leads to (a finding's "harm" continuation,
    whose recorded verdict the outcome is then compared with). ``on_start``, if
    given, sees the runner before the first action (``kvspec export-test``
    records the calls into the target through it)."""
    start = time.monotonic()
    data = load_trace(path)
    name = target or data.get("target", "impl")
    try:
        runner = Runner(name, data["config"], ignore=ignore, kv=data.get("kv", "symbolic"))
    except UnknownTarget as exc:
        raise TraceError(str(exc)) from None
    except (ValueError, TypeError, RuntimeError, ImportError) as exc:
        # the target refuses the configuration (vLLM's own checks), or cannot be
        # built at all (vLLM not installed): the trace's problem, not a finding
        raise TraceError(f"{shown(path)}: target {name!r} cannot run this trace: "
                         f"{clip(str(exc), 200)}") from None
    if on_start is not None:
        on_start(runner)
    total = len(data["actions"])
    beat = heartbeat and (lambda: heartbeat(ReplayProgress(
        time.monotonic() - start, len(runner.actions), total, len(runner.log))))
    stop = periodic(beat, heartbeat_every)
    try:
        failure = runner.run(data["actions"])
    except (KeyError, TypeError, ValueError) as exc:  # apply() records the action first
        raise TraceError(f"{shown(path)}: malformed action {short(runner.actions[-1])}: "
                         f"{clip(str(exc), 200)}") from None
    finally:
        stop.set()
    # a trace of lost performance ends where an efficiency claim first broke
    violations = failure.violations if failure else (runner.lost[0].violations
                                                     if runner.lost else [])
    # with exactly the claims its harm section ignores, a trace is judged by that section
    verdict = (data["harm"]["verdict"] if ignore and "harm" in data
               and set(data["harm"]["ignoring"]) == set(ignore) else data.get("verdict", []))
    recorded = [(v["invariant"], v["message"]) for v in verdict]
    got = [(v.invariant, v.message) for v in violations]
    unknown = sorted({claim for claim, _ in recorded} - set(REGISTRY) - set(RUN_OUTCOMES))
    same = get_comparable(recorded) == get_comparable(got)
    return ReplayOutcome(name, runner.actions, violations, runner.log, same,
                         recorded if "verdict" in data else None, unknown, data["config"])


def get_comparable(verdict: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A verdict with the line numbers of source files its messages name left
    out: the same assert a release moved (scheduler.py:1170 in 0.32.0, :1347
    in 0.33.0) is the same verdict."""
    return [(claim, re.sub(r"(\.py):\d+", r"\1", message)) for claim, message in verdict]
