"""The KV cache manager: per-group block tables over one shared block pool.

Each KV cache group is of its kind (``spec/groups.py``): full attention keeps
every block; a sliding-window or last-state group gives back the blocks behind
its read window, and its table holds ``NULL`` there. A prefix hit counts only as
far as every group can serve it: full attention needs every block of the hit
cached, a windowed group the blocks it reads from the hit's end. Cached blocks
are keyed by hash and group (``get_group_cache_key``).

Groups may differ in block size (full attention beside a sliding window, as
vLLM equalises their page sizes): block hashes then cover the greatest common
divisor of the sizes, a group's block is named by the last hash inside it
(``get_block_hash_index``), a hit ends on a multiple of the least common
multiple (``scheduler_block_size``), and a windowed group caches only the
blocks some hit can read (``is_block_reachable``).
"""
from __future__ import annotations

from typing import Callable, Iterable

from kvspec.impl.block_pool import NULL, BlockPool, KVCacheBlock
from kvspec.impl.request import Request
from kvspec.spec.groups import (compute_num_skipped_blocks, get_block_hash_index,
                                get_group_cache_key, get_needed_blocks,
                                get_num_hashed_blocks, is_block_reachable, is_windowed)
from kvspec.spec.state import GroupSpec, get_hash_block_size, get_scheduler_block_size

Blocks = tuple[list[KVCacheBlock], ...]  # one list per group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, groups: tuple[GroupSpec, ...], num_blocks: int,
                 enable_caching: bool = True) -> None:
        self.groups = groups
        self.block_size = groups[0].block_size
        #: tokens per block hash, and where a prefix hit may end
        self.hash_block_size = get_hash_block_size(groups)
        self.scheduler_block_size = get_scheduler_block_size(groups)
        self.num_groups = len(groups)
        #: some group frees blocks behind its window (vLLM's hybrid KV cache manager)
        self.is_hybrid = any(is_windowed(g) for g in groups)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, Blocks] = {}
        # per request and group: how many leading blocks are in the prefix cache
        self.num_cached_block: dict[str, list[int]] = {}
        #: what becomes of blocks a windowed group gives back (the scheduler
        #: fences them behind a step in flight that may still read them)
        self.release_skipped: Callable[[Request, list], None] = \
            lambda request, blocks: self.free_blocks(blocks)
        #: the computed prefix behind which a windowed group may give blocks
        #: back (the scheduler keeps what a step in flight reads)
        self.get_skip_base: Callable[[Request, int], int] = \
            lambda request, num_computed: num_computed - request.num_output_placeholders

    # -- reads --------------------------------------------------------------
    def empty_blocks(self) -> Blocks:
        return tuple([] for _ in range(self.num_groups))

    def get_blocks(self, request_id: str) -> Blocks:
        return self.req_to_blocks.get(request_id) or self.empty_blocks()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.get_blocks(request_id))

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        """Longest prefix-cache hit every group can serve, leaving at least one
        token to compute."""
        if not self.enable_caching:
            return self.empty_blocks(), 0
        size = self.scheduler_block_size
        max_hit_blocks = (request.num_tokens - 1) // size
        for num_blocks in range(self._num_full_hit_blocks(request, max_hit_blocks), 0, -1):
            hit = self._get_hit(request, num_blocks)
            if hit is not None:
                return hit, num_blocks * size
        return self.empty_blocks(), 0

    def _num_full_hit_blocks(self, request: Request, limit: int) -> int:
        """Scheduler blocks (at most ``limit``) the full-attention group 0 has
        cached from the start."""
        per = self.scheduler_block_size // self.block_size
        num = 0
        while num < limit * per and self._cached(request, 0, num) is not None:
            num += 1
        return num // per

    def _cached(self, request: Request, group: int, index: int) -> KVCacheBlock | None:
        """The cached block holding block ``index`` of ``group`` of the request."""
        hash_index = get_block_hash_index(self.groups[group], index, self.hash_block_size)
        return self.pool.get_cached_block(
            get_group_cache_key(request.block_hashes[hash_index], group))

    def _get_hit(self, request: Request, num_blocks: int) -> Blocks | None:
        """Each group's blocks for a hit of ``num_blocks`` scheduler blocks, or
        None if a group misses a block it would read."""
        hit = self.empty_blocks()
        num_tokens = num_blocks * self.scheduler_block_size
        for g, group in enumerate(self.groups):
            needed = get_needed_blocks(group, num_tokens)
            for index in range(num_tokens // group.block_size):
                block = self._cached(request, g, index) if index in needed else NULL
                if block is None:
                    return None
                hit[g].append(block)
        return hit

    # -- allocation ---------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: Blocks | None = None,
                       delay_cache_blocks: bool = False,
                       num_external_tokens: int = 0) -> Blocks | None:
        """Give the request room for ``num_new_tokens`` more tokens after its
        computed ones (local hits included); None if the pool cannot.
        ``num_external_tokens`` of the new ones arrive by a load: a windowed
        group needs no block behind the window at the load's end."""
        new_computed = new_computed_blocks or self.empty_blocks()
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        self.remove_skipped_blocks(request, self.get_skip_base(request, total_computed))
        held = self.get_blocks(request.request_id)
        need = [cdiv(total_computed + num_new_tokens, g.block_size) for g in self.groups]
        first = [len(held[g]) + len(new_computed[g]) for g in range(self.num_groups)]
        resume = self.get_resume_point(request, total_computed + num_external_tokens)
        skipped = [max(first[g], min(need[g], compute_num_skipped_blocks(group, resume)))
                   for g, group in enumerate(self.groups)]
        num_new = [max(0, need[g] - skipped[g]) for g in range(self.num_groups)]
        if sum(num_new) + self._num_free_among(new_computed) > self.pool.get_num_free_blocks():
            return None
        table = self.req_to_blocks.setdefault(request.request_id, self.empty_blocks())
        self.num_cached_block.setdefault(request.request_id, [0] * self.num_groups)
        new_blocks = self.empty_blocks()
        for g in range(self.num_groups):  # every hit is held before any new block is taken
            self.pool.touch(new_computed[g])
        for g in range(self.num_groups):
            table[g].extend(new_computed[g])
            table[g].extend([NULL] * (skipped[g] - first[g]))
            new_blocks[g].extend(self.pool.get_new_blocks(num_new[g]))
            table[g].extend(new_blocks[g])
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def get_resume_point(self, request: Request, num_hit_tokens: int) -> int:
        """Where the request's first step after a hit of ``num_hit_tokens``
        starts: a hit of the whole prompt recomputes its last token, which reads
        the window before it (finding vllm-0.32.0-hybrid-full-prompt-hit-window-freed)."""
        return min(num_hit_tokens, request.num_tokens - 1)

    def _num_free_among(self, blocks: Blocks) -> int:
        seen = {b.block_id for group in blocks for b in group
                if b.ref_cnt == 0 and not b.is_null}
        return len(seen)

    def remove_skipped_blocks(self, request: Request, num_computed: int) -> None:
        """Windowed groups give back the blocks no step from ``num_computed`` on
        reads; their entries become ``NULL``."""
        table = self.req_to_blocks.get(request.request_id)
        if table is None:
            return
        for g, group in enumerate(self.groups):
            if not is_windowed(group):
                continue
            skipped = min(compute_num_skipped_blocks(group, num_computed), len(table[g]))
            gone = [b for b in table[g][:skipped] if not b.is_null]
            table[g][:skipped] = [NULL] * skipped
            if gone:
                self.release_skipped(request, gone)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks under ``num_tokens``, rounded down to
        where a hit may end, in the prefix cache: those a hit can read."""
        if not self.enable_caching or request.request_id not in self.req_to_blocks:
            return
        size = self.scheduler_block_size
        num_tokens = min(num_tokens // size * size,
                         len(request.block_hashes) * self.hash_block_size)
        cached = self.num_cached_block[request.request_id]
        for g, table in enumerate(self.req_to_blocks[request.request_id]):
            group = self.groups[g]
            num_full = min(num_tokens // group.block_size, len(table))
            for i in range(cached[g], num_full):
                if not table[i].is_null and is_block_reachable(group, i, size):
                    self.cache_block(table[i], self._get_hash(request, g, i), g)
            cached[g] = max(cached[g], num_full)

    def _get_hash(self, request: Request, group: int, index: int):
        """The block hash naming block ``index`` of ``group`` of the request."""
        return request.block_hashes[
            get_block_hash_index(self.groups[group], index, self.hash_block_size)]

    def cache_block(self, block: KVCacheBlock, block_hash, group: int) -> None:
        """Cache one block of ``group`` under the key telling groups apart."""
        self.pool.cache_block(block, get_group_cache_key(block_hash, group))

    def get_windowed_cached_ids(self, request: Request, pos: int) -> list[int]:
        """Blocks cached under the request's hashes of the blocks holding
        position ``pos`` on, in the windowed groups, whoever holds them."""
        found = []
        for g, group in enumerate(self.groups):
            if not is_windowed(group):
                continue
            num = get_num_hashed_blocks(group, len(request.block_hashes), self.hash_block_size)
            for index in range(pos // group.block_size, num):
                key = get_group_cache_key(self._get_hash(request, g, index), g)
                found += [block.block_id for block in self.pool.get_cached_blocks(key)]
        return found

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
        return [b for blocks in (table or ()) for b in blocks if not b.is_null]

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
