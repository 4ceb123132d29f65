"""What a run leaves behind: its step log, its counterexamples and the
snapshot a trace is saved from. Shared by the runner, the fuzzer and replay."""
from __future__ import annotations

import attrs

from kvspec.spec.registry import REGISTRY, Violation
from kvspec.spec.state import Config


class Counterexample(Exception):
    def __init__(self, violations: list[Violation], runner) -> None:
        super().__init__("; ".join(map(str, violations)))
        self.violations = violations
        #: the runner that found it, or the ``RunSnapshot`` of a lost-performance break
        self.runner = runner

    def __reduce__(self):
        # copied and pickled whole (a runner keeps its lost-performance breaks,
        # and bounded model checking copies runners); Exception's own rebuilds
        # from the message alone
        return Counterexample, (self.violations, self.runner)


@attrs.frozen
class RunSnapshot:
    """A run as it stood at one action: what a trace is saved from."""

    config: Config
    actions: list
    log: list
    kv: str


@attrs.frozen
class StepRecord:
    index: int
    #: the action's line (``describe_action``), or a copy of the action it is
    #: written from when first read (an add's line spells its whole prompt)
    _action: object = attrs.field(alias="action", eq=False)
    #: the requests after the action: their line (``describe_request``), or
    #: the views it is written from when first read (most lines never are)
    _requests: object = attrs.field(alias="requests", eq=False, repr=False)
    violations: tuple[Violation, ...] = ()

    @property
    def action(self) -> str:
        if not isinstance(self._action, str):
            object.__setattr__(self, "_action", describe_action(self._action))
        return self._action

    @property
    def requests(self) -> str:
        if not isinstance(self._requests, str):
            object.__setattr__(self, "_requests",
                               " ".join(describe_request(r) for r in self._requests))
        return self._requests

    def __eq__(self, other) -> bool:
        return isinstance(other, StepRecord) and \
            (self.index, self.action, self.requests, self.violations) == \
            (other.index, other.action, other.requests, other.violations)

    def __hash__(self) -> int:
        return hash((self.index, self.action, self.requests, self.violations))


def is_lost_performance(v: Violation) -> bool:
    """A claim of role "efficiency": work lost, nothing corrupted."""
    inv = REGISTRY.get(v.invariant)
    return inv is not None and inv.role == "efficiency"


def describe_request(r) -> str:
    stats = f" hit={r.num_cached_tokens}/{r.num_external_computed_tokens}" if r.has_stats else ""
    blocks = ",".join(map(str, r.block_ids[0])) if r.block_ids else ""
    pre = f" pre={r.num_preemptions}" if r.num_preemptions else ""
    held = f" ph={r.num_output_placeholders}" if r.num_output_placeholders else ""
    return (f"{r.request_id}:{r.status.name} c={r.num_computed_tokens}/{r.num_tokens}"
            f"{held}{stats}{pre} b=[{blocks}]")


def describe_action(action: dict) -> str:
    args = [f"{k}={v}" for k, v in action.items() if k != "op" and v not in ((), [], 0, False, None)]
    return f"{action['op']}({', '.join(args)})"


def record_step(log: list, counts, action: dict, obs, violations) -> None:
    """The action's line in the step log, with the state it left."""
    log.append(StepRecord(len(log), dict(action), tuple(obs.requests.values()),
                          tuple(violations)))
    for v in violations:
        counts[v.invariant] += 1


def keep_first_lost(lost: list, violations: list[Violation], snapshot) -> None:
    """Keep the first break of these efficiency claims, with the trace so far
    (``snapshot()``: the ``RunSnapshot``, taken only then)."""
    claims = {v.invariant for v in violations}
    if all({v.invariant for v in known.violations} != claims for known in lost):
        lost.append(Counterexample(violations, snapshot()))
