"""The prefix cache's entries looked up by block and by key, without a pass
over the whole cache per reader.

A pool view's ``cached`` is a tuple of ``(key, block)`` entries: 10,000 of
them at production size. A claim narrowed to a few changed blocks, or a
change log asking which blocks a key names now, needs the entries of those
blocks or keys alone; a scan of the tuple per question costs more than the
scheduler's own step. ``get_cache_index`` answers from one index, brought
from the last tuple it described to the one asked about by their difference
(two frozensets of entries, each derived once per tuple: ``get_entry_set``).

A cache, never a verdict: the index always describes exactly the tuple it
was asked about (a tuple holding the same entry twice is indexed afresh, with
its repeats), whatever order tuples come in."""
from __future__ import annotations

from kvspec.spec.registry import DerivedByIdentity

#: the (key, block) entries of a prefix-cache tuple, as a set
get_entry_set = DerivedByIdentity(frozenset)


class CacheIndex:
    """One tuple of entries, by block (``keys_of``) and by key (``blocks_of``):
    the lists in tuple order when built afresh, in no stated order after a
    difference was applied."""

    def __init__(self) -> None:
        self.entries: tuple | None = None
        self.by_block: dict = {}
        self.by_key: dict = {}
        #: the blocks cached under two entries or more
        self.shared: set = set()
        #: ``entries`` holds no entry twice (a difference of sets describes it)
        self.is_unique = False

    def keys_of(self, block: int) -> list:
        return self.by_block.get(block, _NONE)

    def blocks_of(self, key) -> list:
        return self.by_key.get(key, _NONE)

    def describe(self, entries: tuple) -> None:
        """Index ``entries`` (from the tuple described now, if that is cheaper)."""
        if entries is self.entries:
            return
        unique = len(get_entry_set(entries)) == len(entries)
        if self.is_unique and unique:
            old, new = get_entry_set(self.entries), get_entry_set(entries)
            gone, came = old - new, new - old
            if len(gone) + len(came) < len(entries) // 2:
                self._apply(gone, came)
                self.entries = entries
                return
        self._build(entries, unique)

    def _build(self, entries: tuple, unique: bool) -> None:
        by_block, by_key = {}, {}
        for key, block in entries:
            by_block.setdefault(block, []).append(key)
            by_key.setdefault(key, []).append(block)
        self.entries, self.by_block, self.by_key, self.is_unique = \
            entries, by_block, by_key, unique
        self.shared = {block for block, keys in by_block.items() if len(keys) >= 2}

    def _apply(self, gone, came) -> None:
        for key, block in gone:
            if len(_remove(self.by_block, block, key)) < 2:
                self.shared.discard(block)
            _remove(self.by_key, key, block)
        for key, block in came:
            keys = self.by_block.setdefault(block, [])
            keys.append(key)
            if len(keys) >= 2:
                self.shared.add(block)
            self.by_key.setdefault(key, []).append(block)


_NONE: list = []


def _remove(index: dict, at, value) -> list:
    """``value`` out of ``index[at]``: what is left there."""
    values = index[at]
    values.remove(value)
    if not values:
        del index[at]
    return values


_INDEX = CacheIndex()


def get_cache_index(entries: tuple) -> CacheIndex:
    """The index of ``entries``: read it before asking about another tuple
    (one index serves every reader, moved from tuple to tuple)."""
    _INDEX.describe(entries)
    return _INDEX
