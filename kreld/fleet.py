"""The fleet bucket's layout: object names and encodings, with no I/O (docs/FLEET.md).

Under ``s3://BUCKET/PREFIX``::

    tables/k/<build-id>               a kernel build's symbol table, once for the fleet
    tables/m/<build-id>               a module build's (or m/<name>/<srcversion>)
    tables/b/<boot-id>                a boot whose symbols differ from its build's
    boots/<boot-id>/batch-<n>         incarnations published in one round (immutable)
    boots/<boot-id>/manifest          the boot, its host and its batches: written last
    index/<boot-id>.<machine-id>.<gen>/<summary>
                                      an empty object whose name is the boot's row in
                                      ``kreldctl boots``: listing index/ lists the fleet

Every object carries the format name and version: JSON objects in ``format`` and
``version`` fields, binary ones (tables) in a first line ``kreld-fleet table 1``, the index
in the ``v`` of its summary.  A reader refuses what it does not recognise with
:class:`~kreld.errors.FleetObjectInvalid`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zstandard

from kreld.errors import FleetObjectInvalid
from kreld.model import BootSnapshot, Incarnation, hexaddr

FORMAT = "kreld-fleet"
VERSION = 1
TABLE_MAGIC = b"kreld-fleet table 1\n"
# A bucket path component SeaweedFS (and most file-backed stores) accept.
MAX_COMPONENT = 255
# Batches of one boot kept before a round writes one batch of the whole boot instead.
COMPACT_AFTER = 32
_BATCH = re.compile(r"batch-[0-9]{8}")
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class Host:
    machine_id: str
    hostname: str

    def to_json(self) -> dict[str, str]:
        return {"machine_id": self.machine_id, "hostname": self.hostname}


@dataclass(frozen=True, slots=True)
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


def index_object(boot: BootSnapshot, host: Host, gen: int) -> str:
    """The boot's listing row as an object name (the summary is left out, and read from
    the manifest, when it would not fit one path component)."""
    summary = {
        "v": VERSION,
        "t": boot.first_seen.realtime,
        "r": boot.release,
        "b": boot.build_id,
        "o": hexaddr(boot.kaslr.value) if boot.kaslr else None,
        "x": boot.restricted,
        "h": host.hostname,
    }
    raw = json.dumps(summary, separators=(",", ":")).encode()
    text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    if len(text) > MAX_COMPONENT:
        text = "-"
    return f"index/{boot.boot_id}.{host.machine_id}.{gen:08x}/{text}"


def parse_index(name: str) -> IndexEntry:
    """An index object name back into its row (*name* relative to the prefix)."""
    parts = name.split("/")
    try:
        if len(parts) != 3 or parts[0] != "index":
            raise ValueError("not index/<boot>.<machine-id>.<gen>/<summary>")
        boot_id, machine_id, gen = parts[1].split(".")
        if not _BOOT_ID.fullmatch(boot_id):
            raise ValueError(f"boot-id {boot_id!r}")
        if not machine_id_ok(machine_id):
            raise ValueError(f"machine-id {machine_id!r}")
        if parts[2] == "-":
            return IndexEntry(
                boot_id, Host(machine_id, ""), int(gen, 16), None, "", None, None, False
            )
        raw = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4))
        s = json.loads(raw)
        if not isinstance(s, dict) or s.get("v") != VERSION:
            raise ValueError(f"summary version {s.get('v') if isinstance(s, dict) else s!r}")
        return IndexEntry(
            boot_id,
            Host(machine_id, str(s["h"])),
            int(gen, 16),
            int(s["t"]),
            str(s["r"]),
            None if s["b"] is None else str(s["b"]),
            None if s["o"] is None else str(s["o"]),
            bool(s["x"]),
        )
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        raise FleetObjectInvalid(name, f"not a kreld index entry: {e}") from e


# -- objects -------------------------------------------------------------------------


def _json_object(kind: str, body: Mapping[str, Any]) -> bytes:
    return json.dumps(
        {"format": FORMAT, "kind": kind, "version": VERSION, **body}, separators=(",", ":")
    ).encode()


def _read_json(name: str, data: bytes, kind: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FleetObjectInvalid(name, f"not JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise FleetObjectInvalid(name, f"not a {FORMAT} object")
    if obj.get("kind") != kind:
        raise FleetObjectInvalid(name, f"a {obj.get('kind')!r} object where a {kind} belongs")
    version = obj.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise FleetObjectInvalid(
            name, f"format version {version!r}; this kreld reads up to {VERSION}"
        )
    return obj


def encode_table(packed: bytes) -> bytes:
    return TABLE_MAGIC + zstandard.ZstdCompressor(level=6).compress(packed)


def decode_table(name: str, data: bytes) -> bytes:
    if not data.startswith(TABLE_MAGIC):
        head = data[: len(TABLE_MAGIC)]
        if head.startswith(b"kreld-fleet table "):
            raise FleetObjectInvalid(name, f"table format {head!r}; this kreld reads version 1")
        raise FleetObjectInvalid(name, "not a kreld symbol table")
    try:
        return zstandard.ZstdDecompressor().decompress(
            data[len(TABLE_MAGIC) :], max_output_size=1 << 30
        )
    except zstandard.ZstdError as e:
        raise FleetObjectInvalid(name, f"damaged table: {e}") from e


@dataclass(frozen=True, slots=True)
class Manifest:
    host: Host
    boot: BootSnapshot
    symbols: dict[str, Any] | None  # the store's boot_symbols record
    batches: tuple[str, ...]


def encode_manifest(m: Manifest) -> bytes:
    return _json_object(
        "manifest",
        {
            "host": m.host.to_json(),
            "boot": m.boot.to_json(),
            "symbols": m.symbols,
            "batches": list(m.batches),
        },
    )


def decode_manifest(name: str, data: bytes) -> Manifest:
    obj = _read_json(name, data, "manifest")
    try:
        host = Host(str(obj["host"]["machine_id"]), str(obj["host"]["hostname"]))
        boot = BootSnapshot.from_json(obj["boot"])
        batches = tuple(str(b) for b in obj["batches"])
        symbols = obj.get("symbols")
        if symbols is not None and not isinstance(symbols, dict):
            raise TypeError("symbols is not an object")
    except (KeyError, TypeError, ValueError) as e:
        raise FleetObjectInvalid(name, f"malformed manifest: {e!r}") from e
    bad = [b for b in batches if not _BATCH.fullmatch(b)]
    if bad:
        raise FleetObjectInvalid(name, f"malformed batch names {bad[:3]}")
    return Manifest(host, boot, symbols, batches)


@dataclass(frozen=True, slots=True)
class Batch:
    incarnations: tuple[Incarnation, ...]
    absolutes: dict[int, list[int]]


def encode_batch(
    boot_id: str, incs: Sequence[Incarnation], absolutes: Mapping[int, list[int]]
) -> bytes:
    raw = _json_object(
        "batch",
        {
            "boot_id": boot_id,
            "incarnations": [i.to_json() for i in incs],
            "absolutes": {str(k): v for k, v in absolutes.items()},
        },
    )
    return zstandard.ZstdCompressor(level=6).compress(raw)


def decode_batch(name: str, data: bytes, boot_id: str) -> Batch:
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
    except zstandard.ZstdError as e:
        raise FleetObjectInvalid(name, f"not a compressed kreld batch: {e}") from e
    obj = _read_json(name, raw, "batch")
    if obj.get("boot_id") != boot_id:
        raise FleetObjectInvalid(name, f"a batch of boot {obj.get('boot_id')!r}, not {boot_id}")
    try:
        incs = tuple(Incarnation.from_json(i) for i in obj["incarnations"])
        absolutes = {int(k): [int(x) for x in v] for k, v in obj["absolutes"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FleetObjectInvalid(name, f"malformed batch: {e!r}") from e
    return Batch(incs, absolutes)


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
