"""The KV cache manager: per-group block tables over one shared block pool.

Built for several KV cache groups; today every group is full attention with
the same block size, so a prefix hit is the same number of blocks in each.
"""
from __future__ import annotations

from typing import Iterable

from kvspec.impl.block_pool import BlockPool, KVCacheBlock
from kvspec.impl.request import Request

Blocks = tuple[list[KVCacheBlock], ...]  # one list per group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_sizes: tuple[int, ...], num_blocks: int,
                 enable_caching: bool = True) -> None:
        assert len(set(block_sizes)) == 1, "kv cache manager: mixed block sizes need hybrid groups"
        self.block_sizes = block_sizes
        self.block_size = block_sizes[0]
        self.num_groups = len(block_sizes)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, Blocks] = {}
        # per request and group: how many leading blocks are in the prefix cache
        self.num_cached_block: dict[str, list[int]] = {}

    # -- reads --------------------------------------------------------------
    def empty_blocks(self) -> Blocks:
        return tuple([] for _ in range(self.num_groups))

    def get_blocks(self, request_id: str) -> Blocks:
        return self.req_to_blocks.get(request_id) or self.empty_blocks()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.get_blocks(request_id))

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        """Longest prefix-cache hit, leaving at least one token to compute."""
        if not self.enable_caching:
            return self.empty_blocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return tuple(list(hit) for _ in range(self.num_groups)), len(hit) * self.block_size

    # -- allocation ---------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: Blocks | None = None,
                       delay_cache_blocks: bool = False) -> Blocks | None:
        """Give the request room for ``num_new_tokens`` more tokens after its
        computed ones (local hits included); None if the pool cannot."""
        new_computed = new_computed_blocks or self.empty_blocks()
        held = self.get_blocks(request.request_id)
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        need = cdiv(total_computed + num_new_tokens, self.block_size)
        num_new = [max(0, need - len(held[g]) - len(new_computed[g]))
                   for g in range(self.num_groups)]
        if sum(num_new) + self._num_free_among(new_computed) > self.pool.get_num_free_blocks():
            return None
        table = self.req_to_blocks.setdefault(request.request_id, self.empty_blocks())
        self.num_cached_block.setdefault(request.request_id, [0] * self.num_groups)
        new_blocks = self.empty_blocks()
        for g in range(self.num_groups):
            self.pool.touch(new_computed[g])
            table[g].extend(new_computed[g])
            new_blocks[g].extend(self.pool.get_new_blocks(num_new[g]))
            table[g].extend(new_blocks[g])
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _num_free_among(self, blocks: Blocks) -> int:
        seen = {b.block_id for group in blocks for b in group if b.ref_cnt == 0}
        return len(seen)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks under ``num_tokens`` in the prefix cache."""
        if not self.enable_caching or request.request_id not in self.req_to_blocks:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        cached = self.num_cached_block[request.request_id]
        for g, table in enumerate(self.req_to_blocks[request.request_id]):
            for i in range(cached[g], min(num_full, len(table))):
                self.pool.cache_block(table[i], request.block_hashes[i])
            cached[g] = max(cached[g], min(num_full, len(table)))

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks whose content is invalid from the prefix cache, and
        forget that any request has them cached, so a recompute re-caches."""
        ids = set(block_ids)
        for block_id in ids:
            self.pool.uncache(self.pool.blocks[block_id])
        for req_id, table in self.req_to_blocks.items():
            cached = self.num_cached_block[req_id]
            for g, blocks in enumerate(table):
                first_bad = next((i for i, b in enumerate(blocks) if b.block_id in ids), None)
                if first_bad is not None:
                    cached[g] = min(cached[g], first_bad)

    def pop_blocks(self, request: Request) -> list:
        """Forget the request's blocks without giving them back: the caller
        frees them later (tail blocks first) with ``free_blocks``."""
        table = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        return [b for blocks in (table or ()) for b in blocks]

    def free_blocks(self, blocks: list) -> None:
        self.pool.free_blocks(reversed(blocks))

    def free(self, request: Request) -> None:
        table = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if table is None:
            return
        for blocks in table:
            # Tail blocks first: they are the least likely to be shared.
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        for cached in self.num_cached_block.values():
            cached[:] = [0] * self.num_groups
        return True
