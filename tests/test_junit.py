"""``kvspec check --junit PATH`` (issue 28, item 2): the run as JUnit XML,
one test case per claim, built from the same summary as ``--json``."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _check(tmp_path: Path, *args: str) -> tuple[int, dict, ET.Element]:
    out = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", *args, "--json",
                          "--junit", "report.xml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    summary = json.loads(out.stdout)
    return out.returncode, summary, ET.parse(tmp_path / "report.xml").getroot()


def _cases(root: ET.Element) -> dict[str, ET.Element]:
    return {case.get("name").split("::", 1)[1]: case for case in root.iter("testcase")}


def test_a_caught_mutant_is_a_failure_of_the_claim_it_broke(tmp_path):
    code, summary, root = _check(tmp_path, "--target", "mutant:async_block_rounding",
                                 "--budget", "8s")
    assert code == 1 and summary["exit_code"] == 1
    broken = {v["claim"] for v in summary["violations"]}
    cases = _cases(root)
    failed = {name for name, case in cases.items() if case.find("failure") is not None}
    assert failed == broken and failed
    suite = root.find("testsuite")
    assert suite.get("failures") == str(len(failed))
    assert int(suite.get("tests")) == len(summary["claims"]) == len(cases)
    text = cases[sorted(failed)[0]].find("failure").text
    assert summary["trace"] in text and "kvspec replay" in text
    assert (tmp_path / summary["trace"]).is_file()


def test_a_held_run_passes_every_checked_claim_and_skips_the_rest(tmp_path):
    code, summary, root = _check(tmp_path, "--target", "impl", "--budget", "3s",
                                 "--no-design-rules")
    assert code == 0
    cases = _cases(root)
    assert not [c for c in cases.values() if c.find("failure") is not None]
    skipped = {n for n, c in cases.items() if c.find("skipped") is not None}
    unchecked = {c["name"] for c in summary["claims"] if c["checked"] is None}
    assert skipped == unchecked and skipped  # the design rules
    for claim in summary["claims"]:
        props = {p.get("name"): p.get("value") for p in cases[claim["name"]].iter("property")}
        assert props["witnessed"] == str(claim["witnessed"])


def test_an_unwritable_junit_path_is_a_one_line_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    for path, why in (("a-file/report.xml", "not a directory"), ("a-dir", "is a directory")):
        out = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--budget", "2s",
                              "--junit", path], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, out.stderr[-300:]
        assert out.stderr.startswith("kvspec: error: --junit") and why in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
        assert "kvspec: target" not in out.stdout  # refused before anything ran
