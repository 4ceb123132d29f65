"""Deterministic replay of a saved trace against any target."""
from __future__ import annotations

from pathlib import Path

import attrs

from kvspec.harness.runner import Runner
from kvspec.harness.targets import UnknownTarget
from kvspec.harness.trace import TraceError, load_trace, short
from kvspec.text import clip, shown


@attrs.define
class ReplayOutcome:
    target: str
    actions_run: list
    violations: list
    steps: list
    same_as_recorded: bool


def replay_trace(path: Path, target: str | None = None) -> ReplayOutcome:
    data = load_trace(path)
    name = target or data.get("target", "impl")
    try:
        runner = Runner(name, data["config"])
    except UnknownTarget as exc:
        raise TraceError(str(exc)) from None
    except (ValueError, TypeError, RuntimeError) as exc:
        # the target refuses the configuration (vLLM's own checks), or cannot be
        # built at all (vLLM not installed): the trace's problem, not a finding
        raise TraceError(f"{shown(path)}: target {name!r} cannot run this trace: "
                         f"{clip(str(exc), 200)}") from None
    try:
        failure = runner.run(data["actions"])
    except (KeyError, TypeError, ValueError) as exc:  # apply() records the action first
        raise TraceError(f"{shown(path)}: malformed action {short(runner.actions[-1])}: "
                         f"{clip(str(exc), 200)}") from None
    violations = failure.violations if failure else []
    recorded = [(v["invariant"], v["message"]) for v in data.get("verdict", [])]
    got = [(v.invariant, v.message) for v in violations]
    return ReplayOutcome(name, runner.actions, violations, runner.log, recorded == got)
