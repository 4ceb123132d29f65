"""Token arithmetic of the KV path: pure functions, evaluable by Z3.

These are the rules the scheduler must follow; the lemmas of ``kvspec prove``
and the relations of ``actions`` are stated with them.
"""
from __future__ import annotations

from kvspec.spec.logic import If, Max, Min, cdiv  # noqa: F401  (re-exported for proofs)


def compute_num_computed_after_hit(num_local, num_external, num_tokens):
    """Tokens counted as computed after a (sync or successful async) hit:
    local + external, but always leaving the last token to compute so that the
    request can sample (the full-prompt-hit rule)."""
    return Min(num_local + num_external, num_tokens - 1)


def compute_num_computed_pre_34616(num_allocated_blocks, block_size, num_tokens):
    """The rule vLLM used before #34616 after an async load: a block multiple,
    clipped to the prompt, minus one on a full hit. Wrong when the last external
    token sits mid-block before the prompt end."""
    rounded = Min(num_allocated_blocks * block_size, num_tokens)
    return If(rounded == num_tokens, num_tokens - 1, rounded)


def compute_truncated_computed(first_invalid_block, block_size, num_computed):
    """``num_computed_tokens`` after a load failure: everything before the first
    invalid block, never more than before."""
    return Min(first_invalid_block * block_size, num_computed)


def compute_external_stat(num_cached, num_local):
    """External hits recorded in the stats: what the cache gave beyond local hits."""
    return Max(0, num_cached - num_local)


def compute_computed_after_rejection(num_computed, num_drafts, num_accepted):
    """Spec decode: rejected drafts are no longer computed."""
    return num_computed - (num_drafts - num_accepted)


def compute_lowered_stats(num_cached, num_external, num_valid):
    """Stats after failure recovery keeps ``num_valid`` tokens: both lowered
    together, local hits first to survive (they did not come from the failed load)."""
    num_local = num_cached - num_external
    lowered = Min(num_cached, num_valid)
    return lowered, Max(0, lowered - num_local)


def compute_external_lowered(num_cached, num_external, num_valid):
    """Stats after failure recovery keeps ``num_valid`` tokens, lowering only the
    external count: to what of it the kept prefix still covers past the local hits."""
    num_local = num_cached - num_external
    return num_cached, Max(0, Min(num_external, num_valid - num_local))


def compute_first_stats(num_local, num_external, num_tokens):
    """Stats at the first scheduling: what counts as computed, and how much of it
    came from the external store (the full-hit rule takes the last token back)."""
    num_cached = compute_num_computed_after_hit(num_local, num_external, num_tokens)
    return num_cached, compute_first_external(num_cached, num_local, num_external)


def compute_first_external(num_cached, num_local, num_external):
    """The external part of the first scheduling's hits: the connector's answer,
    less whatever of it the scheduling did not count as computed."""
    return Max(0, Min(num_external, num_cached - num_local))
