"""kvspec's claims inside any test suite that builds vLLM schedulers.

``pytest -p kvspec.observe tests/v1/core`` wraps vLLM's ``Scheduler`` (and so
``AsyncScheduler``): every scheduler a test builds is watched. After each
``add_request``, ``schedule``, ``update_from_output``, ``finish_requests`` and
``reset_prefix_cache`` the watch observes the scheduler through the ``vllm``
target's observation map (``kvspec/harness/vllm_observe.py``), rebuilds the
history the claims need from the calls it saw (``spec/history.py``), and
evaluates every claim that a bare scheduler lets it evaluate
(``BARE_CLAIMS``; the others, and why, in ``NOT_ON_A_BARE_SCHEDULER``).

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

import kvspec.spec.catalogue  # noqa: F401  (registers every claim)
from kvspec.harness.vllm_observe import NULL_BLOCKS, VllmObserver
from kvspec.spec import history
from kvspec.spec.history import Ghost
from kvspec.spec.invariants import Context
from kvspec.spec.registry import REGISTRY, evaluate
from kvspec.spec.state import Config, GroupSpec

#: claims that need what only kvspec's own environment knows, and why
NOT_ON_A_BARE_SCHEDULER = {
    "placeholders_match_in_flight": "needs the shares of the steps in flight the harness keeps",
    "output_is_the_sampled_sequence": "needs the tokens the worker sampled at each position",
    "stats_are_the_first_hits": "needs the connector's answer when the stats were set",
}
#: why claims of the other kinds are not evaluated on a watched scheduler
NOT_OF_THIS_KIND = {
    "data": "needs the worker's KV content (the data oracle), which a bare scheduler has not",
    "relation": "not evaluated by the plugin yet (needs each step's worker outcome mapped)",
    "model": "needs the connector's answers the environment gives",
    "liveness": "needs the healed phase the harness drives",
}
#: state claims evaluated on a watched scheduler
BARE_CLAIMS = tuple(name for name, inv in REGISTRY.items()
                    if inv.kind == "state" and name not in NOT_ON_A_BARE_SCHEDULER)

WATCHED_CALLS = ("add_request", "schedule", "update_from_output", "finish_requests",
                 "reset_prefix_cache")


class Unmappable(Exception):
    """A scheduler kvspec's state cannot describe (its reason is the message)."""


@attrs.define
class TestRecord:
    nodeid: str
    schedulers: int = 0
    mapped: int = 0
    unmappable: list[str] = attrs.Factory(list)
    calls: int = 0
    violations: list[dict] = attrs.Factory(list)
    out_of_contract: list[str] = attrs.Factory(list)
    #: the test's own result (passed, failed, skipped), kvspec aside
    outcome: str = "not run"

    def note_violation(self, claim: str, call: str, message: str) -> None:
        """The first break of each claim, and how often it broke (a broken pool
        can break a claim for every block after every call)."""
        first = next((v for v in self.violations if v["claim"] == claim), None)
        if first is None:
            self.violations.append({"claim": claim, "call": call, "message": message,
                                    "count": 1})
        else:
            first["count"] += 1

    @property
    def verdict(self) -> str:
        if not self.mapped:
            return "unmapped" if self.schedulers else "no scheduler"
        if self.out_of_contract:
            return "out of contract"
        return "violation" if self.violations else "clean"


CURRENT: list[TestRecord] = []  # the test running now (one at a time per process)


# -- mapping a scheduler ----------------------------------------------------------
def get_group_spec(spec) -> GroupSpec:
    kind = type(spec).__name__
    if kind == "FullAttentionSpec":
        return GroupSpec(spec.block_size)
    if kind == "SlidingWindowSpec":
        return GroupSpec(spec.block_size, "sliding_window", spec.sliding_window)
    if kind == "MambaSpec" and getattr(spec, "mamba_cache_mode", None) == "align":
        return GroupSpec(spec.block_size, "last_state")
    mode = getattr(spec, "mamba_cache_mode", None)
    raise Unmappable(f"a {kind}{f' ({mode} mode)' if mode else ''} KV cache group")


def get_config(s) -> Config:
    """kvspec's ``Config`` of a vLLM scheduler, or ``Unmappable``."""
    groups = tuple(get_group_spec(g.kv_cache_spec) for g in s.kv_cache_config.kv_cache_groups)
    if not groups:
        raise Unmappable("no KV cache group (an attention-free model)")
    is_async = type(s).__name__ == "AsyncScheduler" or any(
        c.__name__ == "AsyncScheduler" for c in type(s).__mro__)
    transfer = getattr(s.vllm_config, "kv_transfer_config", None)
    try:
        return Config(
            groups=groups, num_blocks=s.kv_cache_config.num_blocks - NULL_BLOCKS,
            max_num_batched_tokens=s.max_num_scheduled_tokens, max_num_seqs=s.max_num_running_reqs,
            max_model_len=s.max_model_len,
            long_prefill_token_threshold=s.scheduler_config.long_prefill_token_threshold,
            policy=s.policy.value, enable_prefix_caching=s.cache_config.enable_prefix_caching,
            kv_load_failure_policy=getattr(transfer, "kv_load_failure_policy", None) or "fail",
            async_scheduling=is_async,
            num_speculative_tokens=getattr(s, "num_spec_tokens", 0) if is_async else 0)
    except (ValueError, TypeError) as exc:
        raise Unmappable(f"outside kvspec's limits: {exc}") from None


# -- watching one scheduler ---------------------------------------------------------
class Watch:
    """One scheduler, observed after every watched call."""

    def __init__(self, scheduler, record: TestRecord | None) -> None:
        from kvspec.harness.vllm_target import modules
        self.record = record
        self.observer = VllmObserver(modules(), get_config(scheduler))
        self.observer.scheduler = scheduler
        self.ghost = Ghost()
        #: requests some schedule() call returned
        self.scheduled: set[str] = set()
        #: per scheduled output (by id), each request's start and known tokens then
        self.steps: dict[int, dict[str, tuple[int, int]]] = {}
        #: requests a reported load failure may lower the stats of (at the next check)
        self.lowered_ok: frozenset = frozenset()
        #: the state before the output being applied, and the loads it finished
        self.state_before = None
        self.recving: set[str] = set()
        #: the pool as the last watched call left it
        self.pool_seen: tuple | None = None

    def note_out_of_contract(self, reason: str) -> None:
        if self.record is not None and reason not in self.record.out_of_contract:
            self.record.out_of_contract.append(reason)

    def check(self, call: str, synced: bool = True, after_step: bool = False,
              obs=None) -> None:
        """Judge the state the call left (``obs``: already observed after it)."""
        self.check_mappable()
        obs = obs or self.observer.observe()
        history.process_observation(self.ghost, obs, {}, self.lowered_ok)
        self.lowered_ok = frozenset()
        ctx = Context(obs, self.ghost, None, synced=synced, after_step=after_step)
        if self.record is None:
            return
        self.pool_seen = (obs.pool.ref_cnt, obs.pool.free_queue)
        self.record.calls += 1
        for name in BARE_CLAIMS:
            messages, _ = evaluate(REGISTRY[name], ctx)
            for m in messages:
                self.record.note_violation(name, call, m)

    # -- before and after each call ---------------------------------------------------
    def before_add(self, request) -> None:
        if getattr(request, "resumable", False):
            raise Unmappable("a streaming (resumable) session, whose prompt grows between "
                             "runs: kvspec does not model it")
        if request.num_computed_tokens:
            self.note_out_of_contract("a request added with num_computed_tokens already set")
        self.observer.note_request(request)

    def after_schedule(self, out) -> None:
        for rid in out.num_scheduled_tokens:
            self.scheduled.add(rid)
        s = self.observer.scheduler
        starts = self.observer.get_step_view(out, {}).num_computed_before
        self.steps[id(out)] = {rid: (starts[rid], s.requests[rid].num_tokens)
                               for rid in out.num_scheduled_tokens
                               if rid in starts and rid in s.requests}
        self.check("schedule", synced=False)

    def before_output(self, out, model_output) -> None:
        started = self.steps.pop(id(out), {})
        tokens = dict(zip(getattr(model_output, "req_ids", ()) or (),
                          getattr(model_output, "sampled_token_ids", ()) or ()))
        for rid, n in out.num_scheduled_tokens.items():
            start, known = started.get(rid, (None, None))
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if start is None:
                continue
            sampled = len(tokens.get(rid, ()))
            if start + n - drafts < known and sampled:
                self.note_out_of_contract("a sampled token for a partial prefill chunk")
            if start + n - drafts >= known and drafts and not sampled:
                self.note_out_of_contract("no token for a spec-decode step (the model "
                                          "runner samples at least the bonus token)")
        kv = getattr(model_output, "kv_connector_output", None)
        invalid = {b - NULL_BLOCKS for b in (getattr(kv, "invalid_block_ids", None) or ())}
        failed = set(getattr(kv, "failed_recving", None) or ())
        obs = self.observer.observe()
        self.lowered_ok = frozenset(failed | {
            r.request_id for r in obs.requests.values()
            if invalid & {b for t in r.block_ids for b in t}})
        self.state_before = obs
        recving = set(getattr(kv, "finished_recving", None) or ())
        history.process_loads_finished(self.ghost, recving)
        self.recving = recving

    def after_output(self) -> None:
        after = self.observer.observe()
        history.process_output_applied(self.ghost, self.state_before, after, self.recving)
        self.check("update_from_output", after_step=True, obs=after)

    def before_finish(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
        obs = self.observer.observe()
        for rid in ids:
            history.process_abort(self.ghost, obs.requests.get(rid))

    def before(self, name: str, args, kwargs) -> None:
        self.check_mappable()
        self.note_hand_placed()
        self.note_pool_changed_by_hand()
        if name == "add_request":
            self.before_add(args[0] if args else kwargs["request"])
        elif name == "update_from_output":
            self.before_output(*(list(args) + list(kwargs.values()))[:2])
        elif name == "finish_requests":
            self.before_finish(args[0] if args else kwargs.get("request_ids"))

    def after(self, name: str, result) -> None:
        if name == "schedule":
            self.after_schedule(result)
        elif name == "update_from_output":
            self.after_output()
        else:
            self.check(name)

    def get_pool(self) -> tuple:
        pool = self.observer._pool_view()
        return pool.ref_cnt, pool.free_queue

    def note_pool_changed_by_hand(self) -> None:
        """The block pool changed between two watched calls: the test took or
        freed blocks itself (no scheduler call did it)."""
        if self.pool_seen is not None and self.get_pool() != self.pool_seen:
            self.note_out_of_contract("the block pool changed between scheduler calls "
                                      "(blocks taken or freed by the test)")

    def check_mappable(self) -> None:
        """Requests in states kvspec does not model end the watch."""
        for r in self.observer.scheduler.requests.values():
            if r.status.name == "WAITING_FOR_STREAMING_REQ":
                raise Unmappable("a streaming session waiting for input "
                                 "(WAITING_FOR_STREAMING_REQ), which kvspec does not model")

    def note_hand_placed(self) -> None:
        s = self.observer.scheduler
        if any(r.request_id not in self.scheduled for r in s.running):
            self.note_out_of_contract("a request put into running without schedule()")


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


def get_not_evaluated() -> dict[str, str]:
    """Every registered claim the plugin does not evaluate, with why."""
    return {name: NOT_ON_A_BARE_SCHEDULER.get(name) or NOT_OF_THIS_KIND.get(inv.kind, "")
            for name, inv in REGISTRY.items() if name not in BARE_CLAIMS}


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
