"""How many steps the healed phase may take before a request still live is a
liveness violation (``Runner._do_drain``), and so how long a replay can run
(``trace.replay_work``): one rule for both."""
from __future__ import annotations

from kvspec.spec.state import Config

#: steps a drain may take beyond its requests' work
DRAIN_SLACK = 20
#: a drain of at most this many tokens may take one step per token (every
#: small run: what it always allowed)
PER_TOKEN_UP_TO = 2_000
#: beyond, how many times the work of a slow schedule a correct scheduler
#: would beat it allows: room for preemptions, recomputation, steps in flight
DRAIN_FACTOR = 4


def get_chunk(config: Config) -> int:
    """The fewest prompt tokens a step gives the request it prefills, when
    nothing else runs: the budget, or the long-prefill threshold below it."""
    threshold = config.long_prefill_token_threshold
    return max(1, min(config.max_num_batched_tokens, threshold or config.max_num_batched_tokens))


def get_resident(config: Config, requests) -> int:
    """How many of ``requests`` certainly fit in the pool and the batch at once:
    the pool over the largest one's blocks in every group."""
    longest = max(p + m for p, m in requests)
    per_request = sum(-(-longest // g.block_size) for g in config.groups)
    return max(1, min(config.max_num_seqs, config.num_blocks // per_request))


def compute_drain_work(config: Config, requests) -> int:
    """Steps the work of ``requests`` ((prompt tokens, max_tokens) of each) may
    take: one step per token (a step computes at least one) for a small drain;
    for a larger one, ``DRAIN_FACTOR`` times a slow schedule: every prompt
    prefilled alone in chunks of ``get_chunk``, then the requests decoded in
    batches of ``get_resident``, each batch for its longest output. At
    production size (2,000-token prompts, an 8,192-token budget, a pool of
    thousands of blocks) that is hundreds of times fewer steps than tokens."""
    per_token = sum(p + m for p, m in requests)
    if per_token <= PER_TOKEN_UP_TO:
        return per_token
    chunk, resident = get_chunk(config), get_resident(config, requests)
    prefill = sum(-(-p // chunk) for p, _m in requests)
    decode = -(-len(requests) // resident) * max(m for _p, m in requests)
    return min(per_token, DRAIN_FACTOR * (prefill + decode))


def compute_drain_bound(config: Config, requests, in_flight: int = 0) -> int:
    """Steps a drain may take for its live ``requests`` (``compute_drain_work``),
    the steps in flight and ``DRAIN_SLACK`` besides."""
    return DRAIN_SLACK + in_flight + compute_drain_work(config, requests)
