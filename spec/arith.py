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


def compute_num_rejected(num_drafts, num_sampled):
    """Spec decode: the drafts a step's output rejects (it samples the accepted
    drafts and one token)."""
    return num_drafts - (num_sampled - 1)


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


# -- async scheduling: output placeholders ------------------------------------------
#
# Under async scheduling step N+1 is scheduled before step N's output arrives. A
# request that samples in a step (not a prefill chunk) gets one placeholder per
# token the step will produce (the sampled token plus its scheduled drafts), so
# that ``num_computed_tokens`` may run ahead of the tokens the scheduler knows.
# Everything that treats positions as real KV (the prefix cache, a connector
# store) must stop at ``compute_real_computed`` (#27644).

def compute_placeholders_after_schedule(num_placeholders, num_drafts, is_prefill_chunk):
    """Placeholders once a step is scheduled: one per token the step will sample
    (the bonus token and every scheduled draft); a prefill chunk samples nothing."""
    return If(is_prefill_chunk, num_placeholders, num_placeholders + 1 + num_drafts)


def compute_placeholders_after_output(num_placeholders, num_drafts, num_sampled, is_stale):
    """Placeholders once a step's output is applied: the rejected drafts and the
    appended tokens stop being placeholders, which is the step's whole share
    (1 + drafts). Output made stale by a preemption in between no longer owns a
    share: the preemption zeroed them (#47900, #48245)."""
    num_rejected = compute_num_rejected(num_drafts, num_sampled)
    return If(is_stale, num_placeholders, num_placeholders - num_rejected - num_sampled)


def compute_real_computed(num_computed, num_placeholders):
    """The computed positions whose tokens are known: the boundary the prefix
    cache and a connector's store may use (#27644)."""
    return num_computed - num_placeholders


def compute_running_new_tokens(num_tokens, num_spec, num_placeholders, num_computed):
    """Positions a running request may be scheduled: its known tokens and drafts,
    plus the placeholder positions its steps in flight will fill, less what is
    computed."""
    return num_tokens + num_spec + num_placeholders - num_computed
