"""``kvspec review BASE HEAD``: what a change to vLLM introduces.

A reviewer asks what a change *introduces*. The review runs the default check
on HEAD, replays every counterexample on BASE (a second process,
``harness/base_worker.py``) and reports only HEAD-only failures as
regressions; one that fails on BASE too is pre-existing (named when it is a
known finding). It also says how much of the change ran: for every hunk HEAD
changes, in how many of the check's runs its lines executed (line coverage by
coverage.py, one context per run). A changed hunk that never ran is named in
the verdict's first lines, and the review does not pass.

Exit codes: 0 no regression and every changed line kvspec can run ran; 1 a
regression; 2 bad input; 3 no regression found, but part of the change never
ran (or the base could not answer).
"""
from __future__ import annotations

import difflib
from pathlib import Path

import attrs

from kvspec.harness.vllm_source import CHECKED_MODULES, VllmSource

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
    #: HEAD statements in the hunk (coverage.py's parser); for a deletion, the
    #: statements next to it
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

def statements_of(text: str) -> tuple[set[int], dict[int, int]]:
    """The statement lines of a Python text (coverage.py's parser) and, for
    every line of a multi-line statement, the statement's first line."""
    from coverage.parser import PythonParser
    parser = PythonParser(text=text)
    try:
        parser.parse_source()
    except Exception:  # noqa: BLE001 - a file coverage cannot parse: no statements
        return set(), {}
    firsts = {}
    for line in range(1, text.count("\n") + 2):
        firsts[line] = parser.first_line(line)
    return set(parser.statements), firsts


def attach_statements(hunks: list[Hunk], head: VllmSource) -> None:
    parsed: dict[str, tuple[set[int], dict[int, int]]] = {}
    for h in hunks:
        path = head.package.parent / h.path
        if h.path not in parsed:
            text = path.read_text(errors="replace") if path.is_file() else ""
            parsed[h.path] = statements_of(text)
        statements, firsts = parsed[h.path]
        lines = (range(h.head_start - 1, h.head_start + 1) if h.is_deletion
                 else range(h.head_start, h.head_end + 1))
        h.statements = tuple(sorted({firsts.get(x, x) for x in lines} & statements))


def measured_lines(data, head: VllmSource, patched_files: dict) -> dict[str, dict[int, set[str]]]:
    """coverage.py's data as ``vllm/...`` path -> HEAD line -> the contexts
    (runs) that executed it. Code that kvspec's fixes patched runs under its
    own file name; its lines are mapped back to the HEAD file's through the
    lines the patch left as they were."""
    out: dict[str, dict[int, set[str]]] = {}
    for filename in data.measured_files():
        by_line = data.contexts_by_lineno(filename)
        if filename in patched_files:
            original, text, patched = patched_files[filename]
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
    a, b = original.splitlines(), patched.splitlines()
    mapping = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                mapping[j1 + k + 1] = i1 + k + 1
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


def review_verdict(result, hunks: list[Hunk], base_errors, code_changed) -> ReviewVerdict:
    """The review's first line and exit code (see the module doc)."""
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
    tail = (" | " + " | ".join(notes)) if notes else ""
    if result.counterexample is not None:
        claims = sorted({v.invariant for v in result.counterexample.violations})
        return ReviewVerdict(f"REGRESSION: HEAD breaks {', '.join(claims)}, BASE does not"
                             f"{tail}", 1)
    if unrun or base_errors:
        return ReviewVerdict(f"INCOMPLETE: no regression found, but not all of the change "
                             f"was checked{tail}", 3)
    if not hunks:
        return ReviewVerdict(f"PASS: no regression (HEAD changes none of vLLM's Python "
                             f"files){tail}", 0)
    ran = sum(1 for h in hunks if h.statements)
    return ReviewVerdict(f"PASS: no regression; every changed hunk with code ran ({ran} of "
                         f"{len(hunks)} hunks have statements){tail}", 0)


# -- the Markdown review ---------------------------------------------------------------------

def markdown(verdict: ReviewVerdict, result, hunks: list[Hunk], base_label: str,
             head_label: str, head_given: str, base_given: str, statuses, seconds: float,
             wall: float) -> str:
    from kvspec.spec.catalogue import REGISTRY
    from kvspec.text import command_arg
    md = [f"## kvspec review: {verdict.line.split(':')[0]}", "", f"**{verdict.line}**", "",
          f"- base: {base_label}", f"- head: {head_label}",
          f"- check: {result.runs} runs, {result.actions} actions in {result.elapsed:.0f}s "
          f"(budget {seconds:g}s; review wall time {wall:.0f}s)", ""]
    if result.counterexample is not None:
        ce = result.counterexample
        md += ["### Regression", "", "| step | action | requests after it |", "| --- | --- | --- |"]
        md += [f"| {s.index} | `{s.action}` | {s.requests} |" for s in ce.runner.log]
        md += [""] + [f"- **{v.invariant}**: {v.message}" for v in ce.violations] + [""]
        md += ["Replay:", "", "```",
               f"kvspec replay {command_arg(result.trace_path)} --vllm {command_arg(head_given)}"
               "    # fails",
               f"kvspec replay {command_arg(result.trace_path)} --vllm {command_arg(base_given)}"
               "    # passes", "```", ""]
    if result.known:
        md += ["### Pre-existing (fail on the base too)", "",
               "| finding | times | upstream | trace |", "| --- | --- | --- | --- |"]
        md += [f"| {h.finding or 'not a known finding'} | {h.count} | {h.upstream} | "
               f"`{h.trace_path}` |" for h in result.known.values()]
        md.append("")
    md += ["### Coverage of the change", "",
           "| hunk | kvspec drives it | statements ran | runs that ran it |",
           "| --- | --- | --- | --- |"]
    for h in hunks:
        ran = f"{len(h.ran)}/{len(h.statements)}" if h.statements else "no statements"
        md.append(f"| `{h.where()}` | {'yes' if h.checked_module else 'no'} | {ran} | "
                  f"{h.runs}{' **never ran**' if h.never_ran else ''} |")
    md.append("")
    changed = [s for s in statuses if s.status in ("code-changed", "drifted")]
    if changed:
        md += ["### kvspec's fixes on HEAD", ""]
        md += [f"- `{s.fix}`: {s.status}: {s.detail}" for s in changed]
        md.append("")
    witnessed = sum(1 for n in REGISTRY if result.witnessed.get(n))
    never = [n for n in REGISTRY if not result.witnessed.get(n)]
    md += ["### Claims", "", f"{witnessed} of {len(REGISTRY)} claims witnessed"
           + (f"; never witnessed: {', '.join(never)}" if never else "") + ".", ""]
    return "\n".join(md)
