"""What an incremental check judges: the requests and blocks a call may have
changed since the claims last held.

Each state and data claim is a conjunction: over live requests (a claim of
scope "request" reads one request's view, its ghost entries and its blocks'
content), over blocks (scope "block": one block's count, holders, free and
prefix-cache entries, content), or over the whole state (scope "all"). A
conjunct whose inputs are unchanged since a check at which it held still
holds, so a check may judge only the changed conjuncts and be exactly as
strong as a full one. The harness derives the ``Scope`` from what it saw change
(``kvspec/harness/incremental.py``) and checks everything at an interval and at
the end of every run, so that a gap in that bookkeeping cannot hide a
violation for long (``tests/test_incremental.py`` holds both to the full check).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class Scope:
    #: request ids whose conjuncts are judged: changed views, ghost entries,
    #: queue membership, blocks' content, and requests that left
    requests: frozenset[str]
    #: block ids whose conjuncts are judged: changed counts, free or cached
    #: entries, holders (every block a changed request held or holds), content
    blocks: frozenset[int]
    #: those of ``blocks`` whose prefix-cache conjuncts may have changed (what
    #: a cached block must hold: its entries, content, load or failure mark,
    #: a key learnt since); None: all of ``blocks``
    cached: frozenset[int] | None = None

    def get_cached(self) -> frozenset[int]:
        return self.blocks if self.cached is None else self.cached

    def is_empty(self) -> bool:
        return not self.requests and not self.blocks


class ChangeLog:
    """What changed, in order (request ids, block ids): each reader keeps a
    mark, reads what was logged since it, and the log drops what every reader
    has read (``trim``)."""

    def __init__(self) -> None:
        self.items: list = []
        #: the absolute position of ``items[0]``
        self.offset = 0
        #: nothing is kept until a reader takes its first mark (a log no one
        #: reads, ``kvspec watch``'s, stays empty)
        self.active = False

    def add(self, item) -> None:
        if self.active:
            self.items.append(item)

    def extend(self, items) -> None:
        if self.active:
            self.items.extend(items)

    def mark(self) -> int:
        self.active = True
        return self.offset + len(self.items)

    def since(self, mark: int) -> list:
        return self.items[max(0, mark - self.offset):]

    def trim(self, mark: int) -> None:
        """Forget what was logged before ``mark`` (every reader is past it)."""
        drop = min(len(self.items), mark - self.offset)
        if drop > 0:
            del self.items[:drop]
            self.offset += drop

    def __deepcopy__(self, memo) -> "ChangeLog":
        copy = ChangeLog()
        copy.items, copy.offset, copy.active = list(self.items), self.offset, self.active
        return copy
