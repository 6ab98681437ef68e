"""``@record``: kreld's one record system, for every frozen record of kreld/.

Why not ``@dataclass(frozen=True, slots=True)``, measured (bench/bench_startup.py,
tests/core/test_record.py; the figures are in bench/RESULTS.md, not here, where they
would go stale):

* a frozen, slotted dataclass compiles six methods for each class, one
  ``exec`` apiece, and every start of ``kreld`` and ``kreldctl`` defines some
  fifty records: :func:`record` compiles ``__init__`` alone (tests/core/test_record.py
  holds it to under half a dataclass's cost) and shares the rest;
* importing :mod:`dataclasses` imports :mod:`inspect` (and with it ``ast``,
  ``dis``, ``tokenize``), a sixth of a ``kreldctl`` command that needs neither;
  kreldctl's store path imports neither (tests/core/test_record.py).  The daemon gets
  :mod:`dataclasses` through structlog anyway; its records are still ``@record``,
  so that there is one kind of record to read, test and pickle.
* per call, ``__init__`` is a little faster and ``==`` and ``hash`` a little
  slower than a dataclass's; no record is hashed per address.

Mutable state (a connection's counters, a running daemon's parts) is a plain
class with ``__slots__``, never a record whose lists are appended to.

:func:`record` reads the class's annotations itself (``ClassVar`` ones are
not fields), gives the class ``__slots__`` and ``__match_args__``, compiles
only ``__init__`` (its signature must be the fields'), and shares the rest:
equality, hashing, ``repr`` and the frozen ``__setattr__`` work over an
:func:`operator.attrgetter` of the fields.  :func:`field` gives a default
factory, metadata or ``compare=False``; :func:`fields` and :func:`replace` are
the counterparts of :mod:`dataclasses`' own.  Assigning to a record raises
:class:`FrozenInstanceError`, an ``AttributeError``.  There is no
``__post_init__``, ``InitVar`` or keyword-only field: a record is plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any, ClassVar, TypeVar, dataclass_transform

__all__ = ["MISSING", "Field", "FrozenInstanceError", "T", "field", "fields", "record", "replace"]

T = TypeVar("T")

_object_setattr = object.__setattr__


class FrozenInstanceError(AttributeError):
    """An assignment to (or deletion of) a field of a record."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
_EMPTY: Mapping[str, Any] = {}


class Field:
    """One field of a record, as :func:`fields` returns it."""

    __slots__ = ("compare", "default", "default_factory", "metadata", "name", "type")

    def __init__(
        self,
        default: Any = MISSING,
        default_factory: Callable[[], Any] | Any = MISSING,
        metadata: Mapping[str, Any] | None = None,
        compare: bool = True,
    ) -> None:
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("a field takes a default or a default_factory, not both")
        self.name = ""
        self.type: Any = None
        self.default = default
        self.default_factory = default_factory
        self.metadata: Mapping[str, Any] = metadata or _EMPTY
        self.compare = compare

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, type={self.type!r}, default={self.default!r})"


def field(
    *,
    default: Any = MISSING,
    default_factory: Callable[[], Any] | Any = MISSING,
    metadata: Mapping[str, Any] | None = None,
    compare: bool = True,
) -> Any:
    """A field's default, default factory, metadata or exclusion from ``==``."""
    return Field(default, default_factory, metadata, compare)


def fields(obj: object) -> tuple[Field, ...]:
    """The fields of a record (class or instance), in order."""
    try:
        return obj.__record_fields__  # type: ignore[attr-defined,no-any-return]
    except AttributeError:
        raise TypeError(f"{obj!r} is not a record") from None


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of the record *obj* with *changes* to some of its fields."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    values.update(changes)
    return obj.__class__(**values)


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _is_classvar(annotation: object) -> bool:
    if isinstance(annotation, str):  # from __future__ import annotations
        return annotation.startswith(("ClassVar", "typing.ClassVar"))
    return getattr(annotation, "__origin__", annotation) is ClassVar


def _own_fields(cls: type) -> list[Field]:
    out = []
    # Python >= 3.10: a class's __annotations__ are its own, never a base's.
    for name, annotation in getattr(cls, "__annotations__", {}).items():
        if _is_classvar(annotation):
            continue
        value = cls.__dict__.get(name, MISSING)
        f = value if isinstance(value, Field) else Field(default=value)
        f.name, f.type = name, annotation
        out.append(f)
    return out


def _init(qualname: str, fields: tuple[Field, ...]) -> Callable[..., None]:
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
            if any(p.partition("=")[2] for p in params):
                raise TypeError(f"{qualname}: field {n!r} without a default follows one with")
            params.append(n)
            body.append(f" _set(self,'{n}',{n})")
    src = f"def __init__(self,{','.join(params)}):\n" + ("\n".join(body) or " pass")
    ns: dict[str, Any] = {}
    exec(src, env, ns)
    init: Callable[..., None] = ns["__init__"]
    init.__qualname__ = f"{qualname}.__init__"
    return init


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make *cls* a frozen record with ``__slots__`` (see the module's docstring)."""
    inherited: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        for f in getattr(base, "__record_fields__", ()):
            inherited[f.name] = f
    own = _own_fields(cls)
    for f in own:
        inherited.pop(f.name, None)
    all_fields = (*inherited.values(), *own)
    if "__post_init__" in cls.__dict__:
        raise TypeError(f"@record {cls.__qualname__}: no __post_init__ in a record")
    names = tuple(f.name for f in all_fields)
    compared = tuple(f.name for f in all_fields if f.compare)
    key: Callable[[Any], Any] = attrgetter(*compared) if compared else (lambda self: ())

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
        # pickle and copy rebuild through __init__: the frozen __setattr__
        # refuses the default slot-by-slot restore.
        return self.__class__, tuple(getattr(self, n) for n in names)

    ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    for f in own:
        ns.pop(f.name, None)  # a default would shadow the slot
    ns["__slots__"] = tuple(f.name for f in own)
    ns["__match_args__"] = names
    ns["__record_fields__"] = all_fields
    ns["__init__"] = _init(cls.__qualname__, all_fields)
    ns["__setattr__"] = _frozen_setattr
    ns["__delattr__"] = _frozen_delattr
    for name, fn in (("__eq__", __eq__), ("__hash__", __hash__), ("__repr__", __repr__)):
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
        ns[name] = fn
    ns["__reduce__"] = __reduce__
    meta: Any = type(cls)
    new = meta(cls.__name__, cls.__bases__, ns)
    new.__qualname__ = cls.__qualname__
    return new  # type: ignore[no-any-return]
