"""Observing a target without copying what did not change: the tuples a view
is built of are the same objects while the lists they copy are equal, so an
unchanged view compares with the last one judged by identity, field by field
(``incremental.py`` compares every view with its baseline).

Nothing here trusts a version counter: every list is compared whole with a
copy of it as last read (a C loop; elements the same objects compare by
identity), so what a call returns always equals a fresh copy."""
from __future__ import annotations


class TupleCache:
    def __init__(self) -> None:
        #: key -> (the list as last read, the tuple made of it)
        self._tuples: dict = {}

    def get(self, key, values, make=tuple, *args) -> tuple:
        """``make(values, *args)``: ``tuple(values)``, or what ``make`` computes
        of nothing but ``values`` and ``args`` (each block's id, which never
        changes: a block without ``__eq__`` compares by identity), the very
        same object while ``values`` is unchanged (a list compared whole, a
        tuple by identity first)."""
        known = self._tuples.get(key)
        if known is not None and (known[0] is values and type(values) is tuple
                                  or known[0] == values):
            return known[1]
        frozen = make(values, *args)
        # a tuple cannot change: kept as it is, it is known again by identity
        self._tuples[key] = (values if type(values) is tuple else list(values), frozen)
        return frozen

    def get_equal(self, key, fresh: tuple) -> tuple:
        """``fresh``, or the tuple returned last time for ``key`` if equal to it."""
        known = self._tuples.get(key)
        if known is not None and is_equal(known[1], fresh):
            return known[1]
        self._tuples[key] = (None, fresh)
        return fresh


def is_equal(old: tuple, new: tuple) -> bool:
    """``old == new``, at once where the lengths differ (tuples, unlike
    lists, compare their common prefix first: 10,000 entries)."""
    return len(old) == len(new) and old == new


class ViewMemo:
    """One request's last view, the fields it was made of, the tuples its
    lists were last copied to (``tuples``), and what a target read to make it
    (``reads``, where a target keeps them: vLLM's observer)."""

    __slots__ = ("tuples", "fields", "view", "reads")

    def __init__(self) -> None:
        self.tuples = TupleCache()
        self.fields = None
        self.view = None
        self.reads = None

    def get(self, fields, make):
        """``make(fields)``, the very view made last time while ``fields`` (a
        tuple or dict of them) are equal: compared one by one, by identity first."""
        if fields != self.fields:
            self.fields, self.view = fields, make(fields)
        return self.view


def keep_memos_of(memos: dict, requests: dict) -> dict:
    """``memos`` of the requests still held: one that left is forgotten (its
    prompt copy with it), the dict kept as it is while none did."""
    if len(memos) > len(requests):
        return {rid: memos[rid] for rid in requests}
    return memos
