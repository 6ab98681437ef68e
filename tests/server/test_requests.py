"""Requests are parsed once, at the edge, against ``io.kreld.varlink`` itself;
one method table dispatches the daemon's socket and the in-process readers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kreld.core.errors import InvalidArgument, KreldError, MethodNotImplemented, NoSuchBoot
from kreld.core.model import BootSnapshot, Clock
from kreld.server import methods
from kreld.server.service import Service
from kreld.store import Store
from kreld.varlink import requests
from kreld.varlink.interface import INTERFACE_DESCRIPTION, IO_KRELD, Type, matches, parse_interface


def test_every_declared_method_has_one_request_and_one_table_entry() -> None:
    """The table and the requests cover exactly what the description declares."""
    declared = set(re.findall(r"^method (\w+)\(", INTERFACE_DESCRIPTION, re.M))
    assert set(IO_KRELD.methods) == declared
    in_table = {name.removeprefix("io.kreld.") for name in methods.METHODS}
    assert declared <= in_table
    assert in_table - declared == {
        "org.varlink.service.GetInfo",
        "org.varlink.service.GetInterfaceDescription",
    }
    assert [m.name for m in methods.METHODS.values() if m.streaming] == ["io.kreld.Subscribe"]


def test_the_parser_reads_signatures_and_types_of_the_description() -> None:
    resolve = IO_KRELD.methods["Resolve"]
    assert list(resolve.parameters) == ["addresses", "boot_id", "at", "clock", "lines"]
    assert resolve.returns["lines"] == Type("optional", Type("named", name="ResolveLines"))
    assert resolve.parameters["addresses"] == Type("array", Type("string"))
    assert resolve.parameters["at"] == Type("optional", Type("int"))
    assert resolve.returns["regions"] == Type("array", Type("named", name="ResolveRegion"))
    inc = IO_KRELD.types["Incarnation"]
    assert inc["sections"] == Type("map", Type("string"))
    assert inc["init_done"] == Type("optional", Type("named", name="Timestamp"))
    assert IO_KRELD.errors["AmbiguousBoot"] == {
        "prefix": Type("string"),
        "matches": Type("array", Type("string")),
    }
    with pytest.raises(ValueError, match="not a varlink type"):
        parse_interface("interface a.b\nmethod M(x: lowercase_thing) -> ()\n")


def test_an_unforeseen_failure_is_answered_with_the_declared_internal_error() -> None:
    """The base of the error family (what the server answers for a failure it did not
    foresee) goes on the wire as io.kreld.InternalError, declared with its one parameter;
    no error is named Error any more (varlink/go's generated code broke on it)."""
    err = KreldError("ValueError: boom")
    assert err.varlink_name == "io.kreld.InternalError"
    assert IO_KRELD.errors["InternalError"] == {"message": Type("string")}
    assert err.parameters() == {"message": "ValueError: boom"}
    assert "Error" not in IO_KRELD.errors


def test_values_match_their_declared_types_and_nothing_else() -> None:
    types = IO_KRELD.types
    ts = {"monotonic": 1, "boottime": 2, "realtime": 3}
    assert matches(ts, Type("named", name="Timestamp"), types)
    assert not matches({**ts, "extra": 1}, Type("named", name="Timestamp"), types)
    assert not matches({"monotonic": 1}, Type("named", name="Timestamp"), types)
    assert matches({"a": "b"}, Type("map", Type("string")), types)
    assert not matches({"a": 1}, Type("map", Type("string")), types)
    assert not matches(True, Type("int"), types)  # a JSON bool is not an int
    assert not matches(1 << 63, Type("int"), types)
    assert matches(None, Type("optional", Type("int")), types)
    assert not matches(None, Type("int"), types)


@pytest.mark.parametrize(
    ("cls", "params", "named"),
    [
        (requests.GetBoot, {"bogus": 1}, "bogus"),
        (requests.GetBoot, {"boot_id": 5}, "boot_id"),
        (requests.GetBoot, {"boot_id": "x" * 257}, "boot_id"),
        (requests.GetModules, {"at": "yesterday"}, "at"),
        (requests.GetModules, {"at": 2**70}, "at"),
        (requests.GetModules, {"all": "yes"}, "all"),
        (requests.GetModules, {"clock": "sundial"}, "clock"),
        (requests.Resolve, {}, "addresses"),
        (requests.Resolve, {"addresses": "0x1"}, "addresses"),
        (requests.Resolve, {"addresses": ["zz"]}, "addresses"),
        (requests.Resolve, {"addresses": ["0x1_0"]}, "addresses"),
        (requests.Resolve, {"addresses": [hex(1 << 64)]}, "addresses"),
        (requests.Resolve, {"addresses": ["0x1"] * 100_001}, "addresses"),
        (requests.ListBoots, {"boot_id": None}, "boot_id"),
        (requests.GetInterfaceDescription, {"interface": 1}, "interface"),
    ],
)
def test_a_bad_parameter_is_invalid_parameter_naming_it(
    cls: type[requests.Request], params: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        requests.parse(cls, params)
    assert e.value.varlink_name == "org.varlink.service.InvalidParameter"
    assert e.value.parameters() == {"parameter": named}


def _batch(last: object) -> list[object]:
    """A batch long enough to be parsed at once, written alike but for *last*."""
    return [f"{0xFFFFFFFF81000000 + 16 * i:#018x}" for i in range(requests.BATCH_ADDRESSES)] + [
        last
    ]


@pytest.mark.parametrize(
    "last",
    [
        "0xffffffff8100001_",  # not a digit, in the place of one
        "0xffffffff81_00001",  # a digit separator int() would take
        "0xffffffff8100 001",  # whitespace bytes.fromhex() would skip
        "0xffffff\n8100001a",  # a newline, the batch's own row separator
        "0x1ffffffff81000010",  # 17 digits: past 64 bits
        "-xffffffff81000010",
        "0yffffffff81000010",
        "0xffffffff8100001\u00e9",  # not ASCII
        0xFFFFFFFF81000010,  # not a string
        None,
    ],
)
def test_a_batch_with_one_bad_address_is_invalid_whatever_spoils_it(last: object) -> None:
    """A batch written alike is parsed at once; any address that int() or the
    64-bit bound would refuse still makes the whole call InvalidParameter."""
    with pytest.raises(InvalidArgument) as e:
        requests.parse(requests.Resolve, {"addresses": _batch(last)})
    assert e.value.parameters() == {"parameter": "addresses"}


@pytest.mark.parametrize(
    "written",
    [
        "{:#018x}",  # as a profiler writes kernel addresses
        "0X{:016X}",  # capitals
        "{:#x}",  # widths that differ: parsed one by one
        "{:#06x}",  # fewer digits, all the same width
        " {:x} ",  # what int() accepts besides
    ],
)
def test_a_batch_parses_to_the_values_int_reads(written: str) -> None:
    """Batches, alike or not, give the values int(a, 16) gives one by one."""
    values = [0, 1, 0xFFFF, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFF81234567, *range(64, 64 * 40, 64)]
    if "06x" in written:
        values = [v & 0xFFFF for v in values]
    raw = [written.format(v) for v in values]
    assert len(raw) > requests.BATCH_ADDRESSES
    got = requests.parse(requests.Resolve, {"addresses": raw}).addresses
    assert [int(a) for a in got] == [int(a, 16) for a in raw] == values


def test_good_parameters_become_typed_fields() -> None:
    r = requests.parse(
        requests.Resolve, {"addresses": ["0x10", "ffff"], "at": 7, "clock": "boottime"}
    )
    assert r == requests.Resolve(addresses=[0x10, 0xFFFF], at=7, clock=Clock.BOOTTIME)
    m = requests.parse(requests.GetModules, {"boot_id": None, "all": None})
    assert m == requests.GetModules(None, None, Clock.MONOTONIC, False)
    assert requests.parse(requests.GetModules, {}) == m


def test_in_process_calls_raise_the_kreld_error_itself(tmp_path: Path) -> None:
    """kreldctl's readers get KreldError from the service, never a varlink error
    to translate back."""

    def no_current() -> BootSnapshot:
        raise NoSuchBoot("current")

    with Store(tmp_path / "st") as store:
        svc = Service(store, current_boot=no_current, current_id=lambda: None, loaded=list)
        with pytest.raises(NoSuchBoot):
            methods.call(svc, "GetBoot", {"boot_id": "0123abcd"})
        with pytest.raises(InvalidArgument) as e:
            methods.call(svc, "GetModules", {"colck": "boottime"})
        assert e.value.parameter == "colck"
        with pytest.raises(MethodNotImplemented) as ni:
            methods.call(svc, "Snapshot", {})
        assert ni.value.parameters() == {"method": "Snapshot"}
        assert methods.call(svc, "ListBoots", {}) == {"boots": []}
        with pytest.raises(KreldError) as nf:
            methods.call(svc, "Nope", {})
        assert nf.value.varlink_name == "org.varlink.service.MethodNotFound"
