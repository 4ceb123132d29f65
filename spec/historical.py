"""Rules vLLM (or a plausible patch) once used, written as drop-in variants of
the model's rules and primitives. ``kvspec prove`` states each lemma once as a
function of its rule, proves it for the spec's rule and refutes it for every
historical variant here: a lemma that cannot tell the two apart proves nothing.
"""
from __future__ import annotations

import attrs

from kvspec.spec.arith import (compute_first_external, compute_num_computed_pre_34616,
                               compute_placeholders_after_output, compute_real_computed)
from kvspec.spec.effects import (PREEMPTED, RUNNING, WAITING, Counters, Params,
                                 act_finish_async_load, act_recover, act_sample,
                                 act_sample_stale,
                                 act_schedule_loaded, act_schedule_waiting, has_stats, is_chunk)
from kvspec.spec.groups import compute_recovered_computed, is_served
from kvspec.spec.logic import And, If, Min, Or, fdiv
from kvspec.spec.predicates import is_blocks_cover_computed
from kvspec.spec.pool_effects import Pool, _set, act_free, act_issue_async_load, act_sync_load


# -- token arithmetic ------------------------------------------------------------

def hit_counting_every_token(num_local, num_external, num_tokens):
    """A hit of the whole prompt counts every token: nothing is left to compute
    (what vLLM does with a sync connector that claims the whole prompt, #30320)."""
    return Min(num_local + num_external, num_tokens)


def truncate_after_first_invalid(first_invalid_block, block_size, num_computed):
    """Recovery cuts after the first failed block instead of before it."""
    return Min(num_computed, (first_invalid_block + 1) * block_size)


def first_external_uncapped(num_cached, num_local, num_external):
    """The connector's whole answer recorded as external hits."""
    return num_external


def first_external_zero(num_cached, num_local, num_external):
    """No external hits ever recorded."""
    return 0


def first_cached_count_past_hits(num_cached, num_hits, num_tokens):
    """A full-prompt count admitted for hits one short of the prompt."""
    return Or(num_cached == Min(num_hits, num_tokens - 1),
              And(num_hits >= num_tokens - 1, num_cached == num_tokens))


def lower_cached_only(num_cached, num_external, num_valid):
    """Recovery lowers ``num_cached_tokens`` to the valid prefix and leaves the
    external count as it was."""
    return Min(num_cached, num_valid), num_external


# -- async scheduling: output placeholders -------------------------------------------

def placeholders_after_stale_output_decrementing(num_placeholders, num_drafts, num_sampled,
                                                 is_stale):
    """#47900: the output of a step a preemption made stale is applied like any
    other, taking its share off placeholders the preemption already zeroed."""
    return compute_placeholders_after_output(num_placeholders, num_drafts, num_sampled, False)


def placeholders_after_schedule_ignoring_chunk(num_placeholders, num_drafts,
                                               is_prefill_chunk):
    """A prefill chunk counted like a sampling step: it reserves a placeholder
    for a token it will never sample."""
    return num_placeholders + 1 + num_drafts


def preempt_keeping_placeholders(num_computed, num_placeholders):
    """#48245: a preemption starts the request over but keeps the placeholders of
    its steps in flight, whose stale output never gives them back."""
    return 0, num_placeholders


def placeholders_after_output_forgetting_rejected(num_placeholders, num_drafts, num_sampled,
                                                  is_stale):
    """Delivery that takes one placeholder off per appended token and none for the
    rejected drafts."""
    return If(is_stale, num_placeholders, num_placeholders - num_sampled)


def running_new_tokens_without_placeholders(num_tokens, num_spec, num_placeholders,
                                            num_computed):
    """The sync scheduler's count (vLLM before async scheduling) under async
    scheduling: the positions the steps in flight will fill are forgotten, so a
    second step in flight cannot reach the end and sample."""
    return num_tokens + num_spec - num_computed


def real_computed_snapshot_before_increment(num_computed, placeholders_before,
                                            placeholders_after):
    """#27644 review (seed 002): a scheduled step's boundary read with the
    placeholder count taken before the step increments it, against
    ``num_computed_tokens`` after: the step's draft positions count as real."""
    return compute_real_computed(num_computed, placeholders_before)


# -- KV cache groups ------------------------------------------------------------------

def recovered_computed_by_full_attention(groups, cut, first_present, first_invalid):
    """Seed 003 (#35223, whose review found the per-group accounting of a failed
    load wrong): recovery of a hybrid request keeps the cut at the first failed
    block wherever the full-attention group (group 0, whose hashes name the
    prefix) serves it, asking no other group. A sliding-window or last-state
    group may have given back the blocks a step from the cut reads."""
    return If(is_served(groups[0], cut, first_present[0], first_invalid[0]), cut, 0)


def recovered_one_past_cut(groups, cut, first_present, first_invalid):
    """A recovery that keeps the first failed token too (the cut one late)."""
    kept = compute_recovered_computed(groups, cut, first_present, first_invalid)
    return If(kept > 0, kept + 1, kept)


# -- primitives --------------------------------------------------------------------

def act_finish_async_load_pre_34616(c: Counters, p):
    """Pre-#34616: a finished async load counts its whole allocated blocks,
    clipped to the prompt, less one on a full hit."""
    guard, after = act_finish_async_load(c, p)
    computed = compute_num_computed_pre_34616(c.num_blocks, c.block_size, c.num_tokens)
    return guard, attrs.evolve(after, num_computed=computed)


def act_finish_async_load_rounding_down(c: Counters, p):
    """A finished async load counts only the whole blocks it filled."""
    guard, after = act_finish_async_load(c, p)
    exact = Min(c.num_computed, c.num_tokens - 1)
    return guard, attrs.evolve(after, num_computed=fdiv(exact, c.block_size) * c.block_size)


def act_finish_async_load_counting_every_token(c: Counters, p):
    """A finished async load counts every loaded token, the last one included."""
    guard, after = act_finish_async_load(c, p)
    return guard, attrs.evolve(after, num_computed=c.num_computed)


def act_recover_keeping_failed_block(c: Counters, p):
    """Recovery whose cut may land after the failed block instead of before it."""
    rest, _ = act_recover(c, Params(first_invalid_block=p.first_invalid_block, num_valid=0,
                                    num_cached=p.num_cached, num_external=p.num_external))
    _, after = act_recover(c, p)
    return And(rest, p.num_valid <= (p.first_invalid_block + 1) * c.block_size,
               p.num_valid <= c.num_computed), after


def act_recover_raising_stats(c: Counters, p):
    """Recovery that raises the external count by one."""
    guard, after = act_recover(c, p)
    return guard, attrs.evolve(after, num_external=c.num_external + 1)


def act_schedule_waiting_resetting_stats(c: Counters, p):
    """#36859: a re-scheduling re-sets ``num_external_computed_tokens`` to its own
    external hits, while ``num_cached_tokens`` keeps the first value."""
    guard, after = act_schedule_waiting(c, p)
    start = after.num_computed - p.num_new
    external = compute_first_external(start, p.num_local, p.num_external)
    return guard, attrs.evolve(after, num_external=If(has_stats(c), external,
                                                      after.num_external))


def act_recover_lowering_cached_only(c: Counters, p):
    """Recovery lowers the cached count to the kept prefix, not the external one."""
    guard, after = act_recover(c, p)
    cached, external = lower_cached_only(c.num_cached, c.num_external, p.num_valid)
    has = c.num_cached >= 0
    return guard, attrs.evolve(after, num_cached=If(has, cached, c.num_cached),
                               num_external=If(has, external, c.num_external))


def act_sample_without_rollback(c: Counters, p):
    """Rejected drafts keep counting as computed."""
    guard, after = act_sample(c, p)
    return guard, attrs.evolve(after, num_computed=c.num_computed)


# -- one past each per-request claim's boundary (the sentinels of spec/prove.py) ------

def act_schedule_waiting_recording_whole_external(c: Counters, p):
    """The connector's whole answer recorded as external hits, the token a full
    hit recomputes included: one more external than cached (what 0.18.1 reports
    for a full-prompt async hit)."""
    return act_schedule_waiting(c, p, first_external=first_external_uncapped)


def act_schedule_waiting_recording_again(c: Counters, p):
    """A re-scheduling after preemption records the stats a second time."""
    return act_schedule_waiting(attrs.evolve(c, num_cached=-1), p)


def act_finish_async_load_dropping_last_loaded(c: Counters, p):
    """A finished load gives back its last loaded token on every hit, as if each
    were a full-prompt hit: one token short of the hits it reported."""
    guard, after = act_finish_async_load(c, p)
    return guard, attrs.evolve(after, num_computed=If(c.num_computed >= 1,
                                                      c.num_computed - 1, 0))


def act_compute_one_token_uncovered(c: Counters, p):
    """Slots asked for every scheduled token but the last."""
    end = c.num_computed + p.num_new
    guard = And(c.status == RUNNING, is_chunk(c.num_tokens, end, p.num_new, p.num_drafts),
                is_blocks_cover_computed(p.num_blocks, c.block_size, end - 1))
    return guard, attrs.evolve(c, num_computed=end, num_blocks=p.num_blocks)


def act_schedule_loaded_without_stats(c: Counters, p):
    """A request whose load finished runs without recording its stats."""
    guard, after = act_schedule_loaded(c, p)
    return guard, attrs.evolve(after, num_cached=c.num_cached, num_external=c.num_external,
                               num_stats_sets=c.num_stats_sets)


def act_preempt_uncounted(c: Counters, p):
    """A preemption that sends the request back to WAITING uncounted: it looks
    like a request that never ran, tokens it sampled and all."""
    return c.status == RUNNING, attrs.evolve(c, status=WAITING, num_computed=0, num_blocks=0)


def act_finish_async_load_waking_as_preempted(c: Counters, p):
    """The status a finished load wakes to, with its threshold one too low: every
    request comes back PREEMPTED."""
    guard, after = act_finish_async_load(c, p)
    return guard, attrs.evolve(after, status=If(c.num_preemptions >= 0, PREEMPTED, WAITING))


def act_sample_stale_returning_share(c: Counters, p):
    """#47900: a preempted request's stale output, applied like fresh output,
    takes its one token's share off the placeholders the preemption zeroed."""
    guard, after = act_sample_stale(c, p)
    return guard, attrs.evolve(after, num_placeholders=c.num_placeholders - 1)


# -- the block pool ----------------------------------------------------------------

def act_issue_async_load_caching(p: Pool, r: int, b: int):
    """Review of #34616: async-load blocks cached at allocation, before the KV arrived."""
    guard, after = act_issue_async_load(p, r, b)
    return guard, attrs.evolve(after, cached=_set(p.cached, b, True))


def act_sync_load_keeping_failed_cached(p: Pool, r: int, b: int, ok: bool):
    """Review of #34616: a block whose load failed stays in the prefix cache."""
    guard, after = act_sync_load(p, r, b, ok)
    return guard, attrs.evolve(after, cached=_set(p.cached, b, True))


def act_free_under_load(p: Pool, r: int):
    """Blocks freed while a load still writes them (abort mid-load, #46240)."""
    _, after = act_free(p, r)
    return True, after


def act_free_keeping_references(p: Pool, r: int):
    """A free that drops the request's table but not the blocks' counts."""
    return True, attrs.evolve(p, holds=_set(p.holds, r, tuple(False for _ in p.holds[r])))



def act_free_leaving_blocks_unqueued(p: Pool, r: int):
    """A free that drops the counts but queues no block that reaches zero: a leak."""
    guard, after = act_free(p, r)
    return guard, attrs.evolve(after, free=p.free)
