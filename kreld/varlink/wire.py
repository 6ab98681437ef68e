"""The varlink wire protocol: JSON objects, each ended by a NUL byte.

A call is ``{"method": "iface.Method", "parameters": {...}, "more": bool,
"oneway": bool}``; a reply is ``{"parameters": {...}, "continues": bool}``
or ``{"error": "iface.Name", "parameters": {...}}``.
"""

from __future__ import annotations

import json
from typing import Any

from kreld.core.errors import InvalidRequest, KreldError
from kreld.core.record import field, record

__all__ = [
    "INTERFACE",
    "JSON_PLAIN",
    "SERVICE",
    "Call",
    "VarlinkError",
    "encode",
    "encode_call",
    "error_reply",
    "invalid_parameter",
    "invalid_request",
    "parse_call",
    "reply",
    "reply_encoded",
]

INTERFACE = "io.kreld"
SERVICE = "org.varlink.service"


class VarlinkError(Exception):
    """An error reply: a qualified name and its parameters."""

    # Raised for a call that said "oneway": the varlink spec has the service send
    # it no reply at all, not even an error.
    oneway: bool = False

    def __init__(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        super().__init__(name)
        self.name = name
        self.parameters = parameters or {}

    def __str__(self) -> str:
        detail = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        return f"{self.name}({detail})"

    @classmethod
    def from_kreld(cls, e: KreldError) -> VarlinkError:
        return cls(e.varlink_name, e.parameters())


def invalid_parameter(name: str) -> VarlinkError:
    return VarlinkError(f"{SERVICE}.InvalidParameter", {"parameter": name})


def invalid_request(reason: str) -> VarlinkError:
    return VarlinkError.from_kreld(InvalidRequest(reason))


@record
class Call:
    method: str
    parameters: dict[str, Any] = field(default_factory=dict)
    more: bool = False
    oneway: bool = False

    @property
    def interface(self) -> str:
        return self.method.rpartition(".")[0]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_call(raw: bytes) -> Call:
    """Decode one message (without its NUL); raise a named error when malformed."""
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise invalid_request(f"not UTF-8 at byte {e.start}") from e
    except RecursionError as e:
        raise invalid_request("JSON nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, or an integer with too many digits
        raise invalid_request(f"not JSON: {str(e)[:120]}") from e
    if not isinstance(obj, dict):
        raise invalid_request("a call must be a JSON object")
    oneway = obj.get("oneway", False)
    if not isinstance(oneway, bool):
        raise invalid_request("'more' and 'oneway' must be booleans")
    try:
        return _checked_call(obj, oneway)
    except VarlinkError as e:
        e.oneway = oneway
        raise


def _checked_call(obj: dict[str, Any], oneway: bool) -> Call:
    method = obj.get("method")
    if not isinstance(method, str) or "." not in method or len(method) > 256:
        raise invalid_request("missing or malformed 'method'")
    params = obj.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid_parameter("parameters")
    more = obj.get("more", False)
    if not isinstance(more, bool):
        raise invalid_request("'more' and 'oneway' must be booleans")
    if obj.get("upgrade"):
        raise VarlinkError(f"{SERVICE}.MethodNotImplemented", {"method": method})
    return Call(method, params, more, oneway)


# The bytes a JSON string carries as they are: printable ASCII but '"' and '\\'.
JSON_PLAIN = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')


def encode_call(method: str, parameters: dict[str, Any], more: bool = False) -> bytes:
    """A varlink call as it travels, NUL included.  A long list of plain
    strings (Resolve's addresses) is joined as it is rather than encoded
    string by string: the same JSON, in a third of json.dumps' time."""
    members = []
    for k, v in parameters.items():
        plain = _plain_strings(v) if isinstance(v, list) and len(v) > _PLAIN_LIST else None
        members.append(json.dumps(k).encode() + b":" + (plain or _dumps(v)))
    tail = b',"more":true}\0' if more else b"}\0"
    return b"".join(
        (b'{"method":', _dumps(method), b',"parameters":{', b",".join(members), b"}", tail)
    )


def _dumps(v: object) -> bytes:
    return json.dumps(v, separators=(",", ":")).encode()


_PLAIN_LIST = 64  # items from which a list of strings is tried as plain


def _plain_strings(items: list[Any]) -> bytes | None:
    """*items* as a JSON array if all are strings JSON need not escape
    (printable ASCII without quotes or backslashes); None otherwise."""
    try:
        out = ('["' + '","'.join(items) + '"]').encode()
    except TypeError:  # not all strings
        return None
    # Once the plain bytes are deleted, only the quotes around each string are left.
    return out if out.translate(None, JSON_PLAIN) == b'"' * (2 * len(items)) else None


def encode(obj: dict[str, Any]) -> bytes:
    return _dumps(obj) + b"\0"


def reply(parameters: dict[str, Any], continues: bool = False) -> bytes:
    if continues:
        return encode({"parameters": parameters, "continues": True})
    return encode({"parameters": parameters})


def reply_encoded(parameters: bytes) -> bytes:
    """A reply whose parameters are already a JSON object."""
    return b"".join((b'{"parameters":', parameters, b"}\0"))  # one copy of a large one


def error_reply(err: VarlinkError) -> bytes:
    return encode({"error": err.name, "parameters": err.parameters})
