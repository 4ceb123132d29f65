"""Source patches for the installed vLLM, applied at import, never on disk.

A patch is a unified diff against one or more of vLLM's modules, the diff an
upstream pull request would carry. kvspec reads the installed module's source,
applies the diff's hunks to it (each hunk's lines before the change must occur
exactly once: that probes the installed code, so a release kvspec has not seen
gets the patches that fit it and a one-line reason for those that do not),
executes the result as a fresh module, and builds the ``vllm`` target from the
patched classes. The installed files are never changed, and patched and
unpatched schedulers can live in one process.

Two kinds, kept apart:

- **fixes** (``patches/fixes/``): the minimal fix of each accepted finding
  (``docs/findings/``). ``kvspec check --target vllm`` applies every fix that
  fits by default; ``--strict`` (``--fixes none``) applies none.
- **planted bugs** (``patches/planted/``): plausible bugs put into vLLM's
  recovery, preemption and connector paths, to show the default check catches
  them (``--plant ID``).

A patch may come in variants (``<id>.diff``, ``<id>@<release>.diff``) for releases
whose code differs; the first variant whose hunks all fit is applied. A fix of a
finding of older releases only (a backport) has only ``@<release>`` variants: on
a release without that finding it does not fit, and is not needed
(``accepted_findings.fixes_needed``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import linecache
import sys
import types
from pathlib import Path

import attrs

from kvspec.harness.hunk_apply import HunkDoesNotFit, apply_hunks

PATCHES_DIR = Path(__file__).with_name("patches")


class PatchDoesNotFit(Exception):
    """A patch whose hunks do not fit the source. ``reason``: "changed" (the
    code a hunk changes is not there) or "present" (its added lines already
    are: the source has the change)."""

    def __init__(self, message: str, reason: str = "changed") -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen
class Patch:
    id: str
    kind: str            # "fix", "planted", or "edit" (a change under review, see register_edit)
    summary: str
    #: the finding a fix closes (docs/findings/<finding>.md), or the claim a
    #: planted bug must break
    target: str
    #: an edit's diff file (fixes and planted bugs live in PATCHES_DIR)
    file: Path | None = None

    @property
    def variants(self) -> list[Path]:
        if self.file is not None:
            return [self.file]
        folder = PATCHES_DIR / ("fixes" if self.kind == "fix" else "planted")
        return sorted(folder.glob(f"{self.id}.diff")) + sorted(folder.glob(f"{self.id}@*.diff"))


FIXES: dict[str, Patch] = {p.id: p for p in [
    Patch("priority-preempt-caches-uncomputed-block", "fix",
          "a request preempted in the step it was scheduled has its blocks past the computed "
          "prefix evicted from the prefix cache: they were cached for tokens never computed",
          "vllm-0.32.0-priority-preempt-caches-uncomputed-block"),
    Patch("recovery-cuts-every-request-at-its-first-failed-block", "fix",
          "every request a load failure affects is cut back at its first failed block, "
          "shared or not, has its blocks from there on evicted, and waits while another "
          "request recomputes a shared one; failed blocks leave the prefix cache under both "
          "policies and are cached again once recomputed",
          "vllm-0.32.0-recompute-failed-block-stays-cached, "
          "vllm-0.32.0-fail-policy-shared-failure-downstream-cached"),
    Patch("failed-async-load-self-reservation-hang", "fix",
          "an async load that failed outright and gave its blocks back leaves the in-flight "
          "prefill set, so its reservation no longer blocks admissions, its own retry "
          "included, and waits behind the requests that hold KV, not ahead of them",
          "vllm-0.32.0-failed-async-load-self-reservation-hang"),
    Patch("async-load-reservation-past-max-model-len", "fix",
          "an async load's reservation for its own spec-decode step stops, in each KV cache "
          "group, at the group's last block below max_model_len, so a prompt near "
          "max_model_len is admitted into a pool sized for max_model_len",
          "vllm-0.32.0-async-load-reservation-past-max-model-len"),
    Patch("abort-mid-load-frees-under-send", "fix",
          "a request finished while its load is in flight and its connector delays the free "
          "for a send is freed only once both transfers are reported",
          "vllm-0.32.0-abort-mid-load-frees-under-send"),
    Patch("spec-pad-clipped-by-prefill-threshold", "fix",
          "a new request is padded with placeholder drafts only when the long-prefill cap "
          "leaves room for the padded step", "vllm-0.32.0-spec-pad-clipped-by-prefill-threshold"),
    Patch("async-recovery-drops-output-in-flight", "fix",
          "under async scheduling, a running request that load-failure recovery cuts back "
          "has its output in flight dropped as stale, its placeholders zeroed and its "
          "placeholder drafts cleared, as a preempted one does",
          "vllm-0.32.0-async-recovery-keeps-placeholders"),
    Patch("recovery-evicts-blocks-of-requests-ended-mid-step", "fix",
          "under async scheduling, load-failure recovery also evicts from the prefix cache "
          "the blocks past a failed one of a request that ended while the failing step was "
          "in flight (blocks deferred or held for a send), except blocks a running request "
          "holds, which recovery itself evicts or has recomputed",
          "vllm-0.32.0-recovery-misses-requests-ended-mid-step"),
    Patch("forced-reset-refuses-with-step-in-flight", "fix",
          "a forced reset_prefix_cache (reset_running_requests) while a step is in flight "
          "whose blocks are fenced (deferred frees) preempts nothing and resets as an "
          "unforced call does (False while blocks are held, the connector reset "
          "included), instead of preempting every running request and raising",
          "vllm-0.32.0-forced-reset-raises-under-deferred-frees"),
    Patch("hybrid-full-prompt-hit-keeps-window", "fix",
          "a first allocation skips sliding-window and chunked-local blocks from where "
          "the request resumes: for a hit of the whole prompt one token early, so the "
          "window its recomputed last token reads is not the null block (Mamba groups "
          "still count from the hit's end)",
          "vllm-0.32.0-hybrid-full-prompt-hit-window-freed"),
    Patch("mamba-external-hit-counts-its-state-block", "fix",
          "align-mode Mamba admission counts the block an external hit's state is "
          "loaded into when the first step's state goes to another block, so "
          "allocate_slots no longer runs out of blocks it said it had (the per-step "
          "check only; the full-sequence estimate is unchanged)",
          "vllm-0.32.0-mamba-external-hit-undercounted"),
    Patch("admission-cap-counts-real-blocks", "fix",
          "the sliding-window and chunked-local admission cap is compared with the real "
          "blocks a request holds, not with its block table's length (null entries for "
          "positions out of the window included), so an async load past its window "
          "reserves the block its next step needs",
          "vllm-0.32.0-window-reservation-counts-null-blocks"),
    # Backports of upstream fixes for findings of older releases only (0.32.0 has
    # the fix already, so they fit only the releases named in their variants).
    Patch("async-load-counts-whole-block", "fix",
          "(backport of #34616) an async load counts its hit when it is issued, and a "
          "finished load caches and counts the tokens loaded, not whole blocks",
          "vllm-0.14.1-async-load-counts-whole-block"),
    Patch("stats-reset-after-preemption", "fix",
          "(backport of #37460) the cache-hit stats are taken at the first prefix lookup "
          "only, not again after a preemption", "vllm-0.24.0-stats-reset-after-preemption"),
    Patch("spec-pad-past-max-model-len", "fix",
          "(backport of #53962) a new request is padded with placeholder drafts only when "
          "there is room for the sampled token", "vllm-0.28.0-spec-pad-past-max-model-len"),
    Patch("preemption-drops-output-in-flight", "fix",
          "(what #48245 and #50297 do from 0.28 on, in the release's own discard idiom) under "
          "async scheduling a request preempted with output in flight has that output "
          "discarded and its placeholders zeroed",
          "vllm-0.24.0-preemption-keeps-placeholders"),
    Patch("stale-output-rolls-back-rejected-drafts", "fix",
          "(#46066's guard, fixed upstream from 0.28 on) under async scheduling with spec "
          "decode, a stale frame's rejected drafts no longer come off the restarted "
          "request's num_computed_tokens and placeholders; on 0.24.0 a forced reset also "
          "discards one frame per request, not one per placeholder",
          "vllm-0.24.0-stale-output-rolls-back-rejected-drafts"),
    Patch("preemption-stops-at-fenced-victim", "fix",
          "(backport of #49675) the allocate/preempt loop stops at a victim whose blocks are "
          "fenced behind a step in flight instead of preempting on, the requester included",
          "vllm-0.28.0-preemption-cascades-past-fenced-victims"),
]}

#: fixes of a connector's scheduler side (a finding whose remedy is the connector's,
#: docs/findings/packets/). kvspec's own ``vllm`` target runs kvspec's connector, so
#: "all" leaves these out there; vLLM's tests run with them (``connectors=True``:
#: the packets and the gate, kvspec/harness/pytest_vllm_fixes.py).
CONNECTOR_FIXES: dict[str, Patch] = {p.id: p for p in [
    Patch("pd-window-groups-back-off-one-token", "fix",
          "NIXL and Mooncake P/D stop one prompt token short for any sliding-window or "
          "chunked-local group, as they do for Mamba and bounded replay, so the decode "
          "node computes the last token with a window laid out for it",
          "vllm-0.32.0-hybrid-full-prompt-hit-window-freed"),
]}

PLANTED: dict[str, Patch] = {p.id: p for p in [
    Patch("preempt-keeps-computed-tokens", "planted",
          "a preempted request keeps its num_computed_tokens though its blocks were freed",
          "blocks_cover_computed"),
    Patch("finished-load-caches-whole-prompt", "planted",
          "a finished async load caches the blocks of the whole prompt, past what it loaded",
          "no_caching_of_invalid_blocks"),
    Patch("async-load-never-started", "planted",
          "the connector is told 0 external tokens for an async load, so it never loads",
          "every_request_finishes"),
    Patch("abort-mid-load-frees-at-once", "planted",
          "a request aborted during its async load frees its blocks at once",
          "target_crashed"),
    Patch("prefill-stats-reset-after-preemption", "planted",
          "the cache-hit stats are set again at the lookup after a preemption",
          "stats_set_exactly_once"),
    Patch("spec-rejections-kept-when-none-accepted", "planted",
          "rejected drafts are rolled back only when at least one draft was accepted",
          "update_from_output_relation"),
    Patch("sharer-resumes-without-waiting", "planted",
          "after a shared load failure a sharer resumes its old prefix at once (on the fix)",
          "computed_means_valid"),
    Patch("recovery-keeps-the-failed-block", "planted",
          "recovery cuts after the first failed block instead of before it (on the fix)",
          "computed_means_valid"),
]}


# -- applying a diff to a module's source -------------------------------------------

def _hunks_by_module(diff_text: str) -> dict[str, list]:
    """Module name -> the diff's hunks for it (``a/vllm/x/y.py`` -> ``vllm.x.y``)."""
    from unidiff import PatchSet
    found: dict[str, list] = {}
    for patched_file in PatchSet(diff_text):
        path = patched_file.source_file
        path = path[2:] if path.startswith("a/") else path
        if not path.endswith(".py") or not path.startswith("vllm/"):
            raise PatchDoesNotFit(f"{path}: not a vLLM module")
        found.setdefault(path[:-3].replace("/", "."), []).extend(patched_file)
    return found


def stage(patch: Patch, texts: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``texts`` (module -> patched source so far) with ``patch`` applied, and
    the drift notes (context that differs from the diff's; empty if it fit as
    written). Every variant is tried as written first, then the base variant
    located by the code it changes (``hunk_apply``). PatchDoesNotFit otherwise,
    with why (its ``reason``: "present" when the source already has the change)."""
    reasons, first_reason = [], None
    for exact in (True, False):
        for variant in _variant_order(patch, exact):
            try:
                staged, drift = dict(texts), []
                for module, hunks in _hunks_by_module(variant.read_text()).items():
                    old = staged.get(module, _source(module))
                    if exact:
                        staged[module] = _apply_exactly(old, hunks, f"{variant.name} {module}")
                    else:
                        staged[module], notes = apply_hunks(old, hunks, f"{variant.name} {module}")
                        drift += notes
                return staged, drift
            except (HunkDoesNotFit, PatchDoesNotFit) as exc:
                if not exact:
                    reasons.append(str(exc))
                    first_reason = first_reason or exc.reason
            except ImportError as exc:  # a module this source does not have
                if not exact:
                    reasons.append(f"{variant.name}: {exc}")
    if not reasons:  # only dated variants, none of which fits as written
        reasons = [f"no variant fits as written ({', '.join(v.name for v in patch.variants)})"]
    raise PatchDoesNotFit(f"{patch.id}: " + "; ".join(reasons), first_reason or "changed")


def _variant_order(patch: Patch, exact: bool) -> list[Path]:
    """Every variant for a fit as written; for a fit located by the code it
    changes, only the base variant (written for the newest release): a dated
    variant is a release's own code, and located loosely on a newer source it
    could repeat what that source already does (a backport over the upstream fix)."""
    if exact:
        return patch.variants
    return [v for v in patch.variants if "@" not in v.stem]


def _apply_exactly(text: str, hunks, where: str) -> str:
    """Each hunk where its old lines (context and removed) occur exactly once."""
    lines = text.splitlines(keepends=True)
    for hunk in hunks:
        old = [ln.value for ln in hunk if ln.is_context or ln.is_removed]
        new = [ln.value for ln in hunk if ln.is_context or ln.is_added]
        at = [i for i in range(len(lines) - len(old) + 1) if lines[i:i + len(old)] == old]
        if len(at) != 1:
            raise PatchDoesNotFit(f"{where}: not as written")
        lines[at[0]:at[0] + len(old)] = new
    return "".join(lines)


@functools.lru_cache(maxsize=None)
def _source(module: str) -> str:
    from kvspec.harness.vllm_source import active
    active()  # the vLLM this process checks is chosen before any of it is imported
    return inspect.getsource(importlib.import_module(module))


# -- building patched modules --------------------------------------------------------

@attrs.frozen
class PatchedVllm:
    """The patched modules, by name, and what was applied or left out."""

    modules: dict[str, types.ModuleType]
    applied: tuple[str, ...]
    #: patch id -> why it was not applied
    skipped: dict[str, str]
    #: patch id -> notes on context that differs from its diff's (applied ids only;
    #: none: it applied as written)
    drift: dict[str, list[str]] = attrs.Factory(dict)
    #: patch id -> why it did not fit: "changed" or "present" (``PatchDoesNotFit``)
    reasons: dict[str, str] = attrs.Factory(dict)
    #: the file name each patched module's code runs under -> (the source's file,
    #: its text, the patched text): coverage of the patched code maps back to it
    files: dict[str, tuple[str, str, str]] = attrs.Factory(dict)

    def get(self, module: str, name: str):
        """``name`` from the patched ``module``, or from the installed one."""
        mod = self.modules.get(module) or importlib.import_module(module)
        return getattr(mod, name)

    @contextlib.contextmanager
    def managers(self):
        """While a scheduler is built: vLLM's KV cache spec registry (0.32) names
        the patched per-group managers, so the patched coordinator builds them.
        The registry is global; it is given back as it was, so unpatched
        schedulers in the same process keep the installed managers."""
        patched = self.modules.get(MANAGERS_MODULE)
        try:
            registry = importlib.import_module("vllm.v1.kv_cache_spec_registry")
        except ImportError:  # older releases map specs to managers in the patched module
            registry = None
        if patched is None or registry is None:
            yield
            return
        registry.KVCacheSpecRegistry._ensure_registered()
        specs = registry._REGISTRY_KVCACHESPEC_LIST
        roles = getattr(registry, "_REGISTRY_ROLE_MANAGERS", {})  # 0.31.0 on
        saved = dict(specs), dict(roles)
        for key, meta in specs.items():
            own = getattr(patched, meta.manager_class.__name__, meta.manager_class)
            specs[key] = dataclasses.replace(meta, manager_class=own)
        for role, manager in roles.items():
            roles[role] = getattr(patched, manager.__name__, manager)
        try:
            yield
        finally:
            specs.clear(), specs.update(saved[0])
            roles.clear(), roles.update(saved[1])


#: vLLM's per-group KV cache managers (full attention, sliding window, Mamba)
MANAGERS_MODULE = "vllm.v1.core.single_type_kv_cache_manager"


def build(patches: list[Patch]) -> PatchedVllm:
    """Apply every patch that fits, each module once with all its hunks, and
    execute the patched modules; a patched module sees the other patched
    modules' classes in place of the installed ones."""
    texts: dict[str, str] = {}
    applied, skipped, drift, reasons = [], {}, {}, {}
    for patch in patches:
        try:
            texts, notes = stage(patch, texts)
        except PatchDoesNotFit as exc:
            skipped[patch.id], reasons[patch.id] = str(exc), exc.reason
            continue
        applied.append(patch.id)
        if notes:
            drift[patch.id] = notes
    modules: dict[str, types.ModuleType] = {}
    files: dict[str, tuple[str, str, str]] = {}
    for name, text in _with_dependent_modules(texts).items():
        with _installed(modules):  # a later module imports the patched earlier ones
            modules[name] = _execute(name, text, sorted(applied))
        original = sys.modules[name].__file__
        files[modules[name].__kvspec_code_file__] = (original, _source(name), text)
    _rebind(modules)
    CODE_FILES.update(files)
    return PatchedVllm(modules, tuple(applied), skipped, drift, reasons, files)


#: every patched module's code file name -> (the source's file, its text, the
#: patched text), for telling a place in patched code as the source's
CODE_FILES: dict[str, tuple[str, str, str]] = {}


def source_place(filename: str, line: int) -> tuple[str, int, bool]:
    """(file, line, inside kvspec's own patch) of a place that may be in a
    patched module: its line in the source's file where the patch left it as it
    was; otherwise the patched line, flagged as kvspec's."""
    if filename not in CODE_FILES:
        return filename, line, False
    original, text, patched = CODE_FILES[filename]
    mapping = _line_maps.get(filename)
    if mapping is None:
        from kvspec.harness.hunk_apply import unchanged_lines
        mapping = _line_maps[filename] = unchanged_lines(text, patched)
    if line in mapping:
        return original, mapping[line], False
    return original, line, True


_line_maps: dict[str, dict[int, int]] = {}


def get_shown_place(filename: str, line: int) -> tuple[str, int]:
    """A place as a report shows it: the source's file from ``vllm/`` on
    (another path as it is), " (in kvspec's fix)" where the line is the
    patch's own (``source_place``), and its line."""
    filename, line, in_patch = source_place(filename, line)
    path = filename.replace("\\", "/")
    short = path[path.rindex("/vllm/") + 1:] if "/vllm/" in path else path
    return short + (" (in kvspec's fix)" if in_patch else ""), line


#: modules that subclass or build a class of another module: executed again when
#: that module is patched, so that (say) AsyncScheduler inherits the patched
#: Scheduler and the Scheduler builds the patched KVCacheManager (listed so that
#: one pass follows the chain)
DEPENDENT_MODULES = {
    "vllm.v1.core.single_type_kv_cache_manager": ("vllm.v1.core.kv_cache_coordinator",),
    "vllm.v1.core.kv_cache_coordinator": ("vllm.v1.core.kv_cache_manager",),
    "vllm.v1.core.kv_cache_manager": ("vllm.v1.core.sched.scheduler",),
    "vllm.v1.core.sched.scheduler": ("vllm.v1.core.sched.async_scheduler",),
}


@contextlib.contextmanager
def _installed(modules: dict[str, types.ModuleType]):
    saved = {name: sys.modules[name] for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        sys.modules.update(saved)


def _with_dependent_modules(texts: dict[str, str]) -> dict[str, str]:
    texts = dict(texts)
    for base, dependents in DEPENDENT_MODULES.items():
        for name in dependents if base in texts else ():
            try:
                texts.setdefault(name, _source(name))
            except ImportError:
                continue  # a release without it (AsyncScheduler came in 0.10)
    return texts


def _execute(name: str, text: str, applied: list[str]) -> types.ModuleType:
    original = importlib.import_module(name)
    module = types.ModuleType(name, original.__doc__)
    module.__dict__.update(__file__=original.__file__, __package__=original.__package__,
                           __spec__=original.__spec__, __loader__=original.__loader__)
    filename = f"{original.__file__} (kvspec patches: {', '.join(applied)})"
    # tracebacks (and a crash's located assert) show the patched source's lines,
    # not the installed file's lines at the patched line numbers
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    code = compile(text, filename, "exec")
    module.__kvspec_code_file__ = filename
    exec(code, module.__dict__)  # noqa: S102 (vLLM's own source, with reviewed diffs)
    return module


def _rebind(modules: dict[str, types.ModuleType]) -> None:
    """Where a patched module imported a name from another patched module, give
    it the patched object."""
    for name, patched in modules.items():
        original = sys.modules[name]
        replace = {id(getattr(original, k)): getattr(patched, k)
                   for k in vars(patched) if hasattr(original, k) and not k.startswith("__")}
        for other_name, other in modules.items():
            if other_name == name:
                continue
            for key, value in list(vars(other).items()):
                if id(value) in replace and replace[id(value)] is not value:
                    setattr(other, key, replace[id(value)])


def select(fixes: str = "all", planted: tuple[str, ...] = (),
           connectors: bool = False) -> list[Patch]:
    """The patches a run asks for: ``fixes`` is "all", "none" or ids joined by
    commas; "all" takes the connector fixes too only with ``connectors``."""
    known = FIXES | CONNECTOR_FIXES
    if fixes == "all":
        chosen = list((known if connectors else FIXES).values())
    elif fixes == "none":
        chosen = []
    else:
        ids = [i.strip() for i in fixes.split(",") if i.strip()]
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise ValueError(f"unknown fix {unknown[0]!r}; known: {', '.join(known)}")
        chosen = [p for pid, p in known.items() if pid in ids]  # in this order: it is
        # the order they are staged in, and a later fix may sit beside an earlier one
    edits = []
    for pid in planted:
        if pid not in PLANTED:
            raise ValueError(f"unknown planted bug {pid!r}; known: {', '.join(PLANTED)}")
        (edits if PLANTED[pid].kind == "edit" else chosen).append(PLANTED[pid])
    # an edit is the source under review: it comes first, and the fixes apply
    # over it exactly as they would over a source that carries it
    return edits + chosen


def register_edit(diff: Path) -> str:
    """Make a source edit (a diff against the installed vLLM) a patch that a
    target can name, ``vllm?plant=edit:<stem>``: the in-process twin of
    checking a copy of vLLM that carries the edit (``--vllm COPY``), for
    replaying a review battery's traces in one process."""
    diff = Path(diff).resolve()
    pid = f"edit:{diff.stem}"
    PLANTED[pid] = Patch(pid, "edit", f"the edit {diff.name}", "", file=diff)
    return pid


@functools.lru_cache(maxsize=None)
def patched(fixes: str = "all", planted: tuple[str, ...] = (),
            connectors: bool = False) -> PatchedVllm:
    """The installed vLLM with the chosen patches (built once per choice)."""
    return build(select(fixes, planted, connectors))
