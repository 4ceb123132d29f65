"""Whose crash a raised call is (``runner.describe_crash``): the target's (a
finding) or kvspec's own (a bug to report, never a finding of the target).
Functions are compiled under the file names of the code they stand for, so
the tracebacks look as the real ones do."""
from __future__ import annotations

import pytest

from kvspec.harness.runner import HARNESS_DIR, SPEC_DIR, describe_crash
from kvspec.harness.target import TargetStateError

VLLM_FILE = "/site-packages/vllm/v1/core/sched/scheduler.py"


def define(path: str, source: str, **names):
    scope = dict(names)
    exec(compile(source, path, "exec"), scope)  # noqa: S102 (see the module doc)
    return scope


#: the runner's call, where the real traceback starts
RUNNER = define(HARNESS_DIR + "runner.py",
                "def apply(fn, *args):\n    try:\n        fn(*args)\n"
                "    except Exception as exc:\n        return describe_crash(exc)\n",
                describe_crash=describe_crash)


def blame(fn, *args) -> str:
    return RUNNER["apply"](fn, *args).invariant


OBSERVE = define(HARNESS_DIR + "vllm_observe.py",
                 "def read(r):\n    return r.num_computed_tokens\n"
                 "def odd(r):\n    raise TargetStateError('a full-attention table holds the null "
                 "block 0')\n", TargetStateError=TargetStateError)


class Renamed:
    """A vLLM request whose field kvspec reads is gone (a branch renamed it)."""


def test_the_judging_harness_raising_on_its_own_is_kvspecs_crash():
    assert blame(OBSERVE["read"], Renamed()) == "kvspec_crashed"


def test_the_message_names_where_in_kvspec():
    v = RUNNER["apply"](OBSERVE["read"], Renamed())
    assert "kvspec/harness/vllm_observe.py:2" in v.message and "bug in kvspec" in v.doc


def test_a_state_the_target_must_never_reach_is_the_targets_crash():
    assert blame(OBSERVE["odd"], object()) == "target_crashed"


def test_the_harness_called_from_vllm_is_the_targets_crash():
    """vLLM on the stack (it called kvspec's code, as it calls kvspec's connector):
    not kvspec's alone to answer for."""
    calls = define(VLLM_FILE, "def schedule(r):\n    return read(r)\n", read=OBSERVE["read"])
    assert blame(calls["schedule"], Renamed()) == "target_crashed"


@pytest.mark.parametrize("module", ["zoo.py", "vllm_target.py", "env.py", "in_place.py"])
def test_harness_code_that_runs_as_part_of_the_target_is_the_targets(module):
    """Mutants, adapters, kvspec's connector and its fixes run as the target."""
    code = define(HARNESS_DIR + module, "def go(r):\n    return r.num_computed_tokens\n")
    assert blame(code["go"], Renamed()) == "target_crashed"


def test_a_vllm_assert_re_raised_by_the_adapter_is_the_targets():
    inner = define(VLLM_FILE, "def check(x):\n    assert x > 0, 'negative'\n")
    outer = define(HARNESS_DIR + "vllm_observe.py",
                   "def located(x):\n    try:\n        inner(x)\n"
                   "    except AssertionError as exc:\n"
                   "        raise AssertionError('scheduler.py:2: negative') from exc\n",
                   inner=inner["check"])
    assert blame(outer["located"], -1) == "target_crashed"


def test_the_model_raising_is_kvspecs_even_under_the_target():
    oracle = define(SPEC_DIR + "oracle.py", "def at(keys):\n    return keys[-3]\n")
    calls = define(VLLM_FILE, "def run(k):\n    return at(k)\n", at=oracle["at"])
    assert blame(calls["run"], []) == "kvspec_crashed"


def test_library_frames_do_not_hide_who_called_them():
    """attrs raising for kvspec's judging code: still kvspec's."""
    import attrs
    frozen = attrs.frozen(type("P", (), {"__annotations__": {"x": int}}))
    code = define(HARNESS_DIR + "checker.py", "def go(p):\n    p.x = 2\n")
    assert blame(code["go"], frozen(1)) == "kvspec_crashed"


def test_installed_packages_are_never_library_code():
    """Many Pythons (pyenv, conda, python images) keep site-packages inside the
    standard library's folder: vLLM and kvspec installed there still count."""
    import os
    import sysconfig

    import attrs

    from kvspec.harness.runner import INSTALLED_DIRS, STDLIB_DIR, is_library
    for d in INSTALLED_DIRS:
        assert not is_library(d + os.path.join("vllm", "v1", "request.py"))
        assert not is_library(d + os.path.join("kvspec", "harness", "vllm_observe.py"))
    assert not is_library(os.path.join(sysconfig.get_paths()["purelib"], "vllm", "x.py"))
    assert is_library(STDLIB_DIR + "json/decoder.py") and is_library(attrs.__file__)


def test_raise_from_none_drops_the_exception_it_replaced():
    """``raise ... from None`` in judging code handling a vLLM exception: the
    vLLM frames it hid are not on the way."""
    inner = define(VLLM_FILE, "def get(d, k):\n    return d[k]\n")
    code = define(HARNESS_DIR + "vllm_observe.py",
                  "def read(d):\n    try:\n        return get(d, 'x')\n"
                  "    except KeyError:\n        raise ValueError('no x') from None\n",
                  get=inner["get"])
    assert blame(code["read"], {}) == "kvspec_crashed"


def test_a_scheduler_output_with_lists_of_the_wrong_length_is_the_targets():
    """vLLM's model runner reads the cached requests' lists by position: one
    entry short is the scheduler's broken output, raised by the observer as
    the target's, not an IndexError blamed on kvspec."""
    from types import SimpleNamespace

    from kvspec.harness.vllm_observe import VllmObserver
    cached = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens=[16],
                             new_block_ids=[None, None], resumed_req_ids=set())
    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                          num_scheduled_tokens={"a": 1, "b": 1},
                          scheduled_spec_decode_tokens={})
    observer = VllmObserver(None, None)
    observer.scheduler = SimpleNamespace(requests={})
    with pytest.raises(TargetStateError, match="names 2 cached request.* gives 1 "
                                               "num_computed_tokens"):
        observer.get_step_view(out, {})
    assert blame(observer.get_step_view, out, {}) == "target_crashed"
    cached.num_computed_tokens = [16, 8]
    assert observer.get_step_view(out, {}).num_computed_before == {"a": 16, "b": 8}


def crash_of(fn, *args):
    return RUNNER["apply"](fn, *args)


def test_a_re_raised_vllm_assert_is_placed_at_vllms_line():
    """vLLM's bare asserts are re-raised with their place by the adapter's
    context manager: the place under the crash is vLLM's line, not the
    adapter's ``raise ... from``."""
    inner = define(VLLM_FILE, "def schedule(x):\n    assert x > 0\n")
    adapter = define(HARNESS_DIR + "vllm_target.py",
                     "def located(x):\n    try:\n        schedule(x)\n"
                     "    except AssertionError as exc:\n"
                     "        raise AssertionError('scheduler.py:2: assert x > 0') from exc\n",
                     schedule=inner["schedule"])
    crash = crash_of(adapter["located"], -1)
    assert crash.invariant == "target_crashed"
    assert crash.doc.endswith("scheduler.py:2 in schedule."), crash.doc
    assert "vllm_target.py" not in crash.doc


def test_a_connector_crash_names_the_vllm_call_that_led_there():
    """A connector's method raising, called by vLLM's scheduler: both places,
    so its author sees which call of theirs broke and where vLLM made it."""
    conn = define("/tmp/my_pkg/my_connector.py",
                  "def request_finished(r):\n    return r.missing\n")
    calls = define(VLLM_FILE, "def finish(r):\n    return request_finished(r)\n",
                   request_finished=conn["request_finished"])
    crash = crash_of(calls["finish"], Renamed())
    assert crash.invariant == "target_crashed"
    assert crash.doc.startswith("The connector's own code raised, at "), crash.doc
    assert crash.doc.endswith("my_connector.py:2 in request_finished, called from "
                              "vllm/v1/core/sched/scheduler.py:2 in finish."), crash.doc


def test_kvspec_debug_prints_a_crashs_traceback(monkeypatch, capsys):
    inner = define(VLLM_FILE, "def schedule(x):\n    return x.gone\n")
    monkeypatch.setenv("KVSPEC_DEBUG", "1")
    crash_of(inner["schedule"], Renamed())
    err = capsys.readouterr().err
    assert "Traceback" in err and 'scheduler.py", line 2, in schedule' in err
    assert "AttributeError: 'Renamed' object has no attribute 'gone'" in err


def test_a_crash_after_answers_beyond_the_contract_does_not_call_its_call_legal():
    """A finding replayed with an arrival marked ``beyond_contract`` (a
    connector answering as no in-tree one does): the crash says so."""
    from kvspec.harness.runner import describe_crash_beyond_contract
    inner = define(VLLM_FILE, "def schedule(x):\n    assert x > 0\n")
    crash = crash_of(inner["schedule"], -1)
    assert "legal call" in crash.doc
    one = describe_crash_beyond_contract(crash, ["r0"])
    assert "legal" not in one.doc and "r0 is an arrival marked beyond_contract" in one.doc
    assert one.doc.endswith("scheduler.py:2 in schedule.") and one.message == crash.message
    two = describe_crash_beyond_contract(crash, ["r0", "r2"])
    assert "r0, r2 are arrivals marked beyond_contract" in two.doc


def test_a_crash_raised_while_handling_a_counterexample_is_placed_in_the_target():
    """Hypothesis runs an example again inside its handler of the last one's
    counterexample: that counterexample is the crash's context, not its cause,
    and the place stays the target's line."""
    from kvspec.harness.steplog import Counterexample
    inner = define(VLLM_FILE, "def schedule(x):\n    return x.gone\n")

    def again():
        try:
            raise Counterexample([], None)
        except Counterexample:
            return crash_of(inner["schedule"], Renamed())
    crash = again()
    assert crash.invariant == "target_crashed"
    assert crash.doc.endswith(", at vllm/v1/core/sched/scheduler.py:2 in schedule."), crash.doc


def test_a_crash_after_a_contract_breach_says_the_breach_came_first():
    from kvspec.harness.runner import describe_crash_after_breach
    from kvspec.spec.registry import Violation
    inner = define(VLLM_FILE, "def schedule(x):\n    assert x > 0\n")
    crash = crash_of(inner["schedule"], -1)
    breach = Violation("hit_within_uncomputed_tokens", "r1: the connector claimed 8")
    after = describe_crash_after_breach(crash, [breach, breach])
    assert after.doc == ("The target raised after the connector broke its contract "
                         "(hit_within_uncomputed_tokens, above), at "
                         "vllm/v1/core/sched/scheduler.py:2 in schedule.")


def test_a_crash_in_an_installed_package_under_vllm_is_not_the_connectors():
    """torch or numpy raising under vLLM's own call is the target's crash
    (an installed package decides nothing), not 'the connector's own code'."""
    from kvspec.harness.runner import INSTALLED_DIRS
    torch_like = define(INSTALLED_DIRS[0] + "torch/functional.py",
                        "def cat(x):\n    return x.gone\n")
    calls = define(VLLM_FILE, "def schedule(x):\n    return cat(x)\n", cat=torch_like["cat"])
    crash = crash_of(calls["schedule"], Renamed())
    assert crash.invariant == "target_crashed"
    assert crash.doc.startswith("The target raised while handling a legal call"), crash.doc


def test_the_references_own_crash_is_never_the_connectors():
    """kvspec's packages outside kvspec/ (impl/, spec/ and gpu/, mapped by
    pyproject) are kvspec's: a reference or mutant crash keeps the target's
    wording, as there is no connector in such a run."""
    from kvspec.harness.runner import KVSPEC_DIRS
    impl_dir = next(d for d in KVSPEC_DIRS if d.rstrip("/").endswith("impl"))
    ref = define(impl_dir + "scheduler.py", "def schedule(x):\n    return x.gone\n")
    crash = crash_of(ref["schedule"], Renamed())
    assert crash.doc.startswith("The target raised while handling a legal call"), crash.doc


def test_an_exception_raised_while_handling_another_is_placed_at_its_own_raise():
    """vLLM handling a connector's KeyError and raising its own error: the
    place is vLLM's raise (the handler's), not the connector's line, and the
    crash is not the connector's."""
    conn = define("/tmp/my_pkg/my_connector.py",
                  "def lookup(d):\n    return d['k']\n")
    calls = define(VLLM_FILE, "def schedule(d):\n    try:\n        lookup(d)\n"
                              "    except KeyError:\n        return d.gone\n",
                   lookup=conn["lookup"])
    crash = crash_of(calls["schedule"], {})
    assert crash.doc.startswith("The target raised while handling a legal call"), crash.doc
    assert crash.doc.endswith("scheduler.py:5 in schedule."), crash.doc
    assert "my_connector" not in crash.doc


def test_a_connectors_own_assert_keeps_its_message_and_vllms_is_located():
    """vLLM's bare asserts are re-raised with vLLM's place; a connector's own
    assert under vLLM's call is left as it is (its message, its place)."""
    from kvspec.harness.vllm_target import _located
    conn = define("/tmp/my_pkg/my_connector.py",
                  "def alloc(n):\n    assert n > 0, 'no tokens to load'\n")
    calls = define(VLLM_FILE, "def schedule(n):\n    alloc(n)\n", alloc=conn["alloc"])
    try:
        calls["schedule"](0)
    except AssertionError as exc:
        assert _located(exc) is exc
    bare = define(VLLM_FILE, "def schedule(n):\n    assert n > 0\n")
    try:
        bare["schedule"](0)
    except AssertionError as exc:
        assert str(_located(exc)).startswith("vllm/v1/core/sched/scheduler.py:2: ")
