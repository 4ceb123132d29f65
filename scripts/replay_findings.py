"""Replay every finding trace in docs/findings/ on the installed vLLM (target ``vllm``).

    HF_HUB_OFFLINE=1 /work/venvs/vllm-VERSION/bin/python scripts/replay_findings.py [--json OUT]

One line per trace: ``fails`` (exactly the recorded invariants), ``fails-differently``
(other invariants, or another exception for a recorded crash), ``passes``, or
``error`` (the target could not run it). A trace that fails differently is replayed
again with the unexpected invariants ignored (``masked``): if the recorded ones
then break, the finding is there too, hidden behind an earlier one. With --json,
the same as a JSON object {"vllm": version, "traces": {name: {...}}}. Used to fill
in "Affected releases" in each finding's write-up and docs/vllm-releases.md.
Ignoring invariants is for this analysis only; tests and CI never do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness import replay as replay_module  # noqa: E402
from kvspec.harness.accepted_findings import installed_vllm_version  # noqa: E402
from kvspec.harness.replay import replay_trace  # noqa: E402
from kvspec.harness.runner import Runner  # noqa: E402

FINDINGS = Path(__file__).resolve().parent.parent / "docs" / "findings"


def crash_kind(messages) -> set[str]:
    """'target_crashed: AssertionError: file:line: source' -> 'AssertionError: source'."""
    kinds = set()
    for m in messages:
        if m.startswith("target_crashed: "):
            text = m[len("target_crashed: "):]
            kind, _, rest = text.partition(": ")
            kinds.add(f"{kind}: {rest.split(': ', 1)[-1]}" if kind == "AssertionError" else kind)
    return kinds


def replay_ignoring(path: Path, ignored: set[str]):
    """Replay with some invariants' violations dropped (analysis only)."""

    class Lenient(Runner):
        def _check(self, *args, **kwargs):
            return [v for v in super()._check(*args, **kwargs) if v.invariant not in ignored]

    saved = replay_module.Runner
    replay_module.Runner = Lenient
    try:
        return replay_trace(path, "vllm")
    finally:
        replay_module.Runner = saved


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("traces", nargs="*", type=Path)
    args = parser.parse_args()
    traces = args.traces or sorted(FINDINGS.glob("*.json"))
    results = {}
    for path in traces:
        verdict = json.loads(path.read_text()).get("verdict", [])
        recorded = sorted({v["invariant"] for v in verdict})
        recorded_crash = crash_kind(f"{v['invariant']}: {v['message']}" for v in verdict)
        try:
            outcome = replay_trace(path, "vllm")
        except Exception as exc:  # noqa: BLE001 - report, do not stop
            results[path.name] = {"result": "error", "recorded": recorded,
                                  "error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            got = sorted({v.invariant for v in outcome.violations})
            messages = [f"{v.invariant}: {v.message}"[:300] for v in outcome.violations]
            same = got == recorded and crash_kind(messages) == recorded_crash
            result = "passes" if not got else ("fails" if same else "fails-differently")
            results[path.name] = {"result": result, "recorded": recorded, "got": got,
                                  "messages": messages}
            ignored: set[str] = set()
            while result == "fails-differently" and len(ignored) < 6:
                extra = set(got) - set(recorded)
                if not extra or "target_crashed" in extra:
                    break
                ignored |= extra
                again = replay_ignoring(path, ignored)
                got = sorted({v.invariant for v in again.violations})
                messages = [f"{v.invariant}: {v.message}"[:300] for v in again.violations]
                results[path.name].setdefault("masked", []).append({
                    "ignored": sorted(ignored), "got": got, "messages": messages,
                    "recorded_breaks": set(recorded) <= set(got)})
                if set(recorded) <= set(got) or not got:
                    break
        r = results[path.name]
        detail = r.get("error") or ", ".join(r.get("got", ())) or "-"
        for masked in r.get("masked", ()):
            detail += (f" | ignoring {', '.join(masked['ignored'])}: "
                       f"{', '.join(masked['got']) or 'passes'}")
        print(f"{r['result']:18} {path.name}: {detail}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"vllm": installed_vllm_version(), "traces": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
