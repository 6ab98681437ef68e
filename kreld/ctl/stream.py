"""``kreldctl symbolize`` without ``--for``: addresses read from text, resolved
a batch at a time as the lines come, so that memory stays one batch's
whatever the input's length and the JSON array is written as it grows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from kreld.ctl.args import addresses_in
from kreld.ctl.render import symbol_of

if TYPE_CHECKING:
    from kreld.core.textin import Line
    from kreld.ctl.lines import LineSession

__all__ = ["batches", "symbolize_stream"]


def batches(items: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def symbolize_stream(
    resolve: Callable[[list[str]], list[dict[str, Any]]],
    lines: Iterable[Line],
    session: LineSession | None,
    as_json: bool,
    out: TextIO,
) -> int:
    """Each address of *lines* (whole lines only) resolved by *resolve* (a batch
    to one answer per address), with its source lines when *session* is given."""
    from kreld.varlink.requests import MAX_RESOLVE_ADDRESSES

    first = True
    if as_json:
        out.write("[")
    for batch in batches(
        (a for line, whole in lines if whole for a in addresses_in(line)), MAX_RESOLVE_ADDRESSES
    ):
        results = resolve(batch)
        if session is not None:
            results = session.add(results)
        for r in results:
            if as_json:
                body = json.dumps(r, indent=2).replace("\n", "\n  ")
                out.write(("\n  " if first else ",\n  ") + body)
            elif session is not None:
                session.render([r], out)
            else:
                where = "" if r.get("image", "kernel") == "kernel" else f" [{r['image']}]"
                print(f"{r['address']} {symbol_of(r) or '?'}{where}", file=out)
            first = False
    if as_json:
        out.write("]\n" if first else "\n]\n")
    return 0
