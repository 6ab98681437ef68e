"""Typed requests: each call's parameters parsed once, at the edge.

Every method kreld serves has a frozen record here whose fields are the
method's parameters as ``io.kreld.varlink`` declares them (checked at
import).  :func:`parse` turns a call's ``parameters`` object into one:
an unknown parameter, or one not of its declared type, is
:class:`~kreld.errors.InvalidArgument` naming it (on the wire
``org.varlink.service.InvalidParameter``).  A few fields are parsed further
than their declared type (``addresses`` into integers, ``clock`` into a
:class:`~kreld.model.Clock`); their parsers are at least as strict as the
interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from kreld.errors import InvalidArgument
from kreld.interface import INTERFACES, Interface, Type, matches
from kreld.model import Clock
from kreld.record import field, fields, record, replace

# Addresses one Resolve may ask about: its reply (some 30 bytes an address)
# is built in memory, so this bounds what one call can make the daemon hold.
MAX_RESOLVE_ADDRESSES = 100_000
# Longest string parameter (a boot-id, a clock, an interface name) accepted.
MAX_STRING = 256


def invalid(name: str) -> InvalidArgument:
    return InvalidArgument(name, "rejected by kreld")


def parse_addresses(raw: object) -> list[int]:
    """Resolve's ``addresses``: at most :data:`MAX_RESOLVE_ADDRESSES` hex
    strings (``0x`` optional), each below 2**64."""
    if not isinstance(raw, list) or len(raw) > MAX_RESOLVE_ADDRESSES:
        raise invalid("addresses")
    try:
        # int() in one pass, then what parse_addr() checks, for all at once:
        # int() took only strings; no "_" digit separators; no value past 64 bits.
        addrs = [int(a, 16) for a in raw]
        if "_" in "".join(raw) or (addrs and not 0 <= min(addrs) <= max(addrs) < 1 << 64):
            raise ValueError("not 64-bit hex addresses")
    except (ValueError, TypeError) as e:
        raise invalid("addresses") from e
    return addrs


def parse_clock(raw: object) -> Clock:
    if raw is None:
        return Clock.MONOTONIC
    if not isinstance(raw, str):
        raise invalid("clock")
    try:
        return Clock(raw)
    except ValueError as e:
        raise invalid("clock") from e


# Fields parsed further than their declared type, by these functions (given
# None when the parameter is absent).
_CLOCK = {"parse": parse_clock}
_ADDRESSES = {"parse": parse_addresses}


class Request:
    """A call's parameters, typed; subclasses name their interface and method."""

    __slots__ = ()

    INTERFACE: ClassVar[str] = "io.kreld"
    METHOD: ClassVar[str]


@record
class GetInfo(Request):
    INTERFACE = "org.varlink.service"
    METHOD = "GetInfo"


@record
class GetInterfaceDescription(Request):
    INTERFACE = "org.varlink.service"
    METHOD = "GetInterfaceDescription"
    interface: str


@record
class GetBoot(Request):
    METHOD = "GetBoot"
    boot_id: str | None = None


@record
class ListBoots(Request):
    METHOD = "ListBoots"


@record
class Snapshot(Request):
    METHOD = "Snapshot"


@record
class GetModules(Request):
    METHOD = "GetModules"
    boot_id: str | None = None
    at: int | None = None
    clock: Clock = field(default=Clock.MONOTONIC, metadata=_CLOCK)
    all: bool = False


@record
class Resolve(Request):
    METHOD = "Resolve"
    addresses: list[int] = field(metadata=_ADDRESSES)
    boot_id: str | None = None
    at: int | None = None
    clock: Clock = field(default=Clock.MONOTONIC, metadata=_CLOCK)


@record
class ExportKallsyms(Request):
    METHOD = "ExportKallsyms"
    boot_id: str | None = None
    at: int | None = None
    clock: Clock = field(default=Clock.MONOTONIC, metadata=_CLOCK)


@record
class Status(Request):
    METHOD = "Status"


@record
class Subscribe(Request):
    METHOD = "Subscribe"


R = TypeVar("R", bound=Request)


@record
class _Field:
    name: str
    type: Type
    parse: Callable[[object], Any] | None


@record
class _Spec:
    interface: Interface
    fields: tuple[_Field, ...]
    names: frozenset[str]
    bare: Request | None  # the request of a call without parameters, when it may have none


def _spec_of(cls: type[Request]) -> _Spec:
    """The declared parameters of *cls*'s method, which must be its fields."""
    iface = INTERFACES[cls.INTERFACE]
    declared = iface.methods[cls.METHOD].parameters
    own = fields(cls)
    if [f.name for f in own] != list(declared):
        raise TypeError(f"{cls.__name__} does not have the parameters {cls.METHOD} declares")
    spec = _Spec(
        iface,
        tuple(_Field(f.name, declared[f.name], f.metadata.get("parse")) for f in own),
        frozenset(declared),
        None,
    )
    try:
        bare: Request | None = _parse(cls, spec, {})
    except InvalidArgument:
        bare = None
    return replace(spec, bare=bare)


def parse(cls: type[R], params: Mapping[str, Any]) -> R:
    """A call's *params* as a *cls*, checked against the interface."""
    spec = _SPECS[cls]
    if not params and spec.bare is not None:
        return spec.bare  # type: ignore[return-value]
    for k in params:
        if k not in spec.names:
            raise invalid(k)
    return _parse(cls, spec, params)


def _parse(cls: type[R], spec: _Spec, params: Mapping[str, Any]) -> R:
    kwargs: dict[str, Any] = {}
    for f in spec.fields:
        v = params.get(f.name)
        if f.parse is not None:
            kwargs[f.name] = f.parse(v)
        elif v is None:
            if not f.type.optional:
                raise invalid(f.name)
        elif not matches(v, f.type, spec.interface.types) or (
            isinstance(v, str) and len(v) > MAX_STRING
        ):
            raise invalid(f.name)
        else:
            kwargs[f.name] = v
    return cls(**kwargs)


REQUESTS: tuple[type[Request], ...] = (
    GetInfo,
    GetInterfaceDescription,
    GetBoot,
    ListBoots,
    Snapshot,
    GetModules,
    Resolve,
    ExportKallsyms,
    Status,
    Subscribe,
)
_SPECS = {cls: _spec_of(cls) for cls in REQUESTS}
