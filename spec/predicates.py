"""Per-request predicates: pure functions of a request's counters, written
with the ``logic`` helpers so that the same code judges a concrete request
(the invariants in ``invariants``) and a symbolic one (the proofs in ``prove``).
"""
from __future__ import annotations

from kvspec.spec.logic import And, Implies


def is_stats_ordered(prompt_len, num_cached, num_external):
    """``prompt_len >= num_cached >= num_external >= 0``."""
    return And(prompt_len >= num_cached, num_cached >= num_external, num_external >= 0)


def is_cached_le_computed(is_running, num_preemptions, num_cached, num_computed):
    """While running and never preempted, hits reported were computed."""
    return Implies(And(is_running, num_preemptions == 0), num_cached <= num_computed)


def is_computed_within_tokens(num_computed, num_tokens):
    return And(0 <= num_computed, num_computed <= num_tokens)


def is_waiting_with_work(is_waiting, num_computed, num_tokens):
    """A waiting request whose KV arrived still has a token to compute."""
    return Implies(is_waiting, num_computed < num_tokens)


def is_blocks_cover_computed(num_blocks, block_size, num_computed):
    return num_blocks * block_size >= num_computed


def is_unscheduled_without_output(has_stats, num_tokens, prompt_len):
    """A request never scheduled (stats unset) has produced no tokens."""
    return Implies(has_stats == False, num_tokens == prompt_len)  # noqa: E712 (z3 terms)


def is_running_with_stats(is_running, has_stats):
    return Implies(is_running, has_stats)


def is_ref_count_of_holders(ref_cnt, holds):
    """A block's reference count is the number of block tables holding it."""
    from kvspec.spec.logic import If
    return ref_cnt == sum(If(h, 1, 0) for h in holds)


def is_free_iff_unreferenced(is_free, ref_cnt):
    from kvspec.spec.logic import And, Implies
    return And(Implies(is_free, ref_cnt == 0), Implies(ref_cnt == 0, is_free))
