"""Readable reports: the step table of a counterexample and the per-invariant summary."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvspec.spec.catalogue import REGISTRY
from kvspec.text import command_arg, printable

# Request ids, messages that quote them and paths come from the user: they are shown
# as Text (never parsed as rich markup) and made printable first.


def step_table(steps, violations) -> Table:
    table = Table(title="counterexample", show_lines=False)
    table.add_column("step", justify="right")
    table.add_column("action")
    table.add_column("requests after it (status c=computed/tokens hit=cached/external b=blocks)")
    for s in steps:
        table.add_row(str(s.index), Text(printable(s.action)),
                      Text(printable(s.requests).replace(" r", "\nr")))
    return table


def print_counterexample(console: Console, steps, violations, trace_path=None) -> None:
    console.print(step_table(steps, violations))
    for v in violations:
        console.print(Text.assemble(("violated:", "bold red"),
                                    f" {printable(v.invariant)}: {printable(v.message)}"))
        doc = v.doc or (REGISTRY[v.invariant].doc if v.invariant in REGISTRY else "")
        if doc:
            console.print(Text(f"  {doc}", style="dim"))
    if trace_path:
        console.print(Text(f"trace saved: {printable(trace_path)}  "
                           f"(replay: kvspec replay {command_arg(trace_path)})"))


def is_checked_claim(inv, design_rules: bool) -> bool:
    return inv.role == "safety" or design_rules


def summary_table(checks: dict[str, int], witnessed: dict[str, int],
                  violations: dict[str, int], design_rules: bool = True) -> Table:
    table = Table(title="claims")
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
    return table


def unwitnessed(checks: dict[str, int], witnessed: dict[str, int],
                design_rules: bool = True, profile=None) -> dict[str, str]:
    """Claims checked but never witnessed in a run: name -> why that may be
    expected (the registry's reason, or the run's restricted profile; empty when
    it should have been witnessed)."""
    restricted = ""
    if profile is not None and profile.because:
        restricted = (f"this run's profile {profile.name} restricts the environment to step "
                      f"around {', '.join(profile.because)}")
    elif profile is not None and profile.layouts == ("full",):
        restricted = "this run draws one full-attention group only (--layouts full)"
    return {name: inv.unwitnessed_because or restricted for name, inv in REGISTRY.items()
            if is_checked_claim(inv, design_rules) and not witnessed.get(name)}


def restriction_reasons(profile, version: str, patches: dict | None) -> dict[str, str]:
    """Why the profile steps around each finding it names (its fix is not
    applied, or no fix exists), and what the target does not map."""
    from kvspec.harness.accepted_findings import accepted_for
    findings = {f.id: f for f in accepted_for(version)}
    not_fitting = (patches or {}).get("not_fitting", {})
    reasons = {}
    for fid in profile.because:
        fix = findings[fid].fix_id if fid in findings else None
        avoided = ", ".join(f"{k}={v!r}" for k, v in findings[fid].avoided_by) \
            if fid in findings else ""
        if fix is None:
            why = "no fix exists (see its write-up in docs/findings/)"
        elif fix in not_fitting:
            why = f"its fix {fix} does not fit this release: {not_fitting[fix]}"
        else:
            why = f"its fix {fix} was not chosen (--fixes)"
        reasons[fid] = f"{avoided}: {why}" if avoided else why
    if not profile.spec_decode_with_last_state:  # a gap of the target, not a finding
        reasons["spec_decode_with_last_state"] = (
            "the vllm target maps no drafts beside a last-state group: vLLM keeps one "
            "Mamba state per draft, which the spec does not model (docs/notes/hybrid-groups.md)")
    return reasons


def json_summary(result, version: str, budget_s: float, profile, design_rules: bool,
                 patches: dict | None = None) -> dict:
    """``kvspec check --json``: one object describing the run."""
    import attrs

    from kvspec.harness.runner import FEATURES, UNMODELLED_STEPS
    counted = {}
    if result.counterexample is not None:
        for v in result.counterexample.violations:
            counted[v.invariant] = counted.get(v.invariant, 0) + 1
    claims = [{"name": name, "kind": inv.kind, "role": inv.role,
               "checked": result.checks.get(name, 0) if is_checked_claim(inv, design_rules) else None,
               "witnessed": result.witnessed.get(name, 0),
               "violations": counted.get(name, 0)} for name, inv in REGISTRY.items()]
    for name in counted:  # target_crashed, environment_contract: not registry claims
        if name not in REGISTRY:
            claims.append({"name": name, "kind": "outcome", "role": "safety", "checked": None,
                           "witnessed": None, "violations": counted[name]})
    defaults = {f.name: f.default for f in attrs.fields(type(profile))}
    restrictions = {k: v for k, v in attrs.asdict(profile).items()
                    if k not in ("name", "because") and v != defaults[k]}
    ce = result.counterexample
    return {
        "target": result.target, "version": version, "seed": result.seed, "budget_s": budget_s,
        "elapsed_s": round(result.elapsed, 3), "runs": result.runs, "actions": result.actions,
        "actions_per_s": round(result.actions / result.elapsed, 1) if result.elapsed else 0.0,
        "design_rules": design_rules, "claims": claims,
        "unwitnessed": unwitnessed(result.checks, result.witnessed, design_rules, profile),
        "features": {f: result.features.get(f, 0) for f in FEATURES},
        "not_evaluated": {"transition_admitted_by_model": {
            "steps": result.features.get(UNMODELLED_STEPS, 0),
            "why": "the conformance model (spec/effects.py) describes the synchronous step; "
                   "async steps are checked by every other claim"}},
        "profile": {"name": profile.name, "restrictions": restrictions,
                    "because": list(profile.because),
                    "justification": restriction_reasons(profile, version, patches)},
        "patches": patches,
        "verdict": "hold" if ce is None else "violated",
        "violations": [] if ce is None else [{"claim": v.invariant, "message": v.message}
                                             for v in ce.violations],
        "trace": str(result.trace_path) if result.trace_path else None,
    }


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
