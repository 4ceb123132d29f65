"""The block pool: physical KV blocks, their reference counts, the free queue
in eviction order, and the prefix cache (block hash -> the blocks holding that
content, the first served; as vLLM's ``BlockHashToBlockMap``, a copy computed
again is cached too, so evicting one copy loses no content another holds)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable

from kvspec.spec.groups import NULL_BLOCK


class KVCacheBlock:
    __slots__ = ("block_id", "block_hash", "_counts")

    def __init__(self, block_id: int, counts: list[int] | None = None) -> None:
        self.block_id = block_id
        self.block_hash: Hashable | None = None
        #: where the reference count lives, at ``block_id``: its pool's
        #: ``ref_cnts`` (one list an observer copies whole), or its own
        self._counts = counts if counts is not None else {block_id: 0}

    @property
    def ref_cnt(self) -> int:
        return self._counts[self.block_id]

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        # the only way to write a count (no slot holds it): ``ref_cnts`` is exact
        self._counts[self.block_id] = value

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt})"

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK


#: the entry of a block a windowed group gave back: never held, never freed
NULL = KVCacheBlock(NULL_BLOCK)


class FreeQueue:
    """Free blocks, least recently freed first: the eviction order."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self):
        return iter(self._blocks.values())

    def get_block_ids(self) -> tuple[int, ...]:
        """The free blocks' ids in eviction order (the keys: no block is read)."""
        return tuple(self._blocks)

    def popleft(self) -> KVCacheBlock:
        _, block = self._blocks.popitem(last=False)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        #: every block's reference count, by block id (``KVCacheBlock.ref_cnt``
        #: reads and writes it), so that an observer copies them in a C loop
        self.ref_cnts = [0] * num_blocks
        self.blocks = [KVCacheBlock(i, self.ref_cnts) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[Hashable, dict[int, KVCacheBlock]] = {}
        #: every (hash, block id) entry of ``cached``, kept beside it by the same
        #: writers so that an observer copies it whole (10,000 blocks: a C loop)
        self._entries: dict[tuple[Hashable, int], None] = {}
        #: bumped whenever ``cached`` changes, so an observer need not read it again
        self.cache_version = 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """The copy a hit is served from: the first cached."""
        return next(iter(self.cached.get(block_hash, {}).values()), None)

    def get_cached_blocks(self, block_hash: Hashable) -> list[KVCacheBlock]:
        return list(self.cached.get(block_hash, {}).values())

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= len(self.free_queue), "block pool: not enough free blocks"
        blocks = []
        counts = self.ref_cnts
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            counts[block.block_id] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the queue."""
        counts = self.ref_cnts
        for block in blocks:
            if block.is_null:
                continue
            if counts[block.block_id] == 0:
                self.free_queue.remove(block)
            counts[block.block_id] += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        counts = self.ref_cnts
        for block in blocks_in_eviction_order:
            if block.is_null:
                continue
            assert counts[block.block_id] > 0, \
                f"block pool: double free of block {block.block_id}"
            counts[block.block_id] -= 1
            if counts[block.block_id] == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        if block.block_hash is not None:
            return  # already cached
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block
        self._entries[block_hash, block.block_id] = None
        self.cache_version += 1

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block from the prefix cache (its content cannot be trusted)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            copies = self.cached.get(block.block_hash, {})
            copies.pop(block.block_id, None)
            if not copies:
                self.cached.pop(block.block_hash, None)
            self._entries.pop((block.block_hash, block.block_id), None)
            block.block_hash = None
            self.cache_version += 1

    def get_cached_entries(self) -> list[tuple[Hashable, KVCacheBlock]]:
        return [(h, block) for h, copies in self.cached.items() for block in copies.values()]

    def get_cached_entry_ids(self) -> tuple[tuple[Hashable, int], ...]:
        """Every prefix-cache entry as (hash, block id), in the order cached."""
        return tuple(self._entries)

    def cached_block_ids(self) -> list[int]:
        return [block.block_id for _h, block in self.get_cached_entries()]

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._entries.clear()
        self.cache_version += 1
        return True
