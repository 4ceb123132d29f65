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
            "kv_torch")


def count_step(f: Counter, cfg: Config, step: StepView, outcome: WorkerOutcome,
               mid: Observation) -> None:
    live = sum(not r.status.is_finished for r in mid.requests.values())
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


def count_async_schedule(f: Counter, step: StepView, in_flight: set[str], busy: bool) -> None:
    """A step scheduled while another is in flight; a preemption of a request
    whose output is in flight."""
    f["async_scheduling"] += bool(busy and step.total_num_scheduled_tokens)
    f["output_in_flight_at_preemption"] += bool(step.preempted_req_ids & in_flight)
