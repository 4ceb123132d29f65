"""The external KV store: host memory keyed by block hash, the place a KV
connector (LMCache, vLLM's CPU offloading) saves computed blocks to and loads
them back from.

One slab holds every stored block, ``(capacity, *block_shape)`` in the cache's
dtype, pinned when CUDA is available so that loads are DMA copies straight
from it. A stored block is the whole physical block (every layer slot, K and
V), so a block moves as one contiguous copy each way. Keys are any hashable;
with several KV cache groups use ``spec.groups.get_group_cache_key``, since the
blocks of two groups for one prefix hold different layers.

Full, the store evicts its least recently used block that no load in flight
reads (``pin`` / ``unpin``); ``ValueError`` when every block is pinned.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Hashable, Sequence

import attrs
import torch

from kvspec.gpu.paged_cache import PagedKVCache


def is_pinning_available() -> bool:
    """Pinned host memory helps only, and is only allowed, with CUDA."""
    return torch.cuda.is_available()


@attrs.define(eq=False)
class KVStore:
    """Blocks by hash in one host slab (see the module docstring)."""

    slab: torch.Tensor = attrs.field(repr=lambda t: f"<{tuple(t.shape)} {t.dtype}>")
    #: block hash -> slot, least recently used first
    _slots: OrderedDict = attrs.field(factory=OrderedDict, init=False, repr=len)
    _free: list[int] = attrs.field(init=False, repr=len)
    #: slot -> number of loads in flight reading it
    _pins: Counter = attrs.field(factory=Counter, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.slab.device.type != "cpu":
            raise ValueError(f"the store's slab must be in host memory, not {self.slab.device}")
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out slot 0 first

    @classmethod
    def for_cache(cls, cache: PagedKVCache, capacity: int,
                  pin_memory: bool | None = None) -> "KVStore":
        """An empty store for blocks of ``cache``'s shape and dtype; pinned
        unless ``pin_memory=False`` when CUDA is available."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"store capacity must be a positive integer, got {capacity!r}")
        pin = is_pinning_available() if pin_memory is None else pin_memory
        if pin and not is_pinning_available():
            raise ValueError("pin_memory=True needs CUDA, which this machine does not have")
        slab = torch.empty((capacity, *cache.block_shape), dtype=cache.dtype, pin_memory=pin)
        return cls(slab)

    @property
    def capacity(self) -> int:
        return self.slab.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.slab.shape[1:])

    @property
    def is_pinned(self) -> bool:
        return self.slab.is_pinned()

    def __len__(self) -> int:
        return len(self._slots)

    def is_stored(self, block_hash: Hashable) -> bool:
        return block_hash in self._slots

    def get_num_stored_prefix(self, block_hashes: Sequence[Hashable]) -> int:
        """How many of the leading hashes are stored: the blocks a connector
        can offer as an external hit."""
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in self._slots:
                return count
        return len(block_hashes)

    def get_slots(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """The slots of stored blocks (most recently used now);
        ``ValueError`` naming the first hash not stored."""
        missing = [h for h in block_hashes if h not in self._slots]
        if missing:
            raise ValueError(f"block hash {missing[0]!r} is not in the store")
        for block_hash in block_hashes:
            self._slots.move_to_end(block_hash)
        return [self._slots[h] for h in block_hashes]

    def get_block(self, block_hash: Hashable) -> torch.Tensor:
        """The stored block itself (a view of the slab, not a copy)."""
        return self.slab[self.get_slots([block_hash])[0]]

    def pin(self, slots: Sequence[int]) -> None:
        """Keep these slots from eviction while a load reads them."""
        self._pins.update(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self._pins.subtract(slots)
        self._pins = +self._pins  # drop zero counts

    # -- save ----------------------------------------------------------------

    def save(self, block_hash: Hashable, cache: PagedKVCache, block_id: int) -> None:
        """Copy block ``block_id`` of ``cache`` into the store under ``block_hash``."""
        self.save_blocks([block_hash], cache, [block_id])

    def save_blocks(self, block_hashes: Sequence[Hashable], cache: PagedKVCache,
                    block_ids: Sequence[int]) -> None:
        """Save many blocks with one gather on the device and one copy to the
        host. A hash already stored is kept as it is (a hash names content)."""
        self._check_cache(cache)
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} blocks")
        cache.check_block_ids(block_ids)
        new = {}  # hash -> block id, first occurrence
        for block_hash, block_id in zip(block_hashes, block_ids):
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
            else:
                new.setdefault(block_hash, block_id)
        if not new:
            return
        slots = self._allocate(len(new))
        blocks = cache.read_blocks(list(new.values())).to("cpu")
        self.slab.index_copy_(0, torch.tensor(slots, dtype=torch.long), blocks)
        self._slots.update(zip(new, slots))

    def _allocate(self, count: int) -> list[int]:
        """``count`` free slots, evicting least recently used unpinned blocks."""
        while len(self._free) < count:
            victim = next((h for h, s in self._slots.items() if not self._pins[s]), None)
            if victim is None:
                raise ValueError(f"the store is full: {count} blocks to save, "
                                 f"{len(self._free)} free slots, every other block pinned")
            self._free.append(self._slots.pop(victim))
        return [self._free.pop() for _ in range(count)]

    def _check_cache(self, cache: PagedKVCache) -> None:
        if (cache.block_shape, cache.dtype) != (self.block_shape, self.slab.dtype):
            raise ValueError(f"cache blocks {cache.block_shape} {cache.dtype} do not fit the "
                             f"store's {self.block_shape} {self.slab.dtype}")

    # -- load (one block, synchronous; batched and async loads: gpu.loader) ---

    def load(self, block_hash: Hashable, cache: PagedKVCache, block_id: int) -> None:
        """Copy the stored block into block ``block_id`` of ``cache``."""
        self._check_cache(cache)
        cache.write_blocks([block_id], self.get_block(block_hash)[None])
