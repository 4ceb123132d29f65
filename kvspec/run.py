"""One check or fuzz run, from the command line's choices to its verdict.

``prepare`` settles everything before fuzzing starts (the source, the base, the
environment and what it leaves out, the fixes and their statuses, the
recogniser of known findings); ``execute`` fuzzes; ``verdict`` says what it
means. ``check``, ``fuzz`` and ``review`` share them.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import attrs


@attrs.define
class Prepared:
    target: str
    seconds: float
    profile: object
    #: how the profile differs from the whole environment (kvspec.verdict.Restriction)
    restrictions: list
    #: known.FixStatus per fix (vllm targets)
    statuses: list = attrs.Factory(list)
    recogniser: object = None
    #: the base worker (kvspec.harness.base_worker.BaseWorker) or None
    base: object = None
    #: what runs (vllm_source.runtime()), for the report
    runtime: dict | None = None
    import_seconds: float | None = None
    probe_seconds: float = 0.0


def asked_restrictions(layouts: str | None, kv: str) -> dict[str, str]:
    asked = {}
    if layouts is not None:
        asked["layouts"] = f"--layouts {layouts}"
    elif kv == "torch":
        asked["layouts"] = "--kv torch runs the tiny model's layouts (full, sliding)"
    return asked


def start_base(target: str, base: str | None, log_dir: Path | None = None):
    """The base worker a vllm run compares counterexamples with: ``base`` as
    given ("none": no base), or by default the installed release when the
    source checked is another one. Started at once: its import overlaps ours."""
    from kvspec.harness.targets import parse_vllm_target
    from kvspec.harness.vllm_source import active, installed
    if parse_vllm_target(target) is None or base == "none":
        return None
    if base is None:
        if active().is_installed:
            return None
        try:
            installed()
        except ValueError:
            return None  # nothing installed to compare with: shapes decide (known.py)
        base = "installed"
    from kvspec.harness.base_worker import BaseWorker
    log = None if log_dir is None else log_dir / "base-worker.log"
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    return BaseWorker(base, log)


def prepare(target: str, seconds: float, profile, asked: dict[str, str], gaps: dict[str, str],
            base=None, review: bool = False) -> Prepared:
    """Fix statuses, probes and the recogniser for a vllm target (the source
    is imported by now); nothing else for the others."""
    from kvspec.verdict import restrictions
    found = restrictions(profile, asked, gaps)
    prep = Prepared(target, seconds, profile, found, base=base)
    from kvspec.harness.targets import parse_vllm_target
    if parse_vllm_target(target) is None:
        return prep
    from kvspec.harness.known import build_recogniser
    from kvspec.harness.vllm_source import runtime
    from kvspec.harness.vllm_target import modules
    prep.import_seconds = modules().import_seconds
    prep.runtime = runtime()
    started = time.monotonic()
    if base is not None:
        base.wait_ready()
    prep.recogniser, prep.statuses = build_recogniser(target, base, base_decides=review)
    if prep.recogniser is not None:  # a review leaves out the fixes the change handles
        prep.target = prep.recogniser.target
    prep.probe_seconds = time.monotonic() - started
    return prep


def execute(prep: Prepared, seed: int, out: Path, db: Path | None, design_rules: bool, kv: str,
            console, on_run: Callable[[int], None] | None = None, trace_name=None,
            max_examples: int | None = None, time_limit: float | None = None):
    """Fuzz within the budget, at the run sizes ``--scale`` set (``get_scale``);
    progress as a bar on a terminal, as lines in a log."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvspec.harness.fuzz import fuzz
    from kvspec.harness.machine import get_scale

    def event(line: str) -> None:
        print(f"kvspec: {line}", file=sys.stderr, flush=True)
    scale = get_scale()
    if scale == "small":  # never narrow silently: the verdict's first line says so
        prep.restrictions.append(get_scale_restriction(kv))
    common = dict(profile=prep.profile, design_rules=design_rules, kv=kv,
                  recogniser=prep.recogniser, on_event=event, on_run=on_run,
                  trace_name=trace_name, max_examples=max_examples, scale=scale,
                  time_limit=time_limit)
    if not console.is_terminal:  # a log: a plain line at a steady interval
        from kvspec.cli import PROGRESS_EVERY, progress_line
        return fuzz(prep.target, prep.seconds, seed, out, db,
                    heartbeat=progress_line("fuzzing", prep.seconds, examples=max_examples),
                    heartbeat_every=PROGRESS_EVERY, **common)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("fuzzing", total=prep.seconds)

        def tick(result):
            what = "shrinking" if result.shrink_started is not None else "fuzzing"
            progress.update(task, completed=min(result.elapsed, prep.seconds),
                            description=f"{what}: {result.runs} runs"
                            f"{get_scaled_runs(result)}, {result.actions} actions")
        return fuzz(prep.target, prep.seconds, seed, out, db, progress=tick, **common)


def get_scale_restriction(kv: str):
    """No production-sized run drawn: asked (``--scale small``), or what
    ``--kv torch`` asks (its tiny model's vocabulary holds fewer tokens than
    production prompts use: ``cli.set_scale``)."""
    from kvspec.verdict import Restriction
    why = ("--kv torch: its tiny model's vocabulary holds fewer tokens than production "
           "prompts" if kv == "torch" else "--scale small")
    return Restriction("scale", "small", f"no production-sized run; {why}", "asked")


def get_scaled_runs(result) -> str:
    """" (N production-sized)" where a campaign ran any."""
    return describe_scaled_runs(result.scales.get("production", 0))


def describe_scaled_runs(production: int) -> str:
    """What follows a run count: how many were production-sized, if any."""
    return f" ({production} production-sized)" if production else ""


def verdict(result, prep: Prepared) -> tuple[str, int]:
    from kvspec.verdict import first_line
    changed = [s for s in prep.statuses if s.status == "code-changed"]
    errors = prep.recogniser.base_errors if prep.recogniser is not None else []
    return first_line(result, prep.restrictions, changed, errors)


def print_statuses(console, prep: Prepared) -> None:
    """The fixes, the reviewer's signal first: a fix whose code changed."""
    from rich.text import Text
    by: dict[str, list] = {}
    for s in prep.statuses:
        by.setdefault(s.status, []).append(s)
    for s in by.get("code-changed", ()):
        console.print(Text.assemble((f"fix {s.fix}: the code it fixes has changed", "bold red"),
                                    f": {s.detail}"))
    if by.get("handled"):
        console.print(Text.assemble(
            ("fixes the change handles its own way", "bold"), ": "
            + ", ".join(s.fix for s in by["handled"]) + " (without them HEAD replays their "
            "findings' traces otherwise than BASE; left out on HEAD and BASE, BASE decides)"))
    for s in by.get("drifted", ()):
        console.print(Text(f"fix {s.fix}: applied over drifted context: {s.detail}"))
    if by.get("applied"):
        console.print(Text(f"fixes applied as written: {', '.join(s.fix for s in by['applied'])}"))
    if by.get("not-needed"):
        console.print(Text("fixes not needed here (their findings are absent): "
                           + ", ".join(s.fix for s in by["not-needed"])))
    if by.get("not-chosen"):
        console.print(Text("fixes left out (--fixes/--strict; their findings are recognised "
                           "if met): " + ", ".join(s.fix for s in by["not-chosen"])))


def describe_source(console, prep: Prepared) -> None:
    if prep.runtime is None:
        return
    from rich.text import Text
    rt = prep.runtime
    src = rt["source"]
    console.print(Text(
        f"vllm source: {src['kind']} {src['path']} (version {src['version']}"
        + (f", commit {src['commit'][:12]}" if src.get("commit") else "")
        + f"); platform {rt['platform']}, {rt['runner']} runner"
        + (f"; imported in {prep.import_seconds:.1f}s" if prep.import_seconds else "")
        + (f"; known findings probed in {prep.probe_seconds:.1f}s" if prep.probe_seconds >= 0.5
           else "")))
    for note in rt["not_as_shipped"]:
        console.print(Text(f"  not as shipped: {note}"))
    if prep.base is not None:
        console.print(Text(f"base for known findings: {prep.base.label}"
                           + (f" (imported in {prep.base.import_seconds:.1f}s, in parallel)"
                              if prep.base.import_seconds else "")))


def default_check(target: str, budget: float, seed: int, out: Path, base=None, **fuzz_args):
    """The default check as ``kvspec check`` runs it (the target's whole
    environment, its fixes, known findings recognised), for tests and benches:
    (the FuzzResult, the Prepared run). Small runs only, unless ``scale`` says
    otherwise: what it measures (bench_planted.py) needs no size, and a
    production-sized batch would spend seconds of a short budget."""
    from kvspec.cli import target_profile, target_gaps
    from kvspec.harness.fuzz import fuzz
    prep = prepare(target, budget, target_profile(target, quiet=True), {}, target_gaps(target),
                   base)
    result = fuzz(target, budget, seed, out, profile=prep.profile, recogniser=prep.recogniser,
                  **fuzz_args)
    return result, prep
