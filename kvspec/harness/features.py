"""Environment features a run exercises, counted in steps (``kvspec check
--json``): the evidence that a green run drove what it claims to check."""
from __future__ import annotations

from collections import Counter

from kvspec.spec.groups import NULL_BLOCK
from kvspec.spec.state import Config, Observation, StepView, WorkerOutcome

#: actions that ended without a conformance step (``check --json``'s not_evaluated)
OUTSIDE_MODEL = "actions_outside_conformance_model"

FEATURES = ("load_failures", "async_loads", "preemptions", "spec_decode",
            "failure_policy_recompute", "failure_policy_fail", "policy_fcfs", "policy_priority",
            "sends", "prefix_cache_resets", "async_scheduling",
            "output_in_flight_at_preemption", "draft_rollback_in_flight",
            # several KV cache groups (issue 11)
            "hybrid_groups", "sliding_window", "last_state_group",
            "load_failure_in_non_full_group",
            # steps whose KV was moved and checked in real tensors (--kv torch, issue 13)
            "kv_torch",
            # what vLLM's own tests drive (issue 26): connector roles and P/D
            # transfer params, no connector, stale output delivered (a connector
            # that does not require KV delivery), 3 or 4 steps in flight, 3 or 4 drafts
            "role_kv_both", "role_kv_consumer", "role_kv_producer", "no_connector",
            "pd_transfer_params", "stale_output_delivered", "steps_in_flight_3",
            "steps_in_flight_4", "drafts_3_or_4",
            # groups of two block sizes: a step over them, and a request running
            # on a local prefix hit (which ends where every group's blocks end)
            "two_block_sizes", "two_block_sizes_local_hit")


def count_step(f: Counter, cfg: Config, step: StepView, outcome: WorkerOutcome,
               mid: Observation) -> None:
    live = sum(not r.status.is_finished for r in mid.requests.values())
    busy = bool(step.num_scheduled_tokens)
    f[f"role_{cfg.kv_role}" if cfg.kv_connector else "no_connector"] += busy
    f["drafts_3_or_4"] += any(len(d) >= 3 for d in step.scheduled_spec_decode_tokens.values())
    f["load_failures"] += bool(outcome.invalid_block_ids)
    f["async_loads"] += bool(outcome.finished_recving)
    f["preemptions"] += bool(step.preempted_req_ids)
    f["spec_decode"] += any(step.scheduled_spec_decode_tokens.values())
    f[f"failure_policy_{cfg.kv_load_failure_policy}"] += bool(outcome.invalid_block_ids)
    f[f"policy_{cfg.policy}"] += live >= 2
    f["sends"] += bool(outcome.finished_sending)
    if len(cfg.groups) > 1:
        count_groups(f, cfg, step, outcome, mid)


def count_groups(f: Counter, cfg: Config, step: StepView, outcome: WorkerOutcome,
                 mid: Observation) -> None:
    """Several KV cache groups at work: a step over them; a sliding-window
    or last-state table that gave blocks back; a failed block outside the
    full-attention group."""
    f["hybrid_groups"] += bool(step.num_scheduled_tokens)
    tables = [(cfg.groups[g].kind, t) for r in mid.requests.values()
              for g, t in enumerate(r.block_ids)]
    for kind, feature in (("sliding_window", "sliding_window"),
                          ("last_state", "last_state_group")):
        f[feature] += any(k == kind and NULL_BLOCK in t for k, t in tables)
    f["load_failure_in_non_full_group"] += any(
        k != "full_attention" and set(t) & outcome.invalid_block_ids for k, t in tables)
    if cfg.has_mixed_block_sizes:
        f["two_block_sizes"] += bool(step.num_scheduled_tokens)
        f["two_block_sizes_local_hit"] += any(
            r.num_cached_tokens > max(r.num_external_computed_tokens, 0)
            for rid, r in mid.requests.items() if rid in step.num_scheduled_tokens)


def count_async_schedule(f: Counter, step: StepView, in_flight: set[str],
                         num_in_flight: int) -> None:
    """A step scheduled while others are in flight (2 or 3 of them: the step
    makes 3 or 4); a preemption of a request whose output is in flight."""
    scheduled = bool(step.total_num_scheduled_tokens)
    f["async_scheduling"] += bool(num_in_flight and scheduled)
    f["steps_in_flight_3"] += num_in_flight == 2 and scheduled
    f["steps_in_flight_4"] += num_in_flight == 3 and scheduled
    f["output_in_flight_at_preemption"] += bool(step.preempted_req_ids & in_flight)


def count_delivery(f: Counter, stale: set[str], outcome: WorkerOutcome, plans: dict,
                   before: Observation, after: Observation) -> None:
    """A step's output came back: stale output a target appended (its connector
    requires no KV delivery); a request with P/D transfer params at work."""
    f["stale_output_delivered"] += any(
        len(after.requests[rid].output_token_ids) > len(before.requests[rid].output_token_ids)
        for rid in stale if rid in before.requests and rid in after.requests)
    f["pd_transfer_params"] += any(plans[rid].pd for rid in outcome.sampled_token_ids
                                   if rid in plans)
