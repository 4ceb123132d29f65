"""A ``check``/``fuzz`` run as Markdown, for a pull-request comment or a CI job
summary (issue 28, item 2; ``kvspec review`` writes its own).

Built from ``kvspec.report.json_summary`` like the JUnit file, so the three never
disagree: the verdict first, then what a reviewer acts on (the violation, its
trace and the replay command), then the known findings met, then what the run
did not show (claims checked but never witnessed), then the claim table folded.
"""
from __future__ import annotations

from pathlib import Path

from kvspec.junit import get_replay_command

HEADINGS = {"hold": "held", "violated": "VIOLATED", "incomplete": "incomplete"}


def get_heading(summary: dict) -> str:
    verdict = HEADINGS.get(summary["verdict"], summary["verdict"])
    runs = summary.get("examples_budget")  # --examples: a budget in runs, no time limit
    budget = f"{runs} runs" if runs else f"{summary['budget_s']:g} s"
    return (f"### kvspec on `{summary['target']}`: {verdict} "
            f"(seed {summary['seed']}, {budget} budget)")


def get_violation_lines(summary: dict) -> list[str]:
    if not summary["violations"]:
        return []
    lines = ["**New counterexample.**", ""]
    lines += [f"- `{v['claim']}`: {v['message']}" for v in summary["violations"]]
    if summary.get("trace"):
        lines += ["", "```bash", get_replay_command(summary), "```"]
    return lines + [""]


def get_known_lines(summary: dict) -> list[str]:
    known = summary.get("known_findings") or []
    if not known:
        return []
    lines = ["**Known findings met** (not failures of this run):", ""]
    lines += [f"- `{k['finding']}` x{k['count']} ({k['upstream'] or 'no upstream reference'})"
              for k in known]
    return lines + [""]


def get_unwitnessed_lines(summary: dict) -> list[str]:
    names = summary.get("unwitnessed") or []
    if not names:
        return []
    return ["**Checked but never witnessed** (held only vacuously this run): "
            + ", ".join(f"`{n}`" for n in names), ""]


def get_claim_table(summary: dict) -> list[str]:
    rows = [f"| `{c['name']}` | {c['kind']} | {c['role']} | "
            f"{'-' if c['checked'] is None else c['checked']} | "
            f"{'-' if c['witnessed'] is None else c['witnessed']} | {c['violations']} |"
            for c in summary["claims"]]
    return ["<details><summary>claims</summary>", "",
            "| claim | kind | role | checked | witnessed | violations |",
            "| --- | --- | --- | --- | --- | --- |", *rows, "", "</details>"]


def markdown_summary(summary: dict) -> str:
    lines = [get_heading(summary), "", summary["verdict_line"], "",
             f"{summary['runs']} runs, {summary['actions']} actions in "
             f"{summary['elapsed_s']:.1f} s on {summary['version']}.", ""]
    lines += get_violation_lines(summary) + get_known_lines(summary)
    lines += get_unwitnessed_lines(summary) + get_claim_table(summary)
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, summary: dict) -> None:
    Path(path).write_text(markdown_summary(summary), encoding="utf-8")
