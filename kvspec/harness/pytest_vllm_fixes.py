"""A pytest plugin that runs vLLM tests with kvspec's fixes installed.

Load it with ``pytest -p kvspec.harness.pytest_vllm_fixes``. In ``pytest_configure``
(before any test module is imported) it builds the fixed modules
(:func:`kvspec.harness.vllm_patches.patched`) and installs every member a fix
changed into vLLM's own classes (``kvspec/harness/in_place.py``): the installed
``Scheduler``, ``KVCacheManager`` and coordinators carry the fixes, so
``AsyncScheduler``, vLLM's other subclasses, a test's own subclass and an
``isinstance`` on any of them all see them. The fixes are read from
``KVSPEC_VLLM_FIXES``: "all" (the default), "none", or fix ids joined by
commas. Used by ``scripts/packets.py test`` on the finding packets' vLLM-style
tests (docs/findings/packets/), and by ``scripts/calibrate_vllm_tests.py --fixes``
on vLLM's own tests.
"""
from __future__ import annotations

import os

ENV_VAR = "KVSPEC_VLLM_FIXES"


def pytest_configure(config) -> None:
    from kvspec.harness.in_place import InPlace
    from kvspec.harness.vllm_patches import patched

    fixes = os.environ.get(ENV_VAR, "all").strip() or "all"
    built = patched(fixes, connectors=True)  # vLLM's tests build connectors too
    plan = InPlace.of(built.modules)
    plan.install()  # for the whole session: nothing else in it wants vLLM unfixed
    config._kvspec_vllm_fixes = (fixes, built.applied, built.skipped, plan.get_names())


def pytest_report_header(config) -> list[str]:
    fixes, applied, skipped, members = getattr(config, "_kvspec_vllm_fixes",
                                                ("?", (), {}, []))
    lines = [f"kvspec vLLM fixes ({ENV_VAR}={fixes}): applied {', '.join(applied) or 'none'}",
             f"kvspec vLLM fixes: {len(members)} members of vLLM's classes replaced in place"]
    lines += [f"kvspec fix not applied: {pid}: {why}" for pid, why in skipped.items()]
    return lines
