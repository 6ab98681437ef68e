"""JSON from someone else, read within bounds and checked against a shape.

``json.loads`` recurses once per nesting level (100,000 levels is a
RecursionError), accepts ``NaN`` and ``Infinity``, turns any run of digits into
an int, and leaves every field whatever type the writer chose.  A reader of the
fleet bucket must trust none of that, so:

* :func:`max_depth` measures the nesting before anything is parsed: strings are
  blanked (brackets inside them do not nest), then the running depth is the
  cumulative sum of ``[{`` as +1 and ``]}`` as -1, a chunk at a time (linear;
  numpy does the sums);
* :func:`loads` refuses a document nested deeper than asked, or holding
  ``NaN``/``Infinity``, and returns the parsed value;
* :func:`check` walks a value against a shape made of :class:`Str`,
  :class:`Int`, :class:`Bool`, :class:`Opt`, :class:`List`, :class:`Map` and
  :class:`Obj` (strings and lists bounded in length, integers in range, objects
  with the fields they must and may have), raising :class:`ShapeError` that
  names the path of the first field that does not fit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "Bool",
    "Int",
    "JsonRefused",
    "List",
    "Map",
    "Obj",
    "Opt",
    "Shape",
    "ShapeError",
    "Str",
    "check",
    "loads",
    "max_depth",
]

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_CHUNK = 1 << 20
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class JsonRefused(ValueError):
    """Not JSON this reader takes: malformed, too deep, or a non-finite number."""


class ShapeError(ValueError):
    """A parsed value that does not have the shape asked for."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path or 'the document'}: {what}")
        self.path = path
        self.what = what


def max_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in *data* (linear in its size)."""
    blank = _STRING.sub(b'""', data)
    depth = deepest = 0
    view = np.frombuffer(blank, dtype=np.uint8)
    for at in range(0, len(view), _CHUNK):
        steps = _OPEN[view[at : at + _CHUNK]].astype(np.int32)
        if not steps.any():
            continue
        run = np.cumsum(steps) + depth
        deepest = max(deepest, int(run.max()))
        depth = int(run[-1])
    return deepest


def _no_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a number this reader takes")


def loads(data: bytes, depth: int) -> Any:
    """*data* parsed, refused when nested deeper than *depth* or not plain JSON."""
    deep = max_depth(data)
    if deep > depth:
        raise JsonRefused(f"nested {deep} deep, more than {depth}")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except JsonRefused:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise JsonRefused(f"not JSON: {e}") from e


# -- shapes --------------------------------------------------------------------------


class Shape:
    def check(self, v: Any, path: str) -> None:
        raise NotImplementedError


class Str(Shape):
    def __init__(self, max_len: int, pattern: str | None = None) -> None:
        self.max_len = max_len
        self.pattern = re.compile(pattern) if pattern else None

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, str):
            raise ShapeError(path, f"a {_kind(v)} where a string belongs")
        if len(v) > self.max_len:
            raise ShapeError(path, f"a string of {len(v):,} characters, more than {self.max_len:,}")
        if self.pattern is not None and not self.pattern.fullmatch(v):
            raise ShapeError(path, f"{v[:80]!r} is not of the form {self.pattern.pattern}")


class Int(Shape):
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ShapeError(path, f"a {_kind(v)} where an integer belongs")
        if not self.lo <= v <= self.hi:
            raise ShapeError(path, f"{v} out of range [{self.lo}, {self.hi}]")


class Bool(Shape):
    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, bool):
            raise ShapeError(path, f"a {_kind(v)} where true or false belongs")


class Opt(Shape):
    """*inner*, or null."""

    def __init__(self, inner: Shape) -> None:
        self.inner = inner

    def check(self, v: Any, path: str) -> None:
        if v is not None:
            self.inner.check(v, path)


class List(Shape):
    def __init__(self, item: Shape, max_len: int) -> None:
        self.item, self.max_len = item, max_len

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, list):
            raise ShapeError(path, f"a {_kind(v)} where an array belongs")
        if len(v) > self.max_len:
            raise ShapeError(path, f"{len(v):,} items, more than {self.max_len:,}")
        for i, x in enumerate(v):
            self.item.check(x, f"{path}[{i}]")


class Map(Shape):
    """An object used as a dictionary: keys of one shape, values of another."""

    def __init__(self, key: Str, value: Shape, max_len: int) -> None:
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict):
            raise ShapeError(path, f"a {_kind(v)} where an object belongs")
        if len(v) > self.max_len:
            raise ShapeError(path, f"{len(v):,} members, more than {self.max_len:,}")
        for k, x in v.items():
            self.key.check(k, f"{path} key")
            self.value.check(x, f"{path}.{k[:64]}")


class Obj(Shape):
    """An object with *required* fields and *optional* ones (others are allowed:
    a later writer of the same version may add some, as JSON readers expect)."""

    def __init__(
        self, required: Mapping[str, Shape], optional: Mapping[str, Shape] | None = None
    ) -> None:
        self.required = dict(required)
        self.optional = dict(optional or {})

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict):
            raise ShapeError(path, f"a {_kind(v)} where an object belongs")
        for k, shape in self.required.items():
            if k not in v:
                raise ShapeError(f"{path}.{k}" if path else k, "missing")
            shape.check(v[k], f"{path}.{k}" if path else k)
        for k, shape in self.optional.items():
            if k in v:
                shape.check(v[k], f"{path}.{k}" if path else k)


def check(v: Any, shape: Shape, path: str = "") -> None:
    shape.check(v, path)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}.get(
        type(v), "object"
    )
