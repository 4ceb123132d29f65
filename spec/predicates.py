"""Per-request predicates: pure functions of a request's counters, written
with the ``logic`` helpers so that the same code judges a concrete request
(the invariants in ``invariants``) and a symbolic one (the proofs in ``prove``).
"""
from __future__ import annotations

from kvspec.spec.logic import And, If, Implies, Min, Not, Or


def is_stats_ordered(prompt_len, num_cached, num_external):
    """``prompt_len >= num_cached >= num_external >= 0``."""
    return And(prompt_len >= num_cached, num_cached >= num_external, num_external >= 0)


def is_cached_le_computed(is_running, is_waiting, num_cached, num_computed, num_tokens):
    """Hits reported were computed: a running request has computed at least its
    cached count; a waiting one (its load finished or in flight) counts them all
    but the last token, which a full-prompt hit recomputes."""
    return And(Implies(is_running, num_cached <= num_computed),
               Implies(is_waiting, Min(num_cached, num_tokens - 1) <= num_computed))


def is_computed_within_tokens(num_computed, num_tokens):
    return And(0 <= num_computed, num_computed <= num_tokens)


def is_placeholders_nonnegative(num_placeholders):
    """No step in flight owes a request a negative number of tokens."""
    return num_placeholders >= 0


def is_waiting_with_work(is_waiting, num_computed, num_tokens):
    """A waiting request whose KV arrived still has a token to compute."""
    return Implies(is_waiting, num_computed < num_tokens)


def is_preempted_counted(is_preempted, num_preemptions):
    """A PREEMPTED request has been preempted at least once."""
    return Implies(is_preempted, num_preemptions >= 1)


def is_blocks_cover_computed(num_blocks, block_size, num_computed):
    return num_blocks * block_size >= num_computed


def is_unscheduled_without_output(has_stats, is_waiting_unpreempted, num_tokens, prompt_len):
    """A request that has not run has produced no tokens: one without stats (never
    scheduled), or one waiting that was never preempted (nothing but a preemption
    sends a request that ran back to wait)."""
    return Implies(Or(has_stats == False, is_waiting_unpreempted),  # noqa: E712 (z3 terms)
                   num_tokens == prompt_len)


def is_running_with_stats(is_running, has_stats):
    return Implies(is_running, has_stats)


def is_admissible_lowering(old_cached, old_external, new_cached, new_external):
    """Failure recovery may lower the stats, never raise them, and must keep
    them ordered. Which lowering is a scheduler's choice: both together (the
    reference), the external count only, or none at all are all admitted."""
    return And(new_cached <= old_cached, new_external <= old_external,
               new_external >= 0, new_cached >= new_external)


def is_first_cached_count(num_cached, num_hits, num_tokens):
    """The cached count a first scheduling records for ``num_hits`` hits: the
    prefix it starts from, or on a full-prompt hit the whole prompt (the last
    token is recomputed to sample; vLLM counts it as a hit, the reference does
    not). Both describe the same scheduling."""
    return Or(num_cached == Min(num_hits, num_tokens - 1),
              And(num_hits == num_tokens, num_cached == num_tokens))


def is_cached_block_valid(is_cached, is_valid, is_loading):
    """A block in the prefix cache holds the content its hash names, and no
    load is still writing it."""
    return Implies(is_cached, And(is_valid, Not(is_loading)))


def is_load_target_held(is_loading, is_free):
    """A block a load is still writing is held by a request, never free: a free
    block is handed to the next request while the load overwrites it."""
    return Implies(is_loading, Not(is_free))


def is_ref_count_of_holders(ref_cnt, holds):
    """A block's reference count is the number of block tables holding it."""
    return ref_cnt == sum(If(h, 1, 0) for h in holds)


def is_free_iff_unreferenced(is_free, ref_cnt):
    return And(Implies(is_free, ref_cnt == 0), Implies(ref_cnt == 0, is_free))
