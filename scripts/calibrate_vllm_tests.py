"""Calibrate kvspec's claims on vLLM's own unit tests (issue 26).

    python scripts/calibrate_vllm_tests.py 0.32.0 [--python PY] [--shards 2] [--fixes]

Fetches the release's source distribution from PyPI (no build: only its
``tests/`` tree is used), prepares an offline Hugging Face cache holding only
the named models' ``config.json`` (``scripts/vllm_test_models.py``), runs the
scheduler, KV-connector, offloading and streaming test files below with
``-p kvspec.observe`` under ``PY`` (a Python whose installed vLLM is that
release, with kvspec importable), and writes ``docs/calibration/VERSION.json``
and the table in ``docs/calibration/VERSION.md``. Every scheduler a test builds
is watched; a claim a test breaks within the engine's contract is a claim too
strong, a mis-mapping or a vLLM bug, until shown which.

With ``--fixes`` the same files run with every kvspec fix installed in vLLM's
classes (``-p kvspec.harness.pytest_vllm_fixes``) instead; a test that fails
there is run again on the release, and one that passes on the release must be
named by a packet's ``changes_vllm_tests`` (the fix changes what the test
asserts, on purpose; docs/findings/packets/) or the run says so. Writes ``docs/calibration/VERSION-fixes.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_test_models import write_cache  # noqa: E402

TEST_FILES = (
    "tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_kv_sharing.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_reset_prefix_cache_e2e.py", "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py", "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/core/test_mamba_align_chunk_split.py", "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/prefix_cache",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_simple_cpu_offload_connector.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/streaming_input/test_scheduler_streaming.py",
)
#: the gate (--fixes) also runs the tests of the connectors a fix changes
#: (kvspec/harness/vllm_patches.CONNECTOR_FIXES); test_nixl_connector.py needs ray
GATE_EXTRA_FILES = (
    "tests/v1/kv_connector/unit/test_nixl_connector_hma.py",
    "tests/v1/kv_connector/unit/test_nixl_push_connector.py",
    "tests/v1/kv_connector/unit/test_nixl_heartbeat.py",
    "tests/v1/kv_connector/unit/test_mooncake_connector.py",
    "tests/v1/kv_connector/unit/test_mooncake_connector_hma.py",
    "tests/v1/kv_connector/unit/test_mooncake_connector_hybrid_mamba.py",
    "tests/v1/kv_connector/unit/test_hma_auto_config.py",
)
CACHE = ROOT / ".kvspec" / "sdist"


def get_fix_contradicts() -> dict[str, tuple[str, str]]:
    """vLLM tests a kvspec fix changes on purpose: test id -> (fix, why), from
    the packets that say so (``changes_vllm_tests`` in docs/findings/packets/)."""
    from packets import load_packets  # the packets read this module too
    return {entry["id"]: (entry.get("fix", p.fixes[0]), f"packet {p.slug}: {entry['why']}")
            for p in load_packets() for entry in p.get_changed_vllm_tests()}


def get_sdist_url(version: str) -> str:
    request = urllib.request.Request("https://pypi.org/simple/vllm/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        files = json.load(reply)["files"]
    wanted = f"vllm-{version}.tar.gz"
    for f in files:
        if f["filename"] == wanted:
            return f["url"]
    sys.exit(f"calibrate: PyPI has no {wanted}")


def get_tests(version: str) -> Path:
    """The release's ``tests/`` tree, fetched once into .kvspec/sdist/."""
    where = CACHE / f"vllm-{version}"
    if (where / "tests").is_dir() and (where / "pyproject.toml").exists():
        return where
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"vllm-{version}.tar.gz"
    if not archive.exists():
        print(f"calibrate: fetching vllm-{version}.tar.gz from PyPI", file=sys.stderr)
        partial = archive.with_name(archive.name + ".part")  # never a torn archive
        try:
            urllib.request.urlretrieve(get_sdist_url(version), partial)
        except OSError as exc:  # urllib's URLError is one
            sys.exit(f"calibrate: cannot fetch vllm-{version}.tar.gz from PyPI: {exc}")
        partial.replace(archive)
    with tarfile.open(archive) as tar:
        # its tests, and the pytest configuration they run under
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name.startswith(f"vllm-{version}/tests/")
            or m.name == f"vllm-{version}/pyproject.toml")]
        tar.extractall(CACHE, members=members, filter="data")
    return where


def get_conftest_imports(tests: Path) -> list[str]:
    """The third-party modules vLLM's ``tests/conftest.py`` imports at its top:
    every test file of the tree loads it, so each must import."""
    tree = ast.parse((tests / "tests" / "conftest.py").read_text())
    names = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in tree.body
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return sorted(n for n in names - {"vllm", "tests"} if n not in sys.stdlib_module_names)


def check_test_imports(python: str, tests: Path, env: dict | None = None) -> None:
    """Stop with one line when ``python`` lacks what vLLM's test tree imports
    (else every test errors at collection and no verdict is possible)."""
    probe = ("import importlib.util, sys\n"
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([python, "-c", probe, *get_conftest_imports(tests)], env=env,
                         capture_output=True, text=True, timeout=300)
    if missing := out.stdout.split():
        sys.exit(f"calibrate: {python} lacks {', '.join(missing)}, which vLLM's "
                 f"tests/conftest.py imports: pip install -e '{ROOT}[vllm-tests]'")


def get_installed_version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300).stdout.strip()


def run_shard(python: str, source: Path, files: list[str], out: Path, hf_home: Path,
              fixes: bool = False):
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KVSPEC_VLLM_FIXES="all")
    plugin = (["-p", "kvspec.harness.pytest_vllm_fixes", "-rfE"] if fixes else
              ["-p", "kvspec.observe", "--kvspec-observe-json", str(out)])
    # vLLM's own pytest configuration (not a parent folder's), one process per shard
    command = [python, "-m", "pytest", "-q", "-c", "pyproject.toml", "--rootdir", ".",
               "-p", "no:xdist", "-p", "no:cacheprovider", *plugin, *files]
    # with the fixes, the summary pytest prints is the report (failures by test id)
    stdout = out.open("w") if fixes else subprocess.DEVNULL
    return subprocess.Popen(command, cwd=source, env=env, stdout=stdout,
                            stderr=subprocess.DEVNULL)


def run_shards(args, source: Path, files: list[str], hf_home: Path,
               fixes: bool = False) -> tuple[list[Path], float]:
    """The files split over ``args.shards`` pytest processes at once: each
    shard's report file (removed first), and the seconds they took."""
    work = CACHE / f"reports-{args.version}"
    work.mkdir(parents=True, exist_ok=True)
    parts = [work / (f"fixes{i}.txt" if fixes else f"shard{i}.json")
             for i in range(args.shards)]
    for p in parts:
        p.unlink(missing_ok=True)
    start = time.monotonic()
    procs = [run_shard(args.python, source, files[i::args.shards], parts[i], hf_home, fixes)
             for i in range(args.shards)]
    for p in procs:
        p.wait()
    return parts, time.monotonic() - start


def rerun_failures(python: str, source: Path, data: dict, hf_home: Path) -> dict:
    """The tests that failed under the plugin, run again without it: the
    plugin must change no test's outcome."""
    return rerun(python, source, [t["nodeid"] for t in data["tests"]
                                  if t.get("outcome") == "failed"], hf_home)


def rerun(python: str, source: Path, failed: list[str], hf_home: Path) -> dict:
    """``failed`` run again on the release, no kvspec plugin."""
    if not failed:
        return {"rerun": 0, "passed_without": []}
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    # a file that errors at collection (a missing optional import) must not stop the
    # others: without the flag pytest runs nothing and every failure looks shared
    out = subprocess.run([python, "-m", "pytest", "-q", "-rA", "-c", "pyproject.toml",
                          "--rootdir", ".", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "--continue-on-collection-errors", *failed],
                         cwd=source, env=env, capture_output=True, text=True).stdout
    passed = [line.split()[1] for line in out.splitlines() if line.startswith("PASSED ")]
    return {"rerun": len(failed), "passed_without": passed}


def read_summaries(parts: list[Path]) -> tuple[Counter, list[str]]:
    """Outcome counts and the failed (or erroring) test ids from the summaries
    pytest printed (``-rfE``)."""
    counts, failed = Counter(), []
    for part in parts:
        lines = part.read_text().splitlines() if part.exists() else []
        # "ERROR    vllm.x:file.py:12 ..." is a captured log line, not a test id
        failed += [line.split()[1] for line in lines
                   if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1
                   and line.split()[1].startswith("tests/")]
        tail = lines[-1] if lines else ""
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                  tail):
            counts["error" if what.startswith("error") else what] += int(n)
    return counts, sorted(set(failed))


def judge_fixes(counts: Counter, failed: list[str], rerun_result: dict) -> dict:
    """What the fixes did to vLLM's tests: failures the release shares (this
    machine's), failures a fix causes on purpose, and any other (a defect)."""
    caused = [n for n in failed if n in rerun_result["passed_without"]]
    contradicts = get_fix_contradicts()
    return {"tests": sum(counts.values()), "outcomes": dict(counts),
            "failed": failed, "failed_on_the_release_too": sorted(set(failed) - set(caused)),
            "contradicted_on_purpose": {n: contradicts[n] for n in caused if n in contradicts},
            "broken_by_a_fix": [n for n in caused if n not in contradicts]}


def render_fixes(version: str, data: dict, seconds: float) -> str:
    lines = [f"# vLLM {version}'s own tests with every kvspec fix", "",
             f"<!-- written by `python scripts/calibrate_vllm_tests.py {version} --fixes` -->",
             "", f"{len(TEST_FILES) + len(GATE_EXTRA_FILES)} test files or folders, run with "
             "`pytest -p kvspec.harness.pytest_vllm_fixes` (every fix installed in vLLM's own "
             f"classes, `AsyncScheduler` and every subclass included) in {seconds:.0f} s: "
             f"{data['tests']} tests ({', '.join(f'{n} {k}' for k, n in sorted(data['outcomes'].items()))}).",
             "", f"Fixes applied: {', '.join(f'`{f}`' for f in data['applied'])}.", "",
             f"- failed on the release too (this machine's): "
             f"{len(data['failed_on_the_release_too'])}",
             f"- failed because a fix changes what the test asserts, on purpose: "
             f"{len(data['contradicted_on_purpose'])}",
             f"- **broken by a fix (a defect of the fix): {len(data['broken_by_a_fix'])}**", "",
             "## Tests a fix contradicts on purpose", ""]
    lines += [f"- `{n}`: `{fix}`: {why}" for n, (fix, why) in
              data["contradicted_on_purpose"].items()] or ["None."]
    lines += ["", "## Tests broken by a fix", ""]
    lines += [f"- `{n}`" for n in data["broken_by_a_fix"]] or ["None."]
    return "\n".join(lines) + "\n"


def calibrate_fixes(args, source: Path, files: list[str], hf_home: Path) -> None:
    parts, seconds = run_shards(args, source, files, hf_home, fixes=True)
    counts, failed = read_summaries(parts)
    if not counts:
        sys.exit("calibrate: no shard printed pytest's summary (run a shard's pytest by hand)")
    data = judge_fixes(counts, failed, rerun(args.python, source, failed, hf_home))
    data["applied"], data["seconds"] = get_applied(args.python), seconds
    write_fixes(args.version, data)


def rejudge_fixes(version: str) -> None:
    """Judge a run's failures again against the packets' changed tests (no test run)."""
    path = ROOT / "docs" / "calibration" / f"{version}-fixes.json"
    old = json.loads(path.read_text())
    rerun_result = {"passed_without": old["contradicted_on_purpose"].keys()
                    | set(old["broken_by_a_fix"])}
    data = judge_fixes(Counter(old["outcomes"]), old["failed"], rerun_result)
    data["applied"], data["seconds"] = old["applied"], old.get("seconds", 0.0)
    write_fixes(version, data)


def write_fixes(version: str, data: dict) -> None:
    seconds = data["seconds"]
    out = ROOT / "docs" / "calibration"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{version}-fixes.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{version}-fixes.md").write_text(render_fixes(version, data, seconds))
    write_index()
    print(f"calibrate: vLLM {version} with every fix: {data['tests']} tests, "
          f"{len(data['contradicted_on_purpose'])} contradicted on purpose, "
          f"{len(data['broken_by_a_fix'])} broken by a fix; "
          f"docs/calibration/{version}-fixes.md")


def get_applied(python: str) -> list[str]:
    code = ("from kvspec.harness.vllm_patches import patched; "
            "print(','.join(patched('all', connectors=True).applied))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600).stdout.strip().splitlines()
    return out[-1].split(",") if out else []


def merge(parts: list[Path]) -> dict:
    sys.path.insert(0, str(ROOT))
    from kvspec.observe import BARE_CLAIMS, get_not_evaluated, get_summary, read_records
    records = read_records(parts)
    if not records:
        sys.exit("calibrate: no shard wrote a report (run a shard's pytest command by hand)")
    return {"claims": list(BARE_CLAIMS), "not_on_a_bare_scheduler": get_not_evaluated(),
            "summary": get_summary(records),
            "tests": [attrs.asdict(r) | {"verdict": r.verdict} for r in records]}


def render(version: str, data: dict, seconds: float) -> str:
    s = data["summary"]
    outcomes = Counter(t.get("outcome", "?") for t in data["tests"])
    lines = [f"# kvspec's claims on vLLM {version}'s own tests",
             "", f"<!-- written by `python scripts/calibrate_vllm_tests.py {version}` -->", "",
             f"{len(TEST_FILES)} test files or folders of vLLM {version}'s source distribution, "
             f"run with `pytest -p kvspec.observe` in {seconds:.0f} s: {s['tests']} tests "
             f"({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}).", "",
             "| what | tests |", "| --- | --- |",
             f"| built a scheduler kvspec maps | {s['mapped_tests']} |",
             f"| built only schedulers it cannot map | {s['unmapped_tests']} |",
             f"| built no scheduler | {s['no_scheduler']} |",
             f"| broke a claim within the engine's contract | "
             f"{s['verdicts'].get('violation', 0)} |",
             f"| drove the scheduler outside the engine's contract | "
             f"{s['verdicts'].get('out of contract', 0)} |",
             "", f"{s['calls']} calls checked against {len(data['claims'])} claims "
             f"({', '.join(data['claims'])}).", "",
             "Not evaluable on a bare scheduler: " + "; ".join(
                 f"`{k}` ({v})" for k, v in data["not_on_a_bare_scheduler"].items()) + ".", ""]
    rerun = data.get("failed_without_the_plugin")
    if rerun is not None:
        lines += [f"The {rerun['rerun']} tests that failed (this machine: no torchvision beside "
                  "torch 2.13, no accelerator, model configs it does not ship) were run again "
                  f"without the plugin: {len(rerun['passed_without'])} passed then"
                  + (": " + ", ".join(f"`{n}`" for n in rerun["passed_without"])
                     if rerun["passed_without"] else " (the plugin changed no outcome)") + ".", ""]
    lines += ["## Tests that broke a claim within the contract", ""]
    broken = [t for t in data["tests"] if t["verdict"] == "violation"]
    lines += [f"- `{t['nodeid']}`: `{t['violations'][0]['claim']}` after "
              f"`{t['violations'][0]['call']}`: {t['violations'][0]['message']}"
              for t in broken] or ["None."]
    lines += ["", "## Tests outside the engine's contract", ""]
    lines += [f"- `{t['nodeid']}`: {'; '.join(t['out_of_contract'])}"
              for t in data["tests"] if t["verdict"] == "out of contract"] or ["None."]
    lines += ["", "## Schedulers kvspec cannot map, by reason", "", "| reason | tests |",
              "| --- | --- |"]
    lines += [f"| {k} | {n} |" for k, n in sorted(s["unmappable_reasons"].items(),
                                                    key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def write_index() -> None:
    """``docs/calibration.md``: every release calibrated, one line each."""
    where = ROOT / "docs" / "calibration"
    rows, fix_rows = [], []
    for path in sorted(where.glob("*.json")):
        data = json.loads(path.read_text())
        version = path.stem.removesuffix("-fixes")
        if path.stem.endswith("-fixes"):
            fix_rows.append(
                f"| [{version}](calibration/{version}-fixes.md) | {data['tests']} | "
                f"{len(data['failed_on_the_release_too'])} | "
                f"{len(data['contradicted_on_purpose'])} | {len(data['broken_by_a_fix'])} |")
            continue
        s, v = data["summary"], data["summary"]["verdicts"]
        rows.append(f"| [{version}](calibration/{version}.md) | {s['tests']} | "
                    f"{s['mapped_tests']} | {s['calls']} | {len(data['claims'])} | "
                    f"{v.get('violation', 0)} | {v.get('out of contract', 0)} | "
                    f"{s['unmapped_tests']} |")
    text = "\n".join([
        "# kvspec's claims calibrated on vLLM's own tests", "",
        "<!-- written by `python scripts/calibrate_vllm_tests.py VERSION [--fixes]` -->", "",
        "Each release's scheduler, KV-connector, offloading and streaming tests, run with "
        "`pytest -p kvspec.observe` (every scheduler a test builds is watched, every claim a "
        "bare scheduler allows is judged after every call): a break within the engine's "
        "contract is a claim too strong, a mis-mapping or a vLLM bug until shown which.", "",
        "| release | tests | mapped | calls | claims | broke a claim in contract | "
        "out of contract | unmapped only |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows, "",
        "The same tests with every kvspec fix installed in vLLM's own classes "
        "(`pytest -p kvspec.harness.pytest_vllm_fixes`):", "",
        "| release | tests | failed on the release too | a fix contradicts on purpose | "
        "broken by a fix |", "| --- | --- | --- | --- | --- |", *fix_rows, ""])
    (ROOT / "docs" / "calibration.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version")
    parser.add_argument("--python", default=sys.executable,
                        help="a Python whose installed vLLM is that release")
    parser.add_argument("--shards", type=int, default=2, help="pytest processes at once")
    parser.add_argument("--fixes", action="store_true",
                        help="run the tests with every kvspec fix instead of the claims")
    parser.add_argument("--rejudge", action="store_true",
                        help="with --fixes: judge the last run's failures again, run nothing")
    args = parser.parse_args()
    if args.fixes and args.rejudge:
        return rejudge_fixes(args.version)
    installed = get_installed_version(args.python)
    if installed != args.version:
        sys.exit(f"calibrate: {args.python} has vLLM {installed or 'not installed'}, "
                 f"not {args.version}; pass --python of a venv with vLLM {args.version}")
    source = get_tests(args.version)
    check_test_imports(args.python, source)
    files = [f for f in TEST_FILES if (source / f).exists()]
    hf_home = CACHE / "hf_home"
    write_cache(hf_home)
    if args.fixes:
        files += [f for f in GATE_EXTRA_FILES if (source / f).exists()]
        return calibrate_fixes(args, source, files, hf_home)
    parts, seconds = run_shards(args, source, files, hf_home)
    data = merge(parts)
    data["failed_without_the_plugin"] = rerun_failures(args.python, source, data, hf_home)
    out = ROOT / "docs" / "calibration"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.version}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{args.version}.md").write_text(render(args.version, data, seconds))
    write_index()
    s = data["summary"]
    print(f"calibrate: vLLM {args.version}: {s['tests']} tests, {s['mapped_tests']} mapped, "
          f"{s['verdicts'].get('violation', 0)} broke a claim within the contract; "
          f"docs/calibration/{args.version}.md")


if __name__ == "__main__":
    main()
