"""The varlink interface descriptions kreld serves, parsed once at import.

``io.kreld.varlink`` is the contract: :mod:`kreld.varlink.requests` checks every
call's parameters against the method signatures read from it here, so the
file and the checks cannot drift apart.  The parser reads the subset of the
varlink IDL kreld writes: ``interface``, ``type``, ``method`` and ``error``
declarations whose members are ``string``, ``int``, ``float``, ``bool``,
``object``, ``?T``, ``[]T``, ``[string]T`` or a named type.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kreld.core.record import record

__all__ = [
    "INT64",
    "INTERFACES",
    "INTERFACE_DESCRIPTION",
    "IO_KRELD",
    "SERVICE_DESCRIPTION",
    "VARLINK_SERVICE",
    "Interface",
    "Signature",
    "Type",
    "matches",
    "parse_interface",
    "parse_type",
]

INTERFACE_DESCRIPTION = (Path(__file__).parent.parent / "io.kreld.varlink").read_text()
SERVICE_DESCRIPTION = """\
# The varlink service interface
interface org.varlink.service

method GetInfo() -> (
  vendor: string,
  product: string,
  version: string,
  url: string,
  interfaces: []string
)

method GetInterfaceDescription(interface: string) -> (description: string)

error InterfaceNotFound (interface: string)
error MethodNotFound (method: string)
error MethodNotImplemented (method: string)
error InvalidParameter (parameter: string)
error PermissionDenied ()
error ExpectedMore ()
"""

_SCALARS = frozenset({"string", "int", "float", "bool", "object"})


@record
class Type:
    """A member's type: a scalar, ``?T`` (optional), ``[]T`` (array),
    ``[string]T`` (map) or a type declared in the interface (named)."""

    kind: str  # a scalar's name, or "optional", "array", "map", "named"
    of: Type | None = None
    name: str = ""

    @property
    def optional(self) -> bool:
        return self.kind == "optional"


@record
class Signature:
    name: str
    parameters: dict[str, Type]
    returns: dict[str, Type]


@record
class Interface:
    name: str
    description: str
    methods: dict[str, Signature]
    types: dict[str, dict[str, Type]]
    errors: dict[str, dict[str, Type]]


def parse_type(text: str) -> Type:
    if text.startswith("?"):
        return Type("optional", parse_type(text[1:]))
    if text.startswith("[]"):
        return Type("array", parse_type(text[2:]))
    if text.startswith("[string]"):
        return Type("map", parse_type(text[8:]))
    if text in _SCALARS:
        return Type(text)
    if not re.fullmatch(r"[A-Z]\w*", text):
        raise ValueError(f"not a varlink type kreld reads: {text!r}")
    return Type("named", name=text)


_MEMBER = re.compile(r"(\w+)\s*:\s*([?\[\]\w]+)")
_DECL = re.compile(
    r"\b(?P<kind>type|error|method)\s+(?P<name>\w+)\s*\((?P<members>[^)]*)\)"
    r"(?:\s*->\s*\((?P<returns>[^)]*)\))?"
)


def _members(text: str) -> dict[str, Type]:
    return {m[1]: parse_type(m[2]) for m in _MEMBER.finditer(text)}


def parse_interface(description: str) -> Interface:
    """The declarations of one interface description."""
    text = re.sub(r"#[^\n]*", "", description)
    head = re.search(r"^\s*interface\s+([\w.]+)", text, re.M)
    if head is None:
        raise ValueError("no 'interface' line")
    methods: dict[str, Signature] = {}
    types: dict[str, dict[str, Type]] = {}
    errors: dict[str, dict[str, Type]] = {}
    for d in _DECL.finditer(text):
        members = _members(d["members"])
        if d["kind"] == "method":
            methods[d["name"]] = Signature(d["name"], members, _members(d["returns"] or ""))
        elif d["kind"] == "type":
            types[d["name"]] = members
        else:
            errors[d["name"]] = members
    return Interface(head[1], description, methods, types, errors)


IO_KRELD = parse_interface(INTERFACE_DESCRIPTION)
VARLINK_SERVICE = parse_interface(SERVICE_DESCRIPTION)
INTERFACES = {i.name: i for i in (VARLINK_SERVICE, IO_KRELD)}

INT64 = 1 << 63


def matches(value: Any, t: Type, types: dict[str, dict[str, Type]]) -> bool:
    """Whether a decoded JSON *value* is of type *t* (integers within 64 bits)."""
    kind = t.kind
    if kind == "optional":
        return value is None or matches(value, t.of or t, types)
    if kind == "string":
        return isinstance(value, str)
    if kind == "int":
        return type(value) is int and -INT64 <= value < INT64
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "object":
        return value is not None
    if kind == "array":
        return isinstance(value, list) and all(matches(v, t.of or t, types) for v in value)
    if kind == "map":
        return isinstance(value, dict) and all(matches(v, t.of or t, types) for v in value.values())
    fields = types.get(t.name)
    if fields is None or not isinstance(value, dict) or not value.keys() <= fields.keys():
        return False
    return all(matches(value.get(k), ft, types) for k, ft in fields.items())
