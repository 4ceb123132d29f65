"""One registry of named claims: it feeds Hypothesis, Z3, every target and
the generated docs. A claim yields a message per violation it sees, and calls
``witness()`` on what it is given whenever its antecedent holds (a request is
actually in the state the claim speaks about), so a summary can tell a claim
that held from one that was never put to the test.

Four roles:
- ``safety``: what protects users (corrupt KV read or cached, a crash, wrong
  stats, a lost or leaked request or block). Every correct scheduler keeps them.
- ``design``: a rule of vLLM's current design (one writer per recomputed block,
  the long-prefill cap). A different correct design may break it; check one with
  design rules off (``kvspec check --no-design-rules``).
- ``efficiency``: work a correct scheduler need not lose (a computed block the
  prefix cache cannot offer). Breaking one corrupts nothing: a run reports it
  apart, as lost performance, keeps its trace, and goes on; the verdict on
  safety stays as it is.
- ``contract``: a rule of the connector API the scheduler relies on
  (``spec/contract.py``). A breach is the connector's finding, not the
  scheduler's; it stops a run like a safety claim.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterator

import attrs

#: what a claim needs to be evaluated, in the order the docs list them
KINDS = ("state", "data", "relation", "model", "liveness", "connector")
ROLES = ("safety", "design", "efficiency", "contract")
SCOPES = ("all", "request", "block")


@attrs.frozen
class Invariant:
    name: str
    check: Callable[..., Iterator[str]]
    cites: str
    #: "state": the observation and ghost history; "data": the data oracle's
    #: model of the KV content; "relation": one action's before and after;
    #: "model": the transition model Z3 reasons about; "liveness": the healed phase;
    #: "connector": one connector call (spec/contract.py)
    kind: str
    role: str = "safety"
    #: why the claim may go unwitnessed in a default check (empty: it must be witnessed)
    unwitnessed_because: str = ""
    #: for a relation: the action it relates before and after of; for a
    #: connector claim: the call it judges (lookup, load, finish)
    action: str = ""
    #: what a state or data claim is a conjunction over, so that an incremental
    #: check may judge only what changed (``spec/scope.py``): "request" (each
    #: live request alone: its view, its ghost entries, its blocks' content),
    #: "block" (each block alone: its count, holders, free and cached entries,
    #: content), or "all" (judged whole at every check)
    scope: str = "all"

    def applies_to(self, action: str) -> bool:
        return self.action == action

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.check.__doc__ or "")

    @property
    def summary(self) -> str:
        return self.doc.split("\n\n")[0].replace("\n", " ")


@attrs.frozen
class Violation:
    invariant: str
    message: str
    doc: str = ""

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


REGISTRY: dict[str, Invariant] = {}


def invariant(cites: str, kind: str = "state", role: str = "safety",
              unwitnessed_because: str = "", action: str = "", scope: str = "all"):
    """Register a claim; a relation named ``<action>_relation`` relates that action."""
    assert kind in KINDS and role in ROLES and scope in SCOPES, (kind, role, scope)
    assert scope == "all" or kind in ("state", "data"), (kind, scope)

    def register(fn):
        name = fn.__name__
        if kind == "relation" and not action:
            assert name.endswith("_relation"), name
        assert kind != "connector" or action, name
        REGISTRY[name] = Invariant(name, fn, cites, kind, role,
                                   " ".join(unwitnessed_because.split()),
                                   action or name.removesuffix("_relation") if kind == "relation"
                                   else action, scope)
        return fn
    return register


class Witnessing:
    """What a claim is evaluated on counts how often the claim's antecedent held."""

    witnessed: int = 0

    def witness(self, times: int = 1) -> None:
        self.witnessed += times


class Memo(dict):
    """Values derived from what claims judge, computed once for all of them (the
    live requests, references per block): a cache, never a verdict. It pickles
    and copies empty, so what a claim judged compares as it was, and a copy
    recomputes what it needs."""

    def __reduce__(self):
        return Memo, ()


class DerivedByIdentity:
    """A value derived from a tuple, kept for the last few tuples seen: a
    target hands back the very same tuple (its prefix cache's entries) while
    it is unchanged, so what one reader derived from it serves the next
    (each tuple held here, so its id is not reused). A cache, never a verdict."""

    def __init__(self, derive, size: int = 4) -> None:
        self.derive, self.size = derive, size
        self.known: list[tuple[tuple, object]] = []

    def __call__(self, values: tuple):
        for seen, derived in self.known:
            if seen is values:
                return derived
        derived = self.derive(values)
        self.known = [(values, derived), *self.known[:self.size - 1]]
        return derived


def evaluate(inv: Invariant, subject: Witnessing) -> tuple[list[str], int]:
    """Run one claim on ``subject``: its violation messages and how often it was witnessed."""
    subject.witnessed = 0
    messages = list(inv.check(subject))
    return messages, subject.witnessed
