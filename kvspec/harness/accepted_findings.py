"""Known findings: every finding kvspec has written up (docs/findings/), with
the releases it was measured on, its traces, its remedy and its upstream status.

Known findings are fixed, not stepped around, and recognised by behaviour, not
by version strings (:mod:`kvspec.harness.known`). Each has a remedy:
- "fix": a minimal patch of vLLM's source (``kvspec/harness/vllm_patches.py``),
  applied at import by default, so the whole environment stays explored and a
  new bug in the same code still shows;
- "contract": the finding needs a connector answer no in-tree connector gives;
  the environment keeps to vLLM's connector contract instead (``env.py``), and
  the finding's trace steps outside it on purpose (``beyond_contract``);
- "none": no fix written yet. The environment is not narrowed for it: a
  counterexample that behaves as its trace does is reported as this finding
  and the run goes on (``kvspec.harness.known``).

``ACCEPTED`` records what was measured per release (scripts/replay_findings.py,
docs/vllm-releases.md): the tests hold each measured release to it. It decides
nothing at run time; a source kvspec has never seen is probed like any other.
"""
from __future__ import annotations

import attrs



@attrs.frozen
class AcceptedFinding:
    id: str
    summary: str
    traces: tuple[str, ...]          # under docs/findings/
    #: "fix" or "contract" (see the module doc); "none": no fix written yet
    remedy: str = "fix"
    #: the id of its fix in kvspec/harness/vllm_patches.FIXES (default: its own id)
    fix: str = ""
    #: what upstream knows of it, one line (issues and pull requests)
    upstream: str = ""
    #: the KV connector whose own code has it (``--connector``), or "" for vLLM's scheduler
    connector: str = ""

    @property
    def fix_id(self) -> str | None:
        return (self.fix or self.id) if self.remedy == "fix" else None


#: one fix of the recovery loop closes two findings
RECOVERY_FIX = "recovery-cuts-every-request-at-its-first-failed-block"

FINDINGS_0_32_0 = (
    AcceptedFinding("sync-full-prompt-hit-crash",
                    "a sync external hit of the whole prompt crashes schedule()",
                    ("vllm-0.32.0-sync-full-prompt-hit-crash.json",), remedy="contract",
                    upstream="known: #30320 (open); PRs #50864 (closed), #55113 (open)"),
    AcceptedFinding("one-token-async-hit-livelock",
                    "a one-token prompt fully hit by an async load re-queries forever",
                    ("vllm-0.32.0-one-token-async-hit-livelock.json",), remedy="contract",
                    upstream="not reported; no in-tree connector triggers it"),
    AcceptedFinding("priority-preempt-caches-uncomputed-block",
                    "priority policy: preempted in the step it was scheduled, its "
                    "never-computed block stays in the prefix cache",
                    ("vllm-0.32.0-priority-preempt-caches-uncomputed-block.json",),
                    upstream="known: PR #43569 (open)"),
    AcceptedFinding("fail-policy-shared-failure-downstream-cached",
                    "'fail' policy: a failed block shared in one batch leaves garbage cached",
                    ("vllm-0.32.0-fail-policy-shared-failure-downstream-cached.json",),
                    fix=RECOVERY_FIX,
                    upstream="not reported upstream (flagged in vllm-ascend #12184)"),
    AcceptedFinding("recompute-failed-block-stays-cached",
                    "'recompute' policy: failed blocks stay cached; sharers count them",
                    ("vllm-0.32.0-recompute-failed-block-stays-cached.json",
                     "vllm-0.32.0-recompute-failed-block-shared.json",
                     "vllm-0.32.0-recompute-failed-block-own-and-shared.json",
                     "vllm-0.32.0-recompute-failed-block-read-during-partial-recompute.json"),
                    fix=RECOVERY_FIX, upstream="known: #49250 (open)"),
    AcceptedFinding("failed-async-load-self-reservation-hang",
                    "a failed async load reserves blocks against its own retry and hangs",
                    ("vllm-0.32.0-failed-async-load-self-reservation-hang.json",
                     "vllm-0.32.0-failed-async-load-retry-blocks-finished-load.json"),
                    upstream="not reported (adjacent: #48433 closed)"),
    AcceptedFinding("abort-mid-load-frees-under-send",
                    "abort during an async load merges 'loading' and 'delayed free' flags: "
                    "blocks freed under a send, or an assert",
                    ("vllm-0.32.0-abort-mid-load-frees-under-send.json",
                     "vllm-0.32.0-abort-mid-load-send-assert.json"),
                    upstream="assert known: #46240, #43226 (open), PR #46304, PR #56089 (open)"),
)


# Found once every other finding was fixed and the default check explored everything.
ASYNC_LOAD_RESERVATION_PAST_MAX_MODEL_LEN = AcceptedFinding(
    "async-load-reservation-past-max-model-len",
    "an async load of a prompt near max_model_len reserves a spec-decode step past "
    "max_model_len and is never admitted into a pool sized for max_model_len",
    ("vllm-0.32.0-async-load-reservation-past-max-model-len.json",),
    upstream="not reported; most likely a regression of #57104 (in 0.32.0; the trace first "
             "fails on 0.31.0)")

# Found after the seven above (once the fuzzer drew a threshold of 1); 0.31.0 has it too.
SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD = AcceptedFinding(
    "spec-pad-clipped-by-prefill-threshold",
    "a new request padded with placeholder drafts is cut by the long-prefill cap "
    "and schedule() asserts",
    ("vllm-0.32.0-spec-pad-clipped-by-prefill-threshold.json",
     "vllm-0.32.0-spec-pad-clipped-beside-a-running-decode.json"),
    upstream="known: PR #54028 (open)")


def _reproduced(*ids: str) -> tuple[AcceptedFinding, ...]:
    """The 0.32.0 findings whose traces also fail on an older release, with the
    invariants recorded (scripts/replay_findings.py; docs/vllm-releases.md)."""
    by_id = {f.id: f for f in FINDINGS_0_32_0}
    return tuple(by_id[i] for i in ids)


def _only_traces(finding_id: str, *traces: str) -> AcceptedFinding:
    """A 0.32.0 finding of which only some traces fail on an older release."""
    finding = next(f for f in FINDINGS_0_32_0 if f.id == finding_id)
    assert set(traces) <= set(finding.traces), traces
    return attrs.evolve(finding, traces=traces)


# Findings of older releases only (fixed upstream by 0.32.0). Each has a backport
# of the upstream fix (kvspec/harness/vllm_patches.FIXES, a diff that fits only
# the older releases), applied by default there like the 0.32.0 fixes.
ASYNC_LOAD_COUNTS_WHOLE_BLOCK = AcceptedFinding(
    "async-load-counts-whole-block",
    "a finished async load counts whole blocks past the last external token: "
    "never-written KV is cached and read",
    ("vllm-0.14.1-async-load-counts-whole-block.json",),
    fix="async-load-counts-whole-block", upstream="fixed upstream by #34616")
STATS_RESET_AFTER_PREEMPTION = AcceptedFinding(
    "stats-reset-after-preemption",
    "a request preempted before its first output has its cache-hit stats re-set "
    "by the next prefix lookup",
    ("vllm-0.24.0-stats-reset-after-preemption.json",),
    fix="stats-reset-after-preemption", upstream="fixed upstream by #37460 (#36859 closed)")
SPEC_PAD_PAST_MAX_MODEL_LEN = AcceptedFinding(
    "spec-pad-past-max-model-len",
    "padding a new request's last token with placeholder drafts schedules a "
    "position at max_model_len, with no room for the sampled token",
    ("vllm-0.28.0-spec-pad-past-max-model-len.json",),
    fix="spec-pad-past-max-model-len", upstream="fixed upstream by #53962")

# 0.28.0 pads only beside a running decode and has no assert: drafts scheduled
# for no position, and the computed count rolled back below the cached prefix.
SPEC_PAD_CLIPPED_0_28_0 = attrs.evolve(
    SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD,
    traces=("vllm-0.28.0-spec-pad-clipped-no-assert.json",))

# Found when the releases were re-measured with the fixes (2026-11-23); no fix
# written yet, so the default check on those releases still meets them.
WAITING_HEAD_BLOCKS_FINISHED_LOAD = AcceptedFinding(
    "waiting-head-blocks-finished-load",
    "a waiting request that cannot be allocated blocks the promotion of a finished "
    "async load queued behind it, whose blocks it needs: a deadlock",
    ("vllm-0.24.0-waiting-head-blocks-finished-load.json",), remedy="none",
    upstream="known: #45388 (closed); PR #45406")
FULL_ASYNC_HIT_EXTERNAL_EXCEEDS_CACHED = AcceptedFinding(
    "full-async-hit-external-exceeds-cached",
    "a full-prompt async hit records num_cached_tokens = n - 1 but "
    "num_external_computed_tokens = n",
    ("vllm-0.18.1-full-async-hit-external-exceeds-cached.json",), remedy="none",
    upstream="changed upstream by #37460 and #38709")

# Found by the hybrid target (issue 11): with several KV cache groups a load
# failure must be reported per request (``failed_recving``, 0.30.0 on), which vLLM
# honours only for an async load. No fix written: a counterexample that behaves as
# its trace does is reported as this finding and the run goes on.
HYBRID_SYNC_LOAD_FAILURE_UNREPORTABLE = AcceptedFinding(
    "hybrid-sync-load-failure-unreportable",
    "several KV cache groups: a sync load's failure has no report vLLM takes "
    "(invalid_block_ids raise RuntimeError, failed_recving is ignored for a running request)",
    ("vllm-0.32.0-hybrid-sync-load-failure-unreportable.json",), remedy="none",
    upstream="no fix upstream; the direction of open PR #56733")
# Before 0.31.0 block ids crash unpacking the hybrid coordinator's groups (#45474).
HYBRID_BLOCK_FAILURE_UNPACK_CRASH = AcceptedFinding(
    "hybrid-block-failure-unpack-crash",
    "several KV cache groups: any invalid_block_ids crash update_from_output with "
    "ValueError (too many values to unpack, #45474)",
    ("vllm-0.28.0-hybrid-block-failure-unpack-crash.json",), remedy="none",
    upstream="known: #45474, #50687 (open); PRs #45497, #50742, #56135 (open)")

# Found by the hybrid target (issue 11): an async hit of the whole prompt has its
# windowed (and last-state) blocks skipped from the hit's end, not from the token
# recomputed after the load, whose window is left on the null block. 0.31.0 and
# 0.28.0 have it too; on 0.24.0 the fix is not enough (the window is then freed at
# the optimistic boundary under the step in flight), on 0.18.1 and 0.14.1 the
# trace also breaks the stats claims of full-async-hit-external-exceeds-cached.
HYBRID_FULL_PROMPT_HIT_WINDOW_FREED = AcceptedFinding(
    "hybrid-full-prompt-hit-window-freed",
    "several KV cache groups: a full-prompt async hit nulls the sliding-window block "
    "the recomputed last token reads",
    ("vllm-0.32.0-hybrid-full-prompt-hit-window-freed.json",),
    fix="hybrid-full-prompt-hit-keeps-window", upstream="not reported")

# Found by the hybrid target with a last-state group (issue 11): align-mode Mamba
# admission leaves out the block an external hit's state is loaded into, so
# allocate_slots runs out of blocks it said it had. 0.31.0 and 0.28.0 have it too
# (variants of the fix); earlier releases do not map the group.
MAMBA_EXTERNAL_HIT_UNDERCOUNTED = AcceptedFinding(
    "mamba-external-hit-undercounted",
    "a last-state (Mamba, align mode) group: admission does not count the block an "
    "external hit's state needs, and allocation raises ValueError (no free blocks)",
    ("vllm-0.32.0-mamba-external-hit-undercounted.json",),
    fix="mamba-external-hit-counts-its-state-block",
    upstream="known: PR #46892 (open); vllm-ascend #11129 (merged override)")

# Found by a 0.32.0 campaign on hybrid layouts (kvspec fuzz, seed 3302); 0.28.0 on have it.
WINDOW_RESERVATION_COUNTS_NULL_BLOCKS = AcceptedFinding(
    "window-reservation-counts-null-blocks",
    "a sliding-window group's admission cap is compared with the request's block-table "
    "length, null entries out of the window included: an async load past its window "
    "reserves no block for its next step, later loads take it, and nothing runs again",
    ("vllm-0.32.0-window-reservation-counts-null-blocks.json",),
    fix="admission-cap-counts-real-blocks",
    upstream="not reported; the cap came with PR #40946; open PR #55818 (counts only "
             "non-null sliding-window blocks) would likely cover it")

#: Releases measured with scripts/replay_findings.py (docs/vllm-releases.md,
#: 2026-11-23). A 0.32.0 finding is listed for an older release only where each of
#: its listed traces fails there, as released, with exactly the recorded
#: invariants; one that fails there behind another invariant first is in the table
#: of docs/vllm-releases.md, not here. A release's own findings are listed for the
#: releases their traces fail on (their traces, recorded before the claim
#: transition_admitted_by_model, now break it too: docs/vllm-releases.md).
# What the measured releases share (the same code, the same traces failing as recorded).
_0_32_0_AND_0_31_0 = FINDINGS_0_32_0 + (SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD,
                                        ASYNC_LOAD_RESERVATION_PAST_MAX_MODEL_LEN)
_0_28_0_AND_0_24_0 = _reproduced(
    "sync-full-prompt-hit-crash", "one-token-async-hit-livelock",
    "priority-preempt-caches-uncomputed-block", "fail-policy-shared-failure-downstream-cached",
    "recompute-failed-block-stays-cached", "abort-mid-load-frees-under-send") + (
    _only_traces("failed-async-load-self-reservation-hang",
                 "vllm-0.32.0-failed-async-load-self-reservation-hang.json"),
    WAITING_HEAD_BLOCKS_FINISHED_LOAD)
_0_18_1_AND_0_14_1 = _reproduced(
    "sync-full-prompt-hit-crash", "priority-preempt-caches-uncomputed-block",
    "fail-policy-shared-failure-downstream-cached", "recompute-failed-block-stays-cached") + (
    STATS_RESET_AFTER_PREEMPTION,)

# Found by the first async-scheduling runs (issue 10).
ASYNC_RECOVERY_KEEPS_PLACEHOLDERS = AcceptedFinding(
    "async-recovery-keeps-placeholders",
    "async scheduling: load-failure recovery cuts a running request back but keeps its "
    "output placeholders (and delivers output computed on the failed KV)",
    ("vllm-0.32.0-async-recovery-keeps-placeholders.json",),
    fix="async-recovery-drops-output-in-flight",
    upstream="known: #45138, #49250 (open); PRs #45146, #49252 (open)")

RECOVERY_MISSES_REQUESTS_ENDED_MID_STEP = AcceptedFinding(
    "recovery-misses-requests-ended-mid-step",
    "async scheduling: load-failure recovery does not scan a request that ended while the "
    "failing step was in flight; its blocks computed past the failed one stay cached",
    ("vllm-0.32.0-recovery-misses-requests-ended-mid-step.json",),
    fix="recovery-evicts-blocks-of-requests-ended-mid-step",
    upstream="not reported (related: RFC #35780, PR #42461)")

FORCED_RESET_RAISES_UNDER_DEFERRED_FREES = AcceptedFinding(
    "forced-reset-raises-under-deferred-frees",
    "async scheduling with a consumer connector: a forced reset_prefix_cache with a step in "
    "flight preempts every running request, then raises RuntimeError (their blocks are fenced)",
    ("vllm-0.32.0-forced-reset-raises-under-deferred-frees.json",),
    fix="forced-reset-refuses-with-step-in-flight", upstream="not reported")

# Found by the async target on 0.24.0 (issue 10); 0.18.1 and 0.14.1 have it too. From
# 0.28.0 on a preemption zeroes the placeholders and marks the output stale (#48245).
PREEMPTION_KEEPS_PLACEHOLDERS = AcceptedFinding(
    "preemption-keeps-placeholders",
    "async scheduling: a request preempted with output in flight keeps its placeholders "
    "against num_computed_tokens reset to 0 (the real boundary is negative until that "
    "output returns)",
    ("vllm-0.24.0-preemption-keeps-placeholders.json",),
    fix="preemption-drops-output-in-flight", upstream="fixed upstream by #48245 (0.28 on)")

# Found by the async target on 0.28.0 (issue 10): upstream #49674, fixed from 0.31.0 on by
# #49675. On 0.24.0 the trace fails as recorded only with PREEMPTION_KEEPS_PLACEHOLDERS fixed.
PREEMPTION_CASCADES_PAST_FENCED_VICTIMS = AcceptedFinding(
    "preemption-cascades-past-fenced-victims",
    "async scheduling with a consumer connector: preempting a victim whose blocks are fenced "
    "frees nothing, so the loop preempts on, the requester included; the same requests are "
    "preempted every step and never finish",
    ("vllm-0.28.0-preemption-cascades-past-fenced-victims.json",),
    fix="preemption-stops-at-fenced-victim", upstream="known: #49674; fixed by #49675 (0.31 on)")

# Found by the async target with spec decode on 0.24.0 (issue 10, item 4): upstream
# #46066, fixed from 0.28.0 on. A producer connector keeps the forced reset legal.
STALE_OUTPUT_ROLLS_BACK_REJECTED_DRAFTS = AcceptedFinding(
    "stale-output-rolls-back-rejected-drafts",
    "async scheduling with spec decode: output made stale by a preemption (here a forced "
    "reset_prefix_cache) still takes its rejected drafts off the restarted request's "
    "num_computed_tokens and placeholders, which go negative",
    ("vllm-0.24.0-stale-output-rolls-back-rejected-drafts.json",),
    upstream="fixed upstream by #46066 (0.28 on)")

#: The async findings of 0.32.0 whose traces fail as recorded on the older releases
#: too (the forced reset only where frees are deferred, 0.24.0 on).
_ASYNC_RECOVERY = (ASYNC_RECOVERY_KEEPS_PLACEHOLDERS, RECOVERY_MISSES_REQUESTS_ENDED_MID_STEP)
_ASYNC_0_24_0_ON = _ASYNC_RECOVERY + (FORCED_RESET_RAISES_UNDER_DEFERRED_FREES,)

_0_32_0 = _0_32_0_AND_0_31_0 + (ASYNC_RECOVERY_KEEPS_PLACEHOLDERS,
                                RECOVERY_MISSES_REQUESTS_ENDED_MID_STEP,
                                FORCED_RESET_RAISES_UNDER_DEFERRED_FREES,
                                HYBRID_SYNC_LOAD_FAILURE_UNREPORTABLE,
                                HYBRID_FULL_PROMPT_HIT_WINDOW_FREED,
                                MAMBA_EXTERNAL_HIT_UNDERCOUNTED,
                                WINDOW_RESERVATION_COUNTS_NULL_BLOCKS)

ACCEPTED: dict[str, tuple[AcceptedFinding, ...]] = {
    # 0.33.0 (the upstream wheel): its recovery, reset and allocation code is
    # 0.32.0's; every 0.32.0 trace fails there as recorded (docs/vllm-releases.md)
    "0.33.0": _0_32_0,
    "0.32.0": _0_32_0,
    "0.31.0": _0_32_0_AND_0_31_0 + _ASYNC_0_24_0_ON + (HYBRID_SYNC_LOAD_FAILURE_UNREPORTABLE,
                                                       HYBRID_FULL_PROMPT_HIT_WINDOW_FREED,
                                                       MAMBA_EXTERNAL_HIT_UNDERCOUNTED,
                                                       WINDOW_RESERVATION_COUNTS_NULL_BLOCKS),
    "0.28.0": _0_28_0_AND_0_24_0 + (SPEC_PAD_PAST_MAX_MODEL_LEN, SPEC_PAD_CLIPPED_0_28_0)
    + _ASYNC_0_24_0_ON + (PREEMPTION_CASCADES_PAST_FENCED_VICTIMS,
                          HYBRID_BLOCK_FAILURE_UNPACK_CRASH,
                          HYBRID_FULL_PROMPT_HIT_WINDOW_FREED,
                          MAMBA_EXTERNAL_HIT_UNDERCOUNTED,
                          WINDOW_RESERVATION_COUNTS_NULL_BLOCKS),
    "0.24.0": _0_28_0_AND_0_24_0 + (STATS_RESET_AFTER_PREEMPTION,) + _ASYNC_0_24_0_ON + (
        PREEMPTION_KEEPS_PLACEHOLDERS, STALE_OUTPUT_ROLLS_BACK_REJECTED_DRAFTS,
        HYBRID_BLOCK_FAILURE_UNPACK_CRASH),
    "0.18.1": _0_18_1_AND_0_14_1 + (
        _only_traces("abort-mid-load-frees-under-send",
                     "vllm-0.32.0-abort-mid-load-send-assert.json"),
        FULL_ASYNC_HIT_EXTERNAL_EXCEEDS_CACHED) + _ASYNC_RECOVERY + (
        PREEMPTION_KEEPS_PLACEHOLDERS, STALE_OUTPUT_ROLLS_BACK_REJECTED_DRAFTS,
        HYBRID_BLOCK_FAILURE_UNPACK_CRASH),
    "0.14.1": _0_18_1_AND_0_14_1 + (ASYNC_LOAD_COUNTS_WHOLE_BLOCK,) + _ASYNC_RECOVERY + (
        PREEMPTION_KEEPS_PLACEHOLDERS, STALE_OUTPUT_ROLLS_BACK_REJECTED_DRAFTS,
        HYBRID_BLOCK_FAILURE_UNPACK_CRASH),
}


def installed_vllm_version() -> str:
    """The version of the vLLM this process checks (``vllm_source.active()``):
    the installed release's, or the chosen source's."""
    from kvspec.harness.vllm_source import active
    return active().version


def accepted_for(version: str) -> tuple[AcceptedFinding, ...]:
    """What was measured on ``version`` (empty for a release not measured)."""
    return ACCEPTED.get(version, ())


def catalogue() -> dict[str, AcceptedFinding]:
    """Every known finding, by id, with the traces of every release it was
    measured on (the release-specific variants of one finding merged)."""
    found: dict[str, AcceptedFinding] = {}
    for findings in ACCEPTED.values():
        for f in findings:
            if f.id in found:
                traces = found[f.id].traces + tuple(t for t in f.traces
                                                    if t not in found[f.id].traces)
                found[f.id] = attrs.evolve(found[f.id], traces=traces)
            else:
                found[f.id] = f
    return found


def findings_of_fix(fix_id: str) -> list[AcceptedFinding]:
    """The known findings a fix closes."""
    return [f for f in catalogue().values() if f.fix_id == fix_id]


# -- findings in a KV connector's own code (docs/connectors.md) ---------------------
#
# Kept apart from the scheduler's: they are asked only of a run with that connector
# (``--connector``), their traces replay on a target naming it, and kvspec applies
# no fix for them (remedy "none": a counterexample is recognised by its breach of
# the connector's contract, or its crash, as a trace of the finding breaks it; the
# remedies under docs/findings/connectors/remedies/ are offered upstream). Whether a
# source still has one is probed like any finding's, never read off a version.
CONNECTOR_FINDINGS: tuple[AcceptedFinding, ...] = (
    AcceptedFinding(
        "example-connector-lookup-and-load-keys-differ",
        "ExampleConnector keys its lookup by (n - 2) // block * block tokens and its load "
        "by (n - 1) // block * block: a promised hit loads a folder nothing saved",
        ("connectors/example-connector-lookup-and-load-keys-differ.json",
         "connectors/example-connector-lookup-and-load-keys-differ-sync.json"), remedy="none",
        connector="ExampleConnector",
        upstream="PR #40684 (closed unmerged); still in 0.32.0 and 0.33.0"),
    AcceptedFinding(
        "example-connector-first-chunk-saved-under-prompt-key",
        "ExampleConnector saves a new request in its first step only, under the whole "
        "prompt's key: a chunked prefill stores positions not computed yet, and a later "
        "hit claims a prompt the files do not hold",
        ("connectors/example-connector-first-chunk-saved-under-prompt-key.json",
         "connectors/example-connector-first-chunk-saved-then-hit-whole.json",
         "connectors/example-connector-first-chunk-hit-claims-whole-prompt.json",
         "connectors/example-connector-first-chunk-hit-after-preemption.json",
         "connectors/example-connector-first-chunk-saved-and-hit-in-one-step.json"),
        remedy="none", connector="ExampleConnector",
        upstream="#16928; open PR #53314 caps the hit at what was saved (the save of a "
                 "partly computed block stays)"),
    AcceptedFinding(
        "example-connector-negative-hit",
        "ExampleConnector answers a negative hit where the local prefix cache already "
        "reaches past its lookup's key, and vLLM takes it",
        ("connectors/example-connector-negative-hit.json",
         "connectors/example-connector-negative-hit-after-preemption.json",
         "connectors/example-connector-negative-hit-one-token-prompt.json",
         "connectors/example-connector-negative-hit-computed-below-zero.json",
         "connectors/example-connector-negative-hit-recomputes-a-shared-slot.json"),
        remedy="none",
        connector="ExampleConnector",
        upstream="open PR #53611 (fixes #53495) covers a one-token prompt, not a local "
                 "hit past the key"),
    AcceptedFinding(
        "offloading-reset-reload-assert",
        "OffloadingConnector: a forced cache reset that preempts and reloads a request "
        "flushes the new load with the preempted one's jobs and asserts",
        ("connectors/offloading-reset-reload-assert.json",), remedy="none",
        connector="OffloadingConnector",
        upstream="fixed in 0.33.0 (its flush leaves the step's new loads out); open PR "
                 "#57810 reaches the same assert through pause/sleep"),
    AcceptedFinding(
        "mooncake-store-forced-reset-resume-typeerror",
        "MooncakeStoreConnector: a request preempted by a forced prefix-cache reset and "
        "resumed by the next schedule() crashes build_connector_meta with TypeError",
        ("connectors/mooncake-store-forced-reset-resume-typeerror.json",), remedy="none",
        connector="MooncakeStoreConnector",
        upstream="not reported; remedy docs/findings/connectors/remedies/"
                 "mooncake-store-keep-resumed-state.diff"),
    AcceptedFinding(
        "hf3fs-resumed-request-saves-stale-blocks",
        "HF3FSKVConnector: a resumed request's new block ids are appended to its old "
        "table, so its saves read blocks of the old table, not its KV",
        ("connectors/hf3fs-resumed-request-saves-stale-blocks.json",), remedy="none",
        connector="HF3FSKVConnector",
        upstream="not reported; remedy docs/findings/connectors/remedies/"
                 "hf3fs-resumed-request-replaces-table.diff"),
)


def connector_findings(name: str) -> tuple[AcceptedFinding, ...]:
    """The known findings of the connector ``name`` (as ``--connector`` names it)."""
    return tuple(f for f in CONNECTOR_FINDINGS if f.connector == name)
