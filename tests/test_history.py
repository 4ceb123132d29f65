"""The expected history has one set of writers (issue 25): the ``process_*``
functions of spec/history.py. The runner calls them as events happen; no
other module assigns to a ghost field or mutates one in place."""
from __future__ import annotations

import ast
from pathlib import Path

import attrs

from kvspec.spec.history import Ghost

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name for f in attrs.fields(Ghost)}
MUTATORS = {"add", "pop", "update", "setdefault", "discard", "clear", "remove", "append"}


def _is_ghost_field(node) -> bool:
    """``<...>.ghost.<field>`` or ``ghost.<field>``, possibly subscripted."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not (isinstance(node, ast.Attribute) and node.attr in FIELDS):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "ghost") or (
        isinstance(owner, ast.Name) and owner.id == "ghost")


def _writes(tree) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = getattr(node, "targets", None) or [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            targets = [node.func.value]
        lines += [node.lineno for t in targets if _is_ghost_field(t)]
    return lines


def test_only_the_history_writes_the_ghost():
    found = {}
    for path in [*ROOT.glob("spec/*.py"), *ROOT.glob("impl/*.py"), *ROOT.glob("kvspec/**/*.py")]:
        if path.name == "history.py":
            continue
        lines = _writes(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, found


def test_the_check_sees_a_write_outside_the_history():
    """The scan is not blind: the shapes of write it looks for are found."""
    for code in ("self.ghost.stats[rid] = now", "self.ghost.recovered |= x",
                 "ghost.finished_mid_load.add(rid)", "del self.ghost.placeholders[rid]"):
        assert _writes(ast.parse(code)), code
    assert not _writes(ast.parse("want = ctx.ghost.placeholders.get(rid, 0)"))
