"""Connectives that evaluate on Python values and on Z3 terms alike.

The spec's arithmetic is written once with these helpers; on plain ints and
bools they cost one isinstance check, on Z3 expressions they build terms. Z3
is imported lazily so concrete checking never pays for it.
"""
from __future__ import annotations


_CONCRETE = frozenset({int, bool, float, str, type(None)})


def _is_symbolic(*values) -> bool:
    for v in values:  # the common case, plain Python values, costs one set lookup each
        if type(v) not in _CONCRETE and type(v).__module__.startswith("z3"):
            return True
    return False


def If(cond, then, other):
    if _is_symbolic(cond, then, other):
        import z3
        return z3.If(cond, then, other)
    return then if cond else other


def And(*conds):
    if _is_symbolic(*conds):
        import z3
        return z3.And(*conds)
    return all(conds)


def Or(*conds):
    if _is_symbolic(*conds):
        import z3
        return z3.Or(*conds)
    return any(conds)


def Not(cond):
    if _is_symbolic(cond):
        import z3
        return z3.Not(cond)
    return not cond


def Implies(a, b):
    if _is_symbolic(a, b):
        import z3
        return z3.Implies(a, b)
    return (not a) or b


def Min(a, b):
    return If(a <= b, a, b)


def Max(a, b):
    return If(a >= b, a, b)


def cdiv(a, b):
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return (a + b - 1) / b if _is_symbolic(a, b) else -(-a // b)


def fdiv(a, b):
    """Floor division for non-negative ``a`` and positive ``b`` (Z3's integer
    division agrees there)."""
    return a / b if _is_symbolic(a, b) else a // b
