"""The stored form of a module incarnation: compact, and apart from the wire form.

A boot records every loaded module again, so its incarnations are most of
what a boot adds to the store.  The stored record leaves out what the key
already says (boot-id, seq), writes timestamps as ``[monotonic, boottime,
realtime]`` (later ones as differences from the load), and keeps section
bases as one list of offsets from the lowest base, the section names being
interned once per distinct set of names in the ``layouts`` table (every load
of one module build has the same set).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kreld.model import Incarnation, ModuleState, SeenBy, Timestamp

VERSION = 2


def layout_key(names: Sequence[str]) -> bytes:
    return hashlib.sha1("\0".join(names).encode()).digest()[:12]


def _ts(t: Timestamp | None, rel: Timestamp | None = None) -> list[int] | None:
    """``[monotonic, boottime, realtime]``, as differences from *rel* if given."""
    if t is None:
        return None
    if rel is None:
        return [t.monotonic, t.boottime, t.realtime]
    return [t.monotonic - rel.monotonic, t.boottime - rel.boottime, t.realtime - rel.realtime]


def _un_ts(v: Any, rel: Timestamp | None = None) -> Timestamp | None:
    if v is None:
        return None
    t = Timestamp(int(v[0]), int(v[1]), int(v[2]))
    if rel is not None:
        t = Timestamp(
            t.monotonic + rel.monotonic, t.boottime + rel.boottime, t.realtime + rel.realtime
        )
    return t


def encode(inc: Incarnation) -> tuple[bytes, bytes, list[str]]:
    """The record, and the layout key and names it refers to."""
    s = inc.state
    names = sorted(s.sections)
    base0 = min(s.sections.values(), default=0)
    rec: dict[str, Any] = {
        "v": VERSION,
        "n": s.name,
        "L": layout_key(names).hex(),
        "b0": base0,
        "o": [s.sections[n] - base0 for n in names],
        "l": _ts(inc.loaded),
        "by": inc.seen_by.value,
    }
    optional = {
        "B": s.build_id,
        "cs": s.coresize,
        "is": s.initsize,
        "st": s.initstate,
        "sv": s.srcversion,
        "t": s.taint,
        "cb": None if s.core_base is None else s.core_base - base0,
        "r": s.restricted or None,
        "i": s.inode,
        "f": list(s.faults) or None,
        "il": inc.init_live or None,
        # Later times as differences from the load: short numbers.
        "id": _ts(inc.init_done, inc.loaded),
        "u": _ts(inc.unloaded, inc.loaded),
        "ua": _ts(inc.unloaded_after, inc.loaded),
        "uby": inc.unload_seen_by.value if inc.unload_seen_by else None,
    }
    rec.update({k: v for k, v in optional.items() if v is not None})
    raw = json.dumps(rec, separators=(",", ":")).encode()
    return raw, layout_key(names), names


def decode(
    raw: bytes | memoryview, boot_id: str, seq: int, layout: Callable[[bytes], list[str]]
) -> Incarnation:
    """An incarnation from its stored record (this form, or the wire JSON of
    schema 1 stores)."""
    d: Mapping[str, Any] = json.loads(bytes(raw))
    if d.get("v") != VERSION:
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
    assert loaded is not None
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
