"""How many block-table entries name each block, over every request of an
observation, without reading every table per question.

``ref_count_is_holders`` judges the blocks a call changed; their holders
are all the tables' entries naming them, which at production size (64
requests of 125 blocks) is a pass over 8,000 entries per check. The tally
here is brought from the requests it last counted to those asked about
table by table: a view the target handed back unchanged is the very same
object, and a table that grew is counted by its new end alone.

A cache, never a verdict: after ``describe(requests)`` the tally is exactly
that of ``requests``' tables, whatever requests it counted before."""
from __future__ import annotations

from collections import Counter


class TableTally:
    def __init__(self) -> None:
        #: request id -> the tables counted for it (a view's ``block_ids``)
        self.tables: dict[str, tuple] = {}
        self.count: Counter = Counter()

    def describe(self, requests: dict) -> Counter:
        """Entries per block over ``requests``' tables (NULL_BLOCK entries too)."""
        tables = self.tables
        for rid, r in requests.items():
            old = tables.get(rid)
            if old is not r.block_ids:
                self._replace(old or (), r.block_ids)
                tables[rid] = r.block_ids
        if len(tables) > len(requests):
            for rid in [rid for rid in tables if rid not in requests]:
                self._replace(tables.pop(rid), ())
        return self.count

    def _replace(self, old: tuple, new: tuple) -> None:
        for g in range(max(len(old), len(new))):
            a = old[g] if g < len(old) else ()
            b = new[g] if g < len(new) else ()
            if a is b:
                continue
            if len(a) <= len(b) and b[:len(a)] == a:  # grew at its end
                self.count.update(b[len(a):])
            else:
                self.count.subtract(a)
                self.count.update(b)


_TALLY = TableTally()


def get_table_tally(requests: dict) -> Counter:
    """Entries per block over ``requests``' tables: read it before asking
    about other requests (one tally serves every reader)."""
    return _TALLY.describe(requests)
