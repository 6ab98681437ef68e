"""Resolve of a batch of addresses with the standard library alone.

numpy would make a batch a few vectorized calls, but its import costs the
daemon some 17 MiB for its whole life (its libraries, OpenBLAS among them,
and its modules' objects; bench/bench_memory.py), for one search.  Here the
work is done by C loops all the same: ``map`` over ``bisect``, gathers by
``operator.itemgetter``, ``dict`` and ``memoryview``, one pass each, with
little Python bytecode per address (a comprehension's add or shift).

* A batch that lies in one region (a profile of the kernel's text) is named
  as it comes: its distinct addresses (when a sample of them repeats much),
  each region's names in the order the addresses meet them.
* Any other batch has its distinct addresses sorted once.  Regions do not
  overlap, so each region's addresses are then one run of the sorted list,
  found by two bisections, and its names come out in ascending order.
* A large section's keys are searched through a page index
  (:class:`SectionKeys`): the keys that fall in each page of the section's
  span are found by arithmetic, and only those few (some 2) are bisected.  A
  plain bisection of a kernel's keys costs 17 probes, each a Python int made
  from the map: several times as long.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from itertools import repeat
from operator import sub
from typing import TYPE_CHECKING

from kreld.core.record import record, replace
from kreld.core.symtab import KEY_SPAN, SymbolTable, SymbolTables
from kreld.symbols.quoting import gather, json_array, quote_entries

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from kreld.symbols.queries import Region

__all__ = ["Named", "SectionKeys", "name_batch", "section_keys"]

# Sections with fewer keys are bisected whole (at most 10 probes), and so are
# fewer addresses: the check that a kept index still fits reads all the
# section's keys (0.2 ms for a kernel's), what some 400 bisections save.
_INDEXED_KEYS = 1024
_INDEXED_WANTS = 512
# Keys a page of a paged SectionKeys holds on average.
_KEYS_PER_PAGE = 2
# Page indexes kept (a kernel's, and the modules' with many symbols).
_KEPT_INDEXES = 16
_NO_ADDRESS = 1 << 64  # above every address
_SAMPLE = 512  # addresses looked at for repeats


class SectionKeys:
    """One section's keys as a batch searches them: ``keys[i]`` is its i-th
    key less ``first``, and ``after`` the same from the second on.

    A large section's keys are copied into an array of small ints, relative
    to its first (kept while the keys are the same bytes: see
    :func:`section_keys`), and cut into pages of ``1 << shift``: a key *w*
    has its last key at or below it among ``keys[low[p]:high[p] + 1]``,
    ``p = w >> shift``; a small one's are the table's own, searched whole.
    """

    __slots__ = ("after", "first", "high", "keys", "low", "shift")

    def __init__(self, keys: Sequence[int], first: int = 0) -> None:
        self.keys, self.first = keys, first
        self.after = memoryview(keys)[1:] if isinstance(keys, array) else keys[1:]
        self.shift = 0
        self.low = self.high = array("I")

    @classmethod
    def paged(cls, keys: memoryview) -> SectionKeys:
        first = keys[0]
        span = keys[-1] - first
        rel = array("I" if span < 1 << 32 else "q", [k - first for k in keys])
        self = cls(rel, first)
        self.shift = max(span * _KEYS_PER_PAGE // len(rel), 1).bit_length()
        starts = range(0, span + (1 << self.shift), 1 << self.shift)
        # The last key at or below each page's start.
        below = array("I", [k - 1 for k in map(bisect_right, repeat(rel), starts)])
        self.low, self.high = below[:-1], below[1:]
        return self

    def search(self, wants: list[int]) -> list[int]:
        """For each of *wants* (each in ``[keys[0], keys[-1])``, in any
        order), the index of the last key at or below it."""
        # In after[lo:hi], the keys after keys[lo] (at or below the want): the
        # count of those at or below it, added to lo, is the index sought.
        if not self.shift:
            return list(map(bisect_right, repeat(self.after), wants))
        shift = self.shift
        pages = [w >> shift for w in wants]
        lows, highs = gather(self.low, pages), gather(self.high, pages)
        return list(map(bisect_right, repeat(self.after), wants, lows, highs))


_paged: OrderedDict[tuple[str, int], tuple[int, SectionKeys]] = OrderedDict()
_paged_lock = threading.Lock()  # Resolve runs on the event loop and on the worker


def section_keys(key: str, sec: int, keys: memoryview, many: bool) -> SectionKeys:
    """Section *sec*'s *keys* of table *key*, paged when they and the
    addresses (*many*) are many, from those kept while the keys are the same."""
    if not many or len(keys) < _INDEXED_KEYS:
        return SectionKeys(keys)
    crc = zlib.crc32(keys)
    with _paged_lock:
        kept = _paged.get((key, sec))
        if kept is not None and kept[0] == crc:
            _paged.move_to_end((key, sec))
            return kept[1]
    paged = SectionKeys.paged(keys)  # built outside the lock: tens of ms, once
    with _paged_lock:
        _paged[(key, sec)] = (crc, paged)
        while len(_paged) > _KEPT_INDEXES:
            _paged.popitem(last=False)
    return paged


class Named:
    """A batch's answer in the making: per address of the runs named so far
    (each less *origin*), its symbol and offset; the regions and the names."""

    __slots__ = ("count", "names", "offset", "origin", "symbol", "used")

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self.symbol: list[int] = []
        self.offset: list[int] = []
        self.used: list[tuple[int, int]] = []  # (region index, count of its names)
        self.names: list[bytes] = []  # '"name",' runs, region by region
        self.count = 0  # of the names so far

    def nothing(self, count: int, symbol: int) -> None:
        self.symbol += repeat(symbol, count)
        self.offset += repeat(0, count)

    def region(self, i: int, r: Region, run: _Run, tables: SymbolTables | None) -> bool:
        """Name *run* (addresses less origin, all in region *i*, *r*).  False,
        with nothing named, when *run* is not in order and some of it lies
        outside its section's keys: it must be sorted first."""
        first = self.count  # names before this region's
        unnamed = -2 - len(self.used)
        count: int | None = 0
        if r.name is not None:  # kernel code: one symbol, the region's own
            self.symbol += repeat(first, len(run.values))
            moved = self.origin - r.base
            self.offset += [a + moved for a in run.values]
            self.names.append(json_array([r.name])[1:-1] + b",")
            count = 1
        else:
            table = tables.get(r.table) if tables is not None and r.table is not None else None
            sec = None if table is None else 0 if r.inc is None else table.section_index(r.section)
            if table is None or sec is None or r.table is None:
                self.nothing(len(run.values), unnamed)
            else:
                count = self._in_table(table, r.table, sec, run, (r.rel_base, first, unnamed))
        if count is None:
            return False
        self.used.append((i, count))
        self.count += count
        return True

    def _in_table(
        self, table: SymbolTable, key: str, sec: int, run: _Run, numbers: tuple[int, int, int]
    ) -> int | None:
        """Name *run* in section *sec* of *table* (stored under *key*);
        *numbers*: what the table's values are relative to, the first name's
        number, and the symbol of an address without one.  The count of
        distinct names (None: see :meth:`region`)."""
        rel, first, unnamed = numbers
        keys = table.keys
        lo, hi = bisect_left(keys, sec << 40), bisect_left(keys, (sec + 1) << 40)
        if lo == hi:  # a section without symbols
            self.nothing(len(run.values), unnamed)
            return 0
        sk = section_keys(key, sec, keys[lo:hi], len(run.values) >= _INDEXED_WANTS)
        shift = self.origin - rel + KEY_SPAN + (sec << 40) - sk.first
        wants = [a + shift for a in run.values]
        # Below the section's first key: no symbol; from its last on: the last.
        if run.ordered:
            a = bisect_left(wants, sk.keys[0])
            b = bisect_left(wants, sk.keys[-1], a)
        elif wants and (run.low + shift < sk.keys[0] or run.high + shift >= sk.keys[-1]):
            return None
        else:
            a, b = 0, len(wants)
        at = sk.search(wants[a:b] if a or b < len(wants) else wants)
        at += repeat(len(sk.keys) - 1, len(wants) - b)  # each address's key
        # The distinct keys in the order met (ascending when ordered), numbered.
        place = dict.fromkeys(at, 0)
        place.update(zip(place, range(first, first + len(place)), strict=True))
        self.nothing(a, unnamed)
        self.symbol += gather(place, at)
        self.offset += map(sub, wants[a:] if a else wants, gather(sk.keys, at))
        if place:
            entries = gather(table.sorted[lo:hi], list(place))
            self.names.append(quote_entries(table, entries))
        return len(place)


@record
class _Run:
    """Addresses of one region (less the batch's origin): whether they are
    in ascending order, and the lowest and the highest."""

    values: Sequence[int]
    ordered: bool
    low: int
    high: int


def name_batch(
    regions: Sequence[Region],
    bases: Sequence[int],
    limits: Sequence[int],
    addresses: Sequence[int],
    tables: SymbolTables | None,
) -> tuple[Named, Sequence[int], Sequence[int]]:
    """Every address of *addresses* placed in its region (the last of *bases*
    at or below it, if below its limit) and named: the regions and names, and
    per address its symbol and offset, in the order asked.

    A batch that lies in one region (a profile of the kernel alone) is named
    as it comes; any other has its distinct addresses sorted, and each
    region's are then one run of them, found by bisection."""
    with _collector_paused():
        if addresses:
            low, high = min(addresses), max(addresses)
            i = bisect_right(bases, low) - 1
            if i >= 0 and high < limits[i] and bisect_right(bases, high) - 1 == i:
                named = _in_one_region(i, regions[i], _Run(addresses, False, low, high), tables)
                if named is not None:
                    return named
        # Less the lowest, addresses sort and add as small ints (one digit of
        # CPython's ints for a batch within 1 GiB) rather than 64-bit ones.
        origin = min(addresses, default=0)
        moved = [a - origin for a in addresses]
        ordered = sorted(set(moved))
        out = Named(origin)
        n, p = len(ordered), 0
        while p < n:
            a = ordered[p] + origin
            i = bisect_right(bases, a) - 1
            nxt = bases[i + 1] if i + 1 < len(bases) else _NO_ADDRESS
            if i < 0 or a >= limits[i]:  # in no region, up to the next one
                q = bisect_left(ordered, nxt - origin, p)
                out.nothing(q - p, -1)
            else:
                q = bisect_left(ordered, min(limits[i], nxt) - origin, p)
                run = ordered[p:q]
                out.region(i, regions[i], _Run(run, True, run[0], run[-1]), tables)
            p = q
        where = gather(dict(zip(ordered, range(n), strict=True)), moved)
        return out, gather(out.symbol, where), gather(out.offset, where)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while: a batch makes some
    10,000 short-lived containers (a memoryview per name), none in a cycle,
    and the collections they would set off cost it a tenth of its time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _in_one_region(
    i: int, r: Region, run: _Run, tables: SymbolTables | None
) -> tuple[Named, Sequence[int], Sequence[int]] | None:
    """:func:`name_batch` of addresses *run* all in region *i*, in the order
    asked (the distinct ones, when they repeat much); None where they must
    be sorted (see :meth:`Named.region`)."""
    # Repeats, judged on the first addresses (a profile's hot spots repeat
    # throughout): the distinct ones are named once.
    addresses = run.values
    some = addresses[:_SAMPLE]
    if 4 * len(set(some)) < 3 * len(some):
        run = replace(run, values=list(dict.fromkeys(addresses)))
    out = Named(0)
    if not out.region(i, r, run, tables):
        return None
    if run.values is addresses:
        return out, out.symbol, out.offset
    work = run.values
    where = gather(dict(zip(work, range(len(work)), strict=True)), addresses)
    return out, gather(out.symbol, where), gather(out.offset, where)
