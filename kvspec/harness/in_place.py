"""kvspec's fixes installed into vLLM's own classes, not beside them.

``vllm_patches.build`` executes each patched module again, so a fix lives in
a copy of ``Scheduler``: a test's ``isinstance`` on the installed class, a
subclass vLLM or the test defines (``AsyncScheduler``, a diffusion scheduler),
and any module that imported the class before see the unfixed one. Here every
member a patch changed or added (a method, a property, a module-level helper)
is set on the installed class or module instead, rebound to the installed
module's globals (and, for ``super()``, to the installed class), so every
subclass and every importer runs the fix. Members the patches left alone stay
as they are. ``InPlace.install`` returns an undo.
"""
from __future__ import annotations

import sys
import types

import attrs

_MISSING = object()


def is_same_code(a, b) -> bool:
    """Two functions' code is the same, line numbers aside."""
    if not (isinstance(a, types.CodeType) and isinstance(b, types.CodeType)):
        return a == b
    if (a.co_code, a.co_names, a.co_varnames, a.co_freevars) != \
            (b.co_code, b.co_names, b.co_varnames, b.co_freevars):
        return False
    return len(a.co_consts) == len(b.co_consts) and all(
        is_same_code(x, y) for x, y in zip(a.co_consts, b.co_consts))


def get_functions(member) -> list:
    """The functions a class member wraps (a method, a static or class
    method, a property's accessors)."""
    if isinstance(member, types.FunctionType):
        return [member]
    if isinstance(member, (staticmethod, classmethod)):
        return get_functions(member.__func__)
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    return []


def is_changed(new, old) -> bool:
    """A patch changed (or added) this member."""
    if old is _MISSING:
        return True
    new_funcs, old_funcs = get_functions(new), get_functions(old)
    if not new_funcs:
        return False  # constants, nested classes: left as installed
    return len(new_funcs) != len(old_funcs) or not all(
        is_same_code(a.__code__, b.__code__) for a, b in zip(new_funcs, old_funcs))


def rebind_function(f: types.FunctionType, namespace: dict, classes: dict):
    """``f`` running in the installed module (``namespace``), its ``__class__``
    cell (``super()``) naming the installed class (``classes``: copy -> installed)."""
    closure = None
    if f.__closure__:
        closure = tuple(types.CellType(classes.get(id(c.cell_contents), c.cell_contents))
                        if _has_contents(c) else c for c in f.__closure__)
    g = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, closure)
    g.__kwdefaults__, g.__qualname__ = f.__kwdefaults__, f.__qualname__
    g.__dict__.update(f.__dict__)
    g.__doc__, g.__annotations__ = f.__doc__, getattr(f, "__annotations__", {})
    return g


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def rebind(member, namespace: dict, classes: dict):
    if isinstance(member, types.FunctionType):
        return rebind_function(member, namespace, classes)
    if isinstance(member, (staticmethod, classmethod)):
        return type(member)(rebind(member.__func__, namespace, classes))
    if isinstance(member, property):
        return property(*(rebind(f, namespace, classes) if f else None
                          for f in (member.fget, member.fset, member.fdel)), member.__doc__)
    return member


@attrs.define
class InPlace:
    """What installing a ``PatchedVllm`` in place sets: (owner, name, value)."""

    edits: list[tuple[object, str, object]] = attrs.Factory(list)

    @classmethod
    def of(cls, modules: dict[str, types.ModuleType]) -> InPlace:
        """The edits that carry the patched ``modules`` into the installed ones."""
        plan = cls()
        for name, patched in modules.items():
            plan.plan_module(sys.modules[name], patched)
        return plan

    def plan_module(self, installed: types.ModuleType, patched: types.ModuleType) -> None:
        classes = {id(v): getattr(installed, k) for k, v in vars(patched).items()
                   if isinstance(v, type) and isinstance(getattr(installed, k, None), type)}
        namespace = vars(installed)
        for key, new in vars(patched).items():
            old = getattr(installed, key, _MISSING)
            if isinstance(new, type) and getattr(new, "__module__", "") == patched.__name__:
                if isinstance(old, type):
                    self.plan_class(old, new, namespace, classes)
            elif key.startswith("__"):
                continue
            elif isinstance(new, types.FunctionType) and new.__module__ == patched.__name__:
                if is_changed(new, old):
                    self.edits.append((installed, key, rebind(new, namespace, classes)))
            elif old is _MISSING:  # a constant a fix added
                self.edits.append((installed, key, new))

    def plan_class(self, old: type, new: type, namespace: dict, classes: dict) -> None:
        for key, member in vars(new).items():
            if key in ("__dict__", "__weakref__", "__doc__", "__module__"):
                continue
            if is_changed(member, vars(old).get(key, _MISSING)):
                self.edits.append((old, key, rebind(member, namespace, classes)))

    def install(self):
        """Set every edit; returns the undo (which puts back what was there)."""
        saved = [(owner, key, vars(owner).get(key, _MISSING)) for owner, key, _ in self.edits]
        for owner, key, value in self.edits:
            setattr(owner, key, value)

        def undo() -> None:
            for owner, key, value in reversed(saved):
                if value is _MISSING:
                    delattr(owner, key)
                else:
                    setattr(owner, key, value)
        return undo

    def get_names(self) -> list[str]:
        return sorted(f"{getattr(o, '__qualname__', getattr(o, '__name__', o))}.{k}"
                      for o, k, _ in self.edits)
