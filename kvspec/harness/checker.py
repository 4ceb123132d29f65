"""The claims a run checks, evaluated on what each call left: the state and
data claims on a ``Context``, the relations on a ``Transition``, the
conformance claim on a ``ModelStep``. Claims are pure; this only counts, and
narrows a check to what changed since the claims last held
(``incremental.py``)."""
from __future__ import annotations

import os
import time
from collections import Counter

from kvspec.harness.incremental import FULL_CHECK_EVERY, Incremental
from kvspec.spec.invariants import Context
from kvspec.spec.registry import REGISTRY, Invariant, Violation, evaluate

ALL_KINDS = ("state", "data", "relation", "model", "liveness", "connector")


class IncrementalGap(AssertionError):
    """An incremental check judged differently from a full check of the same
    state (``KVSPEC_SHADOW_CHECKS=1``): a change the harness did not see.
    A harness bug, never a finding: it stops the run, it is not reported."""


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
    def __init__(self, kinds=ALL_KINDS, design_rules: bool = True, ignore=frozenset(),
                 full_every: int = FULL_CHECK_EVERY) -> None:
        #: which kinds of claims are checked ("data" alone: the data oracle only)
        self.kinds = tuple(kinds)
        #: whether claims of role "design" (vLLM's design rules) are checked too
        self.design_rules = design_rules
        #: claims not checked, to see what a known violation leads to (replay --ignore)
        self.ignore = frozenset(ignore)
        self.checks: Counter = Counter()
        self.witnessed: Counter = Counter()
        self.incremental = Incremental(full_every)
        #: the claims each kind of check evaluates, in registry order, and
        #: whether any may be narrowed (worked out once)
        self._plans: dict[tuple, tuple[tuple[Invariant, ...], bool]] = {}
        #: the last state judged (``check_full`` judges it whole at a run's end)
        self.last_checked: Context | None = None
        #: judge every incremental check whole as well and raise ``IncrementalGap``
        #: if they differ (tests/test_incremental.py)
        self.shadow = os.environ.get("KVSPEC_SHADOW_CHECKS", "") not in ("", "0")

    def is_checked(self, inv) -> bool:
        return (inv.kind in self.kinds and (inv.role != "design" or self.design_rules)
                and inv.name not in self.ignore)

    def get_plan(self, kinds, action: str | None, has_model: bool) -> tuple[Invariant, ...]:
        """The claims a check of ``kinds`` after ``action`` evaluates."""
        return self._get_plan_entry(kinds, action, has_model)[0]

    def _get_plan_entry(self, kinds, action: str | None,
                        has_model: bool) -> tuple[tuple[Invariant, ...], bool]:
        """The plan, and whether an incremental check may narrow a claim of it."""
        key = (tuple(kinds), action, has_model, self.kinds, self.design_rules, self.ignore)
        entry = self._plans.get(key)
        if entry is None:
            plan = tuple(
                inv for inv in REGISTRY.values() if self.is_checked(inv) and (
                    inv.applies_to(action) if inv.kind == "relation" else
                    has_model if inv.kind == "model" else inv.kind in kinds))
            entry = self._plans[key] = (plan, any(inv.scope != "all" for inv in plan))
        return entry

    def check(self, ctx: Context, kinds=("state", "data"), transition=None,
              model_step=None) -> list[Violation]:
        """Every claim of ``kinds`` on ``ctx``, the relations of ``transition``,
        the model on ``model_step``; the state and data claims judge only what
        changed since they last held, unless the interval came round."""
        action = transition.action if transition is not None else None
        plan, narrowable = self._get_plan_entry(kinds, action, model_step is not None)
        scope = ctx.scope = self.incremental.get_scope(ctx) if narrowable else None
        found, narrowed = [], []
        for inv in plan:
            kind = inv.kind
            if kind == "state" or kind == "data":
                if scope is not None and self.is_unchanged(inv, scope):
                    continue
                ctx.judging = inv.scope
                judged = self.judge(inv, ctx)
                if judged:
                    narrowed += judged
                    found += judged
            else:
                found += self.judge(inv, transition if kind == "relation" else model_step)
        ctx.judging = "all"
        if self.shadow and scope is not None:
            compare_with_full(ctx, plan, narrowed)
        if narrowable and not narrowed:  # a baseline only where the claims held
            self.incremental.advance(ctx, scope)
        self.last_checked = ctx
        return found

    @staticmethod
    def is_unchanged(inv: Invariant, scope) -> bool:
        """Nothing a conjunct of ``inv`` reads changed: it holds as it did."""
        return (inv.scope == "request" and not scope.requests) or \
            (inv.scope == "block" and not scope.blocks)

    def check_full(self) -> list[Violation]:
        """The state and data claims that incremental checks narrow, judged
        whole on the last state checked (the end of a run): a gap in what the
        harness saw change cannot outlive the run."""
        ctx = self.last_checked
        if ctx is None or ctx.scope is None:
            return []  # nothing checked, or the last check was whole
        ctx.scope = None
        found = []
        for inv in self.get_plan(("state", "data") if ctx.synced else ("state",), None, False):
            if inv.scope != "all":
                ctx.judging = inv.scope
                found += self.judge(inv, ctx)
        ctx.judging = "all"
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
        name = inv.name
        if PROFILE is None:  # ``evaluate``, inline: a checked step judges ~60 claims
            subject.witnessed = 0
            messages = list(inv.check(subject))
            witnessed = subject.witnessed
        else:
            start = time.perf_counter()
            messages, witnessed = evaluate(inv, subject)
            cost = PROFILE.setdefault(name, [0, 0.0])
            cost[0] += 1
            cost[1] += time.perf_counter() - start
        self.checks[name] += 1
        self.witnessed[name] += witnessed
        return [Violation(name, m, inv.doc) for m in messages] if messages else []


def compare_with_full(ctx: Context, plan, narrowed: list[Violation]) -> None:
    """Judge ``ctx`` whole; raise ``IncrementalGap`` unless it finds exactly
    what the narrowed check found."""
    scope, ctx.scope = ctx.scope, None
    whole = set()
    for inv in plan:
        if inv.kind in ("state", "data"):
            ctx.judging = inv.scope
            whole.update((inv.name, m) for m in evaluate(inv, ctx)[0])
    ctx.scope, ctx.judging = scope, "all"
    got = {(v.invariant, v.message) for v in narrowed}
    if got != whole:
        raise IncrementalGap(f"missed {sorted(whole - got)}, extra {sorted(got - whole)} "
                             f"(changed requests {sorted(scope.requests)}, "
                             f"blocks {sorted(scope.blocks)})")
