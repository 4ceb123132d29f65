"""Planted bugs in the installed vLLM, each caught by the default check?

For every planted bug of ``kvspec/harness/vllm_patches.PLANTED`` this runs what
``kvspec check --target vllm --plant ID`` runs (the installed release with every
fix that fits, the whole environment, seed 0) for up to ``--budget`` seconds and
records: caught or not, the claims violated, the time to the first failing
example, the time including shrinking, the rows of the minimized step table, and
whether that trace passes on ``vllm`` without the planted bug (it must: the
check caught the planted bug, not something else).

Run from the repository root, with vLLM installed:

    HF_HUB_OFFLINE=1 python bench/bench_planted.py              # 60 s budget each
    HF_HUB_OFFLINE=1 python bench/bench_planted.py --budget 20 --only async-load-never-started

It writes ``bench/planted_results.json``, prints a table, and renders the table of
``docs/findings/README.md`` from it (``--render`` renders it from the committed file
without measuring; ``tests/test_docs.py`` checks they agree).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "planted_results.json"
FINDINGS_README = ROOT / "docs" / "findings" / "README.md"
BEGIN, END = "<!-- planted table: bench/bench_planted.py -->", "<!-- end of planted table -->"


def render_table(result: dict) -> str:
    """The planted-bug table of docs/findings/README.md, from bench/planted_results.json."""
    lines = [f"Measured on vLLM {result['vllm']}, seed {result['seed']}, {result['budget_s']:.0f} s "
             f"budget each, one process on a 2-core machine ({result['date']}, kvspec "
             f"`{result['commit']}`):", "",
             "| planted bug | claim it must break | caught | claims broken | first failure (s) "
             "| with shrinking (s) | steps | replay passes without it |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if not r["caught"]:
            lines.append(f"| `{r['id']}` | `{r['expected']}` | **no** ({r['runs']} runs) "
                         "| | | | | |")
            continue
        lines.append(f"| `{r['id']}`: {r['summary']} | `{r['expected']}` | yes | "
                     f"{', '.join(f'`{c}`' for c in r['claims'])} | {r['seconds']:.2f} | "
                     f"{r['total_seconds']:.2f} | {r['steps']} | "
                     f"{'yes' if r['passes_without_the_bug'] else '**no**'} |")
    return "\n".join(lines)


def render_readme(result: dict, text: str) -> str:
    """docs/findings/README.md with its planted-bug table replaced."""
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise SystemExit(f"{FINDINGS_README}: no {BEGIN!r} marker")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise SystemExit(f"{FINDINGS_README}: no {END!r} marker")
    return f"{head}{BEGIN}\n{render_table(result)}\n{END}{tail}"


def measure(pid: str, budget: float, seed: int, out_dir: Path) -> dict:
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.targets import vllm_target_name
    from kvspec.harness.vllm_patches import PLANTED
    from kvspec.run import default_check

    target = vllm_target_name("all", (pid,))
    result, _ = default_check(target, budget, seed, out_dir)
    row = {"id": pid, "summary": PLANTED[pid].summary, "expected": PLANTED[pid].target,
           "caught": result.counterexample is not None, "runs": result.runs,
           "actions": result.actions, "total_seconds": round(result.elapsed, 2)}
    if result.counterexample is None:
        return row
    claims = sorted({v.invariant for v in result.counterexample.violations})
    clean = replay_trace(result.trace_path, "vllm")
    row.update(claims=claims, seconds=round(result.first_seen, 2),
               steps=len(result.counterexample.runner.log),
               expected_claim_violated=PLANTED[pid].target in claims,
               passes_without_the_bug=not clean.violations)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per planted bug")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="planted bug ids (default: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true",
                        help="only render docs/findings/README.md from the committed results")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.out.read_text())
        FINDINGS_README.write_text(render_readme(result, FINDINGS_README.read_text()))
        return 0

    from kvspec.harness.accepted_findings import installed_vllm_version
    from kvspec.harness.vllm_patches import PLANTED
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pid in args.only or list(PLANTED):
            rows.append(measure(pid, args.budget, args.seed, Path(tmp)))
            r = rows[-1]
            print(f"{pid}: " + (f"caught in {r['seconds']:.2f} s ({r['total_seconds']:.2f} s "
                                f"with shrinking), {r['steps']} steps, {', '.join(r['claims'])}"
                                if r["caught"] else f"SURVIVED {args.budget:.0f} s"),
                  file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                      capture_output=True, text=True).stdout.strip():
        commit += " plus uncommitted changes"
    result = {"note": ("each planted bug under the default check (every fix that fits, the "
                       "whole environment), one after another in one process; times are to "
                       "the first failing example and with shrinking"),
              "vllm": installed_vllm_version(), "budget_s": args.budget, "seed": args.seed,
              "python": platform.python_version(), "platform": platform.platform(),
              "date": datetime.date.today().isoformat(), "commit": commit, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if args.out == DEFAULT_OUT:
        FINDINGS_README.write_text(render_readme(result, FINDINGS_README.read_text()))
        print(f"rendered {FINDINGS_README}", file=sys.stderr)
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
