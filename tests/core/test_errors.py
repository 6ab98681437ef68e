"""The error family is the one table of error names and parameters: the IDL
declares what the classes say, and a client turns every reply back into the
class the server raised."""

from __future__ import annotations

from typing import Any

import pytest

from kreld.client import RemoteError, error_from_reply
from kreld.core.errors import (
    ExitCode,
    KreldError,
    NoSuchBoot,
    StoreError,
    StoreTooNew,
    error_classes,
)
from kreld.varlink.interface import INTERFACES, Type
from kreld.varlink.wire import VarlinkError

CLASSES = error_classes()


def declared() -> dict[str, dict[str, Type]]:
    return {f"{i.name}.{e}": m for i in INTERFACES.values() for e, m in i.errors.items()}


def sample(t: Type) -> Any:
    return {"string": "x", "int": 7, "bool": True, "array": ["a", "b"]}[t.kind]


def test_every_io_kreld_error_of_the_idl_is_a_class_with_the_same_parameters() -> None:
    for name, members in declared().items():
        if not name.startswith("io.kreld."):
            continue
        assert name in CLASSES, f"{name} is declared but no KreldError carries it"
        assert CLASSES[name].fields == tuple(members), name


def test_varlink_service_errors_kreld_raises_have_the_standard_parameters() -> None:
    for name in ("InvalidParameter", "MethodNotFound", "MethodNotImplemented", "InterfaceNotFound"):
        full = f"org.varlink.service.{name}"
        assert CLASSES[full].fields == tuple(declared()[full]), full


@pytest.mark.parametrize("name", sorted(n for n in declared() if n in CLASSES))
def test_a_reply_comes_back_as_the_class_the_server_raised(name: str) -> None:
    params = {k: sample(t) for k, t in declared()[name].items()}
    raised = CLASSES[name].from_parameters(params)
    wire = VarlinkError.from_kreld(raised)
    assert wire.name == name
    back = error_from_reply(wire.name, wire.parameters)
    assert type(back) is type(raised)
    assert str(back) == str(raised)
    assert back.parameters() == wire.parameters
    assert back.exit_code == raised.exit_code


def test_store_too_new_is_not_flattened_into_store_error() -> None:
    back = error_from_reply(
        "io.kreld.StoreTooNew",
        {"path": "/var/lib/kreld", "reason": "schema version 9 is newer than the supported 5"},
    )
    assert type(back) is StoreTooNew and isinstance(back, StoreError)
    assert "schema version 9" in str(back) and back.exit_code == ExitCode.STORE


def test_a_subclass_travels_as_the_class_that_named_it_and_unknown_names_stay_remote() -> None:
    assert CLASSES["io.kreld.NoSuchBoot"] is NoSuchBoot
    assert CLASSES["io.kreld.InternalError"] is KreldError
    other = error_from_reply("com.example.Broken", {"why": 1})
    assert isinstance(other, RemoteError) and other.parameters() == {"why": 1}
    odd = error_from_reply("io.kreld.AmbiguousBoot", {"prefix": "ab", "matches": 3})
    assert isinstance(odd, RemoteError)  # parameters of a shape this kreld does not know
