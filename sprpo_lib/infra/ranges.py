"""Value ranges of config options: declared once, in the field's type, and checked where a
config is read.

A numeric field of a config dataclass states its range with :mod:`annotated_types`::

    lr: Annotated[float, Gt(0)] = 3e-6
    max_steps: Annotated[int, Ge(1)] | None = None

:func:`check_value` checks one value (the config reader calls it with the option's dotted
key), :func:`check_ranges` a whole dataclass instance (each config's ``__post_init__`` calls
it, so a config built in Python is checked too).  A value outside its range is one
``ValueError`` naming the key, the value, the range and a valid example, e.g.
``update.lr=-0.1: out of range; expected a number > 0; for example update.lr=3.0e-06``.
Bottom layer: imports nothing from the package.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any

import annotated_types as at

_BOUNDS = (at.Gt, at.Ge, at.Lt, at.Le)


def constraints(t) -> list:
    """The bounds (``Gt``/``Ge``/``Lt``/``Le``; an ``Interval`` split into them) an
    ``Annotated`` type declares; ``[]`` for any other type."""
    if typing.get_origin(t) is not typing.Annotated:
        return []
    out = []
    for m in t.__metadata__:
        if isinstance(m, at.Interval):
            out += list(m)
        elif isinstance(m, _BOUNDS):
            out.append(m)
    return out


def _num(x) -> str:
    return format(x, "g") if isinstance(x, float) else str(x)


_SIGNS = {at.Gt: ">", at.Ge: ">=", at.Lt: "<", at.Le: "<="}


def describe(cs: list) -> str:
    """A set of bounds as text: ``> 0``, ``>= 1``, ``<= 0``, ``in (0, 1]`` (``""``: none)."""
    lo = next((c for c in cs if isinstance(c, (at.Gt, at.Ge))), None)
    hi = next((c for c in cs if isinstance(c, (at.Lt, at.Le))), None)
    if lo is not None and hi is not None:
        return (f"in {'(' if isinstance(lo, at.Gt) else '['}{_num(_bound(lo))}, "
                f"{_num(_bound(hi))}{')' if isinstance(hi, at.Lt) else ']'}")
    return " and ".join(f"{_SIGNS[type(c)]} {_num(_bound(c))}" for c in cs)


def _bound(c):
    return getattr(c, type(c).__name__.lower())


def _inside(value, cs: list) -> bool:
    ops = {at.Gt: lambda v, b: v > b, at.Ge: lambda v, b: v >= b, at.Lt: lambda v, b: v < b,
           at.Le: lambda v, b: v <= b}
    return all(ops[type(c)](value, _bound(c)) for c in cs)


def _base(t):
    return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t


def _is_number(value, base) -> bool:
    """An int for an int field, an int or float for a float field; never a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral if base is int else numbers.Real)


def _ok(value, t) -> bool:
    cs = constraints(t)
    return not cs or (_is_number(value, _base(t)) and _inside(value, cs))


def _what(base, plural: bool = False) -> str:
    if base is int:
        return "integers" if plural else "an integer"
    return "numbers" if plural else "a number"


def show(value) -> str:
    """``value`` as an override writes it: a list as ``[a,b]``, a float in a form YAML reads
    as a float (``3.0e-06``: YAML takes ``3e-06`` for a string)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
        return repr(value).replace("e", ".0e")
    return repr(value) if isinstance(value, str) else str(value)


def valid_example(t) -> Any:
    """A value inside the range the type ``t`` declares (for messages where a field's
    default is none); ``None`` where ``t`` declares none."""
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        arms = [a for a in typing.get_args(t) if a is not type(None)]
        return valid_example(arms[0]) if len(arms) == 1 else None
    cs, base = constraints(t), _base(t)
    if not cs:
        return None
    for c in cs:
        if isinstance(c, (at.Ge, at.Le)):
            return _bound(c)
    lo = next((_bound(c) for c in cs if isinstance(c, at.Gt)), None)
    hi = next((_bound(c) for c in cs if isinstance(c, at.Lt)), None)
    step = 1 if base is int else 0.1
    if lo is not None and hi is not None:
        return (lo + hi) // 2 if base is int and hi - lo > 1 else (lo + hi) / 2
    return lo + step if lo is not None else (hi - step if hi is not None else 0)


def _elements(t, n: int) -> list | None:
    """The element types of the tuple type ``t`` for ``n`` elements (None: no match)."""
    args = typing.get_args(t)
    if len(args) == 2 and args[1] is Ellipsis:
        return [args[0]] * n
    return list(args) if len(args) == n else None


def check_value(key: str, value: Any, t, example: Any = None) -> Any:
    """``value`` when it lies in the range the type ``t`` declares for config key ``key``
    (``Annotated`` bounds; ``None`` passes where ``t`` is optional; a tuple is checked
    element by element); else one ``ValueError`` naming the key, the value, the range and
    a valid example (``example`` when it is one, else one from the bounds)."""
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        arms = [a for a in typing.get_args(t) if a is not type(None)]
        return value if value is None or len(arms) != 1 else check_value(key, value, arms[0], example)
    if typing.get_origin(_base(t)) is tuple and isinstance(value, (list, tuple)):
        each = _elements(_base(t), len(value)) or []
        bad = next((a for v, a in zip(value, each) if not _ok(v, a)), None)
        if bad is None:
            return value
        kinds = _elements(_base(t), len(example)) if isinstance(example, (list, tuple)) and example else None
        if not (kinds and all(_ok(x, e) for x, e in zip(example, kinds))):
            example = [valid_example(e) for e in each]
        what, text = _what(_base(bad), plural=True), describe(constraints(bad))
        raise ValueError(f"{key}={show(value)}: out of range; expected {what} {text}; for example {key}={show(example)}")
    if _ok(value, t):
        return value
    base, text = _base(t), describe(constraints(t))
    if not _ok(example, t):
        example = valid_example(t)
    why = "out of range" if _is_number(value, base) else "not " + _what(base)
    raise ValueError(f"{key}={show(value)}: {why}; expected {_what(base)} {text}; for example {key}={show(example)}")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=True)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return None


def check_ranges(obj, where: str = "") -> None:
    """Every field of the dataclass instance ``obj`` against the range its type declares
    (:func:`check_value`; nested dataclasses recursively, their keys dotted below
    ``where``); the first value outside is the ``ValueError``."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ranges(value, f"{where}{f.name}.")
        else:
            check_value(where + f.name, value, hints[f.name], _default(f))
