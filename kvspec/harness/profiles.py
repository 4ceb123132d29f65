"""Environment profiles: what the environment may do.

Every run draws from the whole environment (``FULL``) less what the spec does not
model (``UNMODELLED``: that is ``MODELLED``), less what the user asks
to leave out (``--layouts``, ``--kv torch``) and what a target does not map at
all (every target: spec decode beside a last-state group, which the spec does
not model; the vllm target: last-state groups on releases before 0.28.0, a
connector opting out of KV delivery before vLLM had ``requires_kv_delivery``). Known
findings narrow nothing: a counterexample one explains is reported as that
finding and the run goes on (kvspec/harness/known.py). Any other difference from ``FULL`` is a narrowing
nobody asked for, named in the verdict's first line, and the run exits 3
(kvspec/verdict.py).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class EnvProfile:
    name: str
    policies: tuple[str, ...] = ("fcfs", "priority")
    failure_policies: tuple[str, ...] = ("recompute", "fail")
    #: the environment may fail loads
    load_failures: bool = True
    #: a request may both load asynchronously and send its KV when finished
    async_load_with_send: bool = True
    #: a positive long_prefill_token_threshold is never drawn below this
    min_prefill_threshold: int = 0
    #: the pool has at least this many blocks beyond one request of max_model_len
    min_spare_blocks: int = 1
    #: scheduling modes drawn: async (vLLM's default since 0.32) and sync
    scheduling: tuple[str, ...] = ("async", "sync")
    #: under async scheduling, spec decode (placeholder drafts) may be configured
    async_spec_decode: bool = True
    #: connector roles drawn: kv_both (loads and stores), kv_consumer (loads
    #: only), kv_producer (stores only)
    kv_roles: tuple[str, ...] = ("kv_both", "kv_consumer", "kv_producer")
    #: connectors drawn: "default" (KV delivery as the role implies), "best_effort"
    #: (no KV delivery required), "none" (no connector)
    connectors: tuple[str, ...] = ("default", "best_effort", "none")
    #: KV cache group layouts drawn (``machine.LAYOUTS``): one full-attention
    #: group, or hybrid ones with sliding-window and last-state groups, and full
    #: attention beside a sliding window of another block size
    layouts: tuple[str, ...] = ("full", "sliding", "sliding+state", "state", "sliding-mixed")
    #: spec decode (drafts, sync or async) beside a last-state group. Part of the
    #: whole environment, but no target draws it (``MODELLED``; ``cli.target_gaps`` names it):
    #: vLLM keeps a Mamba state per draft in speculative blocks that neither the
    #: spec nor the reference models (one state per block: a rejected draft's
    #: state would stay in the block the next step reads)
    spec_decode_with_last_state: bool = True
    #: with several KV cache groups, which loads may fail: "any", "async" (a
    #: sync-loaded request's failure has no report the release takes) or "none"
    load_failures_with_groups: str = attrs.field(
        default="any", validator=attrs.validators.in_(("any", "async", "none")))
    #: why a restriction is there, where a caller says (named in the verdict)
    because: tuple[str, ...] = ()


FULL = EnvProfile("full")

#: what no target draws because the spec does not model it, by profile field and
#: why (every verdict's first line names it: ``cli.target_gaps``)
UNMODELLED = {"spec_decode_with_last_state": (
    "drafts beside a last-state group: vLLM keeps a Mamba state per draft in speculative "
    "blocks, which neither the spec nor the reference models; docs/notes/hybrid-groups.md")}
#: what every run draws by default: the whole environment less ``UNMODELLED``
MODELLED = attrs.evolve(FULL, **{field: False for field in UNMODELLED})
