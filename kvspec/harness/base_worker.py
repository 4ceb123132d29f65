"""A second process that replays traces on another vLLM source: a review's base.

Two vLLM sources never share a process (each is the ``vllm`` package), so
``kvspec review`` checks its head in-process and asks this worker, which
imported the base once, whether each counterexample also fails there. The
worker starts importing as soon as it is spawned, beside the head's import.

Protocol: one JSON object per line on the worker's stdin and stdout.
Requests ``{"op": "replay", "target", "config", "actions", "lost", "id"}`` and
``{"op": "describe", "target", "id"}``; each answer carries its request's
``id``, so that the late answer to a request the parent stopped waiting for
is never read as the answer to the next one. The first line the worker
writes is ``{"ready": true, ...}`` (or ``{"ready": false, "error": ...}``).
vLLM's own output goes to the worker's stderr, never into the protocol.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from kvspec.harness.known import Outcome, fixes_target

#: how long the base may take to import vLLM and answer its first line
START_TIMEOUT = 600.0


class BaseWorkerError(RuntimeError):
    """The base process could not start or answer."""


class BaseWorker:
    """The parent's side: spawn, wait until ready, replay."""

    def __init__(self, given: str, log_path=None) -> None:
        from kvspec.harness.vllm_source import SOURCE_ENV
        self.given = given
        self.label = given
        self.info: dict = {}
        env = dict(os.environ, **{SOURCE_ENV: given})
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvspec.harness.base_worker"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self._lock = threading.Lock()
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._ready = False
        self._asked = 0  # the id of the last request
        self.started = time.monotonic()
        self.import_seconds: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict:
        if self._ready:
            return self.info
        line = self._read_line(timeout)
        answer = json.loads(line)
        if not answer.get("ready"):
            raise BaseWorkerError(f"the base {self.given!r} cannot be used: "
                                  f"{answer.get('error', 'no reason given')}")
        self.info, self._ready = answer, True
        self.label = answer.get("label", self.given)
        self.import_seconds = answer.get("import_s")
        return self.info

    def _pump(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of output: the process is gone

    def _read_line(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line:
            code = self._proc.poll()
            state = f"exited with {code}" if code is not None else "did not answer in time"
            raise BaseWorkerError(f"the base process {state} (source {self.given!r})")
        return line

    def _ask(self, request: dict, timeout: float = 600.0) -> dict:
        """The worker's answer to ``request``; answers to earlier requests that
        timed out here (still arriving) are passed over."""
        self.wait_ready()
        with self._lock:
            self._asked += 1
            asked = self._asked
            try:
                self._proc.stdin.write(json.dumps(dict(request, id=asked)) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise BaseWorkerError(f"the base process is gone ({exc})") from None
            deadline = time.monotonic() + timeout
            while True:
                answer = json.loads(self._read_line(max(0.0, deadline - time.monotonic())))
                if answer.get("id") == asked:
                    return answer

    def target_for(self, applied) -> str:
        """The base target with the fixes the head run applied."""
        return fixes_target(applied)

    def replay(self, target: str, config, actions: list[dict], lost: bool = False) -> Outcome:
        """``lost``: see :func:`kvspec.harness.known.replay`."""
        from kvspec.harness.trace import config_to_dict
        answer = self._ask({"op": "replay", "target": target, "config": config_to_dict(config),
                            "actions": actions, "lost": lost})
        return Outcome(tuple(tuple(v) for v in answer.get("violations", ())), answer.get("error"),
                       answer.get("step"), answer.get("row"))

    def describe(self, target: str) -> dict:
        return self._ask({"op": "describe", "target": target})

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


# -- the worker's side ------------------------------------------------------------------

def _serve() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything vLLM prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    start = time.monotonic()
    try:
        from kvspec.harness.vllm_source import active
        from kvspec.harness.vllm_target import modules
        source = active()
        modules()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    out.write(json.dumps({"ready": True, "label": source.label(), "source": source.as_dict(),
                          "import_s": round(time.monotonic() - start, 2)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        asked = None
        try:
            request = json.loads(line)
            asked = request.get("id")
            answer = _handle(request)
        except Exception as exc:  # noqa: BLE001
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(dict(answer, id=asked)) + "\n")
    return 0


def _handle(request: dict) -> dict:
    from kvspec.harness.known import replay
    from kvspec.harness.trace import config_from_dict
    if request["op"] == "replay":
        got = replay(request["target"], config_from_dict(request["config"]), request["actions"],
                     lost=bool(request.get("lost")))
        return {"violations": [list(v) for v in got.violations], "error": got.error,
                "step": got.step, "row": got.row}
    if request["op"] == "describe":
        from kvspec.harness.targets import parse_vllm_target
        from kvspec.harness.vllm_patches import patched
        built = patched(*parse_vllm_target(request["target"]))
        return {"applied": list(built.applied), "skipped": built.skipped,
                "drift": built.drift}
    return {"error": f"unknown op {request['op']!r}"}


if __name__ == "__main__":
    sys.exit(_serve())
