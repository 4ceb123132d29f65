"""Known findings, recognised by behaviour.

Whether a vLLM source has a known finding is decided by replaying the
finding's traces on it (a *probe*), never by its version string, so a release
kvspec has not seen, a development version or a pull request's branch is
treated exactly like a measured release. Probe results are cached per source
content (``vllm_source.content_hash``) in ``.kvspec/probes.json``.

Two uses:

- **Fix statuses** (:func:`fix_statuses`): each of kvspec's fixes is
  ``applied`` (as written), ``drifted`` (applied over context that differs
  from its diff's; its finding's trace is replayed to show it still closes
  it), ``not-needed`` (it does not fit, and its findings' traces pass: the
  source does not have them, e.g. a branch that already carries the fix),
  ``code-changed`` (it does not fit and a finding of it is still there: the
  code it fixes was changed; the reviewer's signal, shown first), or
  ``not-chosen`` (left out by ``--fixes``/``--strict``).
- **Recognising a counterexample** (:class:`Recogniser`): instead of
  narrowing the environment around a known finding, a run keeps everything
  and asks, of each counterexample, whether a known finding explains it:
  it passes once that finding's fix is applied (a fix the run left out), it
  fails on the review's base too (``kvspec review``, or ``--base``), or, where
  neither can be asked, it behaves exactly as the finding's trace does (the
  same claims, messages of the same shape) on a source where that trace
  still fails. An explained counterexample is reported as that finding and
  the run goes on; anything else is new.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import attrs

from kvspec.harness.accepted_findings import (AcceptedFinding, catalogue, connector_findings,
                                              findings_of_fix)

#: the findings' traces and write-ups (an editable install: the repository's docs/)
FINDINGS_DIR = Path(__file__).resolve().parent.parent.parent / "docs" / "findings"
PROBES_FILE = Path(".kvspec/probes.json")


# -- replaying and comparing --------------------------------------------------------

@attrs.frozen
class Outcome:
    """What a replay gave: the violations as (claim, message), or why it could not run."""

    violations: tuple[tuple[str, str], ...] = ()
    error: str | None = None
    #: the index of the action the failure was judged at, and of its step-log
    #: row (a drain's steps are rows of one action); None: it passed, or the
    #: answer does not say
    step: int | None = None
    row: int | None = None

    @property
    def claims(self) -> frozenset[str]:
        return frozenset(c for c, _ in self.violations)

    @property
    def fails(self) -> bool:
        return bool(self.violations)


def replay(target: str, config, actions: list[dict], lost: bool = False) -> Outcome:
    """Run ``actions`` on a fresh ``target`` in this process. ``lost``: a run
    that breaks no other claim answers with its lost performance (efficiency
    claims, which never stop a run) instead of nothing."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.targets import TargetCannotMap
    try:
        runner = Runner(target, config)
        failure = runner.run(actions)
    except TargetCannotMap as exc:
        return Outcome(error=f"the target cannot map it: {exc}")
    except (ValueError, TypeError, RuntimeError, ImportError) as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}")
    if failure is None:
        return Outcome(tuple((v.invariant, v.message) for ce in runner.lost
                             for v in ce.violations) if lost else ())
    return Outcome(tuple((v.invariant, v.message) for v in failure.violations),
                   step=len(runner.actions) - 1, row=len(runner.log) - 1)


def _memo_key(config, actions: list[dict], pairs) -> str:
    return hashlib.sha256(json.dumps([repr(config), actions, pairs], sort_keys=True,
                                     default=str).encode()).hexdigest()


@attrs.frozen
class Where:
    """Where the head's counterexample broke: its last action and step-log row
    (``key``: the counterexample's memo key in the recogniser)."""

    key: str
    action: int
    row: int | None = None

    def is_after(self, got: Outcome) -> bool:
        """The base's replay failed before this point."""
        if got.step is None or got.step == self.action:
            return got.row is not None and self.row is not None and got.row < self.row
        return got.step < self.action


def compare_with_base(pairs, where: Where, got: Outcome) -> tuple[bool, str]:
    """Whether the base fails a head counterexample (``pairs``) the same way,
    and how it fails instead if it does not ("" when it passes).

    The same way: at the same point, breaking every claim the head breaks
    there, a crash with the same exception; or at an earlier point, breaking
    it exactly as the head does (every head violation's message shape), which
    is a known failure whose timing the change moved. Sharing one claim is not
    enough: a change that keeps a known bug and breaks a second claim in its
    step, or breaks the same claim in a way of its own, has a failure of its
    own."""
    if not got.fails:
        return False, ""
    seen = ", ".join(sorted(got.claims))
    if where.is_after(got):
        if shape(pairs) <= shape(got.violations):
            return True, ""
        at = f"action {got.step + 1} of {where.action + 1}" if got.step is not None else "a step"
        return False, f"BASE fails this trace earlier, at {at}, and otherwise: {seen}"
    missing = sorted({c for c, _ in pairs} - got.claims)
    if missing:
        return False, f"BASE fails this trace too, as {seen}, but not as {', '.join(missing)}"
    if _crash_kinds(pairs) - _crash_kinds(got.violations):
        return False, ("BASE fails this trace too, but crashes otherwise: "
                       + "; ".join(m for c, m in got.violations if c == "target_crashed"))
    return True, ""


def template(message: str) -> str:
    """A violation message with what varies between runs taken out: request
    ids, numbers (a list of numbers, whatever its length), line numbers and
    the list of patches applied."""
    text = re.sub(r" \(kvspec patches: [^)]*\)", "", message)
    text = re.sub(r"\br\d+\b", "r#", text)
    text = re.sub(r"\d+", "#", text)
    return re.sub(r"\[#(?:, #)*(?:, \.\.\.)?\]", "[#...]", text)


def shape(violations) -> frozenset[tuple[str, str]]:
    return frozenset((claim, template(message)) for claim, message in violations)


def behaves_as(violations, recorded) -> bool:
    """Every violation is one the recorded verdict has (same claim, same message
    shape), and the claims are the recorded ones."""
    got, want = shape(violations), shape(recorded)
    return bool(got) and got <= want and {c for c, _ in got} == {c for c, _ in want}


def fails_as(violations, finding) -> bool:
    """The violations are the way one of ``finding``'s traces fails (for a
    connector's finding: its breach, :func:`get_breach`)."""
    if finding.connector:
        breach = get_breach(violations)
        return any(behaves_as(breach, get_breach(recorded(t))) for t in finding.traces) \
            and get_consequences(violations) <= get_allowed_consequences([finding])
    return any(behaves_as(violations, recorded(t)) for t in finding.traces)


def get_consequences(violations) -> frozenset[str]:
    """The claims of a step besides the connector's breach (:func:`get_breach`)."""
    breach = set(get_breach(violations))
    return frozenset(c for c, m in violations if (c, m) not in breach)


#: what a step breaks when vLLM uses KV that a connector left invalid without
#: saying so (a load of garbage, a store of it read back): the consequences any
#: connector finding that ships bad KV may have, whichever its traces show
GARBAGE_READ_CLAIMS = frozenset({"computed_means_valid", "no_caching_of_invalid_blocks",
                                 "update_from_output_relation",
                                 "placeholders_match_in_flight"})


def get_allowed_consequences(findings) -> frozenset[str]:
    """The scheduler claims a step may break beside a breach for it to be taken
    for ``findings``: those their traces break, and what reading invalid KV
    breaks (``GARBAGE_READ_CLAIMS``). Any other is not taken for them: a new
    bug may write a breach of the same shape (a scheduler that frees blocks
    under a store does), and its own claims then tell it apart."""
    return GARBAGE_READ_CLAIMS | frozenset(c for f in findings for t in f.traces
                                           for c in get_consequences(recorded(t)))


def get_breach(violations) -> tuple[tuple[str, str], ...]:
    """Of a step's violations, the connector's own: its contract claims (kind
    ``connector``, judged on its answers and transfers) and a crash. The
    scheduler claims that break in the same step are what the breach led to
    (garbage loaded, then sampled from): they differ with the configuration
    (async scheduling adds placeholders) while the breach stays the same, so a
    connector's finding is known by its breach, and the rest of the step is
    asked only to be among its consequences (:func:`get_allowed_consequences`)."""
    import kvspec.spec.catalogue  # noqa: F401  (registers every claim)
    from kvspec.spec.registry import REGISTRY
    return tuple((c, m) for c, m in violations
                 if c == "target_crashed" or getattr(REGISTRY.get(c), "kind", "") == "connector")


# -- traces of the known findings ------------------------------------------------------

def trace_path(name: str) -> Path:
    return FINDINGS_DIR / name


def load_finding_trace(name: str) -> dict | None:
    """A finding's trace (None where kvspec was installed without its docs/)."""
    from kvspec.harness.trace import load_trace
    path = trace_path(name)
    if not path.is_file():
        return None
    return load_trace(path)


@functools.lru_cache(maxsize=None)
def recorded(name: str) -> tuple[tuple[str, str], ...]:
    data = load_finding_trace(name)
    if data is None:
        return ()
    return tuple((v["invariant"], v["message"]) for v in data.get("verdict", ()))


def _crash_kinds(violations) -> set[str]:
    return {m.split(":", 1)[0] for c, m in violations if c == "target_crashed"}


def fails_as_recorded(outcome: Outcome, want) -> bool:
    """The recorded claims exactly, and a recorded crash with the same exception."""
    return (outcome.fails and outcome.claims == {c for c, _ in want}
            and _crash_kinds(outcome.violations) == _crash_kinds(want))


# -- probes (cached per source content) ---------------------------------------------------

class ProbeCache:
    """Replays of finding traces on one source, kept across runs in
    ``.kvspec/probes.json`` (keyed by the source's content, kvspec's fixes and
    the trace)."""

    def __init__(self, source_key: str, path: Path = PROBES_FILE) -> None:
        self.source_key = source_key
        self.path = path
        self.entries: dict[str, dict] = {}
        self.dirty = False
        try:
            self.entries = json.loads(path.read_text())
            if not isinstance(self.entries, dict):
                self.entries = {}
        except (OSError, ValueError):
            self.entries = {}

    def probe(self, trace: str, target: str) -> Outcome:
        key = f"{self.source_key}|{_kvspec_key()}|{trace}|{target}{_connector_key(target)}"
        hit = self.entries.get(key)
        if hit is not None:
            return Outcome(tuple(tuple(v) for v in hit["violations"]), hit["error"])
        data = load_finding_trace(trace)
        if data is None:
            outcome = Outcome(error=f"no trace {trace} (kvspec installed without docs/findings)")
        else:
            outcome = replay(target, data["config"], data["actions"])
        self.entries[key] = {"violations": [list(v) for v in outcome.violations],
                             "error": outcome.error}
        self.dirty = True
        return outcome

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".probes-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError:
            pass  # a cache: a run that cannot keep it probes again next time


def _connector_key(target: str) -> str:
    """What a probe with a real connector also depends on: the source's
    connector code, and a connector installed beside kvspec (``module:Class``)."""
    from kvspec.harness.targets import parse_connector_choice
    from kvspec.harness.vllm_source import active, connectors_hash
    choice = parse_connector_choice(target)
    if choice is None:
        return ""
    key = "|connectors " + connectors_hash(active())
    if choice.module_path:
        import importlib.util
        try:
            spec = importlib.util.find_spec(choice.module_path)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is not None and origin.is_file():
            key += " " + hashlib.sha256(origin.read_bytes()).hexdigest()[:16]
    return key


_KVSPEC_KEY: str | None = None


def _kvspec_key() -> str:
    """A hash of what a probe's result depends on besides the source: kvspec's
    patches, its claims and its harness (the package's Python files)."""
    global _KVSPEC_KEY
    if _KVSPEC_KEY is None:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parent.parent.parent
        for folder in ("kvspec", "spec", "impl"):
            for path in sorted((root / folder).rglob("*")):
                if path.suffix in (".py", ".diff") and path.is_file():
                    h.update(path.as_posix().encode() + path.read_bytes())
        _KVSPEC_KEY = h.hexdigest()[:16]
    return _KVSPEC_KEY


def fixes_target(fix_ids, planted=()) -> str:
    from kvspec.harness.targets import vllm_target_name
    ids = sorted(set(fix_ids))
    return vllm_target_name(",".join(ids) if ids else "none", tuple(planted))


# -- fix statuses ---------------------------------------------------------------------

STATUSES = ("code-changed", "handled", "drifted", "applied", "not-needed", "not-chosen")


@attrs.frozen
class FixStatus:
    fix: str
    status: str
    detail: str = ""
    #: known findings of this fix that the source still has (probe: their trace
    #: fails as recorded without the fix)
    present: tuple[str, ...] = ()


def fix_statuses(patched, chosen: set[str], cache: ProbeCache,
                 planted: tuple[str, ...] = ()) -> list[FixStatus]:
    """The status of every fix kvspec has on this source (see the module doc),
    code-changed first."""
    from kvspec.harness.vllm_patches import FIXES
    applied = set(patched.applied) & set(FIXES)
    out = []
    for fix in FIXES:
        if fix not in chosen:
            out.append(FixStatus(fix, "not-chosen", "left out by --fixes/--strict"))
        elif fix in applied and fix not in patched.drift:
            out.append(FixStatus(fix, "applied"))
        elif fix in applied:
            out.append(_drifted(fix, patched, applied, cache, planted))
        else:
            out.append(_not_fitting(fix, patched, applied, cache, planted))
    return sorted(out, key=lambda s: STATUSES.index(s.status))


def get_handled(statuses: list[FixStatus], applied: set[str], cache: ProbeCache, base,
                planted=()) -> list[FixStatus]:
    """A review: the fixes that fit HEAD but whose findings' traces HEAD, without
    the fix (every other fix in place), fails otherwise than BASE does without
    it. The change alters what happens on the path that fix closes (a change
    written as a fix of that finding, say): applying kvspec's fix over it would
    check kvspec's way instead of the change's, and could close the very path
    the change alters. Such a fix is left out on HEAD and on BASE, and BASE
    decides: where the change fails the way BASE does, that is pre-existing."""
    handled = []
    for status in statuses:
        if status.status not in ("applied", "drifted") or not findings_of_fix(status.fix):
            continue
        without = applied - {status.fix}
        differs = [f.id for f in findings_of_fix(status.fix) for t in f.traces
                   if _differs_on_base(t, without, cache, base, planted)]
        if differs:
            handled.append(FixStatus(status.fix, "handled", "without it HEAD replays "
                                     f"{', '.join(dict.fromkeys(differs))} otherwise than "
                                     "BASE does: the change handles that path its own way, so "
                                     "the fix is left out on HEAD and BASE and BASE decides"))
    return handled


def _differs_on_base(trace: str, fixes: set[str], cache: ProbeCache, base, planted) -> bool:
    """Whether HEAD (this process) and BASE replay ``trace`` with ``fixes``
    differently: other claims or message shapes, or one passes. A replay that
    cannot run answers nothing (not different)."""
    data = load_finding_trace(trace)
    if data is None:
        return False
    head = cache.probe(trace, fixes_target(fixes, source_patches(planted)))
    try:
        got = base.replay(base.target_for(fixes), data["config"], list(data["actions"]))
    except Exception:  # noqa: BLE001 - a base that cannot answer leaves the fix applied
        return False
    if head.error is not None or got.error is not None:
        return False
    return shape(head.violations) != shape(got.violations)


def _drifted(fix, patched, applied, cache, planted) -> FixStatus:
    still = _present(fix, applied, cache, planted)
    notes = "; ".join(patched.drift[fix])
    if still:
        return FixStatus(fix, "code-changed", f"applied over drifted context ({notes}), but "
                         f"{', '.join(still)} still fails with it", tuple(still))
    return FixStatus(fix, "drifted", f"{notes}; its findings' traces pass with it")


def _not_fitting(fix, patched, applied, cache, planted) -> FixStatus:
    still = _present(fix, applied, cache, planted)
    why = patched.skipped.get(fix, "").split(": ", 1)[-1]
    if still:
        return FixStatus(fix, "code-changed", f"it does not fit ({why}) and its findings "
                         f"still fail here: {', '.join(still)}", tuple(still))
    if patched.reasons.get(fix) == "present":
        return FixStatus(fix, "not-needed", f"the source already has it ({why})")
    return FixStatus(fix, "not-needed", "its findings' traces pass here")


def _present(fix: str, applied: set[str], cache: ProbeCache, planted) -> list[str]:
    """The findings of ``fix`` whose trace fails as recorded with every other fix
    applied and ``fix`` itself (if it is applied: drifted) left in place."""
    target = fixes_target(applied, source_patches(planted))
    found = []
    for finding in findings_of_fix(fix):
        for trace in finding.traces:
            if fails_as_recorded(cache.probe(trace, target), recorded(trace)):
                found.append(finding.id)
                break
    return found


def is_recognisable_by_shape(finding: AcceptedFinding) -> bool:
    """Whether a counterexample that fails the way the finding's traces do can
    be taken for it without asking a fix or a base: only a crash, whose
    exception and message vLLM itself wrote. Any other claim's message is
    kvspec's own and shared by unrelated bugs (a liveness bug of a change under
    review reads "r1 still WAITING ..." exactly as a known deadlock does).
    A connector's finding is known by its breach of the connector's contract
    (:func:`get_breach`), with only its consequences beside it
    (:func:`fails_as`): a contract claim judges the connector's own answer or
    transfer, and a scheduler bug that writes a breach of the same shape breaks
    claims of its own there."""
    if finding.connector:
        return all(get_breach(recorded(t)) for t in finding.traces)
    return all(claim == "target_crashed" for t in finding.traces for claim, _ in recorded(t)) \
        and any(recorded(t) for t in finding.traces)


def source_patches(planted: tuple[str, ...]) -> tuple[str, ...]:
    """Of a target's planted patches, those that stand for the source itself
    (edits under review); kvspec's own planted bugs are not the source, and a
    probe of the source's findings leaves them out."""
    from kvspec.harness.vllm_patches import PLANTED
    return tuple(p for p in planted if p in PLANTED and PLANTED[p].kind == "edit")


def present_unfixed(applied: set[str], cache: ProbeCache, planted=(),
                    connector_known=()) -> list[AcceptedFinding]:
    """Known findings with no fix applied here (no fix exists, or it did not
    fit), recognisable by their shape, whose trace fails as recorded on this
    source; and of ``connector_known`` (:func:`get_connector_findings`) those
    whose trace fails so (each replayed with the connector it names)."""
    target = fixes_target(applied, source_patches(planted))
    found = []
    for finding in list(catalogue().values()) + list(connector_known):
        if finding.remedy == "contract" or (finding.fix_id and finding.fix_id in applied):
            continue
        if not is_recognisable_by_shape(finding):
            continue
        if any(fails_as_recorded(cache.probe(t, _trace_target(target, t) if finding.connector
                                             else target), recorded(t))
               for t in finding.traces):
            found.append(finding)
    return found


def _trace_target(target: str, trace: str) -> str:
    """``target`` with the connector a connector finding's trace was recorded
    with (its --connector-config included)."""
    from kvspec.harness.targets import with_connector
    data = load_finding_trace(trace)
    return with_connector(target, data["target"]) if data else target


# -- recognising a counterexample ------------------------------------------------------------

@attrs.frozen
class Explanation:
    #: the known finding, or None: several at once, or it fails on the base too
    #: but is no known finding
    finding: str | None
    #: how it was recognised
    how: str
    upstream: str = ""
    #: what it is when no one finding is named
    unnamed: str = "pre-existing"

    @property
    def key(self) -> str:
        return self.finding or self.unnamed


class Recogniser:
    """Decides, of a counterexample, whether a known finding (or the review's
    base) explains it. Deterministic for a given trace, so that shrinking a
    new counterexample never wanders into a known one."""

    def __init__(self, target: str, applied: set[str], toggles: list[str],
                 unfixed: list[AcceptedFinding], base=None, planted: tuple[str, ...] = (),
                 base_toggles: list[str] = (), base_decides: bool = False):
        #: the fixes applied on the run's target
        self.applied = set(applied)
        #: fixes that fit this source but that the run left out (--fixes, --strict)
        self.toggles = list(toggles)
        #: known findings present here with no fix applied (asked by shape when
        #: there is no base)
        self.unfixed = list(unfixed)
        #: a BaseWorker (kvspec.harness.base_worker) or None
        self.base = base
        #: fixes that did not fit this source (code-changed): a counterexample
        #: that fails on the base too is named by the one that closes it there
        self.base_toggles = list(base_toggles)
        #: a review: what passes on the base is a regression, whatever it resembles.
        #: A check asks the base only to recognise: a finding with no fix that this
        #: source has (its trace fails here) is known even where the base lacks it
        self.base_decides = base_decides
        self.planted = tuple(planted)
        self.target = target
        self._memo: dict[str, Explanation | None] = {}
        #: per counterexample (memo key) the base was asked of and does not
        #: fail as the head does: "" it passed, else how it failed instead
        self._base_notes: dict[str, str] = {}
        self.base_errors: list[str] = []

    @property
    def is_active(self) -> bool:
        return bool(self.toggles or self.unfixed or self.base)

    def _target(self, name: str) -> str:
        """A replay target with the run's connector (``--connector``), if any."""
        from kvspec.harness.targets import with_connector
        return with_connector(name, self.target)

    def explain(self, config, actions: list[dict], violations,
                rows: int | None = None) -> Explanation | None:
        """``rows``: the head run's step-log rows, so that a failure the base
        meets earlier in the same action's drain is known as earlier."""
        pairs = tuple((v.invariant, v.message) for v in violations)
        key = _memo_key(config, actions, pairs)
        if key not in self._memo:
            where = Where(key, len(actions) - 1, None if rows is None else rows - 1)
            self._memo[key] = self._explain(config, actions, pairs, where)
        return self._memo[key]

    def get_base_note(self, config, actions: list[dict], violations) -> str | None:
        """What the base did with a counterexample it does not fail as the head
        does: "" it passed, else how it failed (``compare_with_base``); None
        when it was not asked, could not answer, or fails it the same way."""
        pairs = tuple((v.invariant, v.message) for v in violations)
        return self._base_notes.get(_memo_key(config, actions, pairs))

    def _explain(self, config, actions, pairs, where: Where) -> Explanation | None:
        if any(c == "kvspec_crashed" for c, _ in pairs) and self.base_decides \
                and self.base is not None:  # a review: kvspec's bug, or the change's?
            return self._kvspec_crash_on_base(config, actions, pairs, where)
        if any(c in ("environment_contract", "connector_answer", "kvspec_crashed")
               for c, _ in pairs):
            return None  # the environment's or kvspec's own bug: never a finding of the target
        for fix in self._likely_first(self.toggles, pairs):
            rest = self._with_fixes({fix}, config, actions)
            if rest == "" or (rest and self._fix_shape(fix, pairs)):
                return self._by_fix(fix, pairs, rest)
        if len(self.toggles) > 1 and self._with_fixes(set(self.toggles), config, actions) \
                is not None:  # two known findings in one trace: no one fix closes it
            named = self._by_shape(pairs)
            return Explanation(named.id if named else None, "passes with the fixes left out "
                               "of this run (several findings at once)",
                               named.upstream if named else "", "several known findings")
        if self.base is not None:
            found = self._on_base(config, actions, pairs, where)
            if found is not None or self.base_decides:
                return found
        unfixed = self.unfixed if self.base is None else [
            f for f in self.unfixed if f.remedy == "none"]
        finding = _first_failing_as(pairs, unfixed)
        if finding is None:
            return self._by_connector_findings(pairs, unfixed)
        if finding.connector:
            return Explanation(finding.id, f"breaks {finding.connector}'s contract as its "
                               "trace does (the connector's own code; kvspec has no fix for "
                               "it)", finding.upstream)
        return Explanation(finding.id, "behaves as its trace does (no fix applied here)",
                           finding.upstream)

    def _by_connector_findings(self, pairs, unfixed) -> Explanation | None:
        """A breach of the connector's contract made of several of its known
        findings' breaches at once (one finding's garbage loaded, then stored
        by a request that shares it): each violation has the shape of one."""
        breach = shape(get_breach(pairs))
        # the known breaches this one holds whole (a lone claim of a finding whose
        # traces break two at once is not that finding)
        used = [(f, part) for f in unfixed if f.connector for t in f.traces
                if (part := shape(get_breach(recorded(t)))) and part <= breach]
        findings = list(dict.fromkeys(f for f, _ in used))
        if len(findings) < 2 or frozenset().union(*(p for _, p in used)) != breach:
            return None
        if not get_consequences(pairs) <= get_allowed_consequences(findings):
            return None
        owners = " and ".join(dict.fromkeys(f.connector for f in findings))
        return Explanation(None, "its breach is " + " + ".join(f.id for f in findings) +
                           ", each as its trace breaks it", unnamed=f"several known findings "
                           f"of {owners}")

    def _likely_first(self, fixes: list[str], pairs) -> list[str]:
        claims = {c for c, _ in pairs}

        def overlap(fix: str) -> int:
            return -len(claims & {c for f in findings_of_fix(fix) for t in f.traces
                                  for c, _ in recorded(t)})
        return sorted(fixes, key=overlap)

    def _with_fixes(self, fixes: set[str], config, actions) -> str | None:
        """What is left of the trace with ``fixes`` added: "" when it passes, the
        id of the one known finding with no fix here that it then fails as (a
        trace can meet two findings, the second hidden behind the first), None
        when it still fails some other way."""
        got = replay(self._target(fixes_target(self.applied | fixes, self.planted)), config,
                     actions)
        if got.error is not None:
            return None
        if not got.fails:
            return ""
        behind = self._unfixed_shape(got.violations)
        return behind.id if behind is not None else None

    @staticmethod
    def _fix_shape(fix: str, pairs) -> bool:
        """Whether the counterexample fails as one of ``fix``'s findings' traces
        does: asked before a fix that leaves another finding behind is credited
        (a fix can steer a trace away from a bug without closing it)."""
        return _first_failing_as(pairs, findings_of_fix(fix)) is not None

    def _unfixed_shape(self, pairs) -> AcceptedFinding | None:
        return _first_failing_as(pairs, self.unfixed)

    def _by_fix(self, fix: str, pairs, behind: str = "") -> Explanation:
        """The finding of ``fix`` the counterexample fails as (or its first);
        ``behind``: the known no-fix finding the trace fails as once fixed."""
        findings = findings_of_fix(fix)
        verb = "with" if behind else "passes with"
        then = f"; it then fails only as {behind}, a known finding with no fix" if behind else ""
        if not findings:
            return Explanation(None, f"{verb} the fix {fix}{then}")
        f = _first_failing_as(pairs, findings) or findings[0]
        return Explanation(f.id, f"{verb} its fix {fix} (left out of this run){then}", f.upstream)

    def _ask_base(self, config, actions, pairs, where: Where) -> Outcome | None:
        """The base's replay if it fails the counterexample the same way
        (``compare_with_base``); None otherwise, noting what it did instead."""
        try:
            got = self.base.replay(self._target(self.base.target_for(self.applied)), config,
                                   actions)
        except Exception as exc:  # noqa: BLE001 - a base that cannot answer explains nothing
            self.base_errors.append(f"{type(exc).__name__}: {exc}")
            return None
        if got.error is not None:
            self.base_errors.append(got.error)
            return None
        same, otherwise = compare_with_base(pairs, where, got)
        if not same:  # it passes, or fails otherwise: the head's own
            self._base_notes[where.key] = otherwise
            return None
        return got

    def _kvspec_crash_on_base(self, config, actions, pairs, where: Where) -> Explanation | None:
        """kvspec's own crash in a review: not the change's when the base
        crashes kvspec the same way (still kvspec's bug, never a finding)."""
        if self._ask_base(config, actions, pairs, where) is None:
            return None
        return Explanation(None, f"kvspec crashes on the base ({self.base.label}) the same way: "
                           "a bug in kvspec, not the change's; please report it with this "
                           "trace", "", "kvspec's own crash")

    def _on_base(self, config, actions, pairs, where: Where) -> Explanation | None:
        got = self._ask_base(config, actions, pairs, where)
        if got is None:
            return None
        earlier = where.is_after(got)
        how = f"fails on the base ({self.base.label}) too" + (
            ", earlier in the trace (the change moved it)" if earlier else "")
        for fix in self._likely_first(self.base_toggles, pairs):
            closed = self.base.replay(self._target(self.base.target_for(self.applied | {fix})),
                                      config, actions)
            if closed.error is None and not closed.fails:
                named = self._by_fix(fix, pairs)
                return attrs.evolve(named, how=f"{how}; passes there with {fix}")
        named = self._by_shape(pairs)
        several = None if named else self._by_connector_findings(
            pairs, get_connector_findings(self.target))
        if several is not None:
            return attrs.evolve(several, how=how)
        return Explanation(named.id if named else None, how, named.upstream if named else "")

    def _by_shape(self, pairs) -> AcceptedFinding | None:
        """The known finding whose trace failed exactly this way, if one did,
        among those with no fix applied here (an applied fix closes its own)."""
        return _first_failing_as(pairs, [f for f in catalogue().values()
                                         if f.fix_id is None or f.fix_id not in self.applied]
                                 + get_connector_findings(self.target))


def get_connector_findings(target: str) -> list[AcceptedFinding]:
    """The known findings of the real connector a vllm target runs
    (``--connector``): its own, and for vLLM's MultiConnector its children's
    (each child runs its own code; MultiWorld's default pair without a
    ``connectors`` config)."""
    from kvspec.harness.targets import parse_connector_choice
    choice = parse_connector_choice(target)
    if choice is None:
        return []
    names = [choice.name]
    if choice.class_name == "MultiConnector":
        from kvspec.harness.connector_worlds import MultiWorld
        children = choice.get_extra_config().get("connectors") or MultiWorld.DEFAULT_CHILDREN
        names += [c.get("kv_connector", "") for c in children]
    return [f for name in dict.fromkeys(names) for f in connector_findings(name)]


def _first_failing_as(pairs, findings) -> AcceptedFinding | None:
    return next((f for f in findings if fails_as(pairs, f)), None)


def build_recogniser(target: str, base=None,
                     base_decides: bool = False) -> tuple[Recogniser | None, list[FixStatus]]:
    """The recogniser and fix statuses for a vllm ``target`` on the active source
    (None for other targets); ``base_decides``: a review (see Recogniser)."""
    from kvspec.harness.targets import parse_vllm_target, with_connector
    from kvspec.harness.vllm_patches import FIXES, patched, select
    from kvspec.harness.vllm_source import active, content_hash
    options = parse_vllm_target(target)
    if options is None:
        return None, []
    fixes, planted = options
    chosen = {p.id for p in select(fixes) if p.id in FIXES}
    built = patched(fixes, planted)
    applied = set(built.applied) & set(FIXES)
    cache = ProbeCache(content_hash(active()))
    statuses = fix_statuses(built, chosen, cache, planted)
    handled = get_handled(statuses, applied, cache, base, planted) \
        if base_decides and base is not None else []
    left_out = {h.fix for h in handled}
    if left_out:
        applied -= left_out
        statuses = sorted([s for s in statuses if s.fix not in left_out] + handled,
                          key=lambda s: STATUSES.index(s.status))
        target = with_connector(fixes_target(applied, planted), target)
    fitting = set(patched("all", planted).applied) & set(FIXES)
    # a fix the change handles is no toggle: "passes with kvspec's fix" would
    # explain away whatever the change does on the path that fix closes
    toggles = sorted(fitting - applied - left_out)
    unfixed = [] if base_decides else present_unfixed(applied, cache, planted,
                                                      get_connector_findings(target))
    changed = [s.fix for s in statuses if s.status == "code-changed" and s.fix not in applied]
    cache.save()
    return Recogniser(target, applied, toggles, unfixed, base, planted, changed,
                      base_decides), statuses
