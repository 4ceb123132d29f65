"""What the commands say matches what they did (from a fresh-user audit of
the CLI): a search cut short says so, a claim no obligation judged is not
called unproved, a budget in runs is not shown as seconds."""
from __future__ import annotations

from typer.testing import CliRunner

from kvspec.cli import app
from kvspec.markdown_summary import get_heading


def _run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


def test_bmc_cut_by_its_state_budget_says_so(tmp_path):
    shown = _run("bmc", "--depth", "6", "--max-states", "10", "--out", str(tmp_path))
    assert shown.exit_code == 0, shown.output[-800:]
    text = " ".join(shown.output.split())
    assert "stopped the search before every sequence of up to 6 actions was tried" in text
    assert "no violation in every sequence" not in text


def test_prove_only_leaves_other_card_claims_unjudged():
    shown = _run("prove", "--only", "lemma_hit_leaves_a_token")
    assert shown.exit_code == 0, shown.output[-800:]
    assert "not established" not in shown.output
    assert "not judged: no obligation of it was run (--only)" in shown.output
    import re
    assert re.search(r"prove: every obligation holds \(1 lemma\) in [0-9.]+s\s*$",
                     shown.output), shown.output[-300:]


def test_prove_ends_with_which_obligations_did_not_hold():
    from kvspec.cli import describe_proofs
    rows = [{"name": "a", "kind": "lemma", "ok": True, "vacuous": False},
            {"name": "b", "kind": "refutation", "ok": False, "vacuous": False},
            {"name": "c", "kind": "induction", "ok": False, "vacuous": True}]
    assert describe_proofs(rows, 2.0) == (
        "prove: [red]2 of 3 obligations did not hold[/]: b, c (2.0s)")
    assert describe_proofs(rows[:1], 2.0) == "prove: every obligation holds (1 lemma) in 2.0s"


def test_markdown_heading_names_a_budget_in_runs():
    summary = {"verdict": "hold", "target": "impl", "seed": 0, "budget_s": 60.0}
    assert get_heading(summary).endswith("(seed 0, 60 s budget)")
    assert get_heading(dict(summary, examples_budget=200)).endswith("(seed 0, 200 runs budget)")
