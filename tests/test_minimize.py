"""The trace-level minimizer: smaller, still failing the same claim, replayable."""
import json
from pathlib import Path

from kvspec.harness.minimize import minimize, replay_actions
from kvspec.harness.trace import load_trace, save_trace

REGRESSION = Path(__file__).parents[1] / "model_tests" / "regressions" / "cache_failed_block.json"
TARGET = "mutant:cache_failed_block"


def padded_failure():
    data = load_trace(REGRESSION)
    noise = [{"op": "add", "id": "x0", "prompt": [50, 51, 52, 53], "max_tokens": 1,
              "priority": 1},
             {"op": "step", "eos": ["x0"], "drafts": 2, "accept": 1},
             {"op": "reset_prefix_cache"}]
    failure = replay_actions(TARGET, data["config"], noise + data["actions"])
    assert failure is not None
    return data, failure


def test_minimized_trace_is_smaller_and_fails_the_same_claim():
    data, failure = padded_failure()
    smaller = minimize(TARGET, failure)
    claim = data["verdict"][0]["invariant"]
    assert claim in {v.invariant for v in smaller.violations}
    assert len(smaller.runner.log) < len(failure.runner.log)
    assert not any(a["id"].startswith("x") for a in smaller.runner.actions if a["op"] == "add")


def test_minimized_trace_replays_identically(tmp_path):
    _, failure = padded_failure()
    smaller = minimize(TARGET, failure)
    r = smaller.runner
    path = save_trace(tmp_path / "t.json", target=TARGET, config=r.config,
                      actions=list(r.actions), violations=smaller.violations, steps=r.log)
    again = replay_actions(TARGET, load_trace(path)["config"], json.loads(path.read_text())["actions"])
    assert [(v.invariant, v.message) for v in again.violations] == \
        [(v.invariant, v.message) for v in smaller.violations]


def test_nothing_smaller_keeps_the_original():
    data = load_trace(REGRESSION)
    failure = replay_actions(TARGET, data["config"], data["actions"])
    smaller = minimize(TARGET, failure)
    assert len(smaller.runner.log) <= len(failure.runner.log)
    assert {v.invariant for v in smaller.violations} & {v.invariant for v in failure.violations}


def test_long_noise_goes_in_runs_not_one_replay_per_action(monkeypatch):
    """Forty actions of noise (aborts of a request long gone, prefix-cache
    resets: what a budget-cut shrink left an audit's traces) go in chunks:
    far fewer replays than one per action and restart."""
    import kvspec.harness.minimize as m
    data = load_trace(REGRESSION)
    noise = [{"op": "add", "id": "x0", "prompt": [50, 51], "max_tokens": 1},
             {"op": "abort", "id": "x0"}]
    noise += [{"op": "abort", "id": "x0"}, {"op": "reset_prefix_cache"}] * 20
    failure = replay_actions(TARGET, data["config"], noise + data["actions"])
    assert failure is not None
    replays = []
    real = m.replay_actions
    monkeypatch.setattr(m, "replay_actions", lambda *a, **k: replays.append(1) or real(*a, **k))
    smaller = minimize(TARGET, failure, time_limit=120)
    assert not any(a.get("id", "").startswith("x") for a in smaller.runner.actions)
    assert len(smaller.runner.actions) <= len(data["actions"])
    assert len(replays) < 40, len(replays)  # 17 here; one action at a time took 132


def test_arguments_that_change_nothing_are_dropped():
    """A step naming a request in ``finish_sends`` and ``finish_loads`` that
    has no send or async load to act on (legal no-ops the fuzzer makes): the step table
    is as long without them, and they go all the same, so a shrunk trace
    says only what the failure needs."""
    data = load_trace(REGRESSION)
    noisy = list(data["actions"])
    noisy[-1] = {**noisy[-1], "finish_sends": ["r0"], "finish_loads": ["r0"]}
    failure = replay_actions(TARGET, data["config"], noisy)
    assert failure is not None
    smaller = minimize(TARGET, failure)
    step = [a for a in smaller.runner.actions if a["op"] == "step"][-1]
    assert not step.get("finish_sends") and not step.get("finish_loads"), step
    claim = data["verdict"][0]["invariant"]
    assert claim in {v.invariant for v in smaller.violations}
