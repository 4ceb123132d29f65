"""The claims a run checks, evaluated on what each call left: the state and
data claims on a ``Context``, the relations on a ``Transition``, the
conformance claim on a ``ModelStep``. Claims are pure; this only counts."""
from __future__ import annotations

import time
from collections import Counter

from kvspec.spec.invariants import Context
from kvspec.spec.registry import REGISTRY, Violation, evaluate

ALL_KINDS = ("state", "data", "relation", "model", "liveness", "connector")

#: claim name -> [evaluations, seconds] while profiling (``--profile-claims``,
#: bench/bench_claims.py); None: not profiling (no clock read per claim)
PROFILE: dict[str, list] | None = None


def start_profile() -> dict[str, list]:
    """Time every claim evaluation in this process from now on."""
    global PROFILE
    PROFILE = {}
    return PROFILE


def stop_profile() -> dict[str, list]:
    global PROFILE
    found, PROFILE = PROFILE or {}, None
    return found


class Checker:
    def __init__(self, kinds=ALL_KINDS, design_rules: bool = True, ignore=frozenset()) -> None:
        #: which kinds of claims are checked ("data" alone: the data oracle only)
        self.kinds = tuple(kinds)
        #: whether claims of role "design" (vLLM's design rules) are checked too
        self.design_rules = design_rules
        #: claims not checked, to see what a known violation leads to (replay --ignore)
        self.ignore = frozenset(ignore)
        self.checks: Counter = Counter()
        self.witnessed: Counter = Counter()

    def is_checked(self, inv) -> bool:
        return (inv.kind in self.kinds and (inv.role != "design" or self.design_rules)
                and inv.name not in self.ignore)

    def get_subject(self, inv, ctx: Context, kinds, transition, model_step):
        """What ``inv`` judges after this call, or None: it does not apply."""
        if inv.kind == "relation":
            return transition if transition and inv.applies_to(transition.action) else None
        if inv.kind == "model":
            return model_step
        return ctx if inv.kind in kinds else None

    def check(self, ctx: Context, kinds=("state", "data"), transition=None,
              model_step=None) -> list[Violation]:
        found = []
        for inv in REGISTRY.values():
            subject = self.get_subject(inv, ctx, kinds, transition, model_step)
            if subject is not None and self.is_checked(inv):
                found += self.judge(inv, subject)
        return found

    def check_calls(self, calls) -> list[Violation]:
        """The connector contract (spec/contract.py) on each connector call."""
        found = []
        for call in calls:
            for inv in REGISTRY.values():
                if inv.kind == "connector" and inv.action == call.op and self.is_checked(inv):
                    found += self.judge(inv, call)
        return found

    def judge(self, inv, subject) -> list[Violation]:
        if PROFILE is None:
            messages, witnessed = evaluate(inv, subject)
        else:
            start = time.perf_counter()
            messages, witnessed = evaluate(inv, subject)
            cost = PROFILE.setdefault(inv.name, [0, 0.0])
            cost[0] += 1
            cost[1] += time.perf_counter() - start
        self.checks[inv.name] += 1
        self.witnessed[inv.name] += witnessed
        return [Violation(inv.name, m, inv.doc) for m in messages]
