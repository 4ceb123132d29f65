"""Observing a target without copying what did not change: the tuples a view
is built of are the same objects while the lists they copy are equal, so an
unchanged view compares with the last one judged by identity, field by field
(``incremental.py`` compares every view with its baseline)."""
from __future__ import annotations


class TupleCache:
    def __init__(self) -> None:
        #: key -> (the list as last read, the tuple made of it)
        self._tuples: dict = {}

    def get(self, key, values) -> tuple:
        """``tuple(values)``, the very same object while ``values`` is unchanged."""
        known = self._tuples.get(key)
        if known is not None and known[0] == values:
            return known[1]
        frozen = tuple(values)
        self._tuples[key] = (list(values), frozen)
        return frozen
