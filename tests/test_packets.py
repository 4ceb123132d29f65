"""The finding packets (docs/findings/packets/, issue 27) hold together.

Every finding kvspec holds vLLM 0.33.0 to has a packet; every fix that fits
0.33.0 is named by one; each packet's committed measurement on 0.33.0
(``scripts/packets.py test``) says its test behaves as its kind says, with the
fixes its packet.toml names; a malformed packet is a one-line error. The
generated facts are checked against 0.33.0's own source when it is at hand
(``KVSPEC_VLLM`` naming it, as the second phase of ``.ci/run`` does).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import packets  # noqa: E402

from kvspec.harness import vllm_source  # noqa: E402
from kvspec.harness.accepted_findings import ACCEPTED  # noqa: E402
from kvspec.harness.vllm_patches import CONNECTOR_FIXES, FIXES  # noqa: E402

RELEASE = "0.33.0"


def get_findings(all_packets) -> dict[str, packets.Packet]:
    """finding id (``docs/findings/`` stem without its release) -> its packet."""
    return {p.data["finding"].split("-", 2)[2]: p for p in all_packets}


@pytest.fixture(scope="module")
def all_packets():
    return packets.load_packets()


def test_every_finding_of_the_newest_release_has_a_packet(all_packets):
    have = get_findings(all_packets)
    missing = sorted({f.id for f in ACCEPTED[RELEASE]} - set(have))
    assert not missing, f"findings of vLLM {RELEASE} without a packet: {missing}"
    stale = [p.slug for p in have.values()
             if p.kind != "history" and p.data["finding"].split("-", 2)[2]
             not in {f.id for f in ACCEPTED[RELEASE]}]
    assert not stale, f"packets of findings vLLM {RELEASE} does not have: {stale}"


def test_every_fix_of_the_newest_release_is_in_a_packet(all_packets):
    named = {fix for p in all_packets for fix in p.fixes}
    current = {fid for fid in FIXES if (packets.FIXES_DIR / f"{fid}.diff").exists()}
    assert current - named == set(), f"fixes no packet names: {sorted(current - named)}"


def test_the_committed_measurement_matches_every_packet(all_packets):
    path = packets.PACKETS / f"results-{RELEASE}.json"
    measured = json.loads(path.read_text())["packets"]
    for p in all_packets:
        if p.kind == "history":
            continue
        r = measured.get(p.slug)
        assert r is not None, f"{p.slug}: not measured (python scripts/packets.py test)"
        assert (r["kind"], r["fixes"], r["test"]) == (p.kind, p.fixes, p.test), \
            f"{p.slug}: measured as {r['kind']} with {r['fixes']}; measure it again"
        assert r["as_its_kind_says"], f"{p.slug}: {r['why_not']}"
        assert r["released"]["outcome"] == "failed", f"{p.slug}: {r['released']}"


def test_a_malformed_packet_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "packet.toml").write_text('finding = "x"\ntitle = "t"\nkind = "fix"\n')
    with pytest.raises(packets.PacketError, match="names the fixes its test needs"):
        packets.load_packets(where=tmp_path)
    (bad / "packet.toml").write_text('finding = "x"\ntitle = "t"\nkind = "fix"\n'
                                     'fixes = ["no-such-fix"]\n')
    with pytest.raises(packets.PacketError, match="no fix no-such-fix"):
        packets.load_packets(where=tmp_path)
    (bad / "packet.toml").write_text('finding = "x\n')
    with pytest.raises(packets.PacketError, match="packet.toml"):
        packets.load_packets(where=tmp_path)


def test_a_symbol_not_in_the_source_is_refused(tmp_path):
    (tmp_path / "vllm" / "x").mkdir(parents=True)
    (tmp_path / "vllm" / "x" / "m.py").write_text(
        "class C:\n    a: str = 'fail'\n\n    @property\n    def f(self):\n        return 1\n")
    source = packets.Source(tmp_path / "vllm", "9.9")
    assert source.lines("vllm/x/m.py", "C.f") == (4, 6)
    assert source.default("vllm/x/m.py", "C", "a") == "fail"
    assert source.enclosing("vllm/x/m.py", 6) == "C.f"
    with pytest.raises(packets.PacketError, match="no C.g in vLLM 9.9"):
        source.lines("vllm/x/m.py", "C.g")
    assert packets.is_same_default(False, "false")
    assert packets.is_same_default(None, "None (no spec decode)")
    assert not packets.is_same_default("fail", "recompute")


def get_newest_source() -> packets.Source | None:
    given = os.environ.get(vllm_source.SOURCE_ENV)
    try:
        source = packets.get_source(given)
    except vllm_source.SourceError:
        return None
    return source if source.version == RELEASE else None


def test_the_generated_facts_are_fresh():
    """Line numbers, defaults and symbols are read from 0.33.0's source: a
    packet whose facts block is stale, or that names a symbol or a default
    0.33.0 does not have, fails here."""
    source = get_newest_source()
    if source is None:
        pytest.skip(f"needs vLLM {RELEASE}'s source: KVSPEC_VLLM=vllm-{RELEASE}-*.whl "
                    "(.ci/run's second phase sets it)")
    for p in packets.load_packets():
        text = (p.folder / "README.md").read_text()
        assert packets.rendered_readme(p, source) == text, \
            f"{p.slug}: facts stale (python scripts/packets.py render --vllm WHEEL)"


def test_every_fix_applies_with_git_apply_in_the_documented_order(tmp_path):
    """What the packets' index tells a maintainer: every base diff, in the
    registry's order, applies with plain ``git apply`` to 0.33.0's source."""
    import shutil
    import subprocess
    source = get_newest_source()
    if source is None:
        pytest.skip(f"needs vLLM {RELEASE}'s source: KVSPEC_VLLM=vllm-{RELEASE}-*.whl "
                    "(.ci/run's second phase sets it)")
    tree = tmp_path / "checkout"
    shutil.copytree(source.package, tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    for fid in FIXES | CONNECTOR_FIXES:
        diff = packets.fix_path(fid)
        if diff.is_file():
            out = subprocess.run(["git", "apply", str(diff)], cwd=tree, capture_output=True,
                                 text=True)
            assert out.returncode == 0, f"{fid}: {out.stderr.strip()}"


def _runs(released, own, every, message="E   ModuleNotFoundError: No module named 'tblib'"):
    return {"released": (released, message), "with_its_fixes": (own, message),
            "with_every_fix": (every, message)}


@pytest.mark.parametrize("kind", ["fix", "connector"])
def test_an_error_is_never_a_verdict(all_packets, kind):
    """A test that could not run (CI once lacked vLLM's test dependency tblib:
    every run errored) shows neither the bug nor its fix, whatever the kind."""
    packet = next(p for p in all_packets if p.kind == kind)
    why = packets.judge(packet, _runs("error", "error", "error"))
    assert why and "error, not a verdict" in why and "tblib" in why
    assert packets.judge(packet, _runs("failed", "error", "failed"))


def test_the_kinds_are_judged_by_their_outcomes(all_packets):
    fix = next(p for p in all_packets if p.kind == "fix")
    connector = next(p for p in all_packets if p.kind == "connector")
    assert packets.judge(fix, _runs("failed", "passed", "passed")) is None
    assert "does not show the bug" in packets.judge(fix, _runs("passed", "passed", "passed"))
    assert "do not combine" in packets.judge(fix, _runs("failed", "passed", "failed"))
    assert packets.judge(connector, _runs("failed", "failed", "failed")) is None
    assert "nothing closes it" in packets.judge(connector, _runs("failed", "failed", "passed"))


def test_a_python_without_vllms_test_dependencies_is_a_one_line_error(tmp_path):
    """vLLM's tests/conftest.py imports tblib: a Python without it made every
    packet test error at collection (CI, stop 37); the run now stops first."""
    import calibrate_vllm_tests as calibrate
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "import os\nimport pytest\nfrom kvspec_no_such_module import x\n"
        "from vllm import LLM\nfrom tests.models.utils import y\nfrom .local import z\n")
    assert calibrate.get_conftest_imports(tmp_path) == ["kvspec_no_such_module", "pytest"]
    with pytest.raises(SystemExit) as stop:
        calibrate.check_test_imports(sys.executable, tmp_path)
    message = str(stop.value)
    assert "\n" not in message and "lacks kvspec_no_such_module," in message
    assert "[vllm-tests]" in message


def test_the_fix_line_names_changed_and_new_functions(tmp_path, monkeypatch):
    """Audit C (C-1): a method a fix inserts before ``def g`` rendered as
    "changes g". Added lines are now placed in the patched file, removed ones
    in the release, and a function the release lacks is called new."""
    (tmp_path / "vllm" / "x").mkdir(parents=True)
    (tmp_path / "vllm" / "x" / "m.py").write_text(
        "class C:\n    def f(self):\n        return 1\n\n    def g(self):\n        return 2\n")
    fixes = tmp_path / "fixes"
    fixes.mkdir()
    (fixes / "x.diff").write_text(
        "--- a/vllm/x/m.py\n+++ b/vllm/x/m.py\n@@ -1,6 +1,9 @@\n class C:\n"
        "     def f(self):\n-        return 1\n+        return self.h()\n+\n"
        "+    def h(self):\n+        return 1\n \n     def g(self):\n         return 2\n")
    monkeypatch.setattr(packets, "FIXES_DIR", fixes)
    source = packets.Source(tmp_path / "vllm", "9.9")
    assert packets.get_changed_functions("x", source) == {
        "vllm/x/m.py": {"C.f": False, "C.h": True}}
