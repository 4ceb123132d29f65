"""Readable reports: the step table of a counterexample and the per-invariant summary."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvspec.spec.registry import REGISTRY


def step_table(steps, violations) -> Table:
    table = Table(title="counterexample", show_lines=False)
    table.add_column("step", justify="right")
    table.add_column("action")
    table.add_column("requests after it (status c=computed/tokens hit=cached/external b=blocks)")
    for s in steps:
        table.add_row(str(s.index), s.action, s.requests.replace(" r", "\nr"))
    return table


def print_counterexample(console: Console, steps, violations, trace_path=None) -> None:
    console.print(step_table(steps, violations))
    for v in violations:
        console.print(f"[bold red]violated:[/] {v.invariant}: {v.message}")
        doc = v.doc or (REGISTRY[v.invariant].doc if v.invariant in REGISTRY else "")
        if doc:
            console.print(f"  [dim]{doc}[/]")
    if trace_path:
        console.print(f"trace saved: {trace_path}  (replay: kvspec replay {trace_path})")


def summary_table(checks: dict[str, int], violations: dict[str, int]) -> Table:
    table = Table(title="invariants")
    table.add_column("invariant")
    table.add_column("kind")
    table.add_column("checked", justify="right")
    table.add_column("violations", justify="right")
    for name, inv in REGISTRY.items():
        bad = violations.get(name, 0)
        table.add_row(name, inv.kind, str(checks.get(name, 0)),
                      f"[red]{bad}[/]" if bad else "0")
    return table


def _fmt_detection(d) -> tuple[str, str, str]:
    if d is None:
        return "-", "-", "-"
    if not d.caught:
        return "[red]survived[/]", "-", "-"
    return ", ".join(d.invariants), f"{d.seconds:.2f}s", str(d.steps)


def zoo_table(rows) -> Table:
    table = Table(title="bug zoo")
    for column in ("mutant", "upstream", "status", "caught by", "time to detect", "steps",
                   "oracle alone: caught by", "time", "steps"):
        table.add_column(column)
    for r in rows:
        status = {"caught": "[green]caught[/]", "survived": "[red]survived[/]"}.get(r.status, r.status)
        table.add_row(r.name, r.upstream, status, *_fmt_detection(r.full),
                      *_fmt_detection(r.oracle_alone))
    return table
