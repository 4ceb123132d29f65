"""The actions at the level of one request's counters: guard and effect, as
pure functions over a ``Counters`` record. Z3 proves the per-request
invariants inductive over these; the same effects state what the relations of
``actions`` check on concrete traces."""
from __future__ import annotations

import attrs

from kvspec.spec.arith import (compute_computed_after_rejection, compute_first_stats,
                               compute_lowered_stats, compute_num_computed_after_hit,
                               compute_truncated_computed)
from kvspec.spec.logic import And, If, Max, cdiv
from kvspec.spec.predicates import (is_blocks_cover_computed, is_cached_le_computed,
                                    is_computed_within_tokens, is_running_with_stats,
                                    is_stats_ordered, is_unscheduled_without_output,
                                    is_waiting_with_work)

WAITING, LOADING, RUNNING, PREEMPTED = 0, 1, 2, 3


@attrs.frozen
class Counters:
    status: object
    prompt_len: object
    num_tokens: object
    num_computed: object
    num_cached: object
    num_external: object
    num_preemptions: object
    num_blocks: object
    block_size: object

    def replace(self, **changes) -> "Counters":
        return attrs.evolve(self, **changes)


def request_invariants(r: Counters) -> dict:
    """The per-request invariants of the catalogue, by name."""
    has_stats = r.num_cached >= 0
    return {
        "stats_are_ordered": If(has_stats, is_stats_ordered(r.prompt_len, r.num_cached,
                                                            r.num_external), True),
        "cached_le_computed": If(has_stats, is_cached_le_computed(
            r.status == RUNNING, r.num_preemptions, r.num_cached, r.num_computed), True),
        "computed_within_tokens": is_computed_within_tokens(r.num_computed, r.num_tokens),
        "waiting_with_work": is_waiting_with_work(r.status == WAITING, r.num_computed,
                                                   r.num_tokens),
        "blocks_cover_computed": is_blocks_cover_computed(r.num_blocks, r.block_size,
                                                          r.num_computed),
        "running_request_has_stats": is_running_with_stats(r.status == RUNNING, has_stats),
        # strengthening found by the induction proof (docs/proofs.md)
        "unscheduled_request_has_no_output": is_unscheduled_without_output(
            has_stats, r.num_tokens, r.prompt_len),
        # shape facts the invariants above need to be inductive
        "well_formed": And(r.prompt_len >= 1, r.num_tokens >= r.prompt_len, r.block_size >= 1,
                           r.num_preemptions >= 0, r.num_blocks >= 0,
                           If(has_stats, True, r.num_external == 0),
                           If(r.status == PREEMPTED, And(r.num_preemptions >= 1, has_stats), True)),
    }


# Each action: (guard, after). Parameters are the environment's choices.

def act_first_schedule(r: Counters, num_local, num_external, num_new):
    """A WAITING request that never ran is scheduled: hits, stats set once, compute."""
    computed = compute_num_computed_after_hit(num_local, num_external, r.num_tokens)
    cached, external = compute_first_stats(num_local, num_external, r.num_tokens)
    guard = And(r.status == WAITING, r.num_computed == 0, r.num_cached < 0,
                r.num_preemptions == 0, num_local >= 0, num_external >= 0,
                num_local + num_external <= r.num_tokens,
                num_new >= 1, num_new <= r.num_tokens - computed)
    after = r.replace(status=RUNNING, num_computed=computed + num_new, num_cached=cached,
                      num_external=external,
                      num_blocks=Max(r.num_blocks, cdiv(computed + num_new, r.block_size)))
    return guard, after


def act_reschedule(r: Counters, num_local, num_external, num_new):
    """A preempted request runs again: new hits, stats untouched (set once)."""
    computed = compute_num_computed_after_hit(num_local, num_external, r.num_tokens)
    guard = And(r.status == PREEMPTED, r.num_computed == 0, num_local >= 0,
                num_external >= 0, num_local + num_external <= r.num_tokens,
                num_new >= 1, num_new <= r.num_tokens - computed)
    after = r.replace(status=RUNNING, num_computed=computed + num_new,
                      num_blocks=Max(r.num_blocks, cdiv(computed + num_new, r.block_size)))
    return guard, after


def act_async_allocate(r: Counters, num_local, num_external):
    """An async load is issued: blocks for local + external hits, no stats yet."""
    guard = And(r.status == WAITING, r.num_computed == 0, r.num_cached < 0,
                num_local >= 0, num_external >= 1, num_local + num_external <= r.num_tokens)
    target = num_local + num_external
    after = r.replace(status=LOADING, num_computed=target,
                      num_blocks=Max(r.num_blocks, cdiv(target, r.block_size)))
    return guard, after


def act_async_finish(r: Counters):
    """The load is reported finished: back to WAITING, the last token left to compute."""
    guard = r.status == LOADING
    after = r.replace(status=WAITING,
                      num_computed=compute_num_computed_after_hit(r.num_computed, 0, r.num_tokens))
    return guard, after


def act_start_after_load(r: Counters, num_local, num_new):
    """A request whose async load finished is scheduled: stats set once."""
    cached, external = compute_first_stats(num_local, r.num_computed - num_local, r.num_tokens)
    guard = And(r.status == WAITING, r.num_computed >= 1, r.num_cached < 0,
                r.num_preemptions == 0, num_local >= 0, num_local <= r.num_computed,
                num_new >= 1, num_new <= r.num_tokens - r.num_computed)
    after = r.replace(status=RUNNING, num_computed=r.num_computed + num_new, num_cached=cached,
                      num_external=external,
                      num_blocks=Max(r.num_blocks, cdiv(r.num_computed + num_new, r.block_size)))
    return guard, after


def act_decode(r: Counters, num_new, num_drafts, num_accepted):
    """A running request computes ``num_new`` tokens (drafts included) and gets
    ``num_accepted + 1`` tokens back."""
    computed = compute_computed_after_rejection(r.num_computed + num_new, num_drafts, num_accepted)
    guard = And(r.status == RUNNING, num_drafts >= 0, num_accepted >= 0,
                num_accepted <= num_drafts, num_new >= 1,
                r.num_computed + num_new - num_drafts == r.num_tokens)
    after = r.replace(num_computed=computed, num_tokens=r.num_tokens + num_accepted + 1,
                      num_blocks=Max(r.num_blocks, cdiv(r.num_computed + num_new, r.block_size)))
    return guard, after


def act_prefill_chunk(r: Counters, num_new):
    """A running request computes a chunk of its prompt; nothing is sampled."""
    guard = And(r.status == RUNNING, num_new >= 1, r.num_computed + num_new < r.num_tokens)
    after = r.replace(num_computed=r.num_computed + num_new,
                      num_blocks=Max(r.num_blocks, cdiv(r.num_computed + num_new, r.block_size)))
    return guard, after


def act_preempt(r: Counters):
    guard = r.status == RUNNING
    after = r.replace(status=PREEMPTED, num_computed=0, num_blocks=0,
                      num_preemptions=r.num_preemptions + 1)
    return guard, after


def act_recover(r: Counters, first_invalid_block):
    """A load failure: truncate at the first invalid block, lower the stats."""
    truncated = compute_truncated_computed(first_invalid_block, r.block_size, r.num_computed)
    cached, external = compute_lowered_stats(r.num_cached, r.num_external, truncated)
    guard = And(first_invalid_block >= 0,
                first_invalid_block * r.block_size < r.num_computed)
    has_stats = r.num_cached >= 0
    after = r.replace(num_computed=truncated,
                      num_cached=If(has_stats, cached, r.num_cached),
                      num_external=If(has_stats, external, r.num_external))
    return guard, after


ACTIONS = {
    "first_schedule": (act_first_schedule, ("num_local", "num_external", "num_new")),
    "reschedule": (act_reschedule, ("num_local", "num_external", "num_new")),
    "async_allocate": (act_async_allocate, ("num_local", "num_external")),
    "async_finish": (act_async_finish, ()),
    "start_after_load": (act_start_after_load, ("num_local", "num_new")),
    "prefill_chunk": (act_prefill_chunk, ("num_new",)),
    "decode": (act_decode, ("num_new", "num_drafts", "num_accepted")),
    "preempt": (act_preempt, ()),
    "recover": (act_recover, ("first_invalid_block",)),
}
