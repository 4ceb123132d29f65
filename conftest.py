"""Shared by tests/ and model_tests/: the suite runs in pytest-xdist workers
(pyproject's addopts), one per core, so each worker keeps torch to one thread
instead of every worker starting a pool the size of the machine."""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
