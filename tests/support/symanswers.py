"""kreld's symbol answers as the symbol-cache tests (tests/symbols/test_symbols_*.py)
read them: one varlink call, a Resolve spelt out, the symtabs keys of a store, and
kallsyms texts compared line for line or owner by owner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kreld.client import resolutions
from kreld.store import Store

from support.run import raw_exchange

OTHER_ID = "0badc0de0badc0de0badc0de0badc0de0badc0de"


def shift_line(line: str, delta: int) -> str:
    """A kallsyms line of another slide: relocated symbols move, absolute ones stay."""
    addr, typ, rest = line.split(" ", 2)
    if typ in ("A", "a"):
        return line
    return f"{int(addr, 16) + delta:016x} {typ} {rest}"


def first_difference(got: list[str], want: list[str]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"line {i + 1}: got {g!r}, want {w!r}"
    return f"lengths differ: got {len(got)} lines, want {len(want)}"


def assert_same_lines(got: str, want: str) -> None:
    g, w = got.splitlines(), want.splitlines()
    assert g == w, first_difference(g, w)


def by_owner(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """A kallsyms split: the kernel's lines in order, and each module's lines in order."""
    core: list[str] = []
    mods: dict[str, list[str]] = {}
    for line in text.splitlines():
        _, tab, owner = line.partition("\t")
        if tab:
            mods.setdefault(owner, []).append(line)
        else:
            core.append(line)
    return core, mods


def assert_same_but_module_order(got: str, want: str) -> None:
    """The same lines, each module's in order, whatever the order of the modules."""
    (gc, gm), (wc, wm) = by_owner(got), by_owner(want)
    assert gc == wc, first_difference(gc, wc)
    assert gm == wm


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in reply, reply
    return dict(reply["parameters"])


def call(sock: Path, method: str, **params: Any) -> dict[str, Any]:
    """One varlink call on a fresh connection: the raw reply (parameters or error)."""
    msg = json.dumps({"method": f"io.kreld.{method}", "parameters": params}).encode() + b"\0"
    [reply] = raw_exchange(sock, msg, timeout=60)
    return reply


def resolved(sock: Path, addresses: list[str], **params: Any) -> list[dict[str, Any]]:
    """A Resolve on the socket, spelt out per address (kreld.client.resolutions)."""
    return resolutions(addresses, ok(call(sock, "Resolve", addresses=addresses, **params)))


def symtab_keys(state: Path) -> list[str]:
    """The keys of the symtabs database, read from LMDB directly."""
    with Store(state, readonly=True) as store:
        db = store.env.dbs[b"symtabs"]
        if db is None:
            return []
        return store.env.read(
            lambda txn: sorted(bytes(k).decode() for k in txn.cursor(db=db).iternext(values=False))
        )


def ns(inc: dict[str, Any], key: str) -> int:
    return int(inc[key]["monotonic"])


def sym(r: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(image, symbol, offset into it) of one resolution."""
    return r.get("image"), r.get("symbol"), r.get("symbol_offset")
