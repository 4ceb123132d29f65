"""Target names -> constructors. ``impl`` is the default; ``mutant:<name>``
puts one historical bug back into the reference implementation."""
from __future__ import annotations

from kvspec.spec.state import Config


class UnknownTarget(ValueError):
    pass


def available_targets() -> dict[str, str]:
    from kvspec.impl.alternatives import ALTERNATIVES
    from kvspec.impl.mutants import MUTANTS
    names = {"impl": "the reference implementation (kvspec-reference)"}
    for name, mutant in MUTANTS.items():
        names[f"mutant:{name}"] = mutant.description
    for name, alt in ALTERNATIVES.items():
        names[f"alt:{name}"] = f"a correct alternative design: {alt.description}"
    names["vllm"] = "the installed vLLM's v1 Scheduler, in-process on the CPU (needs vllm)"
    return names


def make_target(name: str, config: Config, connector):
    from kvspec.harness.target import ImplTarget
    from kvspec.impl.mutants import MUTANTS
    if name == "impl":
        return ImplTarget(config, connector)
    if name.startswith("mutant:") and name[len("mutant:"):] in MUTANTS:
        mutant = MUTANTS[name[len("mutant:"):]]
        target = ImplTarget(config, connector, scheduler_factory=mutant.scheduler_class())
        target.name = name
        return target
    if name.startswith("alt:"):
        from kvspec.impl.alternatives import ALTERNATIVES
        alt = ALTERNATIVES.get(name[len("alt:"):])
        if alt is not None:
            target = ImplTarget(config, connector, scheduler_factory=alt.cls)
            target.name = name
            return target
    if name == "vllm":
        from kvspec.harness.vllm_target import VllmTarget  # imports vLLM: only when asked
        return VllmTarget(config, connector)
    raise UnknownTarget(f"unknown target {name!r}; known: {', '.join(available_targets())}")
