"""A pytest plugin that runs vLLM tests against kvspec's fixed ``Scheduler``.

Load it with ``pytest -p kvspec.harness.pytest_vllm_fixes``. In ``pytest_configure``
(before any test module is imported) it replaces ``Scheduler`` in the imported module
``vllm.v1.core.sched.scheduler`` with the class patched by kvspec's fixes
(:func:`kvspec.harness.vllm_patches.patched`), so a test's module-level
``from vllm.v1.core.sched.scheduler import Scheduler`` gets the fixed class. That class
builds the patched ``KVCacheManager`` and KV cache coordinator where a fix changes them
(``vllm_patches.DEPENDENT_MODULES``); a test importing those classes itself gets the
installed ones. The fixes are read from ``KVSPEC_VLLM_FIXES``: "all" (the default),
"none", or fix ids joined by commas. Used by tests/test_reproducers.py on
docs/findings/reproducers/.
"""
from __future__ import annotations

import os

ENV_VAR = "KVSPEC_VLLM_FIXES"


def pytest_configure(config) -> None:
    import vllm.v1.core.sched.scheduler as scheduler_module

    from kvspec.harness.vllm_patches import patched

    fixes = os.environ.get(ENV_VAR, "all").strip() or "all"
    built = patched(fixes)
    scheduler_module.Scheduler = built.get("vllm.v1.core.sched.scheduler", "Scheduler")
    config._kvspec_vllm_fixes = (fixes, built.applied, built.skipped)


def pytest_report_header(config) -> list[str]:
    fixes, applied, skipped = getattr(config, "_kvspec_vllm_fixes", ("?", (), {}))
    lines = [f"kvspec vLLM fixes ({ENV_VAR}={fixes}): applied {', '.join(applied) or 'none'}"]
    lines += [f"kvspec fix not applied: {pid}: {why}" for pid, why in skipped.items()]
    return lines
