"""The fleet bucket's layout: object names and encodings, with no I/O (docs/FLEET.md).

Under ``s3://BUCKET/PREFIX``::

    tables/k/<build-id>               a kernel build's symbol table, once for the fleet
    tables/m/<build-id>               a module build's (or m/<name>/<srcversion>)
    tables/b/<boot-id>                a boot whose symbols differ from its build's
    boots/<boot-id>/batch-<n>         incarnations and kernel code published in one round
                                      (immutable; kernel code: kreld/fleet/kernel_code_objects.py)
    boots/<boot-id>/manifest          the boot, its host and its batches: written last
    index/<boot-id>.<machine-id>.<gen>.<version>.<summary>
                                      an empty object whose name is the boot's row in
                                      ``kreldctl boots``: listing index/ lists the fleet

Every object carries the format name and version: JSON objects in ``format`` and
``version`` fields, binary ones (tables) in a first line ``kreld-fleet table 1``, index names in
their fourth field.  A reader refuses what it does not recognise with
:class:`~kreld.core.errors.FleetObjectInvalid`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote

import zstandard

from kreld.core import jsonin
from kreld.core.errors import FleetObjectInvalid
from kreld.core.jsonin import Bool, Int, List, Map, Obj, Opt, Str
from kreld.core.kernel_code import KernelCode, LossWindow
from kreld.core.model import WIRE_ANCHORS, BootSnapshot, BootSymbols, Incarnation
from kreld.core.record import record
from kreld.fleet.kernel_code_objects import (
    ADDR,
    CODES_SHAPE,
    DROPPED_SHAPE,
    I64,
    LOSSES_SHAPE,
    NO_CODE,
    TIME,
    U64,
    CodeDelta,
)

__all__ = [
    "COMPACT_AFTER",
    "FORMAT",
    "MAX_BATCH",
    "MAX_BATCH_INFLATED",
    "MAX_COMPONENT",
    "MAX_MANIFEST",
    "MAX_MANIFEST_BATCHES",
    "MAX_TABLE",
    "MAX_TABLE_INFLATED",
    "TABLE_MAGIC",
    "VERSION",
    "Batch",
    "Host",
    "IndexEntry",
    "Manifest",
    "batch_name",
    "batch_object",
    "decode_batch",
    "decode_manifest",
    "decode_table",
    "digest",
    "encode_batch",
    "encode_manifest",
    "encode_table",
    "index_object",
    "machine_id_ok",
    "manifest_object",
    "merge_batches",
    "parse_index",
    "table_object",
]

FORMAT = "kreld-fleet"
VERSION = 1
TABLE_MAGIC = b"kreld-fleet table 1\n"
# A bucket path component SeaweedFS (and most file-backed stores) accept.
MAX_COMPONENT = 255
# Batches of one boot kept before a round writes one batch of the whole boot instead.
COMPACT_AFTER = 32
# What a reader fetches and inflates, at most (a kernel's table is a few MiB, a
# manifest some KiB, a boot's whole history after compaction a few MiB): an
# object past these is refused before it is read further.
MAX_MANIFEST = 8 << 20
MAX_BATCH = 64 << 20
MAX_BATCH_INFLATED = 64 << 20
MAX_TABLE = 64 << 20
MAX_TABLE_INFLATED = 128 << 20
MAX_JSON_DEPTH = 16
# The distinct batches one manifest may name: a publisher compacts a boot once it
# has COMPACT_AFTER of them, so a manifest naming more is not one kreld wrote, and
# reading them (each up to MAX_BATCH) would cost what its writer chose.
MAX_MANIFEST_BATCHES = 8 * COMPACT_AFTER
_ZSTD_WINDOW = 1 << 23  # kreld compresses at level 6: a 2 MiB window
_BATCH = re.compile(r"batch-[0-9]{8}")
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@record
class Host:
    machine_id: str
    hostname: str

    def to_json(self) -> dict[str, str]:
        return {"machine_id": self.machine_id, "hostname": self.hostname}


@record
class IndexEntry:
    """One boot's row in the listing, decoded from its object name."""

    boot_id: str
    host: Host
    gen: int
    first_seen: int | None  # realtime ns; None when the summary did not fit the name
    release: str
    build_id: str | None
    offset: str | None  # "0x..." KASLR offset
    restricted: bool


def machine_id_ok(text: str) -> bool:
    return _MACHINE_ID.fullmatch(text) is not None


# -- names ---------------------------------------------------------------------------


def table_object(key: str) -> str:
    """``k:<id>`` -> ``tables/k/<id>``; ``m:<name>:<srcv>`` -> ``tables/m/<name>/<srcv>``."""
    return "tables/" + key.replace(":", "/")


def manifest_object(boot_id: str) -> str:
    return f"boots/{boot_id}/manifest"


def batch_name(n: int) -> str:
    return f"batch-{n:08d}"


def batch_object(boot_id: str, name: str) -> str:
    return f"boots/{boot_id}/{name}"


def _quote(text: str) -> str:
    """Percent-encoded, dots too (quote() leaves them: they separate the fields here)."""
    return quote(text, safe="-_~").replace(".", "%2E")


def index_object(boot: BootSnapshot, host: Host, gen: int) -> str:
    """The boot's listing row as one object name, in one path component (a flat listing:
    file-backed stores such as SeaweedFS list one directory, not one per boot)::

        index/<boot-id>.<machine-id>.<gen>.<version>.<first-seen>.<offset>.<restricted>.
              <build-id>.<release>.<hostname>

    numbers in hex, ``-`` for none, release and hostname percent-encoded (dots too).  When
    that would pass 255 bytes the summary is ``-`` and readers take it from the manifest.
    """
    head = f"index/{boot.boot_id}.{host.machine_id}.{gen:x}.{VERSION}"
    summary = ".".join(
        (
            f"{boot.first_seen.realtime:x}",
            f"{boot.kaslr.value:x}" if boot.kaslr else "-",
            "1" if boot.restricted else "0",
            boot.build_id or "-",
            _quote(boot.release),
            _quote(host.hostname),
        )
    )
    if len(head) - len("index/") + 1 + len(summary) > MAX_COMPONENT:
        summary = "-"
    return f"{head}.{summary}"


def parse_index(name: str) -> IndexEntry:
    """An index object name back into its row (*name* relative to the prefix)."""
    try:
        if not name.startswith("index/") or "/" in name[6:]:
            raise ValueError("not index/<boot>.<machine-id>.<gen>.<version>.<summary>")
        parts = name[6:].split(".")
        if len(parts) < 4 or parts[3] != str(VERSION):
            raise ValueError(f"version {parts[3] if len(parts) > 3 else None!r}")
        boot_id, machine_id, gen = parts[0], parts[1], int(parts[2], 16)
        if not _BOOT_ID.fullmatch(boot_id):
            raise ValueError(f"boot-id {boot_id!r}")
        if not machine_id_ok(machine_id):
            raise ValueError(f"machine-id {machine_id!r}")
        if parts[4:] == ["-"]:
            return IndexEntry(boot_id, Host(machine_id, ""), gen, None, "", None, None, False)
        if len(parts) != 10:
            raise ValueError(f"{len(parts)} fields, not 10")
        t, offset, restricted, build_id, release, hostname = parts[4:]
        return IndexEntry(
            boot_id,
            Host(machine_id, unquote(hostname)),
            gen,
            int(t, 16),
            unquote(release),
            None if build_id == "-" else build_id,
            None if offset == "-" else f"{int(offset, 16):#x}",
            restricted == "1",
        )
    except ValueError as e:
        raise FleetObjectInvalid(name, f"not a kreld index entry: {e}") from e


# -- the shapes a reader checks before it believes anything ---------------------------

_TEXT = Str(4096)
_NAME = Str(255)
_BOOT_ID_STR = Str(36, _BOOT_ID.pattern)
_BUILD_ID = Str(128, r"[0-9a-f]{2,128}")
_FAULTS = List(_TEXT, 1024)
BOOT_SHAPE = Obj(
    {
        "boot_id": _BOOT_ID_STR,
        "release": _NAME,
        "version": _TEXT,
        "anchors": Obj({}, {k: Opt(ADDR) for k in WIRE_ANCHORS}),
        "restricted": Bool(),
        "first_seen": TIME,
    },
    {
        "build_id": Opt(_BUILD_ID),
        "kaslr_offset": Opt(ADDR),
        "kaslr_source": Opt(Str(32)),
        "kaslr_path": Opt(_TEXT),
        "restricted_reason": Opt(_TEXT),
        "kptr_restrict": Opt(Int(-(1 << 31), (1 << 31) - 1)),
        "faults": _FAULTS,
    },
)
INCARNATION_SHAPE = Obj(
    {
        "boot_id": _BOOT_ID_STR,
        "seq": Int(0, (1 << 63) - 1),
        "name": _NAME,
        "sections": Map(_NAME, ADDR, 4096),
        "loaded": TIME,
        "seen_by": Str(32),
        "init_live": Bool(),
    },
    {
        "build_id": Opt(_BUILD_ID),
        "coresize": Opt(U64),
        "initsize": Opt(U64),
        "initstate": Opt(Str(32)),
        "srcversion": Opt(Str(64)),
        "taint": Opt(Str(64)),
        "core_base": Opt(ADDR),
        "restricted": Bool(),
        "inode": Opt(U64),
        "faults": _FAULTS,
        "init_done": Opt(TIME),
        "unloaded": Opt(TIME),
        "unloaded_after": Opt(TIME),
        "unload_seen_by": Opt(Str(32)),
        "loaded_after": Opt(TIME),
    },
)
MANIFEST_SHAPE = Obj(
    {
        "host": Obj({"machine_id": Str(32, _MACHINE_ID.pattern), "hostname": _NAME}),
        "boot": BOOT_SHAPE,
        "batches": List(Str(14, _BATCH.pattern), 4096),
    },
    {
        "symbols": Opt(Obj({"kernel": _TEXT}, {"extras": List(_TEXT, 1 << 20)})),
        "gen": Int(0, (1 << 62) - 1),
    },
)
BATCH_SHAPE = Obj(
    {
        "boot_id": _BOOT_ID_STR,
        "incarnations": List(INCARNATION_SHAPE, 1 << 20),
        "absolutes": Map(Str(19, r"[0-9]{1,19}"), List(I64, 1 << 16), 1 << 20),
    },
    # kernel code (kreld/fleet/kernel_code_objects.py): absent from batches written before it
    {"code": CODES_SHAPE, "code_dropped": DROPPED_SHAPE, "losses": LOSSES_SHAPE},
)


# -- objects -------------------------------------------------------------------------


def _json_object(kind: str, body: Mapping[str, Any]) -> bytes:
    return json.dumps(
        {"format": FORMAT, "kind": kind, "version": VERSION, **body}, separators=(",", ":")
    ).encode()


def _read_json(name: str, data: bytes, kind: str, shape: jsonin.Shape) -> dict[str, Any]:
    """*data* parsed within bounds, of *kind* and version, and of *shape*."""
    try:
        obj = jsonin.loads(data, MAX_JSON_DEPTH)
    except jsonin.JsonRefused as e:
        raise FleetObjectInvalid(name, str(e)) from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise FleetObjectInvalid(name, f"not a {FORMAT} object")
    if obj.get("kind") != kind:
        raise FleetObjectInvalid(
            name, f"a {str(obj.get('kind'))[:40]!r} object where a {kind} belongs"
        )
    version = obj.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise FleetObjectInvalid(
            name, f"format version {_shown(version)}; this kreld reads up to {VERSION}"
        )
    try:
        jsonin.check(obj, shape)
    except jsonin.ShapeError as e:
        raise FleetObjectInvalid(name, f"malformed {kind}: {e}") from e
    return obj


def _shown(v: Any) -> str:
    """A value a hostile writer chose, short enough for a message."""
    return repr(v) if isinstance(v, int) and abs(v) < 1 << 64 else repr(str(v)[:40])


def _inflate(name: str, data: bytes, limit: int, what: str) -> bytes:
    """*data* decompressed a MiB at a time, refused as soon as it passes *limit*."""
    out = bytearray()
    try:
        d = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW)
        with d.stream_reader(data, read_across_frames=True) as r:
            while chunk := r.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise FleetObjectInvalid(name, f"inflates past {limit:,} bytes")
    except zstandard.ZstdError as e:
        raise FleetObjectInvalid(name, f"{what}: {e}") from e
    return bytes(out)


def encode_table(packed: bytes) -> bytes:
    return TABLE_MAGIC + zstandard.ZstdCompressor(level=6).compress(packed)


def decode_table(name: str, data: bytes) -> bytes:
    if not data.startswith(TABLE_MAGIC):
        head = data[: len(TABLE_MAGIC)]
        if head.startswith(b"kreld-fleet table "):
            raise FleetObjectInvalid(name, f"table format {head!r}; this kreld reads version 1")
        raise FleetObjectInvalid(name, "not a kreld symbol table")
    return _inflate(name, data[len(TABLE_MAGIC) :], MAX_TABLE_INFLATED, "damaged table")


@record
class Manifest:
    host: Host
    boot: BootSnapshot
    symbols: BootSymbols | None
    batches: tuple[str, ...]
    gen: int | None = None  # its index entry's generation (None: written before it was kept)


def encode_manifest(m: Manifest) -> bytes:
    return _json_object(
        "manifest",
        {
            "host": m.host.to_json(),
            "boot": m.boot.to_json(),
            "symbols": m.symbols.to_json() if m.symbols else None,
            "batches": list(m.batches),
            **({} if m.gen is None else {"gen": m.gen}),
        },
    )


def decode_manifest(name: str, data: bytes, boot_id: str | None = None) -> Manifest:
    """The manifest object *name*; with *boot_id*, refused unless it is that boot's
    (a manifest copied over another boot's key is not believed)."""
    obj = _read_json(name, data, "manifest", MANIFEST_SHAPE)
    try:
        host = Host(obj["host"]["machine_id"], obj["host"]["hostname"])
        boot = BootSnapshot.from_json(obj["boot"])
        batches = tuple(obj["batches"])
    except (KeyError, TypeError, ValueError) as e:
        raise FleetObjectInvalid(name, f"malformed manifest: {e!r}") from e
    if boot_id is not None and boot.boot_id != boot_id:
        raise FleetObjectInvalid(name, f"the manifest of boot {boot.boot_id}, not of {boot_id}")
    # A batch named again adds nothing: each is kept once, where it first appears.
    batches = tuple(dict.fromkeys(batches))
    if len(batches) > MAX_MANIFEST_BATCHES:
        raise FleetObjectInvalid(
            name,
            f"names {len(batches):,} distinct batches, more than {MAX_MANIFEST_BATCHES} "
            f"(a publisher compacts a boot after {COMPACT_AFTER})",
        )
    sym = obj.get("symbols")
    symbols = None if sym is None else BootSymbols.from_json(sym)
    return Manifest(host, boot, symbols, batches, obj.get("gen"))


@record
class Batch:
    incarnations: tuple[Incarnation, ...]
    absolutes: dict[int, list[int]]
    code: CodeDelta = NO_CODE


def encode_batch(
    boot_id: str,
    incs: Sequence[Incarnation],
    absolutes: Mapping[int, list[int]],
    code: CodeDelta = NO_CODE,
) -> bytes:
    body: dict[str, Any] = {
        "boot_id": boot_id,
        "incarnations": [i.to_json() for i in incs],
        "absolutes": {str(k): v for k, v in absolutes.items()},
    }
    if not code.empty():
        body["code"] = [c.to_json() for c in code.codes]
        body["code_dropped"] = list(code.dropped)
        body["losses"] = None if code.losses is None else [w.to_json() for w in code.losses]
    return zstandard.ZstdCompressor(level=6).compress(_json_object("batch", body))


def decode_batch(name: str, data: bytes, boot_id: str) -> Batch:
    raw = _inflate(name, data, MAX_BATCH_INFLATED, "not a compressed kreld batch")
    obj = _read_json(name, raw, "batch", BATCH_SHAPE)
    if obj["boot_id"] != boot_id:
        raise FleetObjectInvalid(name, f"a batch of boot {obj['boot_id']}, not {boot_id}")
    try:
        incs = tuple(Incarnation.from_json(i) for i in obj["incarnations"])
        absolutes = {int(k): list(v) for k, v in obj["absolutes"].items()}
        codes = tuple(KernelCode.from_json(c) for c in obj.get("code", ()))
        wins = obj.get("losses")
        losses = None if wins is None else tuple(LossWindow.from_json(w) for w in wins)
        code = CodeDelta(codes, tuple(obj.get("code_dropped", ())), losses)
    except (KeyError, TypeError, ValueError) as e:
        raise FleetObjectInvalid(name, f"malformed batch: {e!r}") from e
    strays = [i.seq for i in incs if i.boot_id != boot_id]
    strays += [c.seq for c in codes if c.boot_id != boot_id]
    if strays:
        raise FleetObjectInvalid(name, f"records of another boot (seq {strays[:3]})")
    return Batch(incs, absolutes, code)


def merge_batches(batches: Iterable[Batch]) -> tuple[list[Incarnation], dict[int, list[int]]]:
    """A boot's incarnations from its batches in order: a later record of a seq wins."""
    incs: dict[int, Incarnation] = {}
    absolutes: dict[int, list[int]] = {}
    for b in batches:
        for i in b.incarnations:
            incs[i.seq] = i
        absolutes.update(b.absolutes)
    return [incs[s] for s in sorted(incs)], absolutes


def digest(obj: Any) -> bytes:
    """8 bytes that change when a record's published form would."""
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(raw, digest_size=8).digest()
