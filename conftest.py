"""Shared by tests/ and model_tests/: the suite runs in pytest-xdist workers
(pyproject's addopts), one per core, so each worker keeps torch to one thread
instead of every worker starting a pool the size of the machine.

The longest detection tests (each a fuzzing campaign of 30 s to 70 s on 2 cores,
measured 2026-11-26) are marked ``slow``: the README's test command leaves them out
(``-m "not slow"`` in pyproject's addopts, reported as deselected) to keep the suite
under 15 minutes on 2 cores, and ``pytest -m slow`` runs them; ``.ci/run`` runs both.
"""
import os

import pytest

SLOW = {
    "tests/test_vllm.py::test_planted_bug_is_caught_by_the_default_check[finished-load-caches-whole-prompt]",
    "tests/test_vllm.py::test_planted_bug_is_caught_by_the_default_check[sharer-resumes-without-waiting]",
    "tests/test_vllm.py::test_planted_bug_is_caught_by_the_default_check[async-load-never-started]",
    "tests/test_vllm.py::test_planted_bug_is_caught_by_the_default_check"
    "[prefill-stats-reset-after-preemption]",
    "tests/test_vllm.py::test_default_check_finds_no_new_finding",
    "tests/test_review_vllm.py::test_review_reports_a_regression_that_passes_on_the_base",
    "tests/test_review_vllm.py::test_review_passes_the_refactor_and_saw_it_run"
    "[01-refactor-one-clip-for-running-chunk]",
    "tests/test_review_vllm.py::test_a_review_cut_short_is_no_pass"
    "[01-refactor-one-clip-for-running-chunk]",
    "tests/test_claims.py::test_alternative_designs_pass_every_safety_claim[conservative_recovery]",
    "tests/test_claims.py::test_alternative_designs_pass_every_safety_claim[largest_victim]",
    "tests/test_independent_checkers.py::test_a_bug_inside_a_formerly_shared_helper_is_caught"
    "[window-read-starts-one-late]",
    *(f"model_tests/test_model.py::test_mutant_is_caught_with_a_short_replayable_trace[{m}]"
      for m in ("hybrid_full_prompt_hit_window_freed", "hybrid_hit_ignores_window",
                "stale_output_delivered", "preempt_keeps_blocks", "free_under_step_in_flight",
                "async_load_counted_short")),
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
