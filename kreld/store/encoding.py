"""The stored form of a module incarnation: compact, and apart from the wire form.

A boot records every loaded module again, so its incarnations are most of
what a boot adds to the store.  The stored record leaves out what the key
already says (boot-id, seq); section names are interned once per distinct
set of names in the ``layouts`` table (every load of one module build has
the same set), and the rest is packed in binary (version 3)::

    u8      3 (version; a JSON record of an older store starts with "{")
    varint  flags: which optional fields follow (the F_* bits)
    str     module name
    12 B    layout key
    u64     lowest section base (b0)
    varint  offset of each section from b0, in layout order
    zigzag  loaded: monotonic, boottime - monotonic, realtime
    u8      how it was seen (index in SEEN_BY)
    ...     the optional fields, in F_* bit order

A varint is LEB128; a str is a varint length and UTF-8; times after the load
are zigzag varints of the difference from it, on each clock.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kreld.core.model import AddressSource, Incarnation, ModuleState, SeenBy, Timestamp

__all__ = [
    "F_BUILD_ID_RAW",
    "F_BUILD_ID_STR",
    "F_CORESIZE",
    "F_CORE_BASE",
    "F_FAULTS",
    "F_INITSIZE",
    "F_INITSTATE",
    "F_INIT_DONE",
    "F_INIT_LIVE",
    "F_INODE",
    "F_KCORE",
    "F_RESTRICTED",
    "F_SRCVERSION",
    "F_SYSFS",
    "F_TAINT",
    "F_UNLOADED",
    "F_UNLOADED_AFTER",
    "F_UNLOAD_SEEN_BY",
    "SEEN_BY",
    "VERSION",
    "decode",
    "encode",
    "layout_key",
]

VERSION = 3
_JSON_VERSION = 2  # the record of schema 2 stores, still read
_LAYOUT_KEY_LEN = 12
_U64 = struct.Struct("<Q")
SEEN_BY = tuple(SeenBy)  # stored as an index: append only

# Optional fields, in the order they follow the fixed part.
F_BUILD_ID_RAW = 1 << 0  # bytes: a hex build-id, as its bytes
F_BUILD_ID_STR = 1 << 1  # str: any other build-id
F_CORESIZE = 1 << 2
F_INITSIZE = 1 << 3
F_INITSTATE = 1 << 4
F_SRCVERSION = 1 << 5
F_TAINT = 1 << 6
F_CORE_BASE = 1 << 7  # zigzag, relative to b0
F_INODE = 1 << 8
F_FAULTS = 1 << 9  # varint count, then each str
F_INIT_DONE = 1 << 10
F_UNLOADED = 1 << 11
F_UNLOADED_AFTER = 1 << 12
F_UNLOAD_SEEN_BY = 1 << 13
F_RESTRICTED = 1 << 14  # no payload
F_INIT_LIVE = 1 << 15  # no payload
F_LOADED_AFTER = 1 << 16  # since schema 4
# No payload: where the sections came from (kptr_restrict=2 reads kernel memory);
# neither in records written before kreld could.
F_KCORE = 1 << 17  # kernel memory
F_SYSFS = 1 << 18  # sys/module/<m>/sections
_KNOWN_FLAGS = (1 << 19) - 1
_SOURCE_FLAGS = ((AddressSource.KCORE, F_KCORE), (AddressSource.SYSFS, F_SYSFS))


def layout_key(names: Sequence[str]) -> bytes:
    import hashlib  # loads OpenSSL: only when a record is written

    return hashlib.sha1("\0".join(names).encode()).digest()[:_LAYOUT_KEY_LEN]


class _Writer:
    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"negative varint {n}")
        out = self.out
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)

    def zigzag(self, n: int) -> None:
        self.varint(n * 2 if n >= 0 else -n * 2 - 1)

    def blob(self, b: bytes) -> None:
        self.varint(len(b))
        self.out += b

    def text(self, s: str) -> None:
        self.blob(s.encode())

    def texts(self, items: Sequence[str]) -> None:
        self.varint(len(items))
        for s in items:
            self.text(s)

    def seen_by(self, how: SeenBy) -> None:
        self.out.append(SEEN_BY.index(how))

    def since(self, t: Timestamp, rel: Timestamp) -> None:
        self.zigzag(t.monotonic - rel.monotonic)
        self.zigzag(t.boottime - rel.boottime)
        self.zigzag(t.realtime - rel.realtime)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def varint(self) -> int:
        buf, pos = self.buf, self.pos
        n = shift = 0
        while True:
            b = buf[pos]  # IndexError on a truncated record
            pos += 1
            n |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
            if shift > 70:
                raise ValueError("varint too long")
        self.pos = pos
        return n

    def zigzag(self) -> int:
        n = self.varint()
        return n >> 1 if not n & 1 else -(n >> 1) - 1

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("record truncated")
        b = self.buf[self.pos : end]
        self.pos = end
        return b

    def blob(self) -> bytes:
        return self.take(self.varint())

    def text(self) -> str:
        return self.blob().decode()

    def texts(self) -> tuple[str, ...]:
        return tuple(self.text() for _ in range(self.varint()))

    def seen_by(self) -> SeenBy:
        return SEEN_BY[self.take(1)[0]]

    def since(self, rel: Timestamp) -> Timestamp:
        return Timestamp(
            rel.monotonic + self.zigzag(),
            rel.boottime + self.zigzag(),
            rel.realtime + self.zigzag(),
        )


def _hex_bytes(s: str) -> bytes | None:
    """*s* as bytes if it is lower-case hex that round-trips, else None."""
    try:
        b = bytes.fromhex(s)
    except ValueError:
        return None
    return b if b.hex() == s else None


def encode(inc: Incarnation) -> tuple[bytes, bytes, list[str]]:
    """The record, and the layout key and names it refers to; ValueError (or
    struct.error) for one :func:`decode` would not read back."""
    s = inc.state
    names = sorted(s.sections)
    key = layout_key(names)
    base0 = min(s.sections.values(), default=0)
    t = inc.loaded
    # The optional fields, written in F_* order; each one present sets its bit.
    opt = _Writer()
    flags = (F_RESTRICTED if s.restricted else 0) | (F_INIT_LIVE if inc.init_live else 0)
    flags |= sum(bit for source, bit in _SOURCE_FLAGS if s.source == source)

    def put(bit: int, value: Any, write: Callable[[Any], None]) -> None:
        nonlocal flags
        if value is not None:
            flags |= bit
            write(value)

    raw_id = _hex_bytes(s.build_id) if s.build_id is not None else None
    put(F_BUILD_ID_RAW, raw_id, opt.blob)
    put(F_BUILD_ID_STR, s.build_id if raw_id is None else None, opt.text)
    put(F_CORESIZE, s.coresize, opt.varint)
    put(F_INITSIZE, s.initsize, opt.varint)
    put(F_INITSTATE, s.initstate, opt.text)
    put(F_SRCVERSION, s.srcversion, opt.text)
    put(F_TAINT, s.taint, opt.text)
    put(F_CORE_BASE, None if s.core_base is None else s.core_base - base0, opt.zigzag)
    put(F_INODE, s.inode, opt.varint)
    put(F_FAULTS, s.faults or None, opt.texts)
    put(F_INIT_DONE, inc.init_done, lambda v: opt.since(v, t))
    put(F_UNLOADED, inc.unloaded, lambda v: opt.since(v, t))
    put(F_UNLOADED_AFTER, inc.unloaded_after, lambda v: opt.since(v, t))
    put(F_UNLOAD_SEEN_BY, inc.unload_seen_by, opt.seen_by)
    put(F_LOADED_AFTER, inc.loaded_after, lambda v: opt.since(v, t))

    w = _Writer()
    w.out.append(VERSION)
    w.varint(flags)
    w.text(s.name)
    w.out += key
    w.out += _U64.pack(base0)
    for n in names:
        w.varint(s.sections[n] - base0)
    w.zigzag(t.monotonic)
    w.zigzag(t.boottime - t.monotonic)
    w.zigzag(t.realtime)
    w.seen_by(inc.seen_by)
    raw = bytes(w.out + opt.out)
    # What decode() would refuse is never written: it would make every reader of
    # the store fail on this record (a section base of 80 bits, say); nor what the
    # wire form's reader would (an address past 64 bits: parse_addr).
    decode(raw, inc.boot_id, inc.seq, lambda _key: names)
    Incarnation.from_json(inc.to_json())
    return raw, key, names


def _read_state(
    r: _Reader, flags: int, name: str, base0: int, sections: dict[str, int]
) -> ModuleState:
    """The module's own fields of a record, in their order after the load time."""

    def opt(bit: int, read: Callable[[], Any]) -> Any:
        return read() if flags & bit else None

    build_id = opt(F_BUILD_ID_RAW, lambda: r.blob().hex())
    if flags & F_BUILD_ID_STR:
        build_id = r.text()
    coresize = opt(F_CORESIZE, r.varint)
    initsize = opt(F_INITSIZE, r.varint)
    initstate = opt(F_INITSTATE, r.text)
    srcversion = opt(F_SRCVERSION, r.text)
    taint = opt(F_TAINT, r.text)
    core_rel = opt(F_CORE_BASE, r.zigzag)
    inode = opt(F_INODE, r.varint)
    faults = opt(F_FAULTS, r.texts) or ()
    return ModuleState(
        name=name,
        build_id=build_id,
        sections=sections,
        coresize=coresize,
        initsize=initsize,
        initstate=initstate,
        srcversion=srcversion,
        taint=taint,
        core_base=None if core_rel is None else base0 + core_rel,
        restricted=bool(flags & F_RESTRICTED),
        inode=inode,
        faults=faults,
        source=next((source for source, bit in _SOURCE_FLAGS if flags & bit), None),
    )


def decode(
    raw: bytes | memoryview, boot_id: str, seq: int, layout: Callable[[bytes], list[str]]
) -> Incarnation:
    """An incarnation from its stored record: this form, or the JSON of older
    stores (schema 2's compact one, schema 1's wire form).

    A malformed record raises ValueError or IndexError."""
    buf = bytes(raw)
    if buf[:1] != bytes((VERSION,)):
        return _decode_json(buf, boot_id, seq, layout)
    r = _Reader(buf, 1)
    flags = r.varint()
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown record flags {flags:#x}")
    name = r.text()
    names = layout(r.take(_LAYOUT_KEY_LEN))
    (base0,) = _U64.unpack(r.take(8))
    sections = {n: base0 + r.varint() for n in names}
    mono = r.zigzag()
    loaded = Timestamp(mono, mono + r.zigzag(), r.zigzag())
    seen_by = r.seen_by()

    state = _read_state(r, flags, name, base0, sections)

    def opt(bit: int, read: Callable[[], Any]) -> Any:
        return read() if flags & bit else None

    init_done = opt(F_INIT_DONE, lambda: r.since(loaded))
    unloaded = opt(F_UNLOADED, lambda: r.since(loaded))
    unloaded_after = opt(F_UNLOADED_AFTER, lambda: r.since(loaded))
    unload_seen_by = opt(F_UNLOAD_SEEN_BY, r.seen_by)
    loaded_after = opt(F_LOADED_AFTER, lambda: r.since(loaded))
    if r.pos != len(buf):
        raise ValueError(f"{len(buf) - r.pos} bytes after the record")
    return Incarnation(
        boot_id=boot_id,
        seq=seq,
        state=state,
        loaded=loaded,
        seen_by=seen_by,
        init_live=bool(flags & F_INIT_LIVE),
        init_done=init_done,
        unloaded=unloaded,
        unloaded_after=unloaded_after,
        unload_seen_by=unload_seen_by,
        loaded_after=loaded_after,
    )


# -- records of older stores ------------------------------------------------------------


def _un_ts(v: Any, rel: Timestamp | None = None) -> Timestamp | None:
    if v is None:
        return None
    t = Timestamp(int(v[0]), int(v[1]), int(v[2]))
    if rel is not None:
        t = Timestamp(
            t.monotonic + rel.monotonic, t.boottime + rel.boottime, t.realtime + rel.realtime
        )
    return t


def _decode_json(
    raw: bytes, boot_id: str, seq: int, layout: Callable[[bytes], list[str]]
) -> Incarnation:
    d: Mapping[str, Any] = json.loads(raw)
    if d.get("v") != _JSON_VERSION:
        return Incarnation.from_json(d)
    names = layout(bytes.fromhex(d["L"]))
    base0 = int(d["b0"])
    state = ModuleState(
        name=d["n"],
        build_id=d.get("B"),
        sections={n: base0 + int(o) for n, o in zip(names, d["o"], strict=True)},
        coresize=d.get("cs"),
        initsize=d.get("is"),
        initstate=d.get("st"),
        srcversion=d.get("sv"),
        taint=d.get("t"),
        core_base=None if d.get("cb") is None else base0 + int(d["cb"]),
        restricted=bool(d.get("r", False)),
        inode=d.get("i"),
        faults=tuple(d.get("f", ())),
    )
    loaded = _un_ts(d["l"])
    if loaded is None:
        raise ValueError("record without a load time")
    uby = d.get("uby")
    return Incarnation(
        boot_id=boot_id,
        seq=seq,
        state=state,
        loaded=loaded,
        seen_by=SeenBy(d["by"]),
        init_live=bool(d.get("il", False)),
        init_done=_un_ts(d.get("id"), loaded),
        unloaded=_un_ts(d.get("u"), loaded),
        unloaded_after=_un_ts(d.get("ua"), loaded),
        unload_seen_by=SeenBy(uby) if uby else None,
    )
