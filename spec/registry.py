"""One registry of named invariants: it feeds Hypothesis, Z3, every target and
the generated docs. An invariant yields a message per violation it sees."""
from __future__ import annotations

import inspect
from typing import Callable, Iterator

import attrs


@attrs.frozen
class Invariant:
    name: str
    check: Callable[..., Iterator[str]]
    cites: str
    #: "state": needs only the observation and ghost history;
    #: "data": needs the data oracle's model of the KV content.
    kind: str
    #: what establishes it: "hypothesis", and "z3" once a proof covers it
    established_by: tuple[str, ...]

    def applies_to(self, action: str) -> bool:
        """Relations are named ``<action>_relation``."""
        return self.name == f"{action}_relation"

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


def invariant(cites: str, kind: str = "state", established_by=("hypothesis",)):
    def register(fn):
        REGISTRY[fn.__name__] = Invariant(fn.__name__, fn, cites, kind, tuple(established_by))
        return fn
    return register


def check_invariants(ctx, kinds=("state", "data")) -> list[Violation]:
    found = []
    for inv in REGISTRY.values():
        if inv.kind not in kinds:
            continue
        for message in inv.check(ctx):
            found.append(Violation(inv.name, message, inv.doc))
    return found
