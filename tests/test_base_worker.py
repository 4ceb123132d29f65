"""The review's base process (kvspec/harness/base_worker.py): an answer that
arrives after its request timed out is never taken for the next request's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.harness.base_worker import BaseWorker
from kvspec.harness.trace import config_from_dict

pytest.importorskip("vllm", reason="the base process replays on an installed vLLM")

FINDING = (Path(__file__).resolve().parents[1] / "docs" / "findings"
           / "vllm-0.32.0-forced-reset-raises-under-deferred-frees.json")


def test_a_late_answer_is_not_read_as_the_next_requests():
    data = json.loads(FINDING.read_text())
    config, actions = config_from_dict(data["config"]), data["actions"]
    worker = BaseWorker("installed")
    try:
        worker.wait_ready()
        if worker.info.get("source", {}).get("version") != "0.32.0":
            pytest.skip(f"the finding's trace fails on vLLM 0.32.0; installed: {worker.label}")
        # a request the parent gave up waiting for (as ``_ask`` sends it before it
        # times out): written, its answer left unread
        worker._asked += 1
        gave_up = {"op": "replay", "target": "vllm?fixes=all", "config": data["config"],
                   "actions": actions, "id": worker._asked}
        worker._proc.stdin.write(json.dumps(gave_up) + "\n")
        worker._proc.stdin.flush()
        # its late answer (the fixed scheduler passes) arrives while this one is
        # asked: this one, on the release as shipped, still fails as recorded
        got = worker.replay("vllm?fixes=none", config, actions)
        assert got.error is None and got.violations, got
        assert {c for c, _ in got.violations} >= {v["invariant"] for v in data["verdict"]}
        # and the one after it gets its own answer too
        assert not worker.replay("vllm?fixes=all", config, actions).violations
    finally:
        worker.close()
