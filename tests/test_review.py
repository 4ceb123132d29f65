"""``kvspec review`` without vLLM: what changed (hunks), what ran of it (coverage
mapped back through kvspec's own patches), and the verdict's first line.
tests/test_review_vllm.py runs whole reviews of vLLM."""
from __future__ import annotations

from pathlib import Path

from kvspec.harness.fuzz import FuzzResult, KnownHit
from kvspec.harness.vllm_source import resolve
from kvspec.review import (Hunk, _map_back, attach_coverage, attach_statements, changed_hunks,
                           get_harm, review_verdict)

BASE = """\
def schedule(self):
    budget = self.budget
    for request in self.running:
        budget -= 1
    return budget


def recover(self, blocks):
    blocks = list(blocks)
    return [b for b in blocks if b.ok]
"""


def tree(root: Path, scheduler: str, extra: dict[str, str] | None = None) -> Path:
    pkg = root / "vllm"
    (pkg / "v1" / "core" / "sched").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "v1" / "core" / "sched" / "scheduler.py").write_text(scheduler)
    for rel, text in (extra or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_hunks_name_what_head_changes(tmp_path):
    head_text = BASE.replace("budget -= 1", "budget -= 2").replace(
        "    blocks = list(blocks)\n", "")
    base = resolve(str(tree(tmp_path / "base", BASE)))
    head = resolve(str(tree(tmp_path / "head", head_text, {"vllm/v1/worker/new.py": "x = 1\n"})))
    hunks = changed_hunks(base, head)
    where = {(h.path, h.head_start, h.head_end) for h in hunks}
    assert ("vllm/v1/core/sched/scheduler.py", 4, 4) in where
    deletion = next(h for h in hunks if h.is_deletion)
    assert deletion.base_start == 9 and "list(blocks)" in deletion.base_text
    added = next(h for h in hunks if h.path == "vllm/v1/worker/new.py")
    assert added.head_start == 1 and not added.checked_module
    assert next(h for h in hunks if h.head_start == 4).checked_module
    attach_statements(hunks, head)
    assert next(h for h in hunks if h.head_start == 4).statements == (4,)
    assert deletion.statements  # the statements beside a deletion stand for it


def test_identical_sources_change_nothing(tmp_path):
    base = resolve(str(tree(tmp_path / "a", BASE)))
    head = resolve(str(tree(tmp_path / "b", BASE)))
    assert changed_hunks(base, head) == []


def test_lines_of_patched_code_map_back_to_the_source():
    """A fix adds lines; what ran of the patched text maps to the source's lines."""
    patched = BASE.replace("    budget = self.budget\n",
                           "    budget = self.budget\n    self.fence()\n    self.fence()\n")
    by_line = {2: ["run1"], 3: ["run1"], 4: ["run1"], 6: ["run2"]}
    mapped = _map_back(by_line, patched, BASE)
    assert mapped == {2: ["run1"], 4: ["run2"]}  # the fix's own lines map nowhere


def test_coverage_counts_runs_per_hunk():
    hunk = Hunk("vllm/v1/core/sched/scheduler.py", 3, 4, 3, 4, statements=(3, 4))
    attach_coverage([hunk], {"vllm/v1/core/sched/scheduler.py": {3: {"run1", "run2"},
                                                                 4: {"run3"}}})
    assert hunk.ran == (3, 4) and hunk.runs == 3 and not hunk.never_ran


def result() -> FuzzResult:
    return FuzzResult("vllm", 0, 60.0, 100, 2000, {})


def test_a_hunk_that_never_ran_keeps_the_review_from_passing():
    ran = Hunk("vllm/a.py", 1, 2, 1, 2, statements=(1,), ran=(1,), runs=5)
    idle = Hunk("vllm/b.py", 7, 9, 7, 8, statements=(7, 8))
    assert review_verdict(result(), [ran], [], []).code == 0
    verdict = review_verdict(result(), [ran, idle], [], [])
    assert verdict.code == 3 and verdict.line.startswith("INCOMPLETE")
    assert "vllm/b.py:7-9" in verdict.line


def test_pre_existing_findings_do_not_fail_a_review():
    r = result()
    r.known["x"] = KnownHit("recompute-failed-block-stays-cached", "fails on the base too", "",
                            ["no_caching_of_invalid_blocks"], 3)
    verdict = review_verdict(r, [], [], [])
    assert verdict.code == 0 and "recompute-failed-block-stays-cached (3x)" in verdict.line


def test_a_regression_of_the_model_alone_names_what_it_leads_to():
    from types import SimpleNamespace as NS

    from kvspec.spec.registry import Violation
    r = result()
    model = Violation("transition_admitted_by_model", "r0 kept 4 computed tokens")
    r.counterexample = NS(violations=[model])
    harm = NS(violations=[Violation("update_from_output_relation", "kept a token")])
    verdict = review_verdict(r, [], [], [], harm, (), "")
    assert verdict.code == 1
    assert verdict.line.startswith("REGRESSION on HEAD (passes on BASE): "
                                   "transition_admitted_by_model; it leads on to "
                                   "update_from_output_relation")
    assert "leads on" not in review_verdict(r, [], [], [], None).line


def test_a_regression_base_fails_otherwise_says_how():
    from types import SimpleNamespace as NS

    from kvspec.spec.registry import Violation
    r = result()
    r.counterexample = NS(violations=[Violation("ref_count_is_holders", "block 3")])
    note = "BASE fails this trace earlier, at action 2 of 5, and otherwise: computed_means_valid"
    line = review_verdict(r, [], [], [], None, (), note).line
    assert line == f"REGRESSION on HEAD: ref_count_is_holders ({note})"
    # BASE not asked (an environment's fault) or unable to answer: no claim it passes
    assert review_verdict(r, [], [], [], None, (), None).line == (
        "REGRESSION on HEAD: ref_count_is_holders")


def test_harm_is_sought_only_when_no_claim_a_test_checks_broke(tmp_path):
    """What a regression leads to is sought, as `kvspec export-test` seeks it,
    only when every claim it broke is one a standalone test cannot check (the
    model, a relation, placeholder accounting): one that already breaks a
    claim such a test checks (KV content, num_computed_tokens within the
    tokens, a crash) needs no second replay, nor does the environment's or
    kvspec's own fault; with several KV cache groups the block ledger checks
    nothing, so a garbage block cached is sought further too. A missing trace
    is one line, not a traceback."""
    from kvspec.harness.target import make_config
    from kvspec.spec.registry import Violation
    from kvspec.spec.state import GroupSpec
    one = make_config()
    two = make_config(groups=(GroupSpec(4), GroupSpec(4, "sliding_window", 5)))
    model = Violation("transition_admitted_by_model", "r0 kept 4 computed tokens")
    state = Violation("placeholders_match_in_flight", "r0 has 2 placeholders, 1 in flight")
    relation = Violation("update_from_output_relation", "r0 kept a token")
    within = Violation("computed_within_tokens", "r0 computed 9 of 8 tokens")
    cached = Violation("no_caching_of_invalid_blocks", "block 0 holds garbage")
    crash = Violation("target_crashed", "AssertionError")
    kvspec_own = Violation("kvspec_crashed", "KeyError")
    for checked in ([within], [model, within], [crash], [model, crash], [cached], [kvspec_own],
                    [model, kvspec_own], []):
        assert get_harm(tmp_path / "t.json", checked, one) is None, checked
    for beyond in ([model], [model, state, relation], [state]):
        missing = get_harm(tmp_path / "t.json", beyond, one)
        assert isinstance(missing, str) and "t.json" in missing
    assert isinstance(get_harm(tmp_path / "t.json", [cached], two), str)


def test_a_base_that_could_not_answer_makes_it_incomplete():
    verdict = review_verdict(result(), [], ["the base process exited"], [])
    assert verdict.code == 3 and "could not answer" in verdict.line


def test_a_line_short_circuiting_skips_never_ran(tmp_path):
    """A changed operand of a multi-line condition that an earlier operand
    short-circuits (a LoRA-only branch, say) did not run, though the statement's
    first line did: the hunk counts as never run."""
    from kvspec.review import executable_lines
    text = "def f(lora, n):\n    if (\n        lora\n        and n >= 2\n    ):\n        return 1\n"
    assert executable_lines(text) == {1, 2, 3, 4, 6}  # "):" holds no code
    hunk = Hunk("vllm/x.py", 4, 4, 4, 4, statements=(4,))
    attach_coverage([hunk], {"vllm/x.py": {2: {"run1"}, 3: {"run1"}}})
    assert hunk.never_ran


def test_patched_code_run_through_a_link_maps_back(tmp_path):
    """A source given as the vllm package directory runs through a link;
    coverage.py names files by their real path, kvspec's patched modules by the
    path Python imported: both spellings reach the same HEAD lines."""
    from kvspec.review import measured_lines
    real = tree(tmp_path / "real", BASE)
    link_root = tmp_path / "link"
    link_root.mkdir()
    (link_root / "vllm").symlink_to(real / "vllm", target_is_directory=True)
    head = resolve(str(link_root))
    imported = str(link_root / "vllm" / "v1" / "core" / "sched" / "scheduler.py")
    code_file = f"{imported} (kvspec patches: a-fix)"
    patched = BASE.replace("    budget = self.budget\n", "    budget = self.budget\n    x = 1\n")

    class Data:
        def measured_files(self):
            return [str(Path(tmp_path / "real" / "vllm" / "v1" / "core" / "sched").resolve()
                        / "scheduler.py (kvspec patches: a-fix)")]

        def contexts_by_lineno(self, name):
            return {3: ["run0"], 4: ["run1"], 5: ["run2"]}  # 3: the fix's own line
    lines = measured_lines(Data(), head, {code_file: (imported, BASE, patched)})
    assert lines == {"vllm/v1/core/sched/scheduler.py": {3: {"run1"}, 4: {"run2"}}}


def test_lost_performance_head_only_is_a_regression_and_base_s_is_a_note(tmp_path):
    """Lost performance HEAD shows and BASE keeps is a (performance) regression;
    what BASE loses too is named beside the verdict, not held against HEAD."""
    from kvspec.review import LostOnHead
    head_only = LostOnHead(("computed_blocks_are_cached",), 4, "t.json", "head-only")
    old = LostOnHead(("computed_blocks_are_cached",), 2, "u.json", "pre-existing")
    verdict = review_verdict(result(), [], [], [], None, [head_only])
    assert verdict.code == 1
    assert verdict.line.startswith("REGRESSION on HEAD (performance; BASE keeps it): lost "
                                   "computed_blocks_are_cached (4x)")
    passing = review_verdict(result(), [], [], [], None, [old])
    assert passing.code == 0
    assert "lost performance not HEAD's own: computed_blocks_are_cached (2x, BASE: " \
           "pre-existing)" in passing.line


def test_lost_performance_is_replayed_on_base_with_its_own_lost_performance(tmp_path):
    """classify_lost asks BASE for its lost performance (``lost=True``), so a
    trace that loses it on BASE as well is pre-existing."""
    import json

    from kvspec.harness.fuzz import KnownHit
    from kvspec.harness.known import Outcome
    from kvspec.review import classify_lost
    trace = Path(__file__).resolve().parents[1] / "model_tests" / "vllm_regressions" / \
        "failed_load_recomputed_blocks_cached_again.json"
    asked = []

    class Base:
        def __init__(self, answer):
            self.answer = answer

        def replay(self, target, config, actions, lost=False):
            asked.append((target, len(actions), lost))
            return self.answer

    hit = KnownHit(None, "m", "", ["computed_blocks_are_cached"], 3, trace_path=trace)
    lost = Outcome((("computed_blocks_are_cached", "block 1 not cached"),))

    def head(target, config, actions, lost=False):
        asked.append(("head", target, len(actions), lost))
        return lost_on_head

    lost_on_head = lost

    def classify(base):
        return classify_lost({"k": hit}, Base(base), "vllm", head)[0].on_base

    assert classify(lost) == "pre-existing"
    assert classify(Outcome()) == "head-only"
    assert classify(Outcome(error="boom")) == "unknown: boom"
    lost_on_head = Outcome((("computed_blocks_are_cached", "block 1 not cached"),
                            ("computed_blocks_are_cached", "block 2 not cached, copy evicted")))
    assert classify(lost) == "head-only"
    actions = len(json.loads(trace.read_text())["actions"])
    assert asked == [("head", "vllm", actions, True), ("vllm", actions, True)] * 4


def test_lost_performance_is_pre_existing_only_when_base_loses_it_every_way():
    """A change that keeps a known loss and adds another of the same claim on
    the same trace lost performance of its own; BASE breaking a safety claim on
    the trace makes the two incomparable, not a regression."""
    from kvspec.harness.known import Outcome
    from kvspec.review import LostOnHead, compare_lost
    claims = ("computed_blocks_are_cached",)
    kept = ("computed_blocks_are_cached", "r1: block 3 (index 0, group 0) holds computed "
            "tokens no cached block holds")
    added = ("computed_blocks_are_cached", "r2: block 7 (index 1, group 1) holds computed "
             "tokens no cached block holds, and its copy was evicted")
    head = Outcome((kept, added))
    base = Outcome((kept,))
    on_base, note = compare_lost(claims, head, base)
    assert on_base == "head-only"
    assert note.startswith("BASE loses computed_blocks_are_cached on this trace too, but not "
                           "every way HEAD does: r2: block 7")
    # the same losses with other request and block numbers are BASE's too
    renumbered = Outcome(tuple((c, m.replace("r1", "r4").replace("block 3", "block 9"))
                               for c, m in (kept, added)))
    assert compare_lost(claims, head, renumbered) == ("pre-existing", "")
    assert compare_lost(claims, head, Outcome()) == ("head-only", "")
    broken = Outcome((("cached_le_computed", "r1"),), step=3, row=4)
    assert compare_lost(claims, head, broken)[0].startswith(
        "unknown: BASE breaks cached_le_computed")
    # HEAD's replay did not show it again: by claim alone
    assert compare_lost(claims, Outcome(), base) == ("pre-existing", "")
    assert compare_lost(claims, None, Outcome()) == ("head-only", "")
    lost = LostOnHead(claims, 2, "t.json", *compare_lost(claims, head, base))
    verdict = review_verdict(result(), [], [], [], None, [lost])
    assert verdict.code == 1
    assert "computed_blocks_are_cached (2x; BASE loses computed_blocks_are_cached on this " \
           "trace too" in verdict.line


def test_the_review_says_what_export_test_will_do_with_the_trace():
    """A regression whose continuation breaks a claim a test checks names it and
    offers export-test; one whose continuation breaks none says export-test
    refuses the trace, and does not offer it."""
    from types import SimpleNamespace as NS

    from kvspec.review import _harm, is_refused_by_export
    from kvspec.spec.registry import Violation
    broken = [Violation("transition_admitted_by_model", "r0 kept 4 computed tokens")]
    led = NS(violations=[Violation("no_caching_of_invalid_blocks", "block 0 holds garbage")])
    text = "\n".join(_harm(led, broken))
    assert text.startswith("What it leads to: transition_admitted_by_model are claims")
    assert "- **no_caching_of_invalid_blocks**: block 0 holds garbage" in text
    assert not is_refused_by_export(led)
    nothing = NS(violations=[])
    assert "so `kvspec export-test` refuses this trace" in "\n".join(_harm(nothing, broken))
    assert is_refused_by_export(nothing)
    assert not is_refused_by_export(None) and not is_refused_by_export("TraceError: gone")
    assert _harm(None, broken) == []


def test_an_interrupted_review_is_no_pass():
    """A cancelled CI job (SIGTERM) cut the check on HEAD short: the review
    says so and exits 130; it wrote PASS with the runs made before."""
    from types import SimpleNamespace as NS
    ran = Hunk("vllm/a.py", 1, 2, 1, 2, statements=(1,), ran=(1,), runs=5)
    r = result()
    r.interrupted, r.interrupted_by = True, "SIGTERM"
    verdict = review_verdict(r, [ran], [], [])
    assert (verdict.code, verdict.word) == (130, "interrupted")
    assert verdict.line == ("INTERRUPTED by SIGTERM after 100 runs (60s): a partial review, "
                            "no verdict")
    r.counterexample = NS(violations=[NS(invariant="cached_le_computed")])
    r.trace_path = Path("t.json")
    assert review_verdict(r, [ran], [], []).line == (
        "INTERRUPTED by SIGTERM after 100 runs (60s): a partial review, no verdict; found "
        "before it on HEAD, not compared with BASE: cached_le_computed (trace t.json)")


def test_a_review_its_time_limit_cut_short_is_incomplete_unless_it_found_one():
    from types import SimpleNamespace as NS
    ran = Hunk("vllm/a.py", 1, 2, 1, 2, statements=(1,), ran=(1,), runs=5)
    r = result()
    r.time_limited, r.time_limit, r.max_examples = True, 1800.0, 5000
    verdict = review_verdict(r, [ran], [], [])
    assert verdict.code == 3 and verdict.line == (
        "INCOMPLETE: no regression found in the runs made, but not every run was made | "
        "--time-limit 1800s stopped the run after 100 of 5000 runs (--examples)")
    r.counterexample = NS(violations=[NS(invariant="cached_le_computed")])
    verdict = review_verdict(r, [ran], [], [], None, (), "")
    assert verdict.code == 1 and verdict.line.startswith(
        "REGRESSION on HEAD (passes on BASE): cached_le_computed | --time-limit 1800s")


def test_a_regression_the_model_alone_caught_names_the_specific_claims():
    """"admitted by no shape of spec/effects.py" says what, not why: the review
    replays the trace with the model unchecked and names what it breaks then
    (battery edit 13: placeholders_match_in_flight, 'num_output_placeholders=3,
    but its steps in flight will sample 1')."""
    from types import SimpleNamespace as NS
    r = result()
    r.counterexample = NS(violations=[NS(invariant="transition_admitted_by_model")])
    specific = [NS(invariant="placeholders_match_in_flight")]
    line = review_verdict(r, [], [], [], None, (), "", specific).line
    assert line == ("REGRESSION on HEAD (passes on BASE): transition_admitted_by_model (with "
                    "the model unchecked: placeholders_match_in_flight)")


def test_the_model_is_unchecked_only_where_it_alone_broke(tmp_path):
    from types import SimpleNamespace as NS
    from kvspec.review import get_specific
    both = [NS(invariant="transition_admitted_by_model"), NS(invariant="cached_le_computed")]
    assert get_specific(tmp_path / "never-read.json", both) is None  # no replay at all
