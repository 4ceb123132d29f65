"""Random runs of a kvspec state machine for the tests that judge what the
harness does along them (observations, books, the worker model): one seed,
no deadline, no example database, no health check."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test


def run_machine(machine, seed: int, examples: int, steps: int, **more) -> None:
    """``examples`` runs of up to ``steps`` steps of ``machine`` from ``seed``
    (``more``: other Hypothesis settings, such as ``phases``)."""
    machine._hypothesis_internal_use_seed = seed
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), **more))
