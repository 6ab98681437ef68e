"""The kernel's own symbol table, decoded from its kallsyms tables in kernel memory.

Where ``kernel.kptr_restrict=2`` zeroes ``/proc/kallsyms`` and no checked
System.map or vmlinux is at hand, the tables ``/proc/kallsyms`` itself is
printed from are still in the kernel's memory.  VMCOREINFO names them since
Linux 6.0 (commit 5fd8fea935a1 "vmcoreinfo: include kallsyms symbols", with
``kallsyms_num_syms`` from f09bddbd8661): ``SYMBOL(kallsyms_names)``,
``kallsyms_num_syms``, ``kallsyms_token_table``, ``kallsyms_token_index``, and
either ``kallsyms_offsets`` + ``kallsyms_relative_base`` or
``kallsyms_addresses``.  Their format (scripts/kallsyms.c writes them,
kernel/kallsyms.c reads them):

* ``kallsyms_num_syms``: a 32-bit count;
* ``kallsyms_token_index``: 256 16-bit offsets into ``kallsyms_token_table``,
  NUL-ended strings, the expansion of each byte value;
* ``kallsyms_names``: per symbol, its compressed length then that many bytes,
  each a token; the expansion's first character is the type letter.  A length
  of 0x80 or more takes a second byte (``(b0 & 0x7f) | b1 << 7``) since 6.1,
  commit 73bbb94466fd "kallsyms: support "big" kernel symbols"; before it
  every length fits in one byte below 0x80, so one decoder reads both;
* the addresses, in one of the layouts the kernel has had:

  - ``kallsyms_addresses``: absolute values, one ``unsigned long`` each
    (``CONFIG_KALLSYMS_BASE_RELATIVE=n``; gone in 6.11 with commit
    64e166099b69 "kallsyms: get rid of code for absolute kallsyms");
  - ``kallsyms_offsets`` relative to ``kallsyms_relative_base``
    (``CONFIG_KALLSYMS_BASE_RELATIVE``, commit 2213e9a66bb8): unsigned 32-bit
    offsets from the base; or, with ``CONFIG_KALLSYMS_ABSOLUTE_PERCPU``
    (x86_64 SMP), non-negative values absolute (the per-cpu variables, type
    ``A``) and negative ones ``base - 1 - offset``.  Which of the two is told by
    the table itself: a negative offset exists only with absolute per-cpu
    values (scripts/kallsyms.c refuses to write an offset from the base of
    2 GiB or more), and the result is checked against VMCOREINFO's ``_stext``;
  - ``kallsyms_offsets`` with no relative base (Ard Biesheuvel's "kallsyms:
    Get rid of kallsyms relative base"): signed 32-bit offsets from each
    entry's own address.

The decoded table is trusted only once its names and types, in order, are the
ones ``/proc/kallsyms`` lists (it still lists them all, with zero addresses, at
``kptr_restrict=2``) and its ``_stext`` is VMCOREINFO's.  Every count, length
and index is bounded before it is used; what does not hold together is
:class:`KallsymsTableError`.
"""

from __future__ import annotations

import re
import struct

from kreld.core.errors import KallsymsTableError
from kreld.core.record import record
from kreld.kernel.kcore import MAX_READ, Kcore

__all__ = [
    "MAX_NAMES",
    "MAX_SYMBOLS",
    "MemoryKallsyms",
    "check_against",
    "decode_kallsyms",
    "read_kallsyms",
]

MAX_SYMBOLS = 1 << 22  # kallsyms_num_syms (Debian 6.1: some 150,000; allyesconfig under 10^6)
MAX_NAMES = 64 << 20  # the compressed names (Debian 6.1: 1.1 MB)
MAX_COMPRESSED = 0x3FFF  # a name's compressed length: two bytes of ULEB128 at most
MAX_NAME = 1024  # a decoded name with its type letter (KSYM_NAME_LEN is 512 since 6.1)
MAX_TOKEN = 256  # one token's expansion
_TOKENS = 256


@record
class MemoryKallsyms:
    """The kernel's kallsyms lines decoded from its memory: ``text`` as
    ``/proc/kallsyms`` prints them with its pointers shown."""

    text: bytes
    count: int
    layout: str  # which address layout the tables have, for the log

    def address(self, name: str, types: bytes = b"") -> int | None:
        """The address of the first line named *name* (of one of *types*, if given)."""
        kind = rb"[" + re.escape(types) + rb"]" if types else rb"\S"
        pattern = rb"^([0-9a-f]{16}) " + kind + rb" " + re.escape(name.encode()) + rb"$"
        m = re.search(pattern, self.text, re.MULTILINE)
        return int(m[1], 16) if m is not None else None


class _Tables:
    """Where VMCOREINFO says the tables are (``None``: not named)."""

    def __init__(self, kcore: Kcore) -> None:
        self.names = kcore.symbol("kallsyms_names")
        self.num_syms = kcore.symbol("kallsyms_num_syms")
        self.token_table = kcore.symbol("kallsyms_token_table")
        self.token_index = kcore.symbol("kallsyms_token_index")
        self.offsets = kcore.symbol("kallsyms_offsets")
        self.relative_base = kcore.symbol("kallsyms_relative_base")
        self.addresses = kcore.symbol("kallsyms_addresses")
        self.stext = kcore.symbol("_stext")


def read_kallsyms(kcore: Kcore, kallsyms: bytes) -> MemoryKallsyms:
    """The kernel's table decoded from *kcore* and checked against *kallsyms*
    (a read of ``/proc/kallsyms``, zeroed or not), or :class:`KernelReadError`
    saying why it cannot be had."""
    table = decode_kallsyms(kcore)
    check_against(table, kallsyms)
    return table


def decode_kallsyms(kcore: Kcore) -> MemoryKallsyms:
    """Decode the tables VMCOREINFO names (:class:`KallsymsTableError` where
    they are not named, not mapped, or do not hold together)."""
    at = _Tables(kcore)
    where = kcore.path
    required = {
        "kallsyms_names": at.names,
        "kallsyms_num_syms": at.num_syms,
        "kallsyms_token_table": at.token_table,
        "kallsyms_token_index": at.token_index,
    }
    missing = [k for k, v in required.items() if v is None]
    if at.offsets is None and at.addresses is None:
        missing.append("kallsyms_offsets or kallsyms_addresses")
    if missing:
        raise KallsymsTableError(where, f"VMCOREINFO does not name {', '.join(missing)}")
    count = kcore.u32(_known(at.num_syms))
    if not 0 < count <= MAX_SYMBOLS:
        raise KallsymsTableError(where, f"kallsyms_num_syms is {count} (limit {MAX_SYMBOLS})")
    tokens = _tokens(kcore, _known(at.token_table), _known(at.token_index))
    names = _names(kcore, _known(at.names), count, tokens)
    values, layout = _addresses(kcore, at, count)
    _check_stext(where, names, values, at.stext)
    lines = [b"%016x %s\n" % (v, n) for v, n in zip(values, names, strict=True)]
    return MemoryKallsyms(b"".join(lines), count, layout)


def _known(value: int | None) -> int:
    if value is None:  # checked by the caller: every required table is named
        raise KallsymsTableError("VMCOREINFO", "a kallsyms table is not named")
    return value


def _read_long(kcore: Kcore, address: int, length: int, what: str) -> bytes:
    """*length* bytes at *address*, read in pieces of at most ``MAX_READ``."""
    if not kcore.mapped(address, length):
        raise KallsymsTableError(
            kcore.path, f"{what} ({length} bytes at {address:#x}) is not in one segment"
        )
    parts = []
    for start in range(0, length, MAX_READ):
        parts.append(kcore.read(address + start, min(MAX_READ, length - start)))
    return b"".join(parts)


def _tokens(kcore: Kcore, table: int, index: int) -> list[bytes]:
    """The 256 tokens: NUL-ended strings written one after another, each
    index entry where the previous token ends (scripts/kallsyms.c writes them
    so), none longer than ``MAX_TOKEN``."""
    offsets = struct.unpack(f"<{_TOKENS}H", _read_long(kcore, index, 2 * _TOKENS, "token index"))
    seg = kcore.segment_of(table)
    if seg is None:
        raise KallsymsTableError(kcore.path, f"kallsyms_token_table {table:#x} is not mapped")
    span = min(_TOKENS * (MAX_TOKEN + 1), seg.end - table)
    raw = _read_long(kcore, table, span, "token table")
    tokens = []
    at = 0
    for code, off in enumerate(offsets):
        end = raw.find(b"\0", off, off + MAX_TOKEN + 1)
        if off != at or end < 0:
            why = (
                "runs past the token table"
                if off == at
                else f"is not where token {code - 1:#04x} ends"
            )
            raise KallsymsTableError(kcore.path, f"token {code:#04x} at offset {off} {why}")
        tokens.append(raw[off:end])
        at = end + 1
    return tokens


def _names(kcore: Kcore, start: int, count: int, tokens: list[bytes]) -> list[bytes]:
    """*count* names, each ``type letter + b" " + name``, decoded from the
    compressed stream at *start*, read a piece at a time as far as it goes."""
    seg = kcore.segment_of(start)
    if seg is None:
        raise KallsymsTableError(kcore.path, f"kallsyms_names {start:#x} is not mapped")
    limit = min(seg.end - start, MAX_NAMES)
    buf = bytearray()
    out: list[bytes] = []
    join = b"".join
    token = tokens.__getitem__
    p = 0
    for i in range(count):
        if p + 2 + MAX_COMPRESSED > len(buf) and len(buf) < limit:
            more = min(MAX_READ, limit - len(buf))
            buf += kcore.read(start + len(buf), more)
        if p >= len(buf):
            raise KallsymsTableError(kcore.path, f"name {i} of {count} runs past the names")
        n = buf[p]
        p += 1
        if n & 0x80:
            if p >= len(buf):
                raise KallsymsTableError(kcore.path, f"name {i} of {count} runs past the names")
            n = (n & 0x7F) | buf[p] << 7
            p += 1
        if n == 0 or p + n > len(buf):
            why = "is empty" if n == 0 else f"({n} bytes) runs past the names"
            raise KallsymsTableError(kcore.path, f"name {i} of {count} {why}")
        name = join(map(token, buf[p : p + n]))
        p += n
        if not 1 < len(name) <= MAX_NAME:
            raise KallsymsTableError(kcore.path, f"name {i} decodes to {len(name)} bytes")
        out.append(name[:1] + b" " + name[1:])
    return out


def _addresses(kcore: Kcore, at: _Tables, count: int) -> tuple[list[int], str]:
    """Every symbol's address, and the name of the layout they were read in."""
    if at.offsets is None:
        raw = _read_long(kcore, _known(at.addresses), 8 * count, "kallsyms_addresses")
        return list(struct.unpack(f"<{count}Q", raw)), "absolute"
    raw = _read_long(kcore, at.offsets, 4 * count, "kallsyms_offsets")
    offsets = struct.unpack(f"<{count}i", raw)
    mask = (1 << 64) - 1
    if at.relative_base is None:
        return [
            (at.offsets + 4 * i + off) & mask for i, off in enumerate(offsets)
        ], "place-relative"
    base = kcore.u64(at.relative_base)
    if min(offsets) < 0:
        return [
            off if off >= 0 else (base - 1 - off) & mask for off in offsets
        ], "relative to kallsyms_relative_base, per-cpu absolute"
    return [(base + off) & mask for off in offsets], "relative to kallsyms_relative_base"


def _check_stext(where: str, names: list[bytes], values: list[int], stext: int | None) -> None:
    """VMCOREINFO's ``_stext`` where the table has it: the layout was read right."""
    for i, name in enumerate(names):
        if name[2:] == b"_stext":
            if stext is not None and values[i] != stext:
                raise KallsymsTableError(
                    where, f"_stext decodes to {values[i]:#x}, VMCOREINFO says {stext:#x}"
                )
            return
    raise KallsymsTableError(where, "the decoded table has no _stext")


_ADDRESS = re.compile(rb"^[0-9a-fA-F]+ ", re.MULTILINE)


def check_against(table: MemoryKallsyms, kallsyms: bytes) -> None:
    """:class:`KallsymsTableError` unless *table* lists the names and types
    *kallsyms* lists for the kernel itself (its lines before the first one with
    an owner), in the same order: line for line, addresses aside."""
    tab = kallsyms.find(b"\t")
    core = kallsyms if tab < 0 else kallsyms[: kallsyms.rfind(b"\n", 0, tab) + 1]
    listed = _ADDRESS.sub(b"", core)
    decoded = _ADDRESS.sub(b"", table.text)
    if listed == decoded:
        return
    ours, theirs = decoded.splitlines(), listed.splitlines()
    i = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    got = ours[i] if i < len(ours) else b"(end)"
    want = theirs[i] if i < len(theirs) else b"(end)"
    raise KallsymsTableError(
        "/proc/kallsyms",
        f"the tables in kernel memory disagree with it at line {i + 1}: "
        f"{got.decode('utf-8', 'replace')!r}, kallsyms lists {want.decode('utf-8', 'replace')!r}"
        f" ({len(ours)} decoded, {len(theirs)} listed)",
    )
