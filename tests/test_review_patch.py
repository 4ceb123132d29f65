"""A review's HEAD given as a patch of BASE (``kvspec review BASE pr.diff``).

The patched tree is links to BASE's files with the changed ones copied and
patched by ``git apply``: BASE is never written through a link, files outside
``vllm/`` are left out (a diff of those alone has nothing to review), the
tree is found again by the name ``--vllm`` takes, and a diff that is empty,
unreadable or does not apply is a one-line error. None of this imports vLLM: BASE is a small directory.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.harness import vllm_source
from kvspec.harness.vllm_source import SourceError, resolve, resolve_change
from kvspec.review import changed_hunks

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
ORIGINAL = "def step():\n    n = (tokens + block_size - 1) // block_size\n    return n\n"

DIFF = f"""\
diff --git a/{SCHEDULER} b/{SCHEDULER}
--- a/{SCHEDULER}
+++ b/{SCHEDULER}
@@ -1,3 +1,3 @@
 def step():
-    n = (tokens + block_size - 1) // block_size
+    n = tokens // block_size
     return n
diff --git a/tests/test_step.py b/tests/test_step.py
new file mode 100644
--- /dev/null
+++ b/tests/test_step.py
@@ -0,0 +1 @@
+assert True
"""


@pytest.fixture
def base(tmp_path, monkeypatch) -> vllm_source.VllmSource:
    """A vLLM-shaped directory as BASE, and a working directory inside a git
    repository (as kvspec's own checkout is), where git apply must still apply
    the patch's paths from the patched tree's top."""
    root = tmp_path / "base"
    for rel, text in {"vllm/__init__.py": "", SCHEDULER: ORIGINAL,
                      "vllm/v1/request.py": "class Request: ...\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    monkeypatch.chdir(work)
    return resolve(str(root))


def write(tmp_path: Path, text: str, name: str = "pr.diff") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_patch_is_applied_over_links_to_base(base, tmp_path):
    head = resolve_change(str(write(tmp_path, DIFF)), base)
    assert head.kind == "patched" and head.version == base.version
    changed = head.package / "v1" / "core" / "sched" / "scheduler.py"
    assert "n = tokens // block_size" in changed.read_text()
    assert not changed.is_symlink()
    # BASE is untouched: the changed file was copied before git apply wrote it
    assert (base.package / "v1/core/sched/scheduler.py").read_text() == ORIGINAL
    assert (head.package / "v1" / "request.py").is_symlink()
    assert not (head.package / "_C.abi3.so").exists()  # compiled files left out
    assert not (head.root / "tests").exists()  # only vllm/ is applied
    assert "patch " in head.label() and "pr.diff" in head.label()
    # --vllm names the patched tree, and it resolves to the same source
    again = resolve(head.cli_name())
    assert again.package == head.package and again.label() == head.label()
    assert again.kind == "patched" and again.patch == head.patch


def test_a_patch_from_standard_input(base, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(DIFF))
    head = resolve_change("-", base)
    assert head.patch == "from standard input"
    assert "tokens // block_size" in (head.package / "v1/core/sched/scheduler.py").read_text()


def test_a_source_is_not_taken_for_a_patch(base):
    assert resolve_change(str(base.root), base).kind == "directory"


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("hello\n", "not a patch git can read"),
    (DIFF.replace("- 1) // block_size\n+", "- 2) // block_size\n+"),
     "does not apply to BASE (vLLM unknown): patch failed: "),
    (DIFF.replace("a/vllm/", "vllm/").replace("b/vllm/", "vllm/").replace(
        "b/tests/", "tests/"), "its paths have no a/ and b/ prefixes"),
])
def test_a_bad_patch_is_one_clear_error(base, tmp_path, text, message):
    with pytest.raises(SourceError) as raised:
        resolve_change(str(write(tmp_path, text)), base)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_patch_that_does_not_fit_names_the_file(base, tmp_path):
    bad = DIFF.replace("- 1) // block_size\n+", "- 2) // block_size\n+")
    with pytest.raises(SourceError, match=f"patch failed: {SCHEDULER}:1"):
        resolve_change(str(write(tmp_path, bad)), base)


def test_a_patch_is_no_source_of_its_own(base, tmp_path):
    with pytest.raises(SourceError, match="a patch, not a source"):
        resolve(str(write(tmp_path, DIFF)))


def test_a_missing_patch_file(base, tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        resolve_change(str(tmp_path / "nowhere.diff"), base)


def test_the_review_command_says_it_in_one_line(base, tmp_path):
    bad = write(tmp_path, DIFF.replace("- 1) // block_size\n+", "- 2) // block_size\n+"))
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", "review", str(base.root),
                           str(bad), "--budget", "5s"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"kvspec: error: patch {str(bad)!r} does not apply to BASE "
                                   f"(vLLM unknown): patch failed: {SCHEDULER}:1; make the "
                                   "diff against BASE")


def test_a_bad_out_is_refused_before_the_patch_is_applied(base, tmp_path):
    (tmp_path / "taken").write_text("")
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", "review", str(base.root),
                           str(write(tmp_path, DIFF)), "--out", str(tmp_path / "taken")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--out" in done.stderr and "exists and is not a directory" in done.stderr
    assert not list(Path(".kvspec/sources").glob("patch-*"))  # no tree was built


def test_a_patch_of_tests_or_docs_alone_has_nothing_to_review(base, tmp_path):
    """A pull request that changes no file under vllm/ (docs, tests): HEAD is
    BASE, and the review passes with nothing to review, as a review of two
    identical sources does (it was a one-line error, exit 2, failing the job
    of every such pull request)."""
    docs = write(tmp_path, "--- a/docs/x.md\n+++ b/docs/x.md\n@@ -1 +1 @@\n-a\n+b\n")
    head = resolve_change(str(docs), base)
    assert head.kind == "patched" and changed_hunks(base, head) == []
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", "review", str(base.root),
                           str(docs), "--budget", "5s", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: nothing to review (HEAD changes none of vLLM's Python files)" in done.stdout


def test_a_connector_base_does_not_register_is_refused_before_anything_runs(base, tmp_path):
    """Read from HEAD's factory, without importing vLLM (it took the import,
    ~10 s, and a BASE worker started for nothing, to say so)."""
    factory = base.package / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
    factory.parent.mkdir(parents=True)
    factory.write_text('KVConnectorFactory.register_connector(\n    "NixlConnector", "m", "C")\n')
    diff = write(tmp_path, DIFF)
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", "review", str(base.root),
                           str(diff), "--budget", "5s", "--connector", "NixlConector"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "kvspec: error: --connector NixlConector: vLLM unknown registers no connector of "
        "that name; did you mean NixlConnector? `kvspec targets` lists the 1 it does (or "
        "give module.path:ClassName)")


@pytest.mark.parametrize("args, message", [
    (["--budget", "5s", "--time-limit", "10m"], "--time-limit applies with --examples (a "
                                                "budget in runs); --budget is a time limit "
                                                "already"),
    (["--examples", "5", "--time-limit", "soon"], "invalid --time-limit 'soon': use a "
                                                  "positive duration like 60s, 10m or 1h"),
])
def test_a_bad_time_limit_is_refused_before_anything_runs(base, tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "kvspec.cli", "review", str(base.root),
                           str(write(tmp_path, DIFF)), *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"kvspec: error: {message}"


def test_two_reviews_into_one_out_keep_both_traces(base, tmp_path, monkeypatch):
    """A review's trace is named after its HEAD (it was review-seed0.json for
    every review, so a second review into the same --out overwrote the first)."""
    from kvspec.review import get_trace_name
    pr = resolve_change(str(write(tmp_path, DIFF, "pr-1234.diff")), base)
    monkeypatch.setattr(sys, "stdin", io.StringIO(DIFF + "\n"))
    piped = resolve_change("-", base)
    names = {get_trace_name(pr, 0), get_trace_name(piped, 0), get_trace_name(base, 0),
             get_trace_name(base, 1)}
    assert get_trace_name(pr, 0) == "review-pr-1234-seed0.json"
    assert get_trace_name(piped, 0).startswith("review-patch-")
    assert get_trace_name(base, 0) == f"review-{base.root.name}-seed0.json"
    assert len(names) == 4
