"""Names quoted into JSON in bulk: a table's names, picked by index, become
'"name",' runs joined at once, not a Python call per name: with the standard
library for Resolve's symbols (:func:`quote_entries`), with numpy gathers for
its lines' functions and files (:func:`quote_names`, whose callers hold
numpy arrays already)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kreld.core import heap
from kreld.varlink.wire import JSON_PLAIN

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from kreld.core.symtab import SymbolTable

__all__ = ["gather", "join_quoted", "json_array", "quote_entries", "quote_names", "quoted"]


# Bytes of names gathered at a time (see quote_names): each of a slice's index
# arrays holds 8 bytes a byte of name, and the four a slice makes at once stay
# together under glibc's mmap threshold as kreld.core.heap fixes it, so that
# none is mapped (and faulted in) afresh on every call.
_NAME_BYTES = heap.MMAP_THRESHOLD // (4 * 8)

# The bytes a name carries into a JSON string as they are, and NUL.
_PLAIN_OR_NUL = b"\0" + JSON_PLAIN


def quote_names(blob: Any, ends: NDArray[np.uint32], entries: NDArray[Any]) -> list[bytes]:
    """'"name",' for entries *entries* of a table (its names *blob*, their
    *ends* in it), some names a part."""
    import numpy as np

    entries = entries.astype(np.int64)  # the table's are u32: entry 0 has no end before it
    stop = ends[entries].astype(np.int64)
    start = np.where(entries > 0, ends[np.maximum(entries - 1, 0)], 0).astype(np.int64)
    # Some names at a time (_NAME_BYTES), so that the index arrays stay small:
    # a batch's buffers all together must stay below glibc's thresholds
    # (kreld.core.heap), or the heap shrinks after each call and grows again,
    # a page fault per 4 KiB, in the next one.
    upto = np.cumsum(stop - start)
    cuts = np.searchsorted(upto, np.arange(_NAME_BYTES, int(upto[-1]), _NAME_BYTES)).tolist()
    names = np.frombuffer(blob, dtype=np.uint8)
    return [
        quoted(names, start[lo:hi], stop[lo:hi])
        for lo, hi in zip([0, *cuts], [*cuts, len(entries)], strict=True)
        if lo < hi
    ]


def quote_entries(table: SymbolTable, entries: Sequence[int]) -> bytes:
    """'"name",' for each of entries *entries* (at least one) of *table*, in order."""
    stops = gather(table.name_end, entries)
    starts = gather(table.name_start, entries)  # entry 0's is no name's end: 0
    if 0 in entries:
        starts = list(starts)
        starts[entries.index(0)] = 0
    blob = table.names
    names = [blob[a:b] for a, b in zip(starts, stops, strict=True)]
    text = b'","'.join(names)
    # Only the joints' quotes are left once the bytes JSON takes as they are
    # go: no name needs an escape, and each is ASCII.
    if len(text.translate(None, JSON_PLAIN)) != 2 * (len(names) - 1):
        return json_array([bytes(n).decode("utf-8", "replace") for n in names])[1:-1] + b","
    return b'"' + text + b'",'


def gather(seq: Sequence[int] | Mapping[int, int], at: Sequence[int]) -> Sequence[int]:
    """``seq[i]`` for each *i* of *at*, in one C loop (a tuple)."""
    if len(at) > 1:
        got: tuple[int, ...] = operator.itemgetter(*at)(seq)
        return got
    return tuple(seq[i] for i in at)


def join_quoted(parts: list[bytes]) -> bytes:
    """The names of *parts* (from :func:`quote_names`) as a JSON array."""
    if not parts:
        return b"[]"
    return b"".join((b"[", *parts[:-1], parts[-1][:-1], b"]"))


def quoted(names: NDArray[np.uint8], start: NDArray[np.int64], stop: NDArray[np.int64]) -> bytes:
    """'"' name '",' for each name ``names[start:stop]``, in order."""
    import numpy as np

    # Each name and the byte after it (the next name's first, past the end:
    # the last byte again), gathered with one index array made by a running
    # sum: +1 within a name, a jump to each name's start; the bytes after
    # become NULs, which bytes.replace() turns into the '","' between names.
    spans = stop - start + 1
    step = np.ones(int(spans.sum()), dtype=np.int64)
    ends = np.cumsum(spans) - 1  # of each name's byte after, in the gathered bytes
    step[ends[:-1] + 1] = start[1:] - stop[:-1]
    step[:1] = start[:1]
    gathered = names.take(np.cumsum(step, out=step), mode="clip")
    gathered[ends] = 0
    text = gathered.tobytes()
    if text.translate(None, _PLAIN_OR_NUL) or text.count(b"\0") != len(spans):
        # Rare: a name JSON must escape, or not ASCII (or holding a NUL): one by one.
        firsts = [0, *(ends[:-1] + 1).tolist()]
        each = [text[a:b] for a, b in zip(firsts, ends.tolist(), strict=True)]
        return json_array([n.decode("utf-8", "replace") for n in each])[1:-1] + b","
    return b'"' + text[:-1].replace(b"\0", b'","') + b'",'


def json_array(names: list[str]) -> bytes:
    import orjson

    return orjson.dumps(names)
