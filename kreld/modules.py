"""Reader of loaded modules: ``/sys/module/<m>`` and ``/proc/modules``.

A loadable module's directory has ``initstate`` (and, when the reader may
see it, ``sections/``); a built-in module's has neither and is skipped.
Section files hold the hex base of each ELF section; zeros mean the reader
may not see kernel pointers.  Sysfs files appear one by one while the module
loads (``mod_sysfs_setup()`` adds sections and notes after the kobject), so
a read may find a directory that is not yet complete: what is missing is
recorded as a fault and read again later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kreld import consts
from kreld.elfnote import find_build_id
from kreld.errors import NoteError
from kreld.kernel import Root
from kreld.model import ModuleState


@dataclass(frozen=True, slots=True)
class ProcModule:
    size: int | None
    state: str | None
    base: int | None


def parse_proc_modules(text: str) -> dict[str, ProcModule]:
    """``name size refcnt deps state base [taint]`` per line; zero base -> None."""
    out: dict[str, ProcModule] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 6:
            continue
        try:
            size: int | None = int(f[1])
        except ValueError:
            size = None
        try:
            base: int | None = int(f[5], 16) or None
        except ValueError:
            base = None
        out[f[0]] = ProcModule(size, f[4], base)
    return out


def read_proc_modules(root: Root) -> dict[str, ProcModule]:
    try:
        with open(root / consts.PROC_MODULES, encoding="ascii", errors="replace") as f:
            return parse_proc_modules(f.read())
    except OSError:
        return {}


def list_modules(root: Root) -> dict[str, int]:
    """Loadable modules present now: name -> inode of their sysfs directory."""
    base = root / consts.SYS_MODULE
    out: dict[str, int] = {}
    try:
        entries = list(os.scandir(base))
    except OSError:
        return out
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            if os.path.exists(os.path.join(e.path, "initstate")) or os.path.isdir(
                os.path.join(e.path, "sections")
            ):
                out[e.name] = e.inode()
        except OSError:
            continue
    return out


def _read_small(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(65536)
    except OSError:
        return None


def _text(path: str) -> str | None:
    raw = _read_small(path)
    return None if raw is None else raw.decode("utf-8", "replace").strip()


def _int(path: str, faults: list[str]) -> int | None:
    s = _text(path)
    if s is None:
        return None
    try:
        return int(s)
    except ValueError:
        faults.append(f"{os.path.basename(path)}: not a number: {s[:40]!r}")
        return None


def read_module(
    root: Root, name: str, proc: Mapping[str, ProcModule] | None = None
) -> ModuleState | None:
    """Read one module; ``None`` if it is gone or built in."""
    d = os.path.join(root / consts.SYS_MODULE, name)
    try:
        inode = os.stat(d).st_ino
    except OSError:
        return None
    faults: list[str] = []
    initstate = _text(os.path.join(d, "initstate"))
    sections: dict[str, int] = {}
    restricted = False
    sdir = os.path.join(d, "sections")
    try:
        entries = sorted(os.scandir(sdir), key=lambda e: e.name)
    except FileNotFoundError:
        entries = []
        if initstate is None:
            return None  # built-in, or gone
        faults.append("sections/ not present (still loading, or hidden)")
    except OSError as err:
        entries = []
        faults.append(f"sections/: {err.strerror}")
    for entry in entries:
        raw = _read_small(entry.path)
        if raw is None:
            faults.append(f"sections/{entry.name}: unreadable")
            continue
        s = raw.strip().decode("ascii", "replace")
        try:
            addr = int(s, 16)
        except ValueError:
            faults.append(f"sections/{entry.name}: not a hex address: {s[:40]!r}")
            continue
        if addr == 0:
            restricted = True
        else:
            sections[entry.name] = addr
    build_id = None
    note = _read_small(os.path.join(d, "notes", ".note.gnu.build-id"))
    if note is not None:
        try:
            build_id = find_build_id(note)
        except NoteError as err:
            faults.append(f"notes/.note.gnu.build-id: {err}")
    pm = (proc if proc is not None else read_proc_modules(root)).get(name)
    if pm is not None and pm.base is None and pm.size:
        restricted = True
    return ModuleState(
        name=name,
        build_id=build_id,
        sections=sections,
        coresize=_int(os.path.join(d, "coresize"), faults),
        initsize=_int(os.path.join(d, "initsize"), faults),
        initstate=initstate,
        srcversion=_text(os.path.join(d, "srcversion")),
        taint=_text(os.path.join(d, "taint")),
        core_base=pm.base if pm else None,
        restricted=restricted,
        inode=inode,
        faults=tuple(faults),
    )
