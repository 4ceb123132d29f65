"""kvspec.impl: the reference implementation of vLLM's v1 scheduler KV path.

It is written from the semantics of vLLM's scheduler, with the fixes of
#34616 (async-load num_computed_tokens) and #36859/#37460 (stats set once)
applied. It does not know the spec exists: targets observe it from outside.
"""
from kvspec.impl.config import SchedulerConfig
from kvspec.impl.request import Request
from kvspec.impl.scheduler import Scheduler

__all__ = ["Request", "Scheduler", "SchedulerConfig"]
