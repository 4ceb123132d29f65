"""kvspec's claims inside any test suite that builds vLLM schedulers.

``pytest -p kvspec.observe tests/v1/core`` wraps vLLM's ``Scheduler`` (and so
``AsyncScheduler``): every scheduler a test builds is watched. After each
``add_request``, ``schedule``, ``update_from_output``, ``finish_requests`` and
``reset_prefix_cache`` the watch (``kvspec/harness/watch.py``) observes the scheduler through the
``vllm`` target's observation map, rebuilds the history the claims need from
the calls it saw (``spec/history.py``), and evaluates every claim that a bare
scheduler lets it evaluate: the state claims on the state the call left, the
relations on the call itself (``BARE_CLAIMS``; the others, and why, from
``get_not_evaluated``).

A test that drives the scheduler outside the engine's contract (a request put
into ``running`` by hand, a token for a partial prefill chunk) is named with
the reason, and its violations are not counted. Options:
``--kvspec-observe-json PATH`` writes every test's result; ``--kvspec-observe-fail``
fails a test whose scheduler broke a claim within the contract.
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import attrs
import pytest

from kvspec.harness.watch import (
    BARE_CLAIMS,
    TestRecord,
    Unmappable,
    Watch,
    get_not_evaluated,
)

WATCHED_CALLS = ("add_request", "schedule", "update_from_output", "finish_requests",
                 "reset_prefix_cache")

CURRENT: list[TestRecord] = []  # the test running now (one at a time per process)


# -- the wrappers -----------------------------------------------------------------
def get_watch(scheduler) -> Watch | None:
    return getattr(scheduler, "_kvspec_watch", None)


def wrap_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        record = CURRENT[-1] if CURRENT else None
        if record is not None:
            record.schedulers += 1
        try:
            self._kvspec_watch = Watch(self, record)
        except Exception as exc:  # noqa: BLE001 - Unmappable, or a vLLM shape it does not know
            if record is not None:
                record.unmappable.append(str(exc) if isinstance(exc, Unmappable) else
                                         f"kvspec could not map it: {type(exc).__name__}: {exc}")
            return
        if record is not None:
            record.mapped += 1
    return __init__


def wrap_call(name: str, method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        watch = get_watch(self)
        if watch is None:
            return method(self, *args, **kwargs)
        guarded(self, watch, lambda: watch.before(name, args, kwargs))
        result = method(self, *args, **kwargs)
        if get_watch(self) is watch:  # (a watch that ended before the call stays ended)
            guarded(self, watch, lambda: watch.after(name, result))
        return result
    return call


def guarded(scheduler, watch: Watch, step) -> None:
    """Run one of the watch's steps; a scheduler kvspec cannot follow (or a
    shape of vLLM it does not know) ends the watch, never the test."""
    try:
        step()
    except Unmappable as exc:
        detach(scheduler, watch, str(exc))
    except Exception as exc:  # noqa: BLE001 - kvspec's problem, not the test's
        detach(scheduler, watch, f"kvspec could not observe it: {type(exc).__name__}: {exc}")


def detach(scheduler, watch: Watch, reason: str) -> None:
    if getattr(scheduler, "_kvspec_watch", None) is watch:
        del scheduler._kvspec_watch
    if watch.record is not None:
        watch.record.unmappable.append(reason)
        watch.record.mapped -= 1


def install() -> None:
    """Wrap vLLM's Scheduler in place (AsyncScheduler inherits the calls)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    if getattr(Scheduler, "_kvspec_wrapped", False):
        return
    Scheduler.__init__ = wrap_init(Scheduler.__init__)
    for name in WATCHED_CALLS:
        setattr(Scheduler, name, wrap_call(name, getattr(Scheduler, name)))
    Scheduler._kvspec_wrapped = True


# -- pytest ---------------------------------------------------------------------------
def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvspec-observe", "kvspec's claims on every vLLM scheduler")
    group.addoption("--kvspec-observe-json", default=None, metavar="PATH",
                    help="write each test's result (claims broken, contract, mapping) here")
    group.addoption("--kvspec-observe-fail", action="store_true", default=False,
                    help="fail a test whose scheduler broke a claim within the engine's contract")


class Observer:
    def __init__(self, config) -> None:
        self.config = config
        self.records: list[TestRecord] = []
        self.skipped_reason: str | None = None
        #: under pytest-xdist, this worker's id (its results go to PATH.<id>)
        self.worker_id = getattr(config, "workerinput", {}).get("workerid")

    @pytest.hookimpl(tryfirst=True)  # before xdist tells the controller this worker is done
    def pytest_sessionfinish(self) -> None:
        path = self.config.getoption("kvspec_observe_json")
        if self.worker_id and path:
            write_report(Path(f"{path}.{self.worker_id}"), self.records)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        record = TestRecord(item.nodeid)
        CURRENT.append(record)
        try:
            yield
        finally:
            CURRENT.remove(record)
            self.records.append(record)
        if (record.verdict == "violation" and self.config.getoption("kvspec_observe_fail")):
            first = record.violations[0]
            pytest.fail(f"kvspec: {first['claim']} after {first['call']}: {first['message']}",
                        pytrace=False)

    def pytest_runtest_logreport(self, report) -> None:
        """The test's own outcome, so a calibration can tell its failures apart."""
        for record in reversed(self.records):
            if record.nodeid == report.nodeid:
                if report.when == "call" or report.outcome != "passed":
                    record.outcome = report.outcome
                return

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.worker_id:  # the controller reports for every worker
            return
        tr = terminalreporter
        tr.section("kvspec observe")
        if self.skipped_reason:
            tr.write_line(f"kvspec observe checked nothing: {self.skipped_reason}")
            return
        path = self.config.getoption("kvspec_observe_json")
        if path:  # gather what pytest-xdist workers observed
            parts = sorted(Path(path).parent.glob(Path(path).name + ".gw*"))
            self.records += read_records(parts)
            for part in parts:
                part.unlink()
        elif self.config.pluginmanager.has_plugin("dsession"):
            tr.write_line("kvspec observe: under pytest-xdist, pass --kvspec-observe-json PATH "
                          "to gather what the workers observed")
        summary = get_summary(self.records)
        tr.write_line(
            f"{summary['tests']} tests; {summary['mapped_tests']} built a scheduler kvspec maps "
            f"({summary['calls']} calls checked, {len(BARE_CLAIMS)} claims), "
            f"{summary['unmapped_tests']} only ones it cannot, "
            f"{summary['no_scheduler']} none")
        for verdict in ("violation", "out of contract"):
            for r in self.records:
                if r.verdict == verdict:
                    why = (r.violations[0]["claim"] if verdict == "violation"
                           else "; ".join(r.out_of_contract))
                    tr.write_line(f"  {verdict.upper()}: {r.nodeid}: {why}")
        if path:
            write_report(Path(path), self.records)
            tr.write_line(f"kvspec observe: per-test results in {path}")


def get_summary(records: list[TestRecord]) -> dict:
    verdicts = Counter(r.verdict for r in records)
    broken = Counter(v["claim"] for r in records if r.verdict == "violation"
                     for v in {x["claim"]: x for x in r.violations}.values())
    return {"tests": len(records), "mapped_tests": sum(r.mapped > 0 for r in records),
            "unmapped_tests": verdicts["unmapped"], "no_scheduler": verdicts["no scheduler"],
            "calls": sum(r.calls for r in records), "verdicts": dict(verdicts),
            "tests_breaking_each_claim": dict(broken),
            "unmappable_reasons": dict(Counter(x for r in records for x in set(r.unmappable))),
            "out_of_contract_reasons": dict(Counter(x for r in records
                                                    for x in r.out_of_contract))}


def read_records(paths) -> list[TestRecord]:
    """The tests of reports other processes wrote (missing ones skipped)."""
    names = {a.name for a in TestRecord.__attrs_attrs__}
    return [TestRecord(**{k: v for k, v in t.items() if k in names})
            for p in paths if Path(p).exists()
            for t in json.loads(Path(p).read_text())["tests"]]


def write_report(path: Path, records: list[TestRecord]) -> None:
    data = {"claims": list(BARE_CLAIMS), "not_on_a_bare_scheduler": get_not_evaluated(),
            "summary": get_summary(records),
            "tests": [attrs.asdict(r) | {"verdict": r.verdict} for r in records]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def pytest_configure(config) -> None:
    observer = Observer(config)
    try:
        install()
    except ImportError as exc:
        observer.skipped_reason = f"vLLM is not installed ({exc})"
    config.pluginmanager.register(observer, "kvspec-observer")
