"""Replay every finding trace in docs/findings/ on the installed vLLM, as released and with the fixes.

    HF_HUB_OFFLINE=1 /work/venvs/vllm-VERSION/bin/python scripts/replay_findings.py [--json OUT]
    HF_HUB_OFFLINE=1 KVSPEC_VLLM=wheels/vllm-0.33.0-….whl python scripts/replay_findings.py

(``KVSPEC_VLLM`` names any vLLM source: a wheel, a checkout; see README.)

Each trace is replayed twice: as released (``vllm?fixes=none``, the target the
traces record) and with every fix that fits the installed release (``vllm``).
One line per trace and target: ``fails`` (exactly the recorded invariants),
``fails-differently`` (other invariants, or another exception for a recorded
crash), ``passes``, or ``error`` (the target could not run it). A trace that
fails differently is replayed again with the unexpected invariants ignored
(``masked``): if the recorded ones then break, the finding is there too, hidden
behind an earlier one. Ignoring invariants is for this analysis only; tests and
CI never do.

With --json, one object::

    {"vllm": version,
     "targets": {"as_released": "vllm?fixes=none", "with_fixes": "vllm"},
     "fixes": {"applied": [ids], "not_fitting": {id: why}},
     "traces": {name: {"finding": id or null, "fix": id or null, "fix_applied": bool,
                       "as_released": {"result", "recorded", "got", "messages", ["masked"]},
                       "with_fixes": {...the same...}}}}

Used to fill in "Affected releases" in each finding's write-up and docs/vllm-releases.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness.accepted_findings import ACCEPTED, installed_vllm_version  # noqa: E402
from kvspec.harness.replay import replay_trace  # noqa: E402

FINDINGS = Path(__file__).resolve().parent.parent / "docs" / "findings"
TARGETS = {"as_released": "vllm?fixes=none", "with_fixes": "vllm"}


def crash_kind(messages) -> set[str]:
    """'target_crashed: AssertionError: file:line: source' -> 'AssertionError: source'
    (the file may be a patched module's, 'scheduler.py (kvspec patches: a, b)')."""
    kinds = set()
    for m in messages:
        if m.startswith("target_crashed: "):
            text = m[len("target_crashed: "):]
            kind, _, rest = text.partition(": ")
            located = re.search(r":\d+: (.*)$", rest)
            kinds.add(f"{kind}: {located.group(1) if located else rest}"
                      if kind == "AssertionError" else kind)
    return kinds


def message(violation) -> str:
    """'invariant: message', a patched module's list of patches shortened."""
    text = re.sub(r" \(kvspec patches: [^)]*\)", " (patched)", violation.message)
    return f"{violation.invariant}: {text}"[:300]


def findings_by_trace() -> dict[str, object]:
    """Trace file name -> the accepted finding (of any release) it belongs to."""
    found = {}
    for findings in ACCEPTED.values():
        for finding in findings:
            for trace in finding.traces:
                found.setdefault(trace, finding)
    return found


def replay_on(path: Path, target: str, recorded: list[str], recorded_crash: set[str]) -> dict:
    """One trace on one target, with the masked replays of a trace that fails differently."""
    try:
        outcome = replay_trace(path, target)
    except Exception as exc:  # noqa: BLE001 - report, do not stop
        return {"result": "error", "recorded": recorded,
                "error": f"{type(exc).__name__}: {exc}"[:300]}
    got = sorted({v.invariant for v in outcome.violations})
    messages = [message(v) for v in outcome.violations]
    same = got == recorded and crash_kind(messages) == recorded_crash
    result = "passes" if not got else ("fails" if same else "fails-differently")
    entry = {"result": result, "recorded": recorded, "got": got, "messages": messages}
    ignored: set[str] = set()
    while result == "fails-differently" and len(ignored) < 6:
        extra = set(got) - set(recorded)
        if not extra or "target_crashed" in extra:
            break
        ignored |= extra
        again = replay_trace(path, target, ignore=frozenset(ignored))
        got = sorted({v.invariant for v in again.violations})
        messages = [message(v) for v in again.violations]
        entry.setdefault("masked", []).append({
            "ignored": sorted(ignored), "got": got, "messages": messages,
            "recorded_breaks": set(recorded) <= set(got)})
        if set(recorded) <= set(got) or not got:
            break
    return entry


def detail(entry: dict) -> str:
    text = entry.get("error") or ", ".join(entry.get("got", ())) or "-"
    for masked in entry.get("masked", ()):
        text += f" | ignoring {', '.join(masked['ignored'])}: {', '.join(masked['got']) or 'passes'}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("traces", nargs="*", type=Path)
    args = parser.parse_args()
    from kvspec.harness.vllm_patches import patched
    fixes = patched("all")
    from kvspec.harness.vllm_source import active
    print(f"{active().label()}: fixes that fit: {', '.join(fixes.applied) or 'none'}"
          + (f"; not fitting: {', '.join(fixes.skipped)}" if fixes.skipped else ""), flush=True)
    owners = findings_by_trace()
    traces = args.traces or sorted(FINDINGS.glob("*.json"))
    results = {}
    for path in traces:
        verdict = json.loads(path.read_text()).get("verdict", [])
        recorded = sorted({v["invariant"] for v in verdict})
        recorded_crash = crash_kind(f"{v['invariant']}: {v['message']}" for v in verdict)
        finding = owners.get(path.name)
        fix_id = finding.fix_id if finding is not None else None
        results[path.name] = entry = {
            "finding": finding.id if finding is not None else None, "fix": fix_id,
            "fix_applied": fix_id is not None and fix_id in fixes.applied}
        for key, target in TARGETS.items():
            entry[key] = replay_on(path, target, recorded, recorded_crash)
            print(f"{entry[key]['result']:18} {key:11} {path.name}: {detail(entry[key])}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "vllm": installed_vllm_version(), "source": active().as_dict(), "targets": TARGETS,
            "fixes": {"applied": list(fixes.applied), "drifted": dict(fixes.drift),
                      "not_fitting": dict(fixes.skipped)},
            "traces": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
