"""Run the default check once per connector vLLM registers and write the
results table of docs/connectors.md.

    python scripts/connector_table.py [--budget 60s] [--vllm SOURCE] [--out DIR]

Each connector gets ``kvspec check --connector NAME --json`` in its own
process (a connector that takes over signals or hangs cannot stop the
others); the table says per connector whether it ran, the contract claims it
witnessed and what was violated, or the one-line reason it could not run.
Results: ``docs/connectors-results-<version>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def get_registered(vllm: str | None) -> tuple[str, list[str]]:
    """vLLM's version and the connector names its factory registers."""
    code = ("from kvspec.harness.vllm_target import modules; m = modules(); "
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory "
            "as F; import json; print(json.dumps([m.version, sorted(F._registry)]))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               **({"KVSPEC_VLLM": vllm} if vllm else {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    version, names = json.loads(out.stdout.strip().splitlines()[-1])
    return version, names


def check_one(name: str, budget: str, vllm: str | None, out: Path) -> dict:
    """One connector's default check: its verdict, or why it could not run."""
    argv = [sys.executable, "-m", "kvspec", "check", "--connector", name, "--budget", budget,
            "--json", "--out", str(out / name)]
    argv += ["--vllm", vllm] if vllm else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    try:
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"connector": name, "ran": False, "why": "timed out after 900 s"}
    if run.returncode == 2 or not run.stdout.strip():
        lines = [x for x in run.stderr.strip().splitlines() if x.strip()]
        return {"connector": name, "ran": False, "exit": run.returncode,
                "why": lines[-1] if lines else "no output"}
    summary = json.loads(run.stdout)
    claims = {c["name"]: c for c in summary["claims"]}
    contract = [n for n, c in claims.items() if c.get("role") == "contract"]
    return {"connector": name, "ran": True, "exit": run.returncode,
            "verdict": summary["verdict"], "runs": summary["runs"],
            "actions": summary["actions"],
            "witnessed": sorted(n for n in contract if claims[n]["witnessed"]),
            "violated": sorted(n for n, c in claims.items() if c.get("violations")),
            "base": summary.get("base"),
            "known": sorted({f"{k['label']} ({', '.join(k['claims'])})"
                             for k in summary.get("known_findings", [])})}


def render(version: str, rows: list[dict], budget: str) -> str:
    lines = [f"Default check, `--budget {budget}`, vLLM {version} "
             "(`python scripts/connector_table.py`):", "",
             "| connector | ran | runs | contract claims witnessed | violated | known findings "
             "met (the run went on) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r["ran"]:
            why = r["why"].removeprefix("kvspec: error: ").replace("|", "/")
            lines.append(f"| {r['connector']} | no: {why} | | | | |")
            continue
        known = "; ".join(r.get("known") or ()) or "-"
        if r.get("base") and known != "-":
            known = f"base {r['base']}: {known}"
        lines.append(f"| {r['connector']} | yes ({r['verdict']}) | {r['runs']} | "
                     f"{', '.join(r['witnessed']) or '-'} | {', '.join(r['violated']) or '-'} "
                     f"| {known} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="60s")
    parser.add_argument("--vllm", default=None)
    parser.add_argument("--out", default=".kvspec/connectors", type=Path)
    parser.add_argument("--only", default=None, help="connector names, joined by commas")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite docs/connectors-table.md from the saved results")
    args = parser.parse_args()
    if args.render:
        write_table()
        return 0
    version, names = get_registered(args.vllm)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    rows = []
    for name in names:
        print(f"connector_table: {name} ...", file=sys.stderr, flush=True)
        rows.append(check_one(name, args.budget, args.vllm, args.out))
        print(f"connector_table: {name}: {rows[-1].get('verdict') or rows[-1].get('why')}",
              file=sys.stderr, flush=True)
    path = ROOT / "docs" / f"connectors-results-{version}.json"
    if args.only and path.is_file():  # keep the other connectors' rows
        kept = {r["connector"]: r for r in json.loads(path.read_text())["rows"]}
        rows = list({**kept, **{r["connector"]: r for r in rows}}.values())
        rows.sort(key=lambda r: r["connector"])
    path.write_text(json.dumps({"vllm": version, "budget": args.budget, "rows": rows},
                               indent=1) + "\n")
    write_table()
    print(f"connector_table: wrote {path.relative_to(ROOT)} and docs/connectors-table.md",
          file=sys.stderr)
    return 0


def write_table() -> None:
    """docs/connectors-table.md from every docs/connectors-results-*.json."""
    parts = ["# Connectors: the default check per connector", "",
             "Generated by `python scripts/connector_table.py` (see docs/connectors.md for "
             "what each world plays and what the claims mean). A connector's row lists the "
             "contract claims its runs witnessed; a violation stops its run (the trace is "
             "under `--out`).", ""]
    for path in sorted((ROOT / "docs").glob("connectors-results-*.json")):
        data = json.loads(path.read_text())
        parts.append(render(data["vllm"], data["rows"], data["budget"]))
    (ROOT / "docs" / "connectors-table.md").write_text("\n".join(parts))


if __name__ == "__main__":
    sys.exit(main())
