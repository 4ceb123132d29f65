"""``kvspec review BASE HEAD``: what a change to vLLM introduces.

A reviewer asks what a change *introduces*. The review runs the default check
on HEAD, replays every counterexample on BASE (a second process,
``harness/base_worker.py``): one BASE fails the same way (the same claims at
the same point, or exactly HEAD's violations earlier in the trace) is
pre-existing (named when it is a known finding); every other is a regression,
and the verdict says what BASE did with it instead. It also says how much of
the change ran: for every hunk HEAD changes, in how many of the check's runs its lines executed (line coverage by
coverage.py, one context per run). A changed hunk that never ran is named in
the verdict's first lines, and the review does not pass. Lost performance
(an efficiency claim: work a later request redoes, nothing corrupted) is asked
of HEAD and BASE on its trace: unless BASE loses it every way HEAD does (each
message shape), it is a performance regression.

Exit codes: 0 no regression and every changed line kvspec can run ran; 1 a
regression; 2 bad input; 3 no regression found, but part of the change never
ran (or the base could not answer).
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import attrs

from kvspec.harness.vllm_source import CHECKED_MODULES, VllmSource
from kvspec.verdict import EXIT_INTERRUPTED, describe_time_limit
from kvspec.report import config_line

#: equal lines between two changes that still make them one hunk (as a diff's context)
JOIN = 3


@attrs.define
class Hunk:
    """One change HEAD makes to a file, with what ran of it."""

    path: str                 # "vllm/v1/core/sched/scheduler.py"
    head_start: int           # first HEAD line (1-based); for a deletion, where it was
    head_end: int             # last HEAD line (inclusive); head_start - 1 for a deletion
    base_start: int
    base_end: int
    head_text: str = ""       # the hunk's HEAD lines (for the report)
    base_text: str = ""
    #: HEAD lines of the hunk that hold code (``executable_lines``); for a
    #: deletion, those next to it
    statements: tuple[int, ...] = ()
    ran: tuple[int, ...] = ()  # those that executed
    runs: int = 0              # runs in which any of them executed

    @property
    def checked_module(self) -> bool:
        return any(self.path == m or (m.endswith("/") and self.path.startswith(m))
                   for m in CHECKED_MODULES)

    @property
    def is_deletion(self) -> bool:
        return self.head_end < self.head_start

    @property
    def never_ran(self) -> bool:
        return bool(self.statements) and not self.ran

    def where(self) -> str:
        if self.is_deletion:
            return (f"{self.path}: lines {self.base_start}-{self.base_end} removed "
                    f"(HEAD line {self.head_start})")
        return f"{self.path}:{self.head_start}-{self.head_end}"


# -- what changed ------------------------------------------------------------------------

def _python_files(package: Path) -> dict[str, Path]:
    base = package.parent
    return {p.relative_to(base).as_posix(): p for p in sorted(package.rglob("*.py"))
            if "__pycache__" not in p.parts}


def changed_hunks(base: VllmSource, head: VllmSource) -> list[Hunk]:
    """Every change HEAD makes to vLLM's Python files, as hunks."""
    old, new = _python_files(base.package), _python_files(head.package)
    hunks = []
    for rel in sorted(set(old) | set(new)):
        a = old[rel].read_bytes() if rel in old else b""
        b = new[rel].read_bytes() if rel in new else b""
        if a == b:
            continue
        hunks += _file_hunks(rel, a.decode(errors="replace").splitlines(keepends=True),
                             b.decode(errors="replace").splitlines(keepends=True))
    return hunks


def _file_hunks(rel: str, a: list[str], b: list[str]) -> list[Hunk]:
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    groups: list[list] = []
    for op in ops:
        if groups and op[1] - groups[-1][-1][2] <= JOIN and op[3] - groups[-1][-1][4] <= JOIN:
            groups[-1].append(op)
        else:
            groups.append([op])
    hunks = []
    for g in groups:
        i1, i2, j1, j2 = g[0][1], g[-1][2], g[0][3], g[-1][4]
        hunks.append(Hunk(rel, j1 + 1, j2, i1 + 1, i2, "".join(b[j1:j2]), "".join(a[i1:i2])))
    return hunks


# -- what ran of it --------------------------------------------------------------------------

def executable_lines(text: str) -> set[int]:
    """The lines of a Python text that hold code (bytecode of any of its code
    objects). Coverage records the lines that ran, each on its own: a line of a
    multi-line condition that short-circuiting skips did not run, whatever the
    statement's first line did."""
    try:
        code = compile(text, "<review>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return set()
    lines, todo = set(), [code]
    while todo:
        co = todo.pop()
        lines |= {line for _, _, line in co.co_lines() if line}
        todo += [c for c in co.co_consts if hasattr(c, "co_lines")]
    return lines


def attach_statements(hunks: list[Hunk], head: VllmSource) -> None:
    parsed: dict[str, set[int]] = {}
    for h in hunks:
        path = head.package.parent / h.path
        if h.path not in parsed:
            parsed[h.path] = executable_lines(path.read_text(errors="replace")
                                              if path.is_file() else "")
        lines = (range(h.head_start - 1, h.head_start + 1) if h.is_deletion
                 else range(h.head_start, h.head_end + 1))
        h.statements = tuple(sorted(set(lines) & parsed[h.path]))


def measured_lines(data, head: VllmSource, patched_files: dict) -> dict[str, dict[int, set[str]]]:
    """coverage.py's data as ``vllm/...`` path -> HEAD line -> the contexts
    (runs) that executed it. Code that kvspec's fixes patched runs under its
    own file name; its lines are mapped back to the HEAD file's through the
    lines the patch left as they were."""
    out: dict[str, dict[int, set[str]]] = {}
    # coverage.py names a file by its real path: a source given as the package
    # directory itself runs through a link, so both spellings are looked up
    by_name = {**{os.path.realpath(k): v for k, v in patched_files.items()}, **patched_files}
    for filename in data.measured_files():
        by_line = data.contexts_by_lineno(filename)
        if filename in by_name:
            original, text, patched = by_name[filename]
            by_line = _map_back(by_line, patched, text)
            filename = original
        rel = _relative(filename, head)
        if rel is None:
            continue
        lines = out.setdefault(rel, {})
        for line, contexts in by_line.items():
            lines.setdefault(line, set()).update(c for c in contexts if c)
    return out


def _map_back(by_line: dict, patched: str, original: str) -> dict[int, list[str]]:
    """Lines of ``patched`` -> lines of ``original`` (where they are unchanged)."""
    from kvspec.harness.hunk_apply import unchanged_lines
    mapping = unchanged_lines(original, patched)
    return {mapping[line]: ctx for line, ctx in by_line.items() if line in mapping}


def _relative(filename: str, head: VllmSource) -> str | None:
    path = Path(filename)
    for root in (head.package, head.package.resolve()):
        try:
            return (Path("vllm") / path.relative_to(root)).as_posix()
        except ValueError:
            continue
    text = path.as_posix()
    at = text.rfind("/vllm/")
    return text[at + 1:] if at >= 0 else None


def attach_coverage(hunks: list[Hunk], lines: dict[str, dict[int, set[str]]]) -> None:
    for h in hunks:
        ran = lines.get(h.path, {})
        executed = [s for s in h.statements if ran.get(s)]
        h.ran = tuple(executed)
        h.runs = len(set().union(*(ran[s] for s in executed))) if executed else 0


class Coverage:
    """coverage.py over HEAD's vllm package, one context per run."""

    def __init__(self, head: VllmSource) -> None:
        import coverage
        roots = {str(head.package), str(head.package.resolve())}
        from kvspec.harness.vllm_source import installed
        try:  # a copy made of links to the installed files runs those files
            roots.add(str(installed().package.resolve()))
        except ValueError:
            pass
        self.cov = coverage.Coverage(data_file=None, include=[f"{r}/*" for r in roots],
                                     branch=False)

    def start(self) -> None:
        self.cov.start()

    def stop(self) -> None:
        self.cov.stop()

    def on_run(self, number: int) -> None:
        self.cov.switch_context(f"run{number}")

    def data(self):
        return self.cov.get_data()


# -- the verdict ----------------------------------------------------------------------------

@attrs.frozen
class ReviewVerdict:
    line: str
    code: int

    @property
    def word(self) -> str:
        return {0: "pass", 1: "regression", 3: "incomplete",
                EXIT_INTERRUPTED: "interrupted"}.get(self.code, "error")


def get_beyond_a_test(violations, config) -> frozenset[str]:
    """The claims a standalone test of this run cannot check, to leave unchecked,
    when every broken claim is one of them (the transition model, a call's
    relation, placeholder and stats accounting): ``kvspec export-test``'s own
    rule (``get_ignored_to_go_on``). Empty when a broken claim is one a test
    checks (KV content served, num_computed_tokens within the tokens, a request
    that never finishes, a crash) or is no claim of the registry (the
    environment's or kvspec's own fault)."""
    from kvspec.export_test import get_ignored_to_go_on
    from kvspec.spec.catalogue import REGISTRY
    claims = {v.invariant for v in violations}
    return get_ignored_to_go_on(claims, config) if claims <= set(REGISTRY) else frozenset()


def get_harm(trace: Path, violations, config):
    """A regression that broke only claims a standalone test cannot check
    (``get_beyond_a_test``), replayed on HEAD (active in this process) with
    all of those unchecked: the safety claims it goes on to break, which is
    what ``kvspec export-test`` writes its test of, and what a user would see
    (None: it broke such a claim or crashed already; a string: the replay
    could not run). Lost performance met on the way is not harm."""
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.runner import is_lost_performance
    from kvspec.harness.trace import TraceError
    ignored = get_beyond_a_test(violations, config)
    if not ignored:
        return None
    try:
        got = replay_trace(trace, ignore=ignored)
    except (TraceError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if all(is_lost_performance(v) for v in got.violations):
        return attrs.evolve(got, violations=[])
    return got


def get_specific(trace: Path, violations):
    """A regression the transition model alone caught ("admitted by no shape
    of spec/effects.py" says what, not why), replayed on HEAD with the model
    unchecked: the specific claims the same run goes on to break, whose
    messages say why (None: a specific claim broke already, or none follows)."""
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.runner import is_lost_performance
    from kvspec.harness.trace import TraceError
    from kvspec.spec.catalogue import REGISTRY
    claims = {v.invariant for v in violations}
    if not claims <= set(REGISTRY) or any(REGISTRY[c].kind != "model" for c in claims):
        return None
    try:
        got = replay_trace(trace, ignore=frozenset(claims))
    except (TraceError, ValueError, RuntimeError):
        return None
    specific = [v for v in got.violations if not is_lost_performance(v)]
    return specific or None


@attrs.frozen
class LostOnHead:
    """Lost performance the check on HEAD met, and what BASE does with its trace."""

    claims: tuple[str, ...]
    count: int
    trace: str
    #: "head-only" (BASE keeps some of this performance), "pre-existing" (BASE
    #: loses all of it too), or "unknown: <why>" (BASE could not be compared)
    on_base: str
    #: what BASE lost instead, where it lost part of it ("" otherwise)
    note: str = ""

    @property
    def is_regression(self) -> bool:
        return self.on_base == "head-only"


def compare_lost(claims, head, base) -> tuple[str, str]:
    """``on_base`` and its note for lost ``claims`` whose trace HEAD and BASE
    each replayed for their lost performance (``Outcome``s; ``head`` None: not
    asked). Pre-existing only when BASE loses it every way HEAD does (each
    claim, each message shape): a change that keeps a known loss and adds
    another of the same claim on the same trace lost performance of its own."""
    from kvspec.harness.known import shape, template
    if base.error:
        return f"unknown: {base.error}", ""
    if base.step is not None:
        # BASE broke a safety or design claim on it: HEAD may have traded some
        # performance for a fix, which is the reviewer's call, not a regression
        return ("unknown: BASE breaks " + ", ".join(sorted(base.claims))
                + " on this trace, so its performance is not comparable"), ""
    if head is None or head.error or head.step is not None or not head.fails:
        # HEAD's replay did not show it again: compare by claim alone
        shown, missing = (), {(c, "") for c in claims if c not in base.claims}
    else:
        shown = head.violations
        missing = shape(shown) - shape(base.violations)
    if not missing:
        return "pre-existing", ""
    if not base.fails:
        return "head-only", ""
    example = next((m for c, m in shown if (c, template(m)) in missing), "")
    return "head-only", (f"BASE loses {', '.join(sorted(base.claims))} on this trace too, "
                         "but not every way HEAD does" + (f": {example}" if example else ""))


def classify_lost(efficiency: dict, worker, target: str, head_replay=None) -> list[LostOnHead]:
    """Each lost performance HEAD showed, its kept trace replayed on HEAD (this
    process; ``head_replay``, default ``known.replay``) and on BASE (with the same
    fixes), each answering with its own lost performance."""
    from kvspec.harness.known import replay
    from kvspec.harness.trace import TraceError, load_trace
    head_replay = head_replay or replay
    found = []
    for hit in efficiency.values():
        note = ""
        try:
            data = load_trace(Path(hit.trace_path))
            actions = list(data["actions"])
            head = head_replay(target, data["config"], actions, lost=True)
            base = worker.replay(target, data["config"], actions, lost=True)
            on_base, note = compare_lost(hit.claims, head, base)
        except (TraceError, TypeError, OSError) as exc:
            on_base = f"unknown: {exc}"
        found.append(LostOnHead(tuple(hit.claims), hit.count, str(hit.trace_path), on_base, note))
    return found


def harm_claims(harm) -> list[str]:
    return sorted({v.invariant for v in harm.violations}) \
        if harm is not None and not isinstance(harm, str) else []


def review_verdict(result, hunks: list[Hunk], base_errors, code_changed,
                   harm=None, lost=(), base_note: str | None = None,
                   specific=None) -> ReviewVerdict:
    """The review's first line and exit code (see the module doc). ``base_note``:
    what BASE did with the regression's trace (``get_base_note``: "" it passed,
    else how it failed otherwise than HEAD; None: not asked, or no answer)."""
    unrun = [h for h in hunks if h.never_ran]
    notes = []
    if unrun:
        notes.append(f"{len(unrun)} changed hunk(s) never ran: "
                     + "; ".join(h.where() for h in unrun[:6])
                     + (f"; and {len(unrun) - 6} more" if len(unrun) > 6 else ""))
    if code_changed:
        notes.append("the code a fix changes has changed: "
                     + "; ".join(f"{s.fix} ({', '.join(s.present) or 'its finding'})"
                                 for s in code_changed))
    if base_errors:
        notes.append(f"the base could not answer {len(base_errors)} time(s): {base_errors[0]}")
    known = getattr(result, "known", {}) or {}
    if known:
        notes.append("pre-existing (fail on the base too): " + ", ".join(
            f"{h.finding or 'not a known finding'} ({h.count}x)" for h in known.values()))
    old_lost = [x for x in lost if not x.is_regression]
    if old_lost:
        notes.append("lost performance not HEAD's own: " + ", ".join(
            f"{'+'.join(x.claims)} ({x.count}x, BASE: {x.on_base})" for x in old_lost))
    if getattr(result, "time_limited", False):
        notes.insert(0, describe_time_limit(result))
    tail = "".join(f" | {note}" for note in notes)
    if getattr(result, "interrupted", False):
        return describe_interrupted_review(result, tail)
    if result is not None and result.counterexample is not None:
        claims = sorted({v.invariant for v in result.counterexample.violations})
        led = harm_claims(harm)
        leads = f"; it leads on to {', '.join(led)}" if led else ""
        on_base = " (passes on BASE)" if base_note == "" else ""
        differs = f" ({base_note})" if base_note else ""
        why = (f" (with the model unchecked: "
               f"{', '.join(sorted({v.invariant for v in specific}))})" if specific else "")
        return ReviewVerdict(f"REGRESSION on HEAD{on_base}: {', '.join(claims)}{why}{differs}"
                             f"{leads}{tail}", 1)
    new_lost = [x for x in lost if x.is_regression]
    if new_lost:
        return ReviewVerdict("REGRESSION on HEAD (performance; BASE keeps it): lost "
                             + ", ".join(f"{'+'.join(x.claims)} ({x.count}x"
                                         + (f"; {x.note}" if x.note else "") + ")"
                                         for x in new_lost)
                             + f", no safety claim broken{tail}", 1)
    if unrun or base_errors:
        return ReviewVerdict(f"INCOMPLETE: no regression found, but not all of the change "
                             f"was checked{tail}", 3)
    if getattr(result, "time_limited", False):
        return ReviewVerdict(f"INCOMPLETE: no regression found in the runs made, but not "
                             f"every run was made{tail}", 3)
    if not hunks:
        return ReviewVerdict(f"PASS: nothing to review (HEAD changes none of vLLM's Python "
                             f"files){tail}", 0)
    ran = sum(1 for h in hunks if h.statements)
    return ReviewVerdict(f"PASS: no regression; every changed hunk with code ran ({ran} of "
                         f"{len(hunks)} hunks have code){tail}", 0)


def describe_interrupted_review(result, tail: str) -> ReviewVerdict:
    """SIGINT or SIGTERM (a cancelled CI job) cut the check on HEAD short: a
    partial review is no PASS, and what it found was not asked of BASE."""
    ce = result.counterexample
    found = "" if ce is None else (
        f"; found before it on HEAD, not compared with BASE: "
        f"{', '.join(sorted({v.invariant for v in ce.violations}))} (trace {result.trace_path})")
    return ReviewVerdict(f"INTERRUPTED by {result.interrupted_by or 'a signal'} after "
                         f"{result.runs} runs ({result.elapsed:.0f}s): a partial review, "
                         f"no verdict{found}{tail}", EXIT_INTERRUPTED)


# -- a whole review ----------------------------------------------------------------------------

@attrs.define
class Review:
    base: VllmSource
    head: VllmSource
    hunks: list[Hunk]
    seconds: float
    #: a budget in runs instead of ``seconds`` (``--examples``): the same
    #: exploration, shrink and verdict on any machine
    examples: int | None = None
    #: with ``examples``: the check's wall-clock safety net, seconds (``--time-limit``)
    time_limit: float | None = None
    verdict: ReviewVerdict | None = None
    #: the check on HEAD (None: nothing changed, nothing was run)
    result: object = None
    prep: object = None
    base_label: str = ""
    #: the regression replayed on BASE as released (no kvspec fixes): a known
    #: finding there that kvspec's fixes close on BASE but not on HEAD
    base_as_released: object = None
    wall: float = 0.0
    base_import_s: float | None = None
    #: for a regression of claims only kvspec can check: the same trace on HEAD
    #: with those unchecked, to show what a standalone test sees it lead to
    harm: object = None
    #: for a regression the transition model alone caught: the specific claims
    #: (violations) the same trace breaks with the model unchecked
    specific: object = None
    #: the run's lost performance, each asked of BASE (see ``classify_lost``)
    lost: list = attrs.Factory(list)
    #: what BASE did with the regression's trace (``get_base_note``)
    base_note: str | None = None

    def get_budget_text(self) -> str:
        """The budget as the review's lines say it."""
        if self.examples is None:
            return f"{self.seconds:g}s"
        limit = f", time limit {self.time_limit:g}s" if self.time_limit is not None else ""
        return f"{self.examples} runs{limit}"


def get_base_note(recogniser, ce) -> str | None:
    """What BASE did with the regression's trace: "" it passed, else how it
    failed otherwise than HEAD (``known.compare_with_base``); None when it
    was not asked (an environment's or connector's fault) or could not answer."""
    args = (ce.runner.config, list(ce.runner.actions), ce.violations)
    recogniser.explain(*args, rows=len(ce.runner.log))  # memoised: the base's answer
    return recogniser.get_base_note(*args)


def get_trace_name(head: VllmSource, seed: int) -> str:
    """The file a review saves its counterexample in, named after HEAD, so two
    reviews into one --out keep both (``review-pr-1234-seed0.json``)."""
    from kvspec.harness.fuzz import safe_file_stem
    if head.kind == "patched":
        name = head.root.name if head.patch == "from standard input" else Path(head.patch).stem
    elif head.is_installed:
        name = "installed"
    else:
        name = Path(str(head.given).rstrip("/")).name
        for suffix in (".whl", ".tar.gz"):
            name = name.removesuffix(suffix)
    return f"review-{safe_file_stem(name)}-seed{seed}.json"


def check_head(review: Review, worker, seed: int, out: Path, console,
               target: str = "vllm") -> None:
    """The default check on HEAD (this process must have activated it), every
    counterexample asked of the base, coverage of HEAD's package. ``target``:
    ``vllm``, or with a connector (``vllm?connector=...``)."""
    from kvspec.cli import check_target, drawn_profile, target_gaps
    from kvspec.harness.targets import parse_vllm_target, with_connector
    from kvspec.harness.vllm_patches import patched
    from kvspec.run import describe_source, execute, prepare, print_statuses
    check_target(target)
    prep = prepare(target, review.seconds, drawn_profile(target, None, "symbolic"), {},
                   target_gaps(target), worker, review=True)
    review.prep, review.base_label = prep, worker.label
    from rich.text import Text
    console.print(Text(f"kvspec review: base {review.base.label()}, head {review.head.label()}; "
                       f"{len(review.hunks)} changed hunk(s); budget {review.get_budget_text()}"))
    describe_source(console, prep)
    print_statuses(console, prep)
    coverage = Coverage(review.head)
    coverage.start()
    try:
        review.result = execute(prep, seed, out, None, True, "symbolic", console,
                                on_run=coverage.on_run, max_examples=review.examples,
                                time_limit=review.time_limit,
                                trace_name=get_trace_name(review.head, seed))
    finally:
        coverage.stop()
    # the patched files of the fixes the run applied (a review may leave some out)
    attach_coverage(review.hunks, measured_lines(coverage.data(), review.head,
                                                 patched(*parse_vllm_target(prep.target)).files))
    ce = review.result.counterexample
    if review.result.interrupted:  # the user (or CI) asked to stop: nothing more is asked
        review.verdict = review_verdict(review.result, review.hunks, (), [])
        return
    if ce is not None:
        review.base_note = get_base_note(prep.recogniser, ce)
        # what BASE does with it when nothing of kvspec's is applied
        review.base_as_released = worker.replay(with_connector("vllm?fixes=none", target),
                                                ce.runner.config, list(ce.runner.actions))
        review.specific = get_specific(Path(review.result.trace_path), ce.violations)
        review.harm = get_harm(Path(review.result.trace_path), ce.violations,
                               ce.runner.config)
    review.lost = classify_lost(getattr(review.result, "efficiency", {}) or {}, worker, target)
    review.base_import_s = worker.import_seconds
    changed = [s for s in prep.statuses if s.status == "code-changed"]
    review.verdict = review_verdict(review.result, review.hunks,
                                    prep.recogniser.base_errors, changed, review.harm,
                                    review.lost, review.base_note, review.specific)


def to_json(review: Review, markdown_path: Path) -> dict:
    r, prep = review.result, review.prep
    ce = None if r is None else r.counterexample
    return {
        "verdict": review.verdict.word, "verdict_line": review.verdict.line,
        "exit_code": review.verdict.code, "base": review.base.label(),
        "head": review.head.label(), "wall_s": round(review.wall, 1),
        "sources": {"base": review.base.as_dict(), "head": review.head.as_dict()},
        # no time budget applies under --examples
        "budget_s": review.seconds if review.examples is None else None,
        "examples_budget": review.examples, "time_limit_s": review.time_limit,
        "stopped_by": None if r is None else (
            "time limit" if r.time_limited else r.interrupted_by if r.interrupted else None),
        "runs": 0 if r is None else r.runs,
        "actions": 0 if r is None else r.actions, "markdown": str(markdown_path),
        "regression": None if ce is None else {
            "claims": sorted({v.invariant for v in ce.violations}),
            "trace": str(r.trace_path), "shrink_cut_by_budget": r.shrink_cut,
            "passes_on_base": review.base_note == "",
            "fails_on_base_otherwise": review.base_note or None,
            "fails_on_base_as_released": review.base_as_released is not None
            and review.base_as_released.fails,
            "leads_on_to": harm_claims(review.harm),
            "with_the_model_unchecked": sorted({v.invariant for v in review.specific or ()})},
        "lost_performance": [attrs.asdict(x) for x in review.lost],
        "pre_existing": [] if r is None else [
            {"finding": h.finding, "count": h.count, "how": h.how, "trace": str(h.trace_path)}
            for h in r.known.values()],
        "hunks": [{"where": h.where(), "path": h.path, "checked_module": h.checked_module,
                   "statements": len(h.statements), "ran": len(h.ran), "runs": h.runs}
                  for h in review.hunks],
        "fixes": [] if prep is None else [attrs.asdict(s) for s in prep.statuses],
        "import_s": {"head": None if prep is None else prep.import_seconds,
                     "base": review.base_import_s}}


# -- the Markdown review ---------------------------------------------------------------------

LEGEND = (
    "Each row is an action and the requests after it: `c=` computed/known tokens, `ph=` "
    "output placeholders (async scheduling), `hit=` the cache-hit stats "
    "(cached/external tokens), `pre=` preemptions, `b=` the first KV cache group's blocks "
    "(traces written before 2026-11-28 cut statuses to 12 characters: `WAITING_FOR_` is "
    "WAITING_FOR_REMOTE_KVS). In `add`: "
    "`ext` tokens the external KV store holds, `async` an async load, `none` times the "
    "connector answers \"not yet\" first, `send` a KV send delays the free, `offload` the "
    "store keeps what the request computes. In `step`: `finish_loads`, `fail` (loads that "
    "fail, from block `fail_offset`, `fail_blocks` of them), `fail_all`, `eos`, "
    "`finish_sends`, `accept` (drafts accepted), `drafts`. `drain`: the healed phase, where "
    "every load and send completes and every request must finish.")


def markdown(review: Review) -> str:
    from kvspec.spec.catalogue import REGISTRY
    from kvspec.text import command_arg
    v, result = review.verdict, review.result
    md = [f"## kvspec review: {v.word.upper()}", "", f"**{v.line}**", "",
          f"- base: {review.base.label()}", f"- head: {review.head.label()}"]
    if result is not None:
        fixes = [s.fix for s in review.prep.statuses if s.status in ("applied", "drifted")]
        md += [f"- check: {result.runs} runs, {result.actions} actions in "
               f"{result.elapsed:.0f}s (budget {review.get_budget_text()}; review wall time "
               f"{review.wall:.0f}s)",
               f"- both sides run with kvspec's {len(fixes)} fixes of known vLLM findings "
               "applied (so that a known finding hides no regression): "
               + ", ".join(f"`{f}`" for f in fixes)]
        handled = [s.fix for s in review.prep.statuses if s.status == "handled"]
        if handled:
            md.append("- left out on both sides, because the change handles their findings' "
                      "paths its own way (without them HEAD replays those traces otherwise "
                      "than BASE; BASE decides): " + ", ".join(f"`{f}`" for f in handled))
    md.append("")
    if result is not None and result.counterexample is not None:
        md += _regression(review, command_arg)
    if result is not None and result.known:
        md += ["### Pre-existing (fail on the base too)", "",
               "| finding | times | upstream | trace |", "| --- | --- | --- | --- |"]
        md += [f"| {h.finding or 'not a known finding'} | {h.count} | {h.upstream} | "
               f"`{Path(h.trace_path).resolve()}` |" for h in result.known.values()]
        md.append("")
    if review.lost:
        md += ["### Lost performance (no safety claim broken)", "",
               "| claims | times on HEAD | on BASE | trace |", "| --- | --- | --- | --- |"]
        md += [f"| {', '.join(x.claims)} | {x.count} | {x.on_base}"
               f"{f' ({x.note})' if x.note else ''} | `{Path(x.trace).resolve()}` |"
               for x in review.lost]
        md += ["", "HEAD-only: BASE, with the same fixes, keeps some of that performance on "
               "the same trace, so the change loses it; pre-existing: BASE loses it too, "
               "every way HEAD does (claim and message shape).", ""]
    md += ["### Coverage of the change", "",
           "| hunk | in a module kvspec checks | lines with code that ran | runs that ran it |",
           "| --- | --- | --- | --- |"]
    for h in review.hunks:
        ran = f"{len(h.ran)}/{len(h.statements)}" if h.statements else "no code"
        md.append(f"| `{h.where()}` | {'yes' if h.checked_module else 'no'} | {ran} | "
                  f"{h.runs}{' **never ran**' if h.never_ran else ''} |")
    md.append("")
    if review.prep is not None:
        changed = [s for s in review.prep.statuses if s.status in ("code-changed", "drifted")]
        if changed:
            md += ["### kvspec's fixes on HEAD", ""]
            md += [f"- `{s.fix}`: {s.status}: {s.detail}" for s in changed]
            md.append("")
    if result is not None:
        witnessed = sum(1 for n in REGISTRY if result.witnessed.get(n))
        never = [n for n in REGISTRY if not result.witnessed.get(n)]
        md += ["### Claims", "", f"{witnessed} of {len(REGISTRY)} claims witnessed"
               + (f"; never witnessed: {', '.join(never)}" if never else "") + ".", ""]
    return "\n".join(md)


def _regression(review: Review, command_arg) -> list[str]:
    result = review.result
    ce = result.counterexample
    trace = Path(result.trace_path).resolve()
    md = ["### Regression", "", f"Configuration: {config_line(ce.runner.config)}.", "",
          "| step | action | requests after it |", "| --- | --- | --- |"]
    log = ce.runner.log
    md += [f"| {s.index} | `{s.action}` | {s.requests} |" for s in log[:-1]]
    md += [f"| **{s.index} (broke here)** | `{s.action}` | {s.requests} |" for s in log[-1:]]
    md += [""] + [f"- **{x.invariant}**: {x.message}" for x in ce.violations] + [""]
    if review.specific:
        md += ["Why, in specific claims: with the transition model unchecked, the same trace "
               "on HEAD breaks:", ""] + [
            f"- **{x.invariant}**: {x.message}" for x in review.specific] + [""]
    md += _harm(review.harm, ce.violations)
    if result.shrink_cut:
        md += ["The budget ran out while this example was being shrunk: it may hold actions "
               "it does not need (a longer `--budget` shrinks it further).", ""]
    if review.base_note:
        md += [f"With the same fixes, {review.base_note}. HEAD's failure is not BASE's: "
               "part of it is the change's own.", ""]
    released = review.base_as_released
    if released is not None and released.fails:
        md += ["On BASE as released (without kvspec's fixes) it fails too "
               f"({', '.join(sorted(released.claims))}): a known finding there, which "
               "kvspec's fixes close on BASE but not on HEAD. HEAD's change defeats what a fix "
               "relies on, or meets the finding another way; on stock BASE the two coincide.",
               ""]
    md += [LEGEND, "", "Replay:", "", "```",
           f"kvspec replay {command_arg(trace)} --vllm {command_arg(review.head.cli_name())}"
           "    # fails",
           f"kvspec replay {command_arg(trace)} --vllm {command_arg(review.base.cli_name())}"
           + ("    # fails otherwise (above)" if review.base_note else
              "    # passes" if review.base_note == "" else ""),
           "```", ""]
    if not is_refused_by_export(review.harm):
        md += ["A standalone test in vLLM's style, for the pull request (it imports no "
               "kvspec; a break of claims such a test cannot check is written as what it "
               "leads to):", "", "```",
               f"kvspec export-test {command_arg(trace)} --vllm "
               f"{command_arg(review.head.cli_name())} -o test_regression.py", "```", ""]
    return md


def is_refused_by_export(harm) -> bool:
    """Whether ``kvspec export-test`` refuses the regression's trace: it broke
    only claims a test cannot check and, with those unchecked, nothing it can."""
    return harm is not None and not isinstance(harm, str) and not harm.violations


def _harm(harm, broken) -> list[str]:
    """What a regression that broke only claims a standalone test cannot check
    goes on to break with those unchecked (as ``kvspec export-test`` records it)."""
    if harm is None:
        return []
    names = ", ".join(sorted({v.invariant for v in broken}))
    if isinstance(harm, str):
        return [f"The same trace with the claims a standalone test cannot check unchecked "
                f"could not be replayed on HEAD ({harm}).", ""]
    if not harm.violations:
        return [f"{names}: a standalone test checks none of these, and with every claim it "
                "cannot check left unchecked the rest of this trace breaks none it can (KV "
                "content served, num_computed_tokens within the tokens, every request "
                "finishing, a crash), so `kvspec export-test` refuses this trace; "
                "`kvspec replay` reproduces it.", ""]
    return [f"What it leads to: {names} are claims a standalone test cannot check; with "
            "every such claim unchecked, the same trace on HEAD goes on to break:", ""] + [
        f"- **{x.invariant}**: {x.message}" for x in harm.violations] + [""]
