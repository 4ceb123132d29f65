"""kvspec's state machines as Hypothesis tests, for HypoFuzz (docs/ci/README.md):

    pip install hypofuzz==25.11.1 hypothesis==6.148.0
    hypothesis fuzz --no-dashboard -n "$(nproc)" -- docs/ci/hypofuzz/

(HypoFuzz 25.11.1 crashes recording a failure under newer Hypothesis releases,
``AttributeError: 'ConjectureResult' object has no attribute 'slice_comments'``
with 6.170; 6.148.0 works.)
HypoFuzz runs every test here on every core for as long as it is left running,
keeps what it finds in Hypothesis' example database (.hypothesis/ by default; set
HYPOTHESIS_DATABASE_FILE or a profile to share one) and reports each failure once,
with the program that reproduces it. Each test is one target: the reference
implementation, and vLLM's scheduler when vLLM is installed (its known findings, as
``kvspec fuzz`` recognises them, end a run without failing it). A failure here is a
Hypothesis failure (the machine raised on a violated claim), not a kvspec trace:
run `kvspec fuzz` on the same target to get the trace and the step table.
"""
import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

from kvspec.harness.fuzz import is_efficiency_only
from kvspec.harness.machine import machine_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# as kvspec fuzz runs them; max_examples only matters to a plain pytest run of this
# file (HypoFuzz runs until it is stopped)
SETTINGS = settings(deadline=None, stateful_step_count=30,
                    max_examples=int(os.environ.get("KVSPEC_HYPOFUZZ_EXAMPLES", "100")),
                    suppress_health_check=list(HealthCheck))



def skip_known_findings(target: str):
    """What ``kvspec fuzz`` does with a counterexample a known finding of this
    vLLM explains (docs/findings/), or that breaks only an efficiency claim (lost
    performance, reported apart): not a failure; the run stops there."""
    from kvspec.harness.fuzz import is_efficiency_only
    from kvspec.harness.known import build_recogniser
    recogniser, _ = build_recogniser(target)

    def on_counterexample(exc) -> bool:
        if is_efficiency_only(exc):
            return True
        if recogniser is None or not recogniser.is_active:
            return False
        r = exc.runner
        return recogniser.explain(r.config, list(r.actions), exc.violations) is not None
    return on_counterexample


def get_machine(target: str, **kwargs):
    """The machine ``kvspec fuzz --target TARGET`` runs: the environment the
    target maps (its profile), all of kvspec's claims."""
    from kvspec.cli import drawn_profile
    return machine_for(target, profile=drawn_profile(target, None, "symbolic", quiet=True),
                       **kwargs)


TestReference = get_machine("impl", on_counterexample=lambda exc: is_efficiency_only(exc)).TestCase
TestReference.settings = SETTINGS

if importlib.util.find_spec("vllm") is not None:
    TestVllm = get_machine("vllm", on_counterexample=skip_known_findings("vllm")).TestCase
    TestVllm.settings = SETTINGS
else:
    def test_vllm_scheduler():
        pytest.skip("vLLM is not installed (pip install \"kvspec[vllm]\"): only the "
                    "reference implementation is fuzzed")
