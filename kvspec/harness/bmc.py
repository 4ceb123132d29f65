"""Bounded model checking, explicit-state: breadth-first search over every
sequence of actions from a small alphabet, up to depth k, on a small
configuration, checking the whole spec after every action. States already
seen (same observation, same environment state) are not expanded twice.
Breadth-first means the first counterexample found is a shortest one.

The alphabet covers the KV paths: two requests sharing a prefix, one loading
asynchronously and one synchronously, an offloading one; steps that finish
loads and sends, with and without load failures; an abort.
"""
from __future__ import annotations

import copy
import time
from collections import deque

import attrs

from kvspec.harness.runner import Counterexample, Runner
from kvspec.harness.target import make_config

SHARED = [1, 2, 3, 4, 5, 6]

ALPHABET: tuple[dict, ...] = (
    {"op": "add", "id": "r0", "prompt": SHARED + [7], "max_tokens": 2, "ext": 5, "async": True},
    {"op": "add", "id": "r1", "prompt": SHARED + [8, 9], "max_tokens": 2, "ext": 4, "send": True},
    {"op": "add", "id": "r2", "prompt": [11, 12, 13], "max_tokens": 3, "priority": 1,
     "offload": True},
    {"op": "step"},
    {"op": "step", "finish_loads": ["r0"], "finish_sends": ["r1"]},
    {"op": "step", "fail_all": True},
    {"op": "step", "finish_loads": ["r0"], "fail_all": True, "fail_offset": 1},
    {"op": "abort", "id": "r0"},
)


def bmc_config(policy: str = "priority"):
    return make_config(block_size=2, num_blocks=7, max_num_batched_tokens=8, max_num_seqs=2,
                       max_model_len=12, policy=policy)


@attrs.define
class BmcResult:
    target: str
    depth: int
    states: int
    seconds: float
    counterexample: Counterexample | None = None
    exhausted: bool = True   # False when the state budget cut the search


def _fingerprint(runner: Runner):
    obs = runner.obs
    return (repr(sorted(obs.requests.items())), obs.waiting, obs.running, obs.pool.ref_cnt,
            obs.pool.free_queue, tuple(sorted(runner.content.loads)),
            tuple(sorted(runner.content.sends)), repr(runner.content.slots))


def _usable(action: dict, runner: Runner, added: set[str]) -> bool:
    if action["op"] == "add":
        return action["id"] not in added
    if action["op"] == "abort":
        return action["id"] in runner.obs.requests
    return bool(added)


def bmc(target: str, depth: int = 7, max_states: int = 200_000, config=None,
        drain: bool = True) -> BmcResult:
    start = time.perf_counter()
    root = Runner(target, config or bmc_config())
    frontier = deque([(root, frozenset())])
    seen = {_fingerprint(root)}
    states = 1
    for _ in range(depth):
        next_frontier = deque()
        while frontier:
            runner, added = frontier.popleft()
            for action in ALPHABET:
                if not _usable(action, runner, added):
                    continue
                child = copy.deepcopy(runner)
                try:
                    child.apply(dict(action))
                    if drain:  # every prefix must also heal: progress and no leak
                        healed = copy.deepcopy(child)
                        healed.apply({"op": "drain"})
                except Counterexample as exc:
                    return BmcResult(target, depth, states, time.perf_counter() - start, exc)
                key = _fingerprint(child)
                if key in seen:
                    continue
                seen.add(key)
                states += 1
                if states >= max_states:
                    return BmcResult(target, depth, states, time.perf_counter() - start,
                                     exhausted=False)
                added_now = added | {action["id"]} if action["op"] == "add" else added
                next_frontier.append((child, added_now))
        frontier = next_frontier
    return BmcResult(target, depth, states, time.perf_counter() - start)
