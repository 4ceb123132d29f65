"""The block pool: physical KV blocks, their reference counts, the free queue
in eviction order, and the prefix cache (block hash -> the blocks holding that
content, the first served; as vLLM's ``BlockHashToBlockMap``, a copy computed
again is cached too, so evicting one copy loses no content another holds)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable

from kvspec.spec.groups import NULL_BLOCK


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None

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

    def popleft(self) -> KVCacheBlock:
        _, block = self._blocks.popitem(last=False)
        return block

    def append(self, block: KVCacheBlock) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
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
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        for block in blocks_in_eviction_order:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block pool: double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
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
