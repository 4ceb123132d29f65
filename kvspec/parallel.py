"""``kvspec fuzz --workers N``: one campaign over N processes (issue 28, item 4).

Worker ``i`` is an ordinary ``kvspec fuzz`` with seed ``seed + i`` (so worker 0 is
the single-process run of that seed), the same budget, and the same example
database, which every worker writes and replays first: a failure one worker saved
is tried by the others' next batches. Each worker saves its own trace
(``<target>-seed<seed+i>.json``). The campaign's summary is the workers' summed
(runs, actions, checked and witnessed counts per claim) and its verdict the
worst of theirs: a violation in any worker fails the campaign, and its
counterexample (step table and replay command) is printed as the worker printed
it. An interrupt reaches every worker; the campaign then exits 130 like one run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from kvspec.verdict import (EXIT_INTERRUPTED, HOLD_KNOWN, HOLD_PLAIN, KNOWN_NOTE, LOST_NOTE,
                            describe_known)

#: exit codes from best to worst: a campaign reports the worst of its workers'
SEVERITY = (0, 3, 1, EXIT_INTERRUPTED, 2)


def get_worker_commands(argv: list[str], seed: int, workers: int,
                        examples: int | None) -> list[list[str]]:
    """``argv`` (the fuzz options but --seed, --workers, --examples, --json,
    --junit, --markdown) once per worker, with its seed and share of runs."""
    commands = []
    for i in range(workers):
        command = [sys.executable, "-m", "kvspec", "fuzz", *argv, "--seed", str(seed + i),
                   "--json"]
        if examples is not None:
            command += ["--examples", str(-(-examples // workers))]
        commands.append(command)
    return commands


def run_workers(commands: list[list[str]]) -> list[tuple[int, dict | None, str]]:
    """Each worker's exit code, JSON summary (None if it printed none) and stderr."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ)) for c in commands]
    from kvspec.harness.interrupt import interruptible
    try:
        with interruptible():  # SIGTERM too: a cancelled CI job stops every worker
            outputs = [p.communicate() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        outputs = [p.communicate() for p in procs]
    return [(p.returncode, read_summary(out), err) for p, (out, err) in zip(procs, outputs)]


def read_summary(stdout: str) -> dict | None:
    """The ``--json`` summary a ``kvspec check``/``fuzz`` printed (None when it
    printed none: it crashed)."""
    try:
        return json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return None


def get_worst_code(codes: list[int]) -> int:
    known = [c if c in SEVERITY else 2 for c in codes]
    return max(known, key=SEVERITY.index)


def combine(summaries: list[dict]) -> dict:
    """One campaign summary from the workers' (their claims summed)."""
    first = summaries[0]
    by_name: dict[str, list[dict]] = {}  # by name: a row only some workers have (a
    for summary in summaries:            # crash, steps on torch) lines up with no other
        for row in summary["claims"]:
            by_name.setdefault(row["name"], []).append(row)
    claims = [dict(rows[0], **{k: (None if any(r[k] is None for r in rows)
                                   else sum(r[k] for r in rows))
                               for k in ("checked", "witnessed", "violations")})
              for rows in by_name.values()]
    elapsed = max(s["elapsed_s"] for s in summaries)
    actions = sum(s["actions"] for s in summaries)
    failing = [s for s in summaries if s["violations"]]
    shown = failing[0] if failing else first
    known = merge_known(summaries)
    return dict(first, claims=claims, runs=sum(s["runs"] for s in summaries), actions=actions,
                elapsed_s=elapsed, actions_per_s=round(actions / elapsed, 1) if elapsed else 0.0,
                verdict=shown["verdict"], verdict_line=count_known(shown["verdict_line"], known),
                violations=shown["violations"], trace=shown["trace"],
                exit_code=get_worst_code([s["exit_code"] for s in summaries]),
                seeds=[s["seed"] for s in summaries], workers=len(summaries),
                state_checks=dict(first.get("state_checks", {}), **{
                    k: sum(s.get("state_checks", {}).get(k, 0) for s in summaries)
                    for k in ("incremental", "full")}),
                runs_by_scale={k: sum(s.get("runs_by_scale", {}).get(k, 0) for s in summaries)
                               for k in ("small", "production")},
                traces=[s["trace"] for s in failing],
                known_findings=known,
                unwitnessed=combine_unwitnessed([s["unwitnessed"] for s in summaries]))


#: why no worker witnessed a claim, where the workers gave different reasons
SPLIT_REASON = "not reached by any worker's draws; a longer campaign (--budget) may reach it"


def combine_unwitnessed(reasons: list[dict[str, str]]) -> dict[str, str]:
    """The claims no worker witnessed, each with its reason, as one run's JSON
    has them (name -> why): the workers' reason where they agree."""
    names = set.intersection(*(set(r) for r in reasons))
    combined = {}
    for name in sorted(names):
        why = {r[name] for r in reasons}
        combined[name] = why.pop() if len(why) == 1 else SPLIT_REASON
    return combined


def merge_known(summaries: list[dict]) -> list[dict]:
    """The workers' known findings, one entry per finding met, counts summed
    (the first worker's trace and wording kept)."""
    merged: dict[tuple, dict] = {}
    for summary in summaries:
        for hit in summary.get("known_findings", []):
            key = (hit["finding"], hit["label"], tuple(hit["claims"] or ()))
            if key in merged:
                merged[key]["count"] += hit["count"]
            else:
                merged[key] = dict(hit)
    return list(merged.values())


def count_known(line: str, known: list[dict]) -> str:
    """A worker's verdict line with its note on known findings counting every
    worker's (the note added where that worker met none). The note comes after
    every other but lost performance's (``verdict.first_line``)."""
    head, sep, rest = line.partition(" | " + KNOWN_NOTE)
    if sep:  # drop the worker's own note, up to the note after it
        _, lost, tail = rest.partition(" | " + LOST_NOTE)
        rest = lost + tail
    else:
        head, lost, tail = line.partition(" | " + LOST_NOTE)
        rest = lost + tail
    if not known:
        return head + rest
    note = describe_known((k["label"] or k["finding"] or "pre-existing", k["count"])
                          for k in known)
    head = head.replace(HOLD_PLAIN, HOLD_KNOWN, 1)  # another worker met one
    return f"{head} | {note}{rest}"


def report_workers(results: list[tuple[int, dict | None, str]], seed: int) -> list[str]:
    """One line per worker, and the full output of the first that failed."""
    lines = []
    for i, (code, summary, _) in enumerate(results):
        what = summary["verdict_line"] if summary else "printed no summary (it crashed)"
        lines.append(f"kvspec: worker {i} (seed {seed + i}): exit {code}: {what}")
    for i, (code, summary, err) in enumerate(results):
        if code not in (0, EXIT_INTERRUPTED):
            lines += ["", f"kvspec: worker {i}'s output:", err.rstrip()]
            break
    return lines
