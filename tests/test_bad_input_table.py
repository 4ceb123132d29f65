"""Bad input, table-driven: every malformed trace, configuration, action, verdict,
argument and output path is one line on stderr and exit code 2, before anything
runs; never a traceback, a hang, a silent pass or a finding of the target.

The command line runs in-process (``kvspec.cli.run``); a few cases run it as a
real subprocess, through ``main()``.
"""
from __future__ import annotations

import copy
import json
import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvspec import cli

ROOT = Path(__file__).resolve().parents[1]
REGRESSION = ROOT / "model_tests" / "regressions" / "cache_failed_block.json"
FINDING = ROOT / "docs" / "findings" / "vllm-0.32.0-sync-full-prompt-hit-crash.json"
BASE = json.loads(REGRESSION.read_text())


class Ran(BaseException):
    """Something ran that bad input must stop before (not an Exception: the
    command line's catch-all must not turn it into an error line)."""


@pytest.fixture
def guarded(monkeypatch, tmp_path):
    """A scratch working directory, and every entry point that does work (fuzzing,
    replaying, model checking, proving) replaced by one that raises ``Ran``."""
    import kvspec.harness.bmc
    import kvspec.harness.fuzz
    import kvspec.harness.replay
    import kvspec.harness.zoo
    import kvspec.spec.prove

    def ran(*args, **kwargs):
        raise Ran("bad input reached a run")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvspec.harness.fuzz, "fuzz", ran)
    monkeypatch.setattr(kvspec.harness.bmc, "bmc", ran)
    monkeypatch.setattr(kvspec.harness.zoo, "run_zoo", ran)
    monkeypatch.setattr(kvspec.spec.prove, "check_all", ran)
    monkeypatch.setattr(kvspec.harness.replay, "Runner", ran)
    return tmp_path


def invoke(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, out: str, err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert lines[0].isprintable(), repr(lines[0])  # no terminal escapes, no surrogates
    assert lines[0].startswith("kvspec: error: "), err
    assert needle.lower() in lines[0].lower(), (needle, lines[0])
    assert len(lines[0]) <= 400, f"{len(lines[0])} characters: {lines[0][:120]}..."
    assert "Traceback" not in err + out
    for finding in ("target_crashed", "violated", "environment_contract", "invariants hold"):
        assert finding not in out + err, out


# -- trace files --------------------------------------------------------------------

def _symlink_loop(d: Path) -> Path:
    (d / "a.json").symlink_to(d / "b.json")
    (d / "b.json").symlink_to(d / "a.json")
    return d / "a.json"


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo.json")
    return d / "fifo.json"


def _sparse(d: Path) -> Path:
    path = d / "huge.json"
    with path.open("wb") as f:
        f.truncate(65 << 20)
    return path


def _text(content: str | bytes):
    def make(d: Path) -> Path:
        path = d / "t.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path
    return make


FILES = {
    "empty": (_text(""), "invalid JSON"),
    "blank": (_text("  \n\n "), "invalid JSON"),
    "truncated": (_text('{"format": "kvspec-trace/1"'), "invalid JSON"),
    "not-json": (_text("hello"), "invalid JSON"),
    "trailing-garbage": (_text('{"format": "kvspec-trace/1"} x'), "invalid JSON"),
    "binary": (_text(b"\x00\xff\xfe\x80"), "not UTF-8"),
    "deep-list": (_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "deep-object": (_text('{"a":' * 50_000 + "1" + "}" * 50_000), "nested too deeply"),
    "huge-integer": (_text('{"format": "kvspec-trace/1", "seed": ' + "9" * 5000 + "}"),
                     "invalid JSON"),
    "list": (_text("[]"), "not a kvspec trace"),
    "string": (_text('"kvspec-trace/1"'), "not a kvspec trace"),
    "number": (_text("5"), "not a kvspec trace"),
    "null": (_text("null"), "not a kvspec trace"),
    "no-format": (_text('{"actions": []}'), "not a kvspec trace"),
    "wrong-format": (_text('{"format": "kvspec-trace/2"}'), "not a kvspec trace"),
    "format-number": (_text('{"format": 1}'), "not a kvspec trace"),
    "directory": (lambda d: d, "is a directory"),
    "missing": (lambda d: d / "missing.json", "no such trace file"),
    "dangling-symlink": (lambda d: (d / "s.json").symlink_to(d / "gone") or d / "s.json",
                         "no such trace file"),
    "symlink-loop": (_symlink_loop, "cannot read trace"),
    "under-a-file": (lambda d: _text("{}")(d) / "x.json", "cannot read trace"),
    "fifo": (_fifo, "not a regular file"),
    "device": (lambda d: Path("/dev/null"), "not a regular file"),
    "too-large": (_sparse, "not a kvspec trace"),
    # a key twice in one object: json keeps the last one silently, a trace does not
    "duplicate-key-target": (_text(json.dumps(BASE).replace(
        '"target": "', '"target": "impl", "target": "', 1)), "key 'target' appears twice"),
    "duplicate-key-op": (_text(json.dumps(BASE).replace(
        '"op": "step"', '"op": "abort", "op": "step"', 1)), "key 'op' appears twice"),
    "duplicate-key-config": (_text(json.dumps(BASE).replace(
        '"num_blocks": ', '"num_blocks": 99, "num_blocks": ', 1)), "key 'num_blocks' appears"),
    # the path itself is quoted, escaped and shortened in the line
    "missing-newline-in-name": (lambda d: d / "no\nsuch.json", r"no such trace file: '"),
    "escape-sequence-in-name": (lambda d: _named(d, "\x1b[2Jt.json", "hello"), r"\x1b[2jt.json'"),
    "undecodable-name": (lambda d: _named(d, os.fsdecode(b"\xff.json"), "hello"), r"/\udcff.json'"),
    "markup-in-name": (lambda d: _named(d, "[red]t[.json", "hello"), "[red]t[.json': not a kvspec"),
    "name-over-4096-characters": (lambda d: d / ("/".join(["d" * 200] * 25) + ".json"),
                                  "'…dddd"),
}


def _large_pool(trace) -> None:
    """The reviewer's configuration: a large pool, one token a step."""
    trace["config"].update(groups=[{"block_size": 16}], num_blocks=16_384,
                           max_num_batched_tokens=1, max_num_seqs=1, max_model_len=8192)
    trace.pop("verdict", None)


def _named(d: Path, name: str, content: str) -> Path:
    (d / name).write_text(content)
    return d / name


@pytest.mark.parametrize("name", FILES)
def test_trace_file(guarded, capsys, name):
    make, needle = FILES[name]
    path = make(guarded)
    assert_one_line(*invoke(capsys, "replay", path), needle)


# -- trace contents ------------------------------------------------------------------

def edit(**top):
    """A copy of a committed trace with top-level fields replaced (None: removed)."""
    def change(trace):
        for key, value in top.items():
            if value is None:
                trace.pop(key, None)
            else:
                trace[key] = value
    return change


def config(**fields):
    def change(trace):
        for key, value in fields.items():
            if value is _DROP:
                trace["config"].pop(key)
            else:
                trace["config"][key] = value
    return change


def group(**fields):
    def change(trace):
        g = trace["config"]["groups"][0]
        for key, value in fields.items():
            if value is _DROP:
                g.pop(key)
            else:
                g[key] = value
    return change


def action(index: int, **fields):
    """Change fields of actions[index] (the trace's first action is an add of r0,
    its second a step)."""
    def change(trace):
        a = trace["actions"][index]
        for key, value in fields.items():
            if value is _DROP:
                a.pop(key)
            else:
                a[key] = value
    return change


def insert(index: int, new: object):
    def change(trace):
        trace["actions"].insert(index, new)
    return change


_DROP = object()


def _both(*changes):
    def change(trace):
        for c in changes:
            c(trace)
    return change
ADD = {"op": "add", "id": "r9", "prompt": [1, 2, 3], "max_tokens": 1}

TRACES = {
    # top level
    "target-missing": (edit(target=None), "missing field 'target'"),
    "target-number": (edit(target=5), "target: expected a string"),
    "target-empty": (edit(target=""), "target: must not be empty"),
    "target-unknown": (edit(target="nope"), "unknown target 'nope'"),
    "target-unknown-mutant": (edit(target="mutant:nope"), "unknown target"),
    "seed-string": (edit(seed="x"), "seed: expected an integer or null"),
    "seed-float": (edit(seed=1.5), "seed: expected an integer or null"),
    "seed-bool": (edit(seed=True), "seed: expected an integer or null"),
    "unknown-top-field": (edit(notes="hi"), "unknown field 'notes'"),
    "actions-missing": (edit(actions=None), "missing field 'actions'"),
    "actions-object": (edit(actions={}), "actions: expected a list"),
    "actions-string": (edit(actions="add"), "actions: expected a list"),
    "config-missing": (edit(config=None), "missing field 'config'"),
    "config-list": (edit(config=[]), "config: expected an object"),
    "config-string": (edit(config="small"), "config: expected an object"),
    # configuration
    "groups-empty": (config(groups=[]), "config.groups: must not be empty"),
    "groups-missing": (config(groups=_DROP), "missing field 'groups'"),
    "groups-string": (config(groups="x"), "config.groups: expected a list"),
    "groups-number": (config(groups=[5]), "config.groups[0]: expected an object"),
    "groups-too-many": (config(groups=[{"block_size": 2}] * 9), "at most 8"),
    "groups-mixed-sizes": (config(groups=[{"block_size": 2}, {"block_size": 4}]),
                           "block sizes [2, 4] differ"),
    "block-size-zero": (group(block_size=0), "block_size: must be >= 1, got 0"),
    "block-size-negative": (group(block_size=-2), "block_size: must be >= 1, got -2"),
    "block-size-string": (group(block_size="4"), "block_size: expected an integer"),
    "block-size-float": (group(block_size=2.0), "block_size: expected an integer"),
    "block-size-bool": (group(block_size=True), "block_size: expected an integer"),
    "block-size-null": (group(block_size=None), "block_size: expected an integer"),
    "block-size-huge": (group(block_size=4096), "block_size: must be <= 1024"),
    "block-size-missing": (group(block_size=_DROP), "missing field 'block_size'"),
    "group-kind-unknown": (group(kind="mamba"), "kind: must be one of"),
    "group-kind-number": (group(kind=3), "kind: must be one of"),
    "group-extra-field": (group(attention_sink=4), "unknown field 'attention_sink'"),
    "group-window-on-full": (group(sliding_window=4), "sliding_window applies to sliding_window groups only"),
    "num-blocks-zero": (config(num_blocks=0), "num_blocks: must be >= 1"),
    "num-blocks-negative": (config(num_blocks=-1), "num_blocks: must be >= 1"),
    "num-blocks-1e9-float": (config(num_blocks=1e9), "num_blocks: expected an integer"),
    "num-blocks-1e9": (config(num_blocks=10 ** 9), "num_blocks: must be <= 16384"),
    "num-blocks-100k": (config(num_blocks=100_000), "num_blocks: must be <= 16384"),
    "num-blocks-string": (config(num_blocks="7"), "num_blocks: expected an integer"),
    "num-blocks-bool": (config(num_blocks=True), "num_blocks: expected an integer"),
    "num-blocks-null": (config(num_blocks=None), "num_blocks: expected an integer"),
    "num-blocks-fraction": (config(num_blocks=7.5), "num_blocks: expected an integer"),
    "kv-slots-too-many": (lambda t: (config(num_blocks=16_384)(t),
                                     group(block_size=1024)(t)), "KV token slots"),
    "batched-tokens-zero": (config(max_num_batched_tokens=0), "max_num_batched_tokens"),
    "batched-tokens-negative": (config(max_num_batched_tokens=-4), "max_num_batched_tokens"),
    "max-num-seqs-zero": (config(max_num_seqs=0), "max_num_seqs: must be >= 1"),
    "max-num-seqs-huge": (config(max_num_seqs=10 ** 6), "max_num_seqs: must be <= 4096"),
    "max-model-len-zero": (config(max_model_len=0), "max_model_len: must be >= 2"),
    "max-model-len-one": (lambda t: (config(max_model_len=1)(t), edit(actions=[])(t)),
                          "max_model_len: must be >= 2"),
    "max-model-len-huge": (config(max_model_len=10 ** 7), "max_model_len: must be <="),
    "max-model-len-65536": (config(max_model_len=65536), "max_model_len: must be <= 8192"),
    "max-model-len-string": (config(max_model_len="12"), "max_model_len: expected an integer"),
    "threshold-negative": (config(long_prefill_token_threshold=-1),
                           "long_prefill_token_threshold: must be >= 0"),
    "threshold-string": (config(long_prefill_token_threshold="3"), "expected an integer"),
    "policy-unknown": (config(policy="lifo"), "policy: must be one of 'fcfs', 'priority'"),
    "policy-number": (config(policy=1), "policy: must be one of"),
    "failure-policy-unknown": (config(kv_load_failure_policy="ignore"),
                               "kv_load_failure_policy: must be one of"),
    "prefix-caching-string": (config(enable_prefix_caching="yes"), "expected true or false"),
    "prefix-caching-number": (config(enable_prefix_caching=1), "expected true or false"),
    "config-extra-field": (config(num_gpus=1), "unknown field 'num_gpus'"),
    "kv-role-unknown": (config(kv_role="kv_consumer_only"), "kv_role: must be one of"),
    "async-scheduling-string": (config(async_scheduling="yes"), "expected true or false"),
    "kv-connector-string": (config(kv_connector="no"), "expected true or false"),
    "delivery-without-connector": (config(kv_connector=False, requires_kv_delivery=True),
                                   "requires_kv_delivery needs a KV connector"),
    "batches-too-many": (config(async_scheduling=True, max_concurrent_batches=5),
                         "max_concurrent_batches: must be <= 4"),
    "batches-one": (config(async_scheduling=True, max_concurrent_batches=1),
                    "max_concurrent_batches: must be >= 2"),
    "batches-under-sync": (config(max_concurrent_batches=3),
                           "max_concurrent_batches applies to async scheduling only"),
    "config-required-missing": (config(num_blocks=_DROP), "missing field 'num_blocks'"),
    # action shapes
    "action-number": (insert(1, 5), "actions[1]: expected an object"),
    "action-string": (insert(1, "step"), "actions[1]: expected an object"),
    "action-null": (insert(1, None), "actions[1]: expected an object"),
    "action-list": (insert(1, []), "actions[1]: expected an object"),
    "op-missing": (insert(1, {}), "missing field 'op'"),
    "op-unknown": (insert(1, {"op": "boom"}), "actions[1].op: must be one of"),
    "op-number": (insert(1, {"op": 5}), "actions[1].op: must be one of"),
    # add
    "add-id-missing": (action(0, id=_DROP), "missing field 'id'"),
    "add-id-number": (action(0, id=5), "actions[0].id: expected a string"),
    "add-id-null": (action(0, id=None), "actions[0].id: expected a string"),
    "add-id-empty": (action(0, id=""), "actions[0].id: must not be empty"),
    "add-prompt-missing": (action(0, prompt=_DROP), "missing field 'prompt'"),
    "add-prompt-string": (action(0, prompt="abc"), "actions[0].prompt: expected a list"),
    "add-prompt-empty": (action(0, prompt=[]), "actions[0].prompt: must not be empty"),
    "add-prompt-strings": (action(0, prompt=["a", "b"]), "prompt[0]: expected an integer"),
    "add-prompt-floats": (action(0, prompt=[1.5, 2.0]), "prompt[0]: expected an integer"),
    "add-prompt-nulls": (action(0, prompt=[None]), "prompt[0]: expected an integer"),
    "add-prompt-bools": (action(0, prompt=[True, False]), "prompt[0]: expected an integer"),
    "add-prompt-nested": (action(0, prompt=[[1, 2]]), "prompt[0]: expected an integer"),
    "add-prompt-negative": (action(0, prompt=[1, -1]), "prompt[1]: must be >= 0"),
    "add-prompt-huge-token": (action(0, prompt=[2 ** 40]), "prompt[0]: must be <="),
    "add-prompt-long-strings": (action(0, prompt=["token" * 50] * 5000), "expected an integer"),
    "add-max-tokens-missing": (action(0, max_tokens=_DROP), "missing field 'max_tokens'"),
    "add-max-tokens-zero": (action(0, max_tokens=0), "max_tokens: must be >= 1, got 0"),
    "add-max-tokens-negative": (action(0, max_tokens=-1), "max_tokens: must be >= 1, got -1"),
    "add-max-tokens-bool": (action(0, max_tokens=True), "max_tokens: expected an integer"),
    "add-max-tokens-string": (action(0, max_tokens="5"), "max_tokens: expected an integer"),
    "add-max-tokens-null": (action(0, max_tokens=None), "max_tokens: expected an integer"),
    "add-max-tokens-float": (action(0, max_tokens=2.5), "max_tokens: expected an integer"),
    "add-max-tokens-huge": (action(0, max_tokens=10 ** 9), "max_tokens: must be <="),
    "add-priority-string": (action(0, priority="high"), "priority: expected an integer"),
    "add-priority-float": (action(0, priority=0.5), "priority: expected an integer"),
    "add-ext-string": (action(0, ext="abc"), "ext: expected an integer"),
    "add-ext-negative": (action(0, ext=-1), "ext: must be >= 0"),
    "add-ext-bool": (action(0, ext=True), "ext: expected an integer"),
    "add-async-string": (action(0, **{"async": "yes"}), "async: expected true or false"),
    "add-async-number": (action(0, **{"async": 1}), "async: expected true or false"),
    "add-none-negative": (action(0, none=-1), "none: must be >= 0"),
    "add-none-huge": (action(0, none=10 ** 6), "none: must be <= 10"),
    "add-send-string": (action(0, send="no"), "send: expected true or false"),
    "add-offload-number": (action(0, offload=0), "offload: expected true or false"),
    "add-overclaim-string": (action(0, overclaim_ok="y"), "overclaim_ok: expected true"),
    "add-unknown-field": (action(0, prio=1), "unknown field 'prio' for op 'add'"),
    # request ids are printed in step tables: printable, at most 64 characters
    "add-id-newline": (action(0, id="r\n0"), "actions[0].id: must be printable"),
    "add-id-escape-sequence": (action(0, id="\x1b[2J\x1b[31mr0"), "must be printable"),
    "add-id-bell": (action(0, id="r0\x07"), "must be printable"),
    "add-id-lone-surrogate": (action(0, id="\ud800"), "must be printable"),
    "add-id-right-to-left-override": (action(0, id="r\u202e0"), "must be printable"),
    "add-id-nul": (action(0, id="r\x000"), "must be printable"),
    "add-id-65-characters": (action(0, id="x" * 65), "takes at most 64 characters, got 65"),
    "abort-id-tab": (insert(1, {"op": "abort", "id": "r\t0"}), "actions[1].id: must be printable"),
    "step-eos-id-carriage-return": (action(1, eos=["r0\r"]), "eos[0]: must be printable"),
    "verdict-invariant-newline": (edit(verdict=[{"invariant": "a\nb", "message": "m"}]),
                                  "verdict[0].invariant: must be printable"),
    # step
    "step-finish-loads-string": (action(1, finish_loads="abc"), "finish_loads: expected a list"),
    "step-finish-loads-numbers": (action(1, finish_loads=[5]), "finish_loads[0]: expected a str"),
    "step-fail-number": (action(1, fail=5), "actions[1].fail: expected a list"),
    "step-fail-twice": (action(1, fail=["r0", "r0"]), "fail: names an item twice"),
    "step-fail-all-string": (action(1, fail_all="yes"), "fail_all: expected true or false"),
    "step-fail-offset-negative": (action(1, fail_offset=-1), "fail_offset: must be >= 0"),
    "step-fail-offset-string": (action(1, fail_offset="1"), "fail_offset: expected an integer"),
    "step-eos-number": (action(1, eos=7), "actions[1].eos: expected a list"),
    "step-eos-nulls": (action(1, eos=[None]), "eos[0]: expected a string"),
    "step-finish-sends-object": (action(1, finish_sends={}), "finish_sends: expected a list"),
    "step-accept-negative": (action(1, accept=-1), "accept: must be >= 0"),
    "step-accept-huge": (action(1, accept=100), "accept: must be <="),
    "step-drafts-too-many": (action(1, drafts=5), "drafts: must be <= 4"),
    "step-drafts-negative": (action(1, drafts=-1), "drafts: must be >= 0"),
    "step-drafts-string": (action(1, drafts="2"), "drafts: expected an integer"),
    "step-unknown-field": (action(1, foo=1), "unknown field 'foo' for op 'step'"),
    # abort, reset, drain
    "abort-id-missing": (insert(1, {"op": "abort"}), "missing field 'id'"),
    "abort-id-number": (insert(1, {"op": "abort", "id": 0}), "actions[1].id: expected a str"),
    "abort-extra-field": (insert(1, {"op": "abort", "id": "r0", "now": True}),
                          "unknown field 'now' for op 'abort'"),
    "reset-with-field": (insert(1, {"op": "reset_prefix_cache", "all": True}),
                         "unknown field 'all'"),
    "drain-with-field": (insert(1, {"op": "drain", "steps": 5}), "unknown field 'steps'"),
    # impossible actions: well-formed, but the environment never makes them
    "impossible-duplicate-id": (insert(1, {**ADD, "id": "r0"}), "duplicate request id 'r0'"),
    "impossible-prompt-at-max-model-len": (action(0, prompt=list(range(12))),
                                           "12 tokens do not fit under max_model_len=12"),
    "impossible-prompt-too-long": (action(0, prompt=list(range(1000))),
                                   "1000 tokens do not fit"),
    "impossible-ext-past-prompt": (action(0, ext=6), "cannot hold 6 tokens of a 5-token"),
    "impossible-ext-under-a-producer": (_both(config(kv_role="kv_producer"), action(0, ext=2)),
                                        "actions[0].ext: a kv_producer connector loads nothing"),
    "impossible-offload-under-a-producer": (
        _both(config(kv_role="kv_producer"), action(0, ext=0, offload=True)),
        "actions[0].offload: a kv_producer connector loads nothing"),
    "impossible-send-under-a-consumer": (
        _both(config(kv_role="kv_consumer"), action(0, send=True)),
        "actions[0].send: a kv_consumer connector sends nothing"),
    "impossible-ext-without-a-connector": (
        _both(config(kv_connector=False), action(0, ext=2)),
        "actions[0].ext: a run without a connector loads nothing"),
    "impossible-pd-without-a-connector": (
        _both(config(kv_connector=False), action(0, ext=0, pd=True)),
        "actions[0].pd: P/D transfer params need a KV connector"),
    "pd-string": (action(0, pd="yes"), "pd: expected true or false"),
    "reset-running-string": (insert(1, {"op": "reset_prefix_cache", "running": "yes"}),
                             "running: expected true or false"),
    "impossible-abort-unknown": (insert(1, {"op": "abort", "id": "zz"}),
                                 "'zz' names no request added before it"),
    "impossible-abort-before-add": (insert(0, {"op": "abort", "id": "r0"}),
                                    "'r0' names no request added before it"),
    "impossible-fail-unknown": (action(1, fail=["r5"]), "actions[1].fail: 'r5' names no"),
    "impossible-eos-unknown": (action(1, eos=["r0", "r7"]), "actions[1].eos: 'r7' names no"),
    "impossible-finish-loads-unknown": (action(1, finish_loads=["x"]), "finish_loads: 'x'"),
    "impossible-finish-sends-unknown": (action(1, finish_sends=["x"]), "finish_sends: 'x'"),
    "impossible-pool-too-small": (lambda t: (config(num_blocks=2)(t),
                                             action(0, max_tokens=6)(t)),
                                  "needs 5 blocks to finish alone"),
    # too large: every accepted trace replays in minutes
    "too-many-tokens": (lambda t: (_large_pool(t), edit(actions=[
        {"op": "add", "id": f"r{i}", "prompt": [1] * 1000, "max_tokens": 7000}
        for i in range(140)])(t)), "too large a trace: its arrivals carry 1120000 tokens"),
    "replay-of-hours": (lambda t: (_large_pool(t), edit(actions=[
        {"op": "add", "id": "r0", "prompt": [1] * 3000, "max_tokens": 5000},
        {"op": "drain"}])(t)), "too large a trace: replaying it could take"),
    "300k-drains": (edit(actions=[{"op": "drain"}] * 300_000),
                    "actions: takes at most 10000 items, got 300000"),
    "9000-drains-on-a-large-pool": (lambda t: (_large_pool(t), edit(
        actions=[{"op": "drain"}] * 9000)(t)), "up to 189000 scheduler calls"),
    "many-requests-every-step": (lambda t: (_large_pool(t), config(num_blocks=64)(t), edit(
        actions=[{"op": "add", "id": f"r{i}", "prompt": [i], "max_tokens": 100}
                 for i in range(1500)] + [{"op": "drain"}])(t)), "up to 1500 requests"),
    "prompt-of-a-million-strings": (action(0, prompt=["a"] * 1_000_000),
                                    "prompt: takes at most 8191 items"),
    # verdict and step table
    "verdict-string": (edit(verdict="boom"), "verdict: expected a list"),
    "verdict-number": (edit(verdict=5), "verdict: expected a list"),
    "verdict-object": (edit(verdict={}), "verdict: expected a list"),
    "verdict-items-numbers": (edit(verdict=[5]), "verdict[0]: expected an object"),
    "verdict-invariant-number": (edit(verdict=[{"invariant": 3, "message": "m"}]),
                                 "verdict[0].invariant: expected a string"),
    "verdict-invariant-empty": (edit(verdict=[{"invariant": "", "message": "m"}]),
                                "verdict[0].invariant: must not be empty"),
    "verdict-no-message": (edit(verdict=[{"invariant": "x"}]), "missing field 'message'"),
    "verdict-no-invariant": (edit(verdict=[{"message": "x"}]), "missing field 'invariant'"),
    "verdict-extra-field": (edit(verdict=[{"invariant": "a", "message": "b", "doc": "c"}]),
                            "unknown field 'doc'"),
    "verdict-message-deep": (edit(verdict=[{"invariant": "a", "message": [[[[[["x"]]]]]]}]),
                             "message: expected a string"),
    "steps-string": (edit(steps="x"), "steps: expected a list"),
    "steps-negative-index": (edit(steps=[{"index": -1, "action": "a", "requests": ""}]),
                             "steps[0].index: must be >= 0"),
    "steps-empty-item": (edit(steps=[{}]), "missing field"),
}


@pytest.mark.parametrize("name", TRACES)
def test_trace_content(guarded, capsys, name):
    change, needle = TRACES[name]
    trace = copy.deepcopy(BASE)
    change(trace)
    path = guarded / "t.json"
    path.write_text(json.dumps(trace))
    assert_one_line(*invoke(capsys, "replay", path), needle)


# -- arguments -----------------------------------------------------------------------

ARGS = {
    "no-command": ((), "missing command"),
    "unknown-command": (("chekc",), "no such command"),
    "unknown-option": (("check", "--bogus"), "no such option"),
    "replay-no-trace": (("replay",), "missing argument"),
    "replay-unknown-target": (("replay", REGRESSION, "--target", "nope"), "unknown target"),
    "replay-target-empty": (("replay", REGRESSION, "--target", ""), "unknown target"),
    "targets-extra-argument": (("targets", "x"), "unexpected extra argument"),
    "zoo-unknown-mutant": (("zoo", "--mutant", "nope"), "unknown mutant 'nope'"),
    "zoo-budget-zero": (("zoo", "--budget", "0"), "invalid budget"),
    "zoo-budget-tiny": (("zoo", "--budget", "0.1s"), "use at least 1s"),
    "zoo-seed-text": (("zoo", "--seed", "x"), "--seed"),
    "bmc-depth-zero": (("bmc", "--depth", "0"), "invalid --depth 0"),
    "bmc-depth-negative": (("bmc", "--depth", "-3"), "invalid --depth -3"),
    "bmc-depth-text": (("bmc", "--depth", "deep"), "--depth"),
    "bmc-max-states-zero": (("bmc", "--max-states", "0"), "invalid --max-states 0"),
    "bmc-max-states-negative": (("bmc", "--max-states", "-5"), "invalid --max-states -5"),
    "bmc-max-states-float": (("bmc", "--max-states", "1.5"), "--max-states"),
    "bmc-max-states-one": (("bmc", "--target", "mutant:cache_failed_block", "--max-states", "1"),
                           "invalid --max-states 1: depth 1 alone may reach 9 states"),
    "bmc-max-states-eight": (("bmc", "--max-states", "8"), "use 9 or more"),
    "zoo-budget-overflows": (("zoo", "--budget", "9" * 400 + "m"), "more than a week"),
    "check-kvspec-is-a-file": (("check", "--budget", "1s", "--out", "elsewhere"),
                               "the example database '.kvspec/examples': cannot write there"),
    "bmc-unknown-target": (("bmc", "--target", "nope"), "unknown target"),
    "prove-timeout-zero": (("prove", "--timeout", "0"), "invalid --timeout 0"),
    "prove-timeout-negative": (("prove", "--timeout", "-1"), "invalid --timeout -1"),
    "prove-timeout-huge": (("prove", "--timeout", "100000000"), "invalid --timeout"),
    "prove-timeout-text": (("prove", "--timeout", "soon"), "--timeout"),
    "prove-unknown-obligation": (("prove", "--only", "nope"), "unknown obligation 'nope'"),
    # it once pointed at a `kvspec claims` command that does not exist
    "replay-ignore-unknown-claim": (("replay", REGRESSION, "--ignore", "stats_are_orderd"),
                                    "is no claim (did you mean stats_are_ordered?); "
                                    "docs/spec.md lists every claim"),
    "zoo-unknown-mutant-target-spelling": (("zoo", "--mutant", "mutant:nope"),
                                           "unknown mutant 'nope'"),
    # every trace is read before any is replayed, --target or not (one line, no replay)
    "replay-target-later-trace-missing": (("replay", REGRESSION, "missing.json",
                                           "--target", "impl"), "missing.json"),
    # a review's budget in runs, as check's and fuzz's (before any source is read)
    "review-budget-and-examples": (("review", "installed", "change.diff", "--budget", "5s",
                                    "--examples", "3"),
                                   "--examples is a budget in runs instead of --budget"),
    "review-examples-zero": (("review", "installed", "change.diff", "--examples", "0"),
                             "--examples 0: a number of runs, at least 1"),
}
for command in ("check", "fuzz"):
    ARGS.update({
        f"{command}-budget-word": ((command, "--budget", "banana"), "invalid budget"),
        f"{command}-budget-negative": ((command, "--budget", "-5s"), "invalid budget"),
        f"{command}-budget-zero": ((command, "--budget", "0"), "invalid budget"),
        f"{command}-budget-zero-seconds": ((command, "--budget", "0s"), "invalid budget"),
        f"{command}-budget-tiny": ((command, "--budget", "0.0000001s"), "use at least 1s"),
        f"{command}-budget-half-second": ((command, "--budget", "0.5"), "use at least 1s"),
        f"{command}-budget-empty": ((command, "--budget", ""), "invalid budget"),
        f"{command}-budget-unit": ((command, "--budget", "10x"), "invalid budget"),
        f"{command}-budget-exponent": ((command, "--budget", "1e3"), "invalid budget"),
        f"{command}-budget-long": ((command, "--budget", "9" * 500 + "q"), "invalid budget"),
        f"{command}-seed-text": ((command, "--seed", "abc"), "--seed"),
        f"{command}-seed-float": ((command, "--seed", "1.5"), "--seed"),
        f"{command}-seed-empty": ((command, "--seed", ""), "--seed"),
        f"{command}-unknown-target": ((command, "--target", "nope"), "unknown target 'nope'"),
        f"{command}-unknown-mutant-target": ((command, "--target", "mutant:nope"),
                                             "unknown target"),
        f"{command}-long-target": ((command, "--target", "x" * 5000), "unknown target"),
        f"{command}-budget-missing-value": ((command, "--budget"), "requires an argument"),
        f"{command}-budget-overflows": ((command, "--budget", "9" * 400), "more than a week"),
        f"{command}-budget-over-a-week": ((command, "--budget", "169h"), "use at most 168h"),
        f"{command}-json-budget-overflows": ((command, "--json", "--budget", "9" * 400 + "s"),
                                             "more than a week"),
        # before vLLM is imported (it once surfaced after the import, as unexpected)
        f"{command}-base-missing": ((command, "--target", "vllm", "--base", "/nonexistent/v",
                                     "--budget", "1s"), "--base: "),
        # contradictions were accepted, one option silently winning
        f"{command}-strict-and-fixes": ((command, "--target", "vllm", "--strict", "--fixes",
                                         "all"), "--strict is --fixes none: it contradicts"),
        f"{command}-named-options-and-fixes": ((command, "--target", "vllm?fixes=none",
                                                "--fixes", "all"), "names its own options"),
        f"{command}-target-option-twice": ((command, "--target", "vllm?fixes=none&fixes=all"),
                                           "fixes= given twice"),
        f"{command}-budget-and-examples": ((command, "--budget", "5s", "--examples", "3"),
                                           "--examples is a budget in runs instead of --budget"),
    })


#: what a case needs in its working directory first
ARG_SETUP = {"check-kvspec-is-a-file": lambda d: (d / ".kvspec").write_text("x")}


@pytest.mark.parametrize("name", ARGS)
def test_argument(guarded, capsys, name):
    args, needle = ARGS[name]
    ARG_SETUP.get(name, lambda d: None)(guarded)
    assert_one_line(*invoke(capsys, *args), needle)


# -- output paths --------------------------------------------------------------------

def _file(d: Path) -> Path:
    (d / "a-file").write_text("x")
    return d / "a-file"


PATHS = {
    "a-file": (_file, "exists and is not a directory"),
    "under-a-file": (lambda d: _file(d) / "sub", "Not a directory"),
    "deep-under-a-file": (lambda d: _file(d) / "a" / "b" / "c", "Not a directory"),
    "in-proc": (lambda d: Path("/proc/kvspec-out"), "cannot write there"),
    "under-dev-null": (lambda d: Path("/dev/null/out"), "cannot write there"),
    "symlink-loop": (_symlink_loop, "cannot write there"),
    "newline-in-name": (lambda d: _named(d, "x\ny", "x"), r"/x\ny': exists and is not a"),
    "undecodable-name": (lambda d: _named(d, os.fsdecode(b"x\xff"), "x"), r"x\udcff'"),
    "over-4096-characters": (lambda d: d / "/".join(["d" * 200] * 25), "'…dddd"),
}
OPTIONS = {
    "check-out": ("check", "--budget", "1s", "--out"),
    "fuzz-out": ("fuzz", "--budget", "1s", "--out"),
    "fuzz-db": ("fuzz", "--budget", "1s", "--db"),
    "zoo-out": ("zoo", "--budget", "1s", "--mutant", "cache_failed_block", "--out"),
    "zoo-save-regressions": ("zoo", "--budget", "1s", "--mutant", "cache_failed_block",
                             "--save-regressions"),
    "bmc-out": ("bmc", "--depth", "1", "--out"),
    "prove-traces": ("prove", "--traces"),
}
PATH_CASES = [(o, p) for o in OPTIONS for p in PATHS
              if p in ("a-file", "under-a-file", "in-proc", "newline-in-name",
                       "over-4096-characters") or o in ("check-out", "fuzz-db")]


@pytest.mark.parametrize("option, where", PATH_CASES, ids=[f"{o}-{p}" for o, p in PATH_CASES])
def test_output_path(guarded, capsys, option, where):
    make, needle = PATHS[where]
    args = OPTIONS[option]
    code, out, err = invoke(capsys, *args, make(guarded))
    assert_one_line(code, out, err, needle)
    assert args[-1] in err


# -- a finding is a finding, whatever its request ids and paths --------------------------

def _trace_with(tmp_path: Path, change) -> Path:
    trace = copy.deepcopy(BASE)
    change(trace)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    return path


@pytest.mark.parametrize("rid", ["[/]", "[r0]", "[bold red]r0", "[link=file:///etc/passwd]r0",
                                 "r0\\", "é😀", "r 0"])
def test_a_finding_with_an_odd_request_id_exits_1_and_shows_it(tmp_path, monkeypatch, capsys,
                                                                  rid):
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, action(0, id=rid)))
    assert code == 1, out + err
    assert f"add(id={rid}, " in out  # as given: not read as markup, not dropped
    assert "violated: no_caching_of_invalid_blocks" in out and err == ""


def test_a_message_quoting_an_odd_id_is_shown_as_given(tmp_path, monkeypatch, capsys):
    def overclaim(trace):
        trace.update(target="impl", verdict=[], steps=[])
        trace["actions"] = [{"op": "add", "id": "[/]", "prompt": [1, 2, 3, 4, 10],
                             "max_tokens": 2, "ext": 9, "overclaim_ok": True}, {"op": "step"}]
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, overclaim))
    assert code == 1, out + err
    assert "connector answered 9 external tokens for request '[/]'" in out


@pytest.mark.parametrize("out_dir", ["runs[ci]", "o[/]x", "[bold]y", os.fsdecode(b"o\xff"),
                                     "sp ace"])
def test_a_finding_under_an_odd_out_path_exits_1_saved_and_named(tmp_path, monkeypatch, capsys,
                                                                  out_dir):
    from kvspec.text import command_arg, printable
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "bmc", "--target", "mutant:cache_failed_block",
                            "--depth", "4", "--out", out_dir)
    assert code == 1, out + err
    saved = f"{out_dir}/mutant_cache_failed_block.json"
    assert (tmp_path / saved).is_file()
    assert f"trace saved: {printable(saved)}  (replay: kvspec replay {command_arg(saved)})" in out
    assert out.isprintable() or "\n" in out and all(line.isprintable()
                                                     for line in out.splitlines())


def test_fuzz_finding_under_a_markup_out_path_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "fuzz", "--target", "mutant:cache_failed_block",
                            "--budget", "20s", "--out", "o[/]x")
    assert code == 1, out + err
    assert "trace saved: o[/]x/mutant_cache_failed_block-seed0.json" in out
    assert (tmp_path / "o[/]x" / "mutant_cache_failed_block-seed0.json").is_file()


def test_a_finding_that_cannot_be_printed_still_exits_1(tmp_path, monkeypatch, capsys):
    import kvspec.report

    def broken(*args, **kwargs):
        raise UnicodeEncodeError("ascii", "é", 0, 1, "ordinal not in range(128)")
    monkeypatch.setattr(kvspec.report, "print_counterexample", broken)
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "bmc", "--target", "mutant:cache_failed_block",
                            "--depth", "4", "--out", "b")
    assert code == 1, out + err
    assert err.strip() == ("kvspec: the counterexample could not be printed (UnicodeEncodeError); "
                           "trace saved: 'b/mutant_cache_failed_block.json'")


def test_a_finding_with_an_odd_id_as_a_real_process(tmp_path):
    path = _trace_with(tmp_path, action(0, id="[/]é"))
    proc = _subprocess("replay", str(path), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "add(id=[/]é, " in proc.stdout and proc.stderr == ""


# -- size: rejected fast, replayed in minutes -------------------------------------------

@pytest.mark.parametrize("change", [
    edit(verdict=[5] * 300_000),                                   # 300k errors, one reported
    action(1, eos=[f"x{i}" for i in range(100_000)] + [[1], 5]),   # unsortable: no O(n^2)
    action(1, eos=[[1]] + [f"x{i}" for i in range(300_000)]),
], ids=["300k-bad-verdicts", "bad-ids-after-100k", "bad-id-before-300k"])
def test_a_huge_malformed_trace_is_rejected_in_a_second(guarded, capsys, change):
    import time
    path = _trace_with(guarded, change)
    start = time.perf_counter()
    code, out, err = invoke(capsys, "replay", path)
    assert_one_line(code, out, err, "expected")
    assert time.perf_counter() - start < 3.0  # was 27 s and 3.5 GB for a million items


def test_replay_work_bounds_the_scheduler_calls(tmp_path):
    """``replay_work``'s call count is an upper bound: checked on every committed
    regression trace and on drains that run to their bound."""
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.trace import load_trace, replay_work
    traces = sorted((ROOT / "model_tests" / "regressions").glob("*.json"))
    slow = copy.deepcopy(BASE)
    slow.update(target="impl", verdict=[], steps=[])
    slow["config"].update(max_num_batched_tokens=1, num_blocks=12)
    slow["actions"] = [{"op": "add", "id": f"r{i}", "prompt": [i, 2, 3, 4, 5], "max_tokens": 6}
                       for i in range(3)] + [{"op": "drain"}, {"op": "step"}, {"op": "drain"}]
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    for path in [*traces, tmp_path / "slow.json"]:
        data = load_trace(path)
        _, calls, _ = replay_work(data["config"], data["actions"])
        assert len(replay_trace(path).steps) <= calls, path.name


def test_replay_progress_lines_when_not_on_a_terminal(tmp_path, monkeypatch, capsys):
    trace = copy.deepcopy(BASE)
    trace.update(target="impl", verdict=[], steps=[])
    trace["config"].update(num_blocks=1024, max_num_batched_tokens=1, max_model_len=400)
    trace["actions"] = [{"op": "add", "id": "r0", "prompt": [1] * 300, "max_tokens": 60},
                        {"op": "drain"}]
    # the heartbeat's clock replaced by two beats when the replay stops: the
    # lines and their wiring are checked, not how long a replay takes
    from kvspec.harness import replay as replay_module
    asked = []

    class BeatsAtStop(threading.Event):
        def __init__(self, beat) -> None:
            super().__init__()
            self.beat = beat

        def set(self) -> None:
            self.beat()
            self.beat()
            super().set()

    def periodic(beat, every):
        assert beat is not None, "no heartbeat off a terminal"
        asked.append(every)
        return BeatsAtStop(beat)
    monkeypatch.setattr(replay_module, "periodic", periodic)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, lambda t: t.update(trace)))
    assert code == 0, out + err
    assert asked == [cli.PROGRESS_EVERY]
    lines = err.splitlines()
    assert len(lines) == 2, err
    line = re.compile(r"kvspec: replaying \d+s: action [12]/2, \d+ steps")
    assert all(line.fullmatch(text) for text in lines), lines


# -- verdicts, vLLM that cannot be used, long messages -----------------------------------

def test_a_passing_replay_notes_a_recorded_failure_and_unknown_claims(tmp_path, monkeypatch,
                                                                       capsys):
    def passing(trace):
        trace.update(target="impl", verdict=[{"invariant": "no_such_claim", "message": "x"}])
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, passing))
    assert code == 0, out + err
    assert ("note: the recorded verdict names 'no_such_claim', which is no claim of this kvspec"
            in out)
    assert "passes: no invariant violated (verdict differs from the recording, which failed)" in out
    assert err == ""


def test_a_failing_replay_notes_unknown_claims_and_keeps_exit_1(tmp_path, monkeypatch, capsys):
    def renamed(trace):
        trace["verdict"] = [{"invariant": "old_name", "message": "m"}, *trace["verdict"]]
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, renamed))
    assert code == 1, out + err
    assert "names 'old_name', which is no claim" in out
    assert "still fails (verdict differs from the recording)" in out


def test_a_replay_of_a_trace_without_a_verdict_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(capsys, "replay", _trace_with(tmp_path, edit(verdict=None)))
    assert code == 1 and "still fails (the trace records no verdict)" in out, out + err


def _broken_vllm(monkeypatch):
    """vLLM found, but importing it fails (a torch it does not match)."""
    import importlib.util

    import kvspec.harness.vllm_target as vllm_target
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))

    def modules():
        try:
            raise ImportError("cannot import name 'X' from 'torch'")
        except ImportError as exc:
            raise RuntimeError(f"vLLM is not installed: {exc}") from exc
    monkeypatch.setattr(vllm_target, "modules", modules)


@pytest.mark.parametrize("args", [("check", "--target", "vllm", "--budget", "1s"),
                                  ("fuzz", "--target", "vllm", "--budget", "1s"),
                                  ("bmc", "--target", "vllm"), ("replay", FINDING)])
def test_vllm_that_cannot_be_imported_is_one_line_before_anything(guarded, monkeypatch, capsys,
                                                                  args):
    _broken_vllm(monkeypatch)
    code, out, err = invoke(capsys, *args)
    assert_one_line(code, out, err, "target 'vllm'")
    assert ("cannot be used: importing vLLM" in err
            and "failed: ImportError: cannot import name 'X' from 'torch'" in err)
    assert out == ""  # not even the banner


def test_vllm_that_cannot_be_imported_as_a_real_process(tmp_path):
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(  # vLLM's import-time chatter, then a failure
        "import sys\n"
        "print(\"Triton is installed, but doesn't include CPU backend.\", file=sys.stderr)\n"
        "print('INFO: chatter on stdout')\n"
        "raise ImportError('cannot import name X from torch')\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(tmp_path / "fake")}
    proc = subprocess.run([sys.executable, "-m", "kvspec", "check", "--target", "vllm",
                           "--budget", "1s"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert_one_line(proc.returncode, proc.stdout, proc.stderr,
                    "target 'vllm' cannot be used: importing vLLM")
    assert proc.stdout == "" and "Triton" not in proc.stderr


def test_a_target_that_refuses_the_config_is_cut_at_a_word(guarded, monkeypatch, capsys):
    import kvspec.harness.replay

    def refuses(*args, **kwargs):
        raise ValueError("1 validation error for ModelConfig " + "derived_max_model_len " * 30)
    monkeypatch.setattr(kvspec.harness.replay, "Runner", refuses)
    code, out, err = invoke(capsys, "replay", REGRESSION)
    assert_one_line(code, out, err, "cannot run this trace: 1 validation error for ModelConfig")
    assert err.rstrip().endswith("derived_max_model_len…"), err


# -- the counts the issue asks for -----------------------------------------------------

def test_the_table_has_at_least_150_cases():
    assert len(FILES) + len(TRACES) + len(ARGS) + len(PATH_CASES) >= 150


# -- beyond the table --------------------------------------------------------------------

def test_unwritable_out_is_rejected_before_the_run(tmp_path, monkeypatch, capsys):
    import kvspec.harness.fuzz
    calls = []
    monkeypatch.setattr(kvspec.harness.fuzz, "fuzz", lambda *a, **k: calls.append(a))
    monkeypatch.chdir(tmp_path)
    _file(tmp_path)
    code, out, err = invoke(capsys, "fuzz", "--target", "mutant:cache_failed_block",
                            "--budget", "30s", "--out", "a-file/failures")
    assert_one_line(code, out, err, "--out 'a-file/failures': cannot write there")
    assert calls == [] and out == ""  # not even the banner: nothing started


def test_trace_of_a_vllm_finding_without_vllm_is_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert_one_line(*invoke(capsys, "replay", FINDING), "needs vLLM installed")


def test_fuzzer_traces_are_group_readable(tmp_path):
    from kvspec.harness.fuzz import fuzz
    old = os.umask(0o022)
    try:
        result = fuzz("mutant:cache_failed_block", 20, 0, tmp_path)
    finally:
        os.umask(old)
    assert result.trace_path is not None
    mode = stat.S_IMODE(result.trace_path.stat().st_mode)
    assert mode == 0o644, oct(mode)
    assert not list(tmp_path.glob(".trace-*")), "a temporary file was left behind"


def test_progress_lines_when_not_on_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "PROGRESS_EVERY", 0.4)
    code, out, err = invoke(capsys, "check", "--budget", "2s")
    assert code == 0, out + err
    lines = [line for line in err.splitlines() if line.startswith("kvspec: fuzzing ")]
    assert len(lines) >= 2, err
    line = re.compile(r"kvspec: fuzzing \d+s/2s( \(finishing\))?: \d+ runs, \d+ actions, "
                      r"\d+\.\d actions/s")
    assert all(line.fullmatch(text) for text in lines), lines
    assert " actions/s)" in out  # the final summary has the rate too


def _subprocess(*args: str, cwd: Path, code: str | None = None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "kvspec"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


@pytest.mark.parametrize("args, needle", [
    (("check", "--budget", "0.0000001s"), "use at least 1s"),
    (("check", "--seed", "abc"), "--seed"),
    (("replay", "."), "is a directory"),
    (("bmc", "--max-states", "0"), "invalid --max-states 0"),
])
def test_as_a_real_process(tmp_path, args, needle):
    proc = _subprocess(*args, cwd=tmp_path)
    assert_one_line(proc.returncode, proc.stdout, proc.stderr, needle)
    assert not (tmp_path / ".hypothesis").exists()


def test_vllm_not_installed_as_a_real_process(tmp_path):
    hide_vllm = ("import importlib.util as u, sys; real = u.find_spec; "
                 "u.find_spec = lambda n, *a: None if n == 'vllm' else real(n, *a); "
                 "from kvspec.cli import run; sys.exit(run(sys.argv[1:]))")
    proc = _subprocess("replay", str(FINDING), cwd=tmp_path, code=hide_vllm)
    assert_one_line(proc.returncode, proc.stdout, proc.stderr, "needs vLLM installed")


# -- the Python API ----------------------------------------------------------------------

def _request(*args, **kwargs):
    from kvspec.impl import Request
    return Request(*args, **kwargs)


def _scheduler_config(**kwargs):
    from kvspec.impl import SchedulerConfig
    return SchedulerConfig(**kwargs)


def _config(**kwargs):
    from kvspec.harness.target import make_config
    return make_config(**kwargs)


@pytest.mark.parametrize("build, error, match", [
    (lambda: _request(None, [1], 2), TypeError, "request_id must be a str"),
    (lambda: _request(5, [1], 2), TypeError, "request_id must be a str"),
    (lambda: _request("a", ["x"], 2), TypeError, "prompt_token_ids must be integers"),
    (lambda: _request("a", [1.0], 2), TypeError, "prompt_token_ids must be integers"),
    (lambda: _request("a", [True], 2), TypeError, "prompt_token_ids must be integers"),
    (lambda: _request("a", "abc", 2), TypeError, "prompt_token_ids must be a list"),
    (lambda: _request("a", [-1], 2), ValueError, "prompt_token_ids must be >= 0"),
    (lambda: _request("a", [1], "5"), TypeError, "max_tokens must be an integer"),
    (lambda: _request("a", [1], None), TypeError, "max_tokens must be an integer"),
    (lambda: _request("a", [1], True), TypeError, "max_tokens must be an integer"),
    (lambda: _request("a", [1], 2, hash_block_size=0), ValueError, "hash_block_size"),
    (lambda: _scheduler_config(block_sizes=(0,)), ValueError, "block_sizes"),
    (lambda: _scheduler_config(block_sizes=()), ValueError, "block_sizes"),
    (lambda: _scheduler_config(block_sizes=(4, 2)), ValueError, "block sizes"),
    (lambda: _scheduler_config(num_blocks=True), TypeError, "num_blocks"),
    (lambda: _scheduler_config(max_model_len=0), ValueError, "max_model_len"),
    (lambda: _scheduler_config(long_prefill_token_threshold=-1), ValueError, "threshold"),
    (lambda: _config(block_size=0), ValueError, "block_size"),
    (lambda: _config(block_size=-2), ValueError, "block_size"),
    (lambda: _config(num_blocks=10 ** 9), ValueError, "num_blocks"),
    (lambda: _config(num_blocks=1e9), TypeError, "num_blocks"),
    (lambda: _config(max_num_seqs="4"), TypeError, "max_num_seqs"),
    (lambda: _config(policy="lifo"), ValueError, "policy"),
    (lambda: _config(max_model_len=1), ValueError, "max_model_len must be in 2..8192"),
    (lambda: _request("", [1], 2), ValueError, "request_id must not be empty"),
    (lambda: _scheduler(None), TypeError, "Scheduler needs a kvspec.impl.SchedulerConfig"),
    (lambda: _scheduler({"num_blocks": 8}), TypeError, "needs a kvspec.impl.SchedulerConfig"),
    (lambda: _scheduler(_config()), TypeError, "needs a kvspec.impl.SchedulerConfig, got Config"),
    (lambda: _scheduler_config(policy="FCFS"), ValueError,
     r"^policy must be one of 'fcfs', 'priority', got 'FCFS'$"),
    (lambda: _scheduler_config(kv_load_failure_policy="recomput"), ValueError,
     r"^kv_load_failure_policy must be one of 'recompute', 'fail', got 'recomput'$"),
    (lambda: _scheduler_config(num_blocks=10 ** 9), ValueError, "num_blocks must be <= 16384"),
    (lambda: _scheduler_config(max_num_seqs=10 ** 9), ValueError, "max_num_seqs must be <= 4096"),
    (lambda: _scheduler_config(max_model_len=10 ** 12), ValueError, "max_model_len must be <="),
    (lambda: _scheduler_config(max_model_len=1), ValueError, "max_model_len must be >= 2"),
    (lambda: _scheduler_config(block_sizes=(2 ** 40,)), ValueError, r"block_sizes must be .* 1\.\.1024"),
    (lambda: _scheduler_config(block_sizes=(4,) * 9), ValueError, "at most 8"),
    (lambda: _scheduler_config(num_blocks=16_384, block_sizes=(1024,)), ValueError,
     "KV token slots"),
])
def test_python_api_rejects_with_a_clear_error(build, error, match):
    with pytest.raises(error, match=match) as info:
        build()
    assert "\n" not in str(info.value)


def _scheduler(config):
    from kvspec.impl import Scheduler
    return Scheduler(config)


def _scheduler_with_a():
    from kvspec.impl import Request, Scheduler, SchedulerConfig
    s = Scheduler(SchedulerConfig(block_sizes=(8,), num_blocks=16, max_num_batched_tokens=64,
                                  max_model_len=64))
    s.add_request(Request("a", list(range(1, 18)), 2, hash_block_size=8))
    return s


def _state(s):
    return (list(s.requests), [r.request_id for r in s.waiting], [r.request_id for r in s.running],
            [b.ref_cnt for b in s.kv.pool.blocks])


@pytest.mark.parametrize("call, error, match", [
    (lambda s: s.add_request("a"), TypeError, "add_request needs a kvspec.impl.Request, got str"),
    (lambda s: s.add_request(None), TypeError, "add_request needs a kvspec.impl.Request"),
    (lambda s: s.add_request({"request_id": "b"}), TypeError, "needs a kvspec.impl.Request"),
    # hash_block_size left at its default (4) on a scheduler of block size 8: it would
    # share a's cached block 0 with different tokens
    (lambda s: s.add_request(_request("b", [1, 2, 3, 4, 90, 91, 92, 93, 5], 2)), ValueError,
     r"hash_block_size 4 differs from the scheduler's hash block size 8"),
    (lambda s: s.finish_requests("a", _status("RUNNING")), ValueError,
     "needs a FINISHED_\\* status, got RUNNING"),
    (lambda s: s.finish_requests("a", _status("WAITING")), ValueError, "got WAITING"),
    (lambda s: s.finish_requests("a", "FINISHED_ABORTED"), TypeError,
     "needs a RequestStatus, got 'FINISHED_ABORTED'"),
    (lambda s: s.finish_requests(None, _status("FINISHED_ABORTED")), TypeError,
     "needs a request id or an iterable of ids, got None"),
])
def test_scheduler_calls_reject_bad_arguments_and_change_nothing(call, error, match):
    s = _scheduler_with_a()
    s.schedule()
    before = _state(s)
    with pytest.raises(error, match=match):
        call(s)
    assert _state(s) == before


def _status(name):
    from kvspec.spec.state import RequestStatus
    return RequestStatus[name]


def test_finish_requests_checks_the_status_without_assert():
    """The check holds under ``python -O`` too (it is not an assert)."""
    code = ("from kvspec.impl import Request, Scheduler, SchedulerConfig\n"
            "from kvspec.spec.state import RequestStatus\n"
            "s = Scheduler(SchedulerConfig()); s.add_request(Request('a', [1, 2], 2))\n"
            "try:\n    s.finish_requests('a', RequestStatus.RUNNING)\n"
            "except ValueError as e:\n    print('rejected:', e)\n")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.startswith("rejected: finish_requests needs a FINISHED_* status"), proc


def test_matching_hash_block_size_shares_only_equal_blocks():
    from kvspec.impl import Request
    s = _scheduler_with_a()
    s.schedule()
    b = Request("b", [1, 2, 3, 4, 90, 91, 92, 93, 5], 2, hash_block_size=8)
    s.add_request(b)
    out = s.schedule()
    assert out.num_computed_before.get("b") == 0  # a's block 0 holds other tokens


def test_add_request_type_errors_leave_the_scheduler_unchanged():
    from kvspec.impl import Request, Scheduler, SchedulerConfig
    s = Scheduler(SchedulerConfig(block_sizes=(4,), num_blocks=8, max_model_len=16))
    s.add_request(Request("a", [1, 2, 3], 2))
    before = (list(s.requests), len(s.waiting))
    for args in ((None, [1], 2), ("b", ["x"], 2), ("b", [1], "5")):
        with pytest.raises(TypeError):
            s.add_request(Request(*args))
    assert (list(s.requests), len(s.waiting)) == before
