"""kvspec's command line in a subprocess, for the tests that judge what a user
sees: exit codes, stderr lines, ``--json`` summaries, files left behind. The
checkout under test comes first on the path, wherever the test runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def run_kvspec(cwd: Path, *args: str, timeout: int = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """``kvspec ARGS`` run in ``cwd`` (made if missing), in ``env`` (default: this
    process's environment, offline, the checkout on the path)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env=ENV if env is None else env)
