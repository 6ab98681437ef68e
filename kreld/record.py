"""``@record``: a frozen, slotted dataclass that costs a fifth as much to define.

Every start of ``kreld`` and ``kreldctl`` defines some forty frozen records.
On Python 3.11, ``@dataclass(frozen=True, slots=True)`` compiles six
methods for each, one ``exec`` apiece (``__init__``, ``__repr__``,
``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``): 1.1 ms a class
here, some 40 ms of every start (``bench/bench_startup.py``).

:func:`record` lets :func:`dataclasses.dataclass` do everything but the
methods: the fields (defaults, factories, metadata), ``__slots__`` and
``__match_args__``; the result is a real dataclass, so
:func:`dataclasses.fields`, :func:`~dataclasses.replace` and
:func:`~dataclasses.asdict` work on it.  Only ``__init__`` is compiled, since
its signature must be the fields'; equality, hashing, ``repr`` and the
frozen ``__setattr__`` are shared functions over an
:func:`operator.attrgetter` of the fields, which make and compare records
as fast as the generated ones.  0.22 ms a class.

What it leaves out, and refuses: ``__post_init__``, ``InitVar``, and fields
with ``init``, ``repr``, ``compare`` or ``hash`` set, or ``kw_only``.  Use
``@dataclass`` where a record needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, FrozenInstanceError
from operator import attrgetter
from typing import Any, TypeVar, dataclass_transform

T = TypeVar("T")

_object_setattr = object.__setattr__


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _check(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> None:
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"@record {cls.__qualname__}: __post_init__ needs @dataclass")
    for f in fields:
        if not (f.init and f.repr and f.compare) or f.hash is not None or f.kw_only:
            raise TypeError(f"@record {cls.__qualname__}.{f.name}: field options need @dataclass")


def _init(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> Callable[..., None]:
    """``__init__(self, <fields>)``, setting each through ``object.__setattr__``."""
    env: dict[str, Any] = {"_set": _object_setattr, "_NONE": MISSING}
    params, body = [], []
    for f in fields:
        n = f.name
        if f.default is not MISSING:
            env[f"_d_{n}"] = f.default
            params.append(f"{n}=_d_{n}")
            body.append(f" _set(self,'{n}',{n})")
        elif f.default_factory is not MISSING:
            env[f"_f_{n}"] = f.default_factory
            params.append(f"{n}=_NONE")
            body.append(f" _set(self,'{n}',_f_{n}() if {n} is _NONE else {n})")
        else:
            params.append(n)
            body.append(f" _set(self,'{n}',{n})")
    src = f"def __init__(self,{','.join(params)}):\n" + ("\n".join(body) or " pass")
    ns: dict[str, Any] = {}
    exec(src, env, ns)
    init: Callable[..., None] = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[T]) -> type[T]:
    """Make *cls* a frozen dataclass with ``__slots__`` (see the module's docstring)."""
    new: Any = dataclasses.dataclass(cls, init=False, repr=False, eq=False, slots=True)
    fields = dataclasses.fields(new)
    _check(new, fields)
    names = tuple(f.name for f in fields)
    key: Callable[[Any], Any] = attrgetter(*names) if names else (lambda self: ())

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is self.__class__:
            return bool(key(self) == key(other))
        return NotImplemented

    def __hash__(self: Any) -> int:
        return hash(key(self))

    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{self.__class__.__qualname__}({inner})"

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        # pickle and copy: rebuild through __init__ (the frozen __setattr__
        # refuses the default slot-by-slot restore).
        return self.__class__, tuple(getattr(self, n) for n in names)

    methods: dict[str, Any] = {
        "__init__": _init(new, fields),
        "__eq__": __eq__,
        "__hash__": __hash__,
        "__repr__": __repr__,
        "__reduce__": __reduce__,
        "__setattr__": _frozen_setattr,
        "__delattr__": _frozen_delattr,
    }
    for name, fn in methods.items():
        if name != "__init__" and fn.__qualname__.startswith("record."):
            fn.__qualname__ = f"{new.__qualname__}.{name}"
        setattr(new, name, fn)
    # What dataclasses reports of the class is what it is: frozen, with eq.
    params = getattr(new, "__dataclass_params__", None)
    for flag in ("init", "repr", "eq", "frozen"):
        if hasattr(params, flag):
            _object_setattr(params, flag, True)
    return new  # type: ignore[no-any-return]
