"""Target names -> constructors. ``impl`` is the default; ``mutant:<name>``
puts one historical bug back into the reference implementation."""
from __future__ import annotations

from kvspec.spec.state import Config


class TargetCannotMap(ValueError):
    """A trace asks a target for something it does not map (not a finding of the
    target: the trace cannot be replayed there)."""


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
    names["vllm"] = ("the installed vLLM's v1 Scheduler, in-process on the CPU, with every "
                     "accepted finding's fix that fits it (needs vllm); vllm?fixes=none: as "
                     "released; vllm?fixes=ID,...&plant=ID,...: chosen fixes and planted bugs")
    return names


def parse_vllm_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``vllm``, ``vllm?fixes=none``, ``vllm?fixes=a,b&plant=c`` -> (fixes, planted
    bugs); None for another target. ValueError for a malformed one."""
    base, _, query = name.partition("?")
    if base != "vllm":
        return None
    options = {"fixes": "all", "plant": "", "connector": "", "connector_config": ""}
    given: set[str] = set()
    for part in filter(None, query.split("&")):
        key, sep, value = part.partition("=")
        if not sep or key not in options:
            raise ValueError(f"target {name!r}: unknown option {part!r} (fixes=..., plant=..., "
                             "connector=..., connector_config=...)")
        if key in given:
            raise ValueError(f"target {name!r}: {key}= given twice")
        given.add(key)
        options[key] = value
    planted = tuple(p for p in options["plant"].split(",") if p)
    from kvspec.harness.vllm_patches import select
    select(options["fixes"], planted)  # ValueError on an unknown id
    return options["fixes"], planted


def parse_connector_choice(name: str):
    """The real connector a vllm target name asks for (``connector=``), or None.
    ValueError (``ConnectorChoiceError``) for a malformed one."""
    base, _, query = name.partition("?")
    if base != "vllm":
        return None
    fields = dict(part.partition("=")[::2] for part in filter(None, query.split("&")))
    if not fields.get("connector"):
        if fields.get("connector_config"):
            raise ValueError(f"target {name!r}: connector_config without connector")
        return None
    from kvspec.harness.connector_worlds import parse_choice
    return parse_choice(fields["connector"], fields.get("connector_config", ""))


def with_connector(name: str, like: str) -> str:
    """``name`` (a vllm target) with the connector ``like`` runs, if any: a
    replay that explains a counterexample must face the same connector."""
    choice = parse_connector_choice(like)
    if choice is None or parse_connector_choice(name) is not None:
        return name
    return name + ("&" if "?" in name else "?") + choice.to_query()


def vllm_target_name(fixes: str = "all", planted: tuple[str, ...] = (), choice=None) -> str:
    """The target name for a choice of fixes, planted bugs and connector."""
    parts = [] if fixes == "all" else [f"fixes={fixes}"]
    if planted:
        parts.append("plant=" + ",".join(planted))
    if choice is not None:
        parts.append(choice.to_query())
    return "vllm" + ("?" + "&".join(parts) if parts else "")


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
    try:
        vllm_options = parse_vllm_target(name)
        choice = parse_connector_choice(name)
    except ValueError as exc:
        raise UnknownTarget(str(exc)) from None
    if vllm_options is not None:
        from kvspec.harness.vllm_target import VllmTarget  # imports vLLM: only when asked
        target = VllmTarget(config, connector, *vllm_options, choice=choice)
        target.name = name
        return target
    raise UnknownTarget(f"unknown target {name!r}; known: {', '.join(available_targets())}")
