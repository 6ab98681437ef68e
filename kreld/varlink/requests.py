"""Typed requests: each call's parameters parsed once, at the edge.

Every method kreld serves has a frozen record here whose fields are the
method's parameters as ``io.kreld.varlink`` declares them (checked at
import).  :func:`parse` turns a call's ``parameters`` object into one:
an unknown parameter, or one not of its declared type, is
:class:`~kreld.core.errors.InvalidArgument` naming it (on the wire
``org.varlink.service.InvalidParameter``).  A few fields are parsed further
than their declared type (``addresses`` into integers, ``clock`` into a
:class:`~kreld.core.model.Clock`); their parsers are at least as strict as the
interface.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kreld.core import consts
from kreld.core.errors import InvalidArgument
from kreld.core.model import Clock
from kreld.core.record import field, fields, record, replace
from kreld.varlink.interface import INTERFACES, Interface, Type, matches

if TYPE_CHECKING:
    from typing import TypeAlias

    # Resolve's addresses as parsed.
    Addresses: TypeAlias = list[int]

__all__ = [
    "BATCH_ADDRESSES",
    "MAX_RESOLVE_ADDRESSES",
    "MAX_STRING",
    "REQUESTS",
    "AtTime",
    "ExportKallsyms",
    "GetBoot",
    "GetInfo",
    "GetInterfaceDescription",
    "GetKernelCode",
    "GetModules",
    "ListBoots",
    "R",
    "Request",
    "Resolve",
    "Snapshot",
    "Status",
    "Subscribe",
    "invalid",
    "parse",
    "parse_addresses",
    "parse_clock",
]

# Addresses one Resolve may ask about: its reply (some 30 bytes an address)
# is built in memory, so this bounds what one call can make the daemon hold.
MAX_RESOLVE_ADDRESSES = 100_000
# Longest string parameter (a boot-id, a clock, an interface name) accepted.
MAX_STRING = 256
# Address lists longer than this are parsed as a batch when they are written
# alike (see _parse_alike): its fixed cost is that of some 30 int() calls.
BATCH_ADDRESSES = consts.FEW_ADDRESSES


def invalid(name: str) -> InvalidArgument:
    return InvalidArgument(name, "rejected by kreld")


def parse_addresses(raw: object) -> Addresses:
    """Resolve's ``addresses``: at most :data:`MAX_RESOLVE_ADDRESSES` hex
    strings (``0x`` optional), each below 2**64."""
    if not isinstance(raw, list) or len(raw) > MAX_RESOLVE_ADDRESSES:
        raise invalid("addresses")
    if len(raw) > BATCH_ADDRESSES:
        batch = _parse_alike(raw)
        if batch is not None:
            return batch
    try:
        # int() in one pass, then what parse_addr() checks, for all at once:
        # int() took only strings; no "_" digit separators; no value past 64 bits.
        addrs = [int(a, 16) for a in raw]
        if "_" in "".join(raw) or (addrs and not 0 <= min(addrs) <= max(addrs) < 1 << 64):
            raise ValueError("not 64-bit hex addresses")
    except (ValueError, TypeError) as e:
        raise invalid("addresses") from e
    return addrs


def _parse_alike(raw: list[Any]) -> list[int] | None:
    """*raw* parsed at once when every address is written alike, as a profiler
    writes them: ``0x`` and the same number (at most 16) of hex digits; None
    for anything else, which :func:`parse_addresses` parses one by one.

    The strings are joined by newlines into one ASCII buffer of rows of equal
    width.  With ``0`` and ``x`` at the start of every row, no other ``x``, and
    a newline at each row's end, each ``x`` becomes a ``0`` (or goes, where
    the digits are odd) and ``bytes.fromhex`` reads the rows (it skips
    whitespace between bytes: fewer bytes than the rows' digits make say it
    met some, or a newline inside a row); each row's bytes, the value's last,
    are then laid out as big-endian u64.  (int() one by one costs some 0.8 ms
    for 10,000 addresses, this a third.)"""
    try:
        text = "\n".join(raw).encode("ascii") + b"\n"  # TypeError: not all strings
    except (TypeError, UnicodeEncodeError):
        return None
    n = len(raw)
    width, rest = divmod(len(text), n)
    digits = width - 3
    if rest or not 1 <= digits <= 16:
        return None
    if (
        text[0::width] != b"0" * n
        or text[1::width].lower() != b"x" * n
        or text[width - 1 :: width] != b"\n" * n
        or text.count(b"x") + text.count(b"X") != n
    ):
        return None
    # "0x" + digits: an even count of hex digits either way.
    hexes = text.translate(_X_AS_ZERO) if digits % 2 == 0 else text.translate(None, b"xX")
    try:
        octets = bytes.fromhex(hexes.decode("ascii"))
    except ValueError:
        return None
    row = (digits + 2) // 2
    if len(octets) != row * n:
        return None
    used = min(row, 8)  # the value's bytes: a row of 9 starts with the "0x" byte
    u64 = bytearray(8 * n)
    for k in range(used):
        u64[8 - used + k :: 8] = octets[row - used + k :: row]
    return list(struct.unpack(f">{n}Q", u64))


_X_AS_ZERO = bytes.maketrans(b"xX", b"00")


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
class AtTime(Request):
    """What every question about a boot at a time asks: which boot (default the
    current one), and when, on which clock (default now)."""

    METHOD = ""
    boot_id: str | None = None
    at: int | None = None
    clock: Clock = field(default=Clock.MONOTONIC, metadata=_CLOCK)


@record
class GetModules(AtTime):
    METHOD = "GetModules"
    all: bool = False


@record
class GetKernelCode(AtTime):
    METHOD = "GetKernelCode"
    all: bool = False


@record
class Resolve(AtTime):
    METHOD = "Resolve"
    # Declared without a default (the interface requires it): the default here
    # only lets the field follow AtTime's; parse_addresses refuses a missing one.
    addresses: Addresses = field(default=(), metadata=_ADDRESSES)
    lines: bool = False


@record
class ExportKallsyms(AtTime):
    METHOD = "ExportKallsyms"


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
    own = {f.name: f for f in fields(cls)}
    if own.keys() != declared.keys():
        raise TypeError(f"{cls.__name__} does not have the parameters {cls.METHOD} declares")
    spec = _Spec(
        iface,
        tuple(_Field(n, t, own[n].metadata.get("parse")) for n, t in declared.items()),
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
    GetKernelCode,
    Resolve,
    ExportKallsyms,
    Status,
    Subscribe,
)
_SPECS = {cls: _spec_of(cls) for cls in REQUESTS}
