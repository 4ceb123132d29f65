"""The garbage collector's first threshold in a kvspec process.

A checked step allocates thousands of short-lived tuples, lists and views
(observations, scopes, the data oracle's runs), nearly all of them acyclic and
freed by reference counting alone. At CPython's default first-generation
threshold (700 container allocations) the collector walks the young objects
several times per step and promotes the survivors into generations whose walks
span the whole heap: 11% of a production-sized checked step on this project's
2-core machine (bench/README.md, "fifth step"). At 20,000 the collector still
runs (Hypothesis, attrs and the scheduler make some cycles), a few times per
production step instead of dozens.

Set by the ``kvspec`` command (and its fuzz workers) and by ``bench/`` for the
bare and the checked runs alike; a library user's process is left as it is."""
from __future__ import annotations

import gc

#: container allocations between two collections of the youngest generation
GEN0_THRESHOLD = 20_000


def tune_collector() -> None:
    """Raise the first threshold to ``GEN0_THRESHOLD`` (never lower it)."""
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GEN0_THRESHOLD), gen1, gen2)


def describe_collector() -> dict:
    return {"gc_threshold": list(gc.get_threshold())}
