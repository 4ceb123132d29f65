"""Applying a diff's hunks at the level of the code they change.

A fix of vLLM's source is a unified diff written against one release. A later
release, or a pull request's branch, often moves or touches the lines *around*
what the fix changes (0.33.0 inserted ``_drain_deferred_loads()`` beside
lines a fix removes) while the code the fix changes is byte-identical. Such a
fix still applies: each *change* of a hunk (a run of removed and added lines)
is located by its removed lines and as much of its surrounding context as still
occurs exactly once, in order. Only when the removed lines themselves are gone
(or occur in several places even with all their context) does the hunk not fit.

Why a change does not fit matters to a reviewer: ``present`` (its added lines
are already there: the source already has the fix) or ``changed`` (the code it
fixes was changed). Lines are compared without trailing whitespace.
"""
from __future__ import annotations

import attrs


class HunkDoesNotFit(Exception):
    """``reason``: "changed" (the code a change removes is not there, or not
    once), or "present" (its added lines already are)."""

    def __init__(self, message: str, reason: str = "changed") -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen
class Change:
    """One run of removed and added lines, with the context around it."""

    before: tuple[str, ...]
    removed: tuple[str, ...]
    added: tuple[str, ...]
    after: tuple[str, ...]


def split_changes(hunk) -> list[Change]:
    """A unidiff hunk as its changes; each takes the context up to the
    neighbouring change on either side."""
    runs: list[list] = [[]]  # alternating: context, change, context, ...
    for line in hunk:
        is_change = line.is_removed or line.is_added
        if is_change != (len(runs) % 2 == 0):
            runs.append([])
        runs[-1].append(line)
    if len(runs) % 2 == 0:
        runs.append([])
    changes = []
    for i in range(1, len(runs), 2):
        changes.append(Change(
            before=tuple(ln.value for ln in runs[i - 1]),
            removed=tuple(ln.value for ln in runs[i] if ln.is_removed),
            added=tuple(ln.value for ln in runs[i] if ln.is_added),
            after=tuple(ln.value for ln in runs[i + 1])))
    return changes


def _key(line: str) -> str:
    return line.rstrip()


def _occurrences(lines: list[str], block: list[str], start: int) -> list[int]:
    if not block:
        return []
    keys = [_key(x) for x in block]
    first = keys[0]
    return [i for i in range(start, len(lines) - len(keys) + 1)
            if _key(lines[i]) == first and [_key(x) for x in lines[i:i + len(keys)]] == keys]


def _contexts(change: Change):
    """(lines kept before, lines kept after), most context first."""
    pairs = [(kb, ka) for kb in range(len(change.before) + 1)
             for ka in range(len(change.after) + 1)]
    return sorted(pairs, key=lambda p: (-(p[0] + p[1]), -p[0]))


def _locate(lines: list[str], change: Change, start: int) -> tuple[int, int, int] | None:
    """Where ``change``'s removed lines begin, with the context kept (kb, ka):
    the most context that still occurs exactly once from ``start`` on. None if
    no amount of context makes it occur exactly once."""
    for kb, ka in _contexts(change):
        before = list(change.before[len(change.before) - kb:]) if kb else []
        block = before + list(change.removed) + list(change.after[:ka])
        if not change.removed and not (kb or ka):
            continue  # a pure insertion needs a neighbour to sit beside
        found = _occurrences(lines, block, start)
        if len(found) == 1:
            return found[0] + kb, kb, ka
        if len(found) > 1 and change.removed:
            return None  # less context only matches more places
    return None


def apply_change(lines: list[str], change: Change, start: int, where: str) -> tuple[int, str]:
    """Apply one change in place from ``start`` on; (the line after it, a note
    on the context that drifted, or "")."""
    if not change.removed and _is_present(lines, change, start):
        raise _present(change, where)  # an insertion already made: never make it twice
    located = _locate(lines, change, start)
    if located is None:
        if _is_present(lines, change, 0):
            raise _present(change, where)
        raise _missing(lines, change, where)
    at, kb, ka = located
    lines[at:at + len(change.removed)] = list(change.added)
    drift = ""
    if kb < len(change.before) or ka < len(change.after):
        drift = (f"{where}: near {_near(change)!r}, "
                 f"{len(change.before) - kb + len(change.after) - ka} of "
                 f"{len(change.before) + len(change.after)} context lines differ")
    return at + len(change.added), drift


def _is_present(lines: list[str], change: Change, start: int) -> bool:
    """The change's new side is already there: its added lines with all their
    context (a change that removes lines), or beside the neighbour they were
    written next to (a pure insertion, which must never be made twice). A
    common added line found elsewhere with less context says nothing."""
    if not change.added:
        return False
    if change.removed:
        block = list(change.before) + list(change.added) + list(change.after)
        return len(_occurrences(lines, block, start)) == 1
    sides = (list(change.before[-1:]) + list(change.added),
             list(change.added) + list(change.after[:1]))
    return any(len(side) > len(change.added) and _occurrences(lines, side, start)
               for side in sides)


def _near(change: Change) -> str:
    changed = change.removed + change.added
    return next((x.strip() for x in changed + change.before[::-1] + change.after
                 if x.strip()), "(blank lines)")[:60]


def _present(change: Change, where: str) -> HunkDoesNotFit:
    return HunkDoesNotFit(f"{where}: the lines it adds near {_near(change)!r} are already there",
                          "present")


def _missing(lines: list[str], change: Change, where: str) -> HunkDoesNotFit:
    if change.removed and len(_occurrences(lines, list(change.removed), 0)) > 1:
        return HunkDoesNotFit(f"{where}: the code it changes near {_near(change)!r} occurs in "
                              "several places")
    return HunkDoesNotFit(f"{where}: the code it changes near {_near(change)!r} is not there")


def apply_hunks(text: str, hunks, where: str) -> tuple[str, list[str]]:
    """``text`` with every hunk applied: (the patched text, drift notes). A
    hunk whose old lines occur exactly once applies as it is; otherwise each of
    its changes is located on its own (see the module doc). HunkDoesNotFit
    if one does not fit."""
    lines = text.splitlines(keepends=True)
    drift: list[str] = []
    for hunk in hunks:
        old = [ln.value for ln in hunk if ln.is_context or ln.is_removed]
        new = [ln.value for ln in hunk if ln.is_context or ln.is_added]
        exact = _occurrences(lines, old, 0)
        if len(exact) == 1:
            lines[exact[0]:exact[0] + len(old)] = new
            continue
        start = 0
        for change in split_changes(hunk):
            start, note = apply_change(lines, change, start, where)
            if note:
                drift.append(note)
    return "".join(lines), drift


def unchanged_lines(original: str, patched: str) -> dict[int, int]:
    """Line of ``patched`` -> line of ``original``, for the lines a patch left
    as they were (1-based): a place in patched code told as the source's."""
    import difflib
    a, b = original.splitlines(), patched.splitlines()
    mapping = {}
    for tag, i1, i2, j1, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            mapping.update({j1 + k + 1: i1 + k + 1 for k in range(i2 - i1)})
    return mapping
