"""KV-load failure recovery: which requests a failed block affects, where
their computed prefix ends, and who recomputes a block that several share.

Every affected request is cut back at its first failed block. A failed block is
recomputed by exactly one request, and nobody reads it before that:

- Running requests are scanned first, in running order; the first running
  request to meet a failed block *owns* it and recomputes it.
- Every other request holding it becomes a *waiter*: a later running holder,
  and every async loader (a request in WAITING_FOR_REMOTE_KVS), whether or not a
  running request holds the block (a loader cannot recompute before its load
  finishes and it is promoted, and two loaders may share a block no running
  request holds).
- A waiter is not scheduled (in the running loop, or promoted once its load
  finished) while a running holder that is not itself a waiter has not yet
  recomputed its next block; it resumes over every leading block some running
  holder has recomputed since, never past the prefix it had. So where no
  running request recomputes a block, the first of its waiters to be scheduled
  does, and a later waiter in the same step sees it running and waits.

Blocks past the failed one were computed on top of it in the failing step, so
they count as not yet valid until a holder recomputes them too.
"""
from __future__ import annotations

import attrs

from kvspec.impl.request import Request
from kvspec.spec.arith import compute_lowered_stats


@attrs.define
class Waiter:
    block_id: int   # the failed block it waits on
    limit: int      # num_computed_tokens before recovery: never resume past it


@attrs.define
class RecoveryBook:
    waiters: dict[str, Waiter] = attrs.Factory(dict)  # request id -> what it waits on

    def forget(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)


def first_invalid_index(block_ids: list[int], num_tokens: int, block_size: int,
                        invalid: set[int]) -> int | None:
    """Index of the first block under ``num_tokens`` whose load failed."""
    num_blocks = -(-num_tokens // block_size)
    for idx, block_id in enumerate(block_ids[:num_blocks]):
        if block_id in invalid:
            return idx
    return None


def lower_stats(request: Request, valid_tokens: int) -> None:
    """Failure recovery is the one place cache-hit stats may go down; the
    reference lowers both, local hits surviving first (``compute_lowered_stats``,
    one of the lowerings the spec admits)."""
    if request.num_cached_tokens < 0 or request.num_cached_tokens <= valid_tokens:
        return
    request.num_cached_tokens, request.num_external_computed_tokens = compute_lowered_stats(
        request.num_cached_tokens, request.num_external_computed_tokens, valid_tokens)
