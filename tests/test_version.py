"""``kvspec --version`` (issue 28, item 6)."""
from __future__ import annotations

import subprocess
import sys


def test_version_is_one_line_and_exit_0():
    """``kvspec --version`` (issue 28, item 6): kvspec's, Python's and vLLM's."""
    out = subprocess.run([sys.executable, "-m", "kvspec.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    line, = out.stdout.strip().splitlines()
    assert line.startswith("kvspec ") and "Python 3." in line and "vLLM: " in line
