"""Never narrow silently (kvspec/verdict.py): every way an environment can be
narrowed is named in the verdict's first line, and a narrowing nobody asked for
never exits 0."""
from __future__ import annotations

import attrs
import pytest

from kvspec.harness.fuzz import FuzzResult, KnownHit
from kvspec.harness.profiles import FULL, EnvProfile
from kvspec.verdict import EXIT_HOLD, EXIT_INCOMPLETE, EXIT_VIOLATED, first_line, restrictions


def narrowed(field: str) -> EnvProfile:
    """FULL with one field set to a value other than the whole environment's."""
    value = getattr(FULL, field)
    if isinstance(value, bool):
        other = not value
    elif isinstance(value, int):
        other = value + 2
    elif isinstance(value, tuple):
        other = value[:1]
    else:
        other = "none"
    return attrs.evolve(FULL, **{field: other}, name="narrowed")


FIELDS = [f.name for f in attrs.fields(EnvProfile) if f.name not in ("name", "because")]


def held() -> FuzzResult:
    return FuzzResult("vllm", 0, 1.0, 3, 30, {})


@pytest.mark.parametrize("field", FIELDS)
def test_a_restriction_nobody_asked_for_never_exits_0(field):
    found = restrictions(narrowed(field), asked={}, gaps={})
    assert [r.field for r in found] == [field]
    line, code = first_line(held(), found)
    assert code == EXIT_INCOMPLETE and line.startswith("INCOMPLETE")
    assert field in line


@pytest.mark.parametrize("field", FIELDS)
def test_a_restriction_asked_for_is_named_and_may_pass(field):
    found = restrictions(narrowed(field), asked={field: "--option"}, gaps={})
    line, code = first_line(held(), found)
    assert code == EXIT_HOLD and "narrowed as asked" in line and field in line


def test_a_gap_of_the_target_is_named():
    found = restrictions(narrowed("spec_decode_with_last_state"), asked={},
                         gaps={"spec_decode_with_last_state": "not modelled"})
    line, code = first_line(held(), found)
    assert code == EXIT_HOLD and "not mapped by the target" in line
    # named on the verdict line, why on a line of its own (a connector's gaps
    # made the line ~900 characters)
    assert "spec_decode_with_last_state=False" in line and "not modelled" not in line
    from kvspec.verdict import gap_lines
    assert gap_lines(found) == ["  not mapped: spec_decode_with_last_state=False: not modelled"]


def test_the_whole_environment_restricts_nothing():
    assert restrictions(FULL, {}, {}) == []
    assert first_line(held(), []) == ("HOLD: every claim held", EXIT_HOLD)


def test_known_findings_and_changed_fixes_are_in_the_first_line():
    from kvspec.harness.known import FixStatus
    result = held()
    result.known["f"] = KnownHit("hybrid-sync-load-failure-unreportable", "shape", "", [], 4)
    changed = [FixStatus("recovery-fix", "code-changed", "", ("recompute-failed",))]
    line, code = first_line(result, [], changed)
    assert code == EXIT_HOLD
    # a run that met a known finding did not see every claim hold
    assert line.startswith("HOLD: no new violation (known findings aside)")
    assert line.index("code a fix changes has changed") < line.index("known findings met")
    assert "recovery-fix" in line and "hybrid-sync-load-failure-unreportable (4x)" in line


def test_a_new_violation_is_exit_1_whatever_else(monkeypatch):
    class V:
        invariant = "computed_means_valid"

    class CE:
        violations = [V()]
    result = held()
    result.counterexample = CE()
    line, code = first_line(result, restrictions(narrowed("layouts"), {}, {}))
    assert code == EXIT_VIOLATED and line.startswith("VIOLATED, new: computed_means_valid")
    assert "NOT CHECKED" in line


def test_the_check_command_exits_3_on_a_narrowing_nobody_asked_for(monkeypatch, tmp_path):
    """Through the command line: a profile narrowed behind the user's back (here
    by monkeypatching what the target draws) is the summary's first line, and
    the exit code is 3, not 0."""
    from typer.testing import CliRunner

    import kvspec.cli as cli
    monkeypatch.setattr(cli, "drawn_profile", lambda *a, **k: narrowed("load_failures"))
    result = CliRunner().invoke(cli.app, ["check", "--target", "impl", "--budget", "2s",
                                          "--out", str(tmp_path)])
    assert result.exit_code == EXIT_INCOMPLETE, result.output
    summary = [ln for ln in result.stdout.splitlines() if ln.startswith(("HOLD", "INCOMPLETE",
                                                                         "VIOLATED"))]
    assert summary and summary[0].startswith("INCOMPLETE") and "load_failures" in summary[0]
    # asked for (--layouts), the same kind of narrowing passes and says so
    monkeypatch.undo()
    result = CliRunner().invoke(cli.app, ["check", "--target", "impl", "--budget", "2s",
                                          "--layouts", "full", "--out", str(tmp_path)])
    assert result.exit_code == EXIT_HOLD, result.output
    assert "narrowed as asked: layouts=full (--layouts full)" in result.stdout
