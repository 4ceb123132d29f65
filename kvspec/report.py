"""Readable reports: the step table of a counterexample and the per-invariant summary."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvspec.harness.incremental import get_full_every
from kvspec.harness.kv_modes import KV_CLAIM
from kvspec.spec.catalogue import REGISTRY
from kvspec.text import command_arg, printable

# Request ids, messages that quote them and paths come from the user: they are shown
# as Text (never parsed as rich markup) and made printable first.


def config_line(config) -> str:
    """A run's configuration in one line, as a reader of a counterexample needs it."""
    mixed = config.has_mixed_block_sizes
    groups = ", ".join(g.kind + (f" (window {g.sliding_window})" if g.sliding_window else "")
                       + (f" in blocks of {g.block_size}" if mixed else "")
                       for g in config.groups)
    sizes = (f"hash block {config.hash_block_size}, hits per {config.scheduler_block_size} "
             "tokens" if mixed else f"block size {config.block_size}")
    return (f"{sizes}, {config.num_blocks} blocks, groups: {groups}; "
            f"token budget {config.max_num_batched_tokens}, max_num_seqs "
            f"{config.max_num_seqs}, max_model_len {config.max_model_len}, long-prefill "
            f"threshold {config.long_prefill_token_threshold}; {config.policy} policy; load "
            f"failure policy \"{config.kv_load_failure_policy}\"; "
            f"{'async' if config.async_scheduling else 'sync'} scheduling"
            + (f" with {config.num_speculative_tokens} draft tokens"
               if config.num_speculative_tokens else "") + f"; connector role {config.kv_role}")


def step_table(steps, violations) -> Table:
    """The steps of a counterexample; a run stops at the first step that breaks
    a claim, so with violations the last row is where they were seen (marked)."""
    table = Table(title="counterexample", show_lines=False)
    table.add_column("step", justify="right")
    table.add_column("action")
    table.add_column("requests after it (status c=computed/tokens hit=cached/external b=blocks)")
    steps = list(steps)
    for i, j in get_runs_of_same_rows(steps):
        s = steps[i]
        failing = bool(violations) and i == len(steps) - 1
        table.add_row(Text(f"{s.index} *", style="bold red") if failing else str(s.index),
                      Text(printable(s.action)),
                      Text(printable(s.requests).replace(" r", "\nr")))
        if j > i:  # a drain's steps that changed nothing shown: one row for them
            table.add_row(Text("..."), Text(f"{j - i} more rows like step {s.index} (steps "
                                            f"{steps[i + 1].index}-{steps[j].index})",
                                            style="dim"), Text(""))
    return table


def get_runs_of_same_rows(steps) -> list[tuple[int, int]]:
    """(first, last) index of each run of consecutive rows with the same action
    and requests; the last row, where claims broke, is never folded."""
    runs, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) - 1 and (steps[j + 1].action, steps[j + 1].requests) == \
                (steps[i].action, steps[i].requests):
            j += 1
        runs.append((i, j))
        i = j + 1
    return runs


def print_counterexample(console: Console, steps, violations, trace_path=None,
                         config=None) -> None:
    if config is not None:
        console.print(Text(f"configuration: {config_line(config)}"))
    console.print(step_table(steps, violations))
    if violations and steps:
        console.print(Text(f"* the claims below broke at step {steps[-1].index}, the last row",
                           style="red"))
    for v in violations:
        console.print(Text.assemble(("violated:", "bold red"),
                                    f" {printable(v.invariant)}: {printable(v.message)}"))
        doc = v.doc or (REGISTRY[v.invariant].doc if v.invariant in REGISTRY else "")
        if doc:
            console.print(Text(f"  {doc}", style="dim"))
    if trace_path:
        console.print(Text(f"trace saved: {printable(trace_path)}  "
                           f"(replay: kvspec replay {command_arg(trace_path)}"
                           f"{_source_option()})"))


def _source_option() -> str:
    """`` --vllm SOURCE`` where this process checks a vLLM other than the
    installed one (its traces replay on that one only when named)."""
    from kvspec.harness.vllm_source import chosen
    source = chosen()
    if source is None or source.is_installed:
        return ""
    return f" --vllm {command_arg(source.cli_name())}"


def is_checked_claim(inv, design_rules: bool) -> bool:
    return inv.role != "design" or design_rules


#: what the claims table's counts count (one check can witness several cases)
CLAIMS_CAPTION = ("checked: calls the claim was judged after; witnessed: the cases (requests, "
                  "blocks, lookups) where what it speaks of happened, several per call at times; "
                  "a 0 there means the run never tested it")


def summary_table(checks: dict[str, int], witnessed: dict[str, int],
                  violations: dict[str, int], design_rules: bool = True,
                  kv_steps: int = 0) -> Table:
    """One row per claim; ``kv_steps``: steps run on real K/V tensors (``--kv
    torch``), each judged by the torch worker's claim, which is no registry claim."""
    table = Table(title="claims", caption=CLAIMS_CAPTION)
    for column in ("claim", "kind", "role", "checked", "witnessed", "violations"):
        table.add_column(column, justify="right" if column in ("checked", "witnessed",
                                                                "violations") else "left")
    for name, inv in REGISTRY.items():
        if not is_checked_claim(inv, design_rules):
            table.add_row(name, inv.kind, inv.role, "off", "-", "-")
            continue
        bad, seen = violations.get(name, 0), witnessed.get(name, 0)
        table.add_row(name, inv.kind, inv.role, str(checks.get(name, 0)),
                      str(seen) if seen else "[yellow]0[/]", f"[red]{bad}[/]" if bad else "0")
    if kv_steps:
        bad = violations.get(KV_CLAIM, 0)
        table.add_row(KV_CLAIM, "data", "safety", str(kv_steps), str(kv_steps),
                      f"[red]{bad}[/]" if bad else "0")
    return table


def unwitnessed(checks: dict[str, int], witnessed: dict[str, int],
                design_rules: bool = True, violated=(),
                unseen: dict[str, str] | None = None) -> dict[str, str]:
    """Claims checked but never witnessed in a run (nor violated): name -> why
    that may be expected: what the run cannot see (``unseen``), the registry's
    reason, or else that this run's draws did not reach it (a short budget can
    miss a rare one; the verdict line names what the run leaves out)."""
    why = "not reached by this run's draws; a longer run (--budget, --examples) may reach it"
    unseen = unseen or {}
    return {name: unseen.get(name) or inv.unwitnessed_because or why
            for name, inv in REGISTRY.items()
            if is_checked_claim(inv, design_rules) and not witnessed.get(name)
            and name not in violated}


#: contract claims that read what kvspec's world around a connector knows of
#: its store and transfers (spec/contract.py: None there is "unknown")
WORLD_CLAIMS = ("hit_within_stored", "load_lands_in_given_blocks",
                "load_reads_what_was_stored", "delay_covers_reads_in_flight",
                "store_reads_computed_kv")


def get_unreachable(profile) -> dict[str, str]:
    """Claims a run drawn from ``profile`` can never witness, and why: what
    they need is outside what it draws (its restrictions, the verdict line's
    "not mapped" part), so a longer run would not reach them either."""
    from kvspec.harness.machine import LAYOUTS
    if profile is None:
        return {}
    out: dict[str, str] = {}
    groups = {kind for layout in profile.layouts for kind in LAYOUTS.get(layout, ())}
    if "async" not in profile.scheduling:
        for claim in ("placeholders_nonnegative", "placeholders_match_in_flight"):
            out[claim] = ("needs async scheduling, which this run does not draw (scheduling="
                          f"{','.join(profile.scheduling)}); only it keeps output placeholders")
    if "sliding_window" not in groups:
        out["every_group_serves_computed"] = (
            "needs a sliding-window group, which this run does not draw (layouts="
            f"{','.join(profile.layouts)})")
    if "last_state" not in groups:
        out["hit_with_last_state_leaves_last_token"] = (
            "needs a last-state group, which this run does not draw (layouts="
            f"{','.join(profile.layouts)})")
    if not profile.load_failures:
        out["failed_block_recomputed_once"] = "needs a failed load; this run fails none"
    if not {"kv_both", "kv_producer"} & set(profile.kv_roles) or profile.connectors == ("none",):
        out["send_source_intact"] = ("needs a KV send, and no connector role this run draws "
                                     f"stores KV (kv_roles={','.join(profile.kv_roles)})")
    assert set(out) <= set(REGISTRY), set(out) - set(REGISTRY)
    return out


def get_run_unwitnessed(result, design_rules: bool, profile=None) -> dict[str, str]:
    """``unwitnessed`` for a run's result: its violated claims left out, and
    for a connector kvspec plays no world of its own around, why the claims
    on its store and transfers have nothing to judge."""
    violated = {v.invariant for v in result.counterexample.violations} \
        if result.counterexample is not None else set()
    return unwitnessed(result.checks, result.witnessed, design_rules, violated,
                       {**get_connector_silence(result.target, result.features),
                        **get_unreachable(profile), **get_unseen(result.target)})


#: claims only a connector's asynchronous loads, failed loads or delayed frees
#: can witness, each with the world capabilities (``connector_worlds``) and the
#: run's counted features it needs, any one of them
SILENT_CONNECTOR_CLAIMS = {
    "async_load_has_tokens": ("loads_async",),
    "no_load_into_free_blocks": ("loads_async",),
    "no_caching_of_invalid_blocks": ("loads_async", "reports_load_failures"),
    "send_source_intact": ("delays_frees",),
    "delay_covers_reads_in_flight": ("delays_frees",),
    "finished_request_releases_blocks": ("delays_frees", "loads_async"),
}
#: a capability's feature in the run's counts, and what its absence says
SILENCES = {"loads_async": ("async_loads", "answers no asynchronous load"),
            "reports_load_failures": ("load_failures", "reports no failed load"),
            "delays_frees": ("sends", "never delays a finished request's free (no send or "
                             "save of it outlives its step)")}


def get_connector_silence(target: str, features: dict) -> dict[str, str]:
    """For a real connector (``--connector``) whose world says it never does
    what a claim needs (an asynchronous load, a failed load, a delayed free)
    and whose run shows none either (``features``: a subclass may differ):
    its own code rules the claim out, so no budget reaches it. An out-of-tree
    connector kvspec knows nothing of, whose run showed none: perhaps its code
    never does (a longer run would not help then). One whose transfers
    kvspec's world draws (None there), or a run that showed it, gets no reason."""
    from kvspec.harness.connector_worlds import get_world, is_generic_world
    from kvspec.harness.targets import parse_connector_choice
    try:
        choice = parse_connector_choice(target)
        world = None if choice is None else get_world(choice)
    except Exception:  # noqa: BLE001 - the run reported its own connector errors
        return {}
    if world is None:
        return {}
    # unknown (None) counts for a connector whose answers alone decide (no
    # world of kvspec's draws its transfers): what the run showed is all there is
    maybe = (False, None) if is_generic_world(world) else (False,)
    quiet = {c: getattr(world, c) for c, (feature, _) in SILENCES.items()
             if getattr(world, c) in maybe and not features.get(feature, 0)}
    world.close()  # built only to be asked (ExampleWorld makes a folder)
    out = {}
    for claim, needs in SILENT_CONNECTOR_CLAIMS.items():
        if set(needs) <= set(quiet):
            out[claim] = f"{choice.class_name} " + " and ".join(SILENCES[c][1] for c in needs) + (
                ": its own code rules this claim out, so no budget reaches it"
                if all(quiet[c] is False for c in needs) else
                " in this run: if its code never does, no budget reaches it")
    return out


def get_unseen(target: str) -> dict[str, str]:
    from kvspec.harness.connector_worlds import (STORE_PROBE, get_connector_class, get_world,
                                                 has_store_probe, is_generic_world)
    from kvspec.harness.targets import parse_connector_choice
    try:
        choice = parse_connector_choice(target)
        generic = choice is not None and is_generic_world(get_world(choice))
        probed = generic and has_store_probe(get_connector_class(choice))
    except Exception:  # noqa: BLE001 - the run reported its own connector errors
        return {}
    if not generic:
        return {}
    why = (f"{choice.name} derives from no in-tree connector kvspec plays, so kvspec does not "
           "see its transfers")
    out = {claim: why for claim in WORLD_CLAIMS if claim != "hit_within_stored"}
    if not probed:  # the store probe shows the store, which only this claim reads
        out["hit_within_stored"] = (why + f" or its store (a {STORE_PROBE} method would "
                                    "show it)")
    return out


def known_table(known: dict) -> Table:
    """Known findings met during a run (kvspec.harness.fuzz.KnownHit)."""
    table = Table(title="known findings met (the run went on)")
    for column in ("finding", "times", "recognised", "upstream"):
        table.add_column(column)
    table.add_column("first trace", overflow="fold")  # whole, to copy into a replay
    for hit in known.values():
        table.add_row(Text(printable(hit.finding or hit.label or "pre-existing")),
                      str(hit.count), Text(printable(hit.how)), Text(printable(hit.upstream)),
                      Text(printable(str(hit.trace_path or ""))))
    return table


def efficiency_table(lost: dict) -> Table:
    """Efficiency claims broken during a run (kvspec.harness.fuzz.KnownHit per claim)."""
    table = Table(title="lost performance (the run went on; no safety claim broken by it)")
    for column in ("claim", "times", "first message"):
        table.add_column(column)
    table.add_column("first trace", overflow="fold")
    for key, hit in lost.items():
        table.add_row(Text(printable(key)), str(hit.count), Text(printable(hit.how)),
                      Text(printable(str(hit.trace_path or ""))))
    return table


def json_summary(result, version: str, budget_s: float, profile, design_rules: bool,
                 patches: dict | None = None, prep=None) -> dict:
    """``kvspec check --json``: one object describing the run."""
    import attrs

    from kvspec.harness.runner import FEATURES, OUTSIDE_MODEL
    counted = {}
    if result.counterexample is not None:
        for v in result.counterexample.violations:
            counted[v.invariant] = counted.get(v.invariant, 0) + 1
    claims = [{"name": name, "kind": inv.kind, "role": inv.role,
               "checked": result.checks.get(name, 0) if is_checked_claim(inv, design_rules) else None,
               "witnessed": result.witnessed.get(name, 0),
               "violations": counted.get(name, 0)} for name, inv in REGISTRY.items()]
    kv_steps = result.features.get("kv_torch", 0)
    if kv_steps:  # the torch worker's claim judged every step it ran (--kv torch)
        claims.append({"name": KV_CLAIM, "kind": "data", "role": "safety", "checked": kv_steps,
                       "witnessed": kv_steps, "violations": counted.get(KV_CLAIM, 0)})
    for name in counted:  # target_crashed, environment_contract: not registry claims
        if name not in REGISTRY and not (kv_steps and name == KV_CLAIM):
            claims.append({"name": name, "kind": "outcome", "role": "safety", "checked": None,
                           "witnessed": None, "violations": counted[name]})
    defaults = {f.name: f.default for f in attrs.fields(type(profile))}
    changed = {k: v for k, v in attrs.asdict(profile).items()
               if k not in ("name", "because") and v != defaults[k]}
    ce = result.counterexample
    line, code = _verdict(result, prep)
    return {
        "verdict_line": line, "exit_code": code,
        "target": result.target, "version": version, "seed": result.seed, "budget_s": budget_s,
        "elapsed_s": round(result.elapsed, 3), "runs": result.runs, "actions": result.actions,
        "actions_per_s": round(result.actions / result.elapsed, 1) if result.elapsed else 0.0,
        "shrinking": {"started_s": None if result.shrink_started is None
                      else round(result.shrink_started, 3), "cut_by_budget": result.shrink_cut},
        "design_rules": design_rules, "claims": claims,
        "unwitnessed": get_run_unwitnessed(result, design_rules, profile),
        "features": {f: result.features.get(f, 0) for f in FEATURES},
        # docs/spec.md, "Incremental checking"
        "state_checks": {"incremental": result.state_checks.get("incremental", 0),
                         "full": result.state_checks.get("full", 0),
                         "full_every": get_full_every()},
        # issue 30: production-sized runs (kvspec.harness.machine.ProductionMachine)
        "scale": _get_scale(),
        "runs_by_scale": {"small": result.scales.get("small", 0),
                          "production": result.scales.get("production", 0)},
        # actions the conformance model did not judge (every step is a model
        # step since issue 25: sync and async, every group's table)
        "not_evaluated": {} if not result.features.get(OUTSIDE_MODEL) else {
            "transition_admitted_by_model": {"actions": result.features[OUTSIDE_MODEL]}},
        "profile": {"name": profile.name, "restrictions": changed,
                    "because": list(profile.because)},
        "restrictions": [] if prep is None else [
            {"field": r.field, "value": list(r.value) if isinstance(r.value, tuple) else r.value,
             "kind": r.kind, "why": r.why} for r in prep.restrictions],
        "source": None if prep is None or prep.runtime is None else prep.runtime,
        "import_s": None if prep is None or prep.import_seconds is None
        else round(prep.import_seconds, 2),
        "base": None if prep is None or prep.base is None else prep.base.label,
        "fixes": [] if prep is None else [attrs.asdict(s) for s in prep.statuses],
        "known_findings": [{"finding": h.finding, "label": h.label, "count": h.count,
                            "how": h.how, "upstream": h.upstream, "claims": h.claims,
                            "trace": None if h.trace_path is None else str(h.trace_path)}
                           for h in result.known.values()],
        "efficiency": [{"claims": h.claims, "count": h.count, "message": h.how,
                        "trace": None if h.trace_path is None else str(h.trace_path)}
                       for h in (getattr(result, "efficiency", {}) or {}).values()],
        "patches": patches,
        "verdict": "violated" if ce is not None else ("hold" if code == 0 else "incomplete"),
        "violations": [] if ce is None else [{"claim": v.invariant, "message": v.message}
                                             for v in ce.violations],
        "trace": str(result.trace_path) if result.trace_path else None,
        "replays": None if getattr(result, "replays", None) is None else {
            "failed": result.replays[0], "of": result.replays[1],
            "flaky": result.replays[0] < result.replays[1]},
    }


def _verdict(result, prep) -> tuple[str, int]:
    if prep is None:
        from kvspec.verdict import first_line
        return first_line(result, [])
    from kvspec.run import verdict
    return verdict(result, prep)


def _fmt_detection(d) -> tuple[str, str, str]:
    if d is None:
        return "-", "-", "-"
    if not d.caught:
        return "[red]survived[/]", "-", "-"
    return ", ".join(d.invariants), f"{d.seconds:.2f}s", str(d.steps)


def zoo_table(rows) -> Table:
    table = Table(title="bug zoo")
    for column in ("mutant", "upstream", "status", "caught by", "time to detect", "steps",
                   "oracle alone: caught by", "time", "steps"):
        table.add_column(column)
    for r in rows:
        status = {"caught": "[green]caught[/]", "survived": "[red]survived[/]"}.get(
            r.status, Text(printable(r.status)))
        table.add_row(Text(printable(r.name)), Text(printable(r.upstream)), status,
                      *_fmt_detection(r.full), *_fmt_detection(r.oracle_alone))
    return table


def _get_scale() -> str:
    """The run sizes the campaign drew (``--scale``), read where it is reported."""
    from kvspec.harness.machine import get_scale
    return get_scale()
