"""KV-load failure recovery: which requests a failed block affects, where
their computed prefix ends, and who recomputes a block that several share.

A failed block is recomputed by exactly one request, its *owner* (the first
affected request in scan order). Every other request that holds it waits,
unscheduled, until the owner's computed prefix covers the block again; then it
resumes past the block without recomputing it. If the owner leaves first, the
first waiter becomes the owner.
"""
from __future__ import annotations

import attrs

from kvspec.impl.request import Request


@attrs.define
class Waiter:
    block_id: int
    block_end: int      # token position where the shared block ends
    resume_at: int      # num_computed_tokens to resume with once the block is valid


@attrs.define
class RecoveryBook:
    owners: dict[int, str] = attrs.Factory(dict)      # block id -> owner request id
    waiters: dict[str, Waiter] = attrs.Factory(dict)  # request id -> what it waits on

    def forget(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)
        for block_id in [b for b, r in self.owners.items() if r == request_id]:
            del self.owners[block_id]


def first_invalid_index(block_ids: list[int], num_tokens: int, block_size: int,
                        invalid: set[int]) -> int | None:
    """Index of the first block under ``num_tokens`` whose load failed."""
    num_blocks = -(-num_tokens // block_size)
    for idx, block_id in enumerate(block_ids[:num_blocks]):
        if block_id in invalid:
            return idx
    return None


def lower_stats(request: Request, valid_tokens: int) -> None:
    """Failure recovery is the one place cache-hit stats may go down."""
    if request.num_cached_tokens < 0 or request.num_cached_tokens <= valid_tokens:
        return
    local = request.num_cached_tokens - request.num_external_computed_tokens
    request.num_cached_tokens = valid_tokens
    request.num_external_computed_tokens = max(0, valid_tokens - local)
