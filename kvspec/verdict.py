"""A run's verdict: its first summary line and its exit code.

Never narrow silently. Whatever a run did not check is in the verdict's first
line, and only a run that checked what it set out to check exits 0:

- a *restriction* is any way the environment a run draws from differs from
  the whole environment (``profiles.FULL``). The user may ask for one
  (``--layouts``, ``--kv torch``); the target may not map a feature at all (a
  *gap* of the target, such as spec decode beside a last-state group on every
  target: the spec does not model vLLM's per-draft Mamba states); any
  other restriction is *unasked* and makes the run exit 3, whatever it found;
- a fix whose code was changed is shown before anything else (its finding is
  still there, and a counterexample of it is reported as that known finding);
- known findings met on the way are listed; they do not fail a run.

Exit codes: 0 every claim held (known findings aside), 1 a new violation,
2 bad input (the command line's), 3 incomplete: something was not checked
that nobody asked to leave out, 130 interrupted (SIGINT or SIGTERM): a
partial run, which reports no violation it did not find before the interrupt.
"""
from __future__ import annotations

import attrs

EXIT_HOLD, EXIT_VIOLATED, EXIT_BAD_INPUT, EXIT_INCOMPLETE = 0, 1, 2, 3
EXIT_INTERRUPTED = 130


@attrs.frozen
class Restriction:
    #: the EnvProfile field that differs from the whole environment
    field: str
    value: object
    why: str
    #: "asked" (an option of the user's), "gap" (the target does not map it),
    #: or "unasked" (nobody asked: the run is incomplete)
    kind: str

    def text(self) -> str:
        return f"{self.short()} ({self.why})"

    def short(self) -> str:
        return f"{self.field}={_value(self.value)}"


def gap_lines(found: list[Restriction]) -> list[str]:
    """Why the target does not map each field the verdict line names, one line each."""
    return [f"  not mapped: {r.short()}: {r.why}" for r in found if r.kind == "gap"]


def _value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def restrictions(profile, asked: dict[str, str], gaps: dict[str, str]) -> list[Restriction]:
    """Every field of ``profile`` that differs from the whole environment,
    classified: ``asked`` and ``gaps`` map field names to why."""
    import attrs as _attrs

    from kvspec.harness.profiles import FULL
    found = []
    for f in _attrs.fields(type(profile)):
        if f.name in ("name", "because"):
            continue
        value, whole = getattr(profile, f.name), getattr(FULL, f.name)
        if value == whole:
            continue
        if f.name in asked:
            found.append(Restriction(f.name, value, asked[f.name], "asked"))
        elif f.name in gaps:
            found.append(Restriction(f.name, value, gaps[f.name], "gap"))
        else:
            why = (f"profile {profile.name}" + (f", stepping around {', '.join(profile.because)}"
                                                 if profile.because else ""))
            found.append(Restriction(f.name, value, why, "unasked"))
    return found


#: how the verdict line's note on known findings starts (``parallel.combine`` finds it)
KNOWN_NOTE = "known findings met: "


#: a held run's verdict, and one that met known findings (they broke claims)
HOLD_PLAIN, HOLD_KNOWN = "HOLD: every claim held", "HOLD: no new violation (known findings aside)"

#: how the note on lost performance starts (it follows the known findings' note)
LOST_NOTE = "LOST PERFORMANCE"


def describe_known(counts) -> str:
    """The verdict line's note on known findings: each name with its count."""
    return KNOWN_NOTE + ", ".join(f"{name} ({count}x)" for name, count in counts)


def first_line(result, found: list[Restriction], code_changed=(),
               base_errors=()) -> tuple[str, int]:
    """The verdict's first line and the exit code (see the module doc)."""
    unasked = [r for r in found if r.kind == "unasked"]
    notes = []
    if code_changed:
        notes.append("the code a fix changes has changed: " + "; ".join(
            f"{s.fix} ({', '.join(s.present) or 'its finding'} still there)" for s in code_changed))
    if unasked:
        notes.append("NOT CHECKED (nobody asked): " + "; ".join(r.text() for r in unasked))
    asked = [r for r in found if r.kind == "asked"]
    if asked:
        notes.append("narrowed as asked: " + "; ".join(r.text() for r in asked))
    gaps = [r for r in found if r.kind == "gap"]
    if gaps:
        # the target's standing gaps are named only: why, on lines of their own
        # (``gap_lines``), kept the verdict line readable
        notes.append("not mapped by the target: " + ", ".join(r.short() for r in gaps))
    if base_errors:
        notes.append(f"the base could not answer {len(base_errors)} time(s): {base_errors[0]}")
    known = getattr(result, "known", {}) or {}
    if known:
        notes.append(describe_known(
            (hit.label or hit.finding or "pre-existing", hit.count) for hit in known.values()))
    lost = getattr(result, "efficiency", {}) or {}
    if lost:
        notes.append(LOST_NOTE + " (no safety claim broken by it): " + ", ".join(
            f"{key} ({hit.count}x, trace {hit.trace_path})" for key, hit in lost.items()))
    tail = "".join(f" | {note}" for note in notes)
    ce = result.counterexample
    claims = sorted({v.invariant for v in ce.violations}) if ce is not None else []
    if getattr(result, "interrupted", False):
        found = (f"; found before it, new: {', '.join(claims)} (trace {result.trace_path})"
                 if claims else "")
        return (f"INTERRUPTED after {result.elapsed:.1f}s: a partial run, judged up to the "
                f"interrupt{found}{tail}", EXIT_INTERRUPTED)
    if getattr(result, "time_limited", False):
        tail = f" | {describe_time_limit(result)}{tail}"
        if ce is None:
            return (f"INCOMPLETE: no violation in the runs made, but not every run asked "
                    f"for was made{tail}",
                    EXIT_INCOMPLETE)
    if ce is not None:
        replays = getattr(result, "replays", None)
        flaky = (f" (FLAKY: the saved trace broke it in {replays[0]} of {replays[1]} replays)"
                 if replays is not None and replays[0] < replays[1] else "")
        return f"VIOLATED{flaky}, new: {', '.join(claims)}{tail}", EXIT_VIOLATED
    if unasked:
        return f"INCOMPLETE{tail}", EXIT_INCOMPLETE
    return f"{HOLD_KNOWN if known else HOLD_PLAIN}{tail}", EXIT_HOLD


def describe_time_limit(result) -> str:
    """A budget in runs cut by its wall-clock safety net (``--time-limit``)."""
    return (f"--time-limit {result.time_limit:g}s stopped the run after {result.runs} of "
            f"{result.max_examples} runs (--examples)")
