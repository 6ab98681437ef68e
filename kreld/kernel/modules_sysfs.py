"""The sysfs module reader: loaded modules from ``/sys/module/<m>`` and ``/proc/modules``.

A loadable module's directory has ``initstate`` (and, when the reader may
see it, ``sections/``); a built-in module's has neither and is skipped.
Section files hold the hex base of each ELF section; zeros mean the reader
may not see kernel pointers.  Every number is checked as it is read
(:mod:`kreld.kernel.files`): a base outside the kernel's half, a size no module
can have, is a fault of the read, never a value kept.  Sysfs files appear one
by one while the module loads (``mod_sysfs_setup()`` adds sections and notes after the kobject), so
a read may find a directory that is not yet complete: what is missing is
recorded as a fault and read again later.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from kreld.core import consts
from kreld.core.errors import KernelReadError, NoteError
from kreld.core.model import AddressSource, ModuleState
from kreld.core.record import record
from kreld.kernel.files import hex_address, module_size
from kreld.kernel.info import Root
from kreld.kernel.notes import find_build_id

T = TypeVar("T")

__all__ = ["ProcModule", "list_modules", "parse_proc_modules", "read_module", "read_proc_modules"]


@record
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
            size: int | None = module_size(f[1])
        except ValueError:
            size = None
        try:
            base: int | None = hex_address(f[5]) or None
        except ValueError:
            base = None
        out[f[0]] = ProcModule(size, f[4], base)
    return out


def read_proc_modules(root: Root) -> dict[str, ProcModule]:
    try:
        text = root.read_bytes(consts.PROC_MODULES, consts.MAX_PROC_MODULES)
    except KernelReadError:
        return {}
    return parse_proc_modules(text.decode("ascii", "replace"))


def list_modules(root: Root) -> dict[str, int]:
    """Loadable modules present now: name -> inode of their sysfs directory.

    Only "not there" means not there: any other failure (out of descriptors,
    say) raises :class:`KernelReadError`, for a listing that came back empty
    would close every incarnation.
    """
    base = root / consts.SYS_MODULE
    out: dict[str, int] = {}
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        return out
    except OSError as err:
        raise KernelReadError(str(base), err.strerror or str(err)) from err
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if _exists(os.path.join(entry.path, "initstate")) or _exists(
                os.path.join(entry.path, "sections")
            ):
                out[entry.name] = entry.inode()
        except FileNotFoundError:
            continue  # unloaded while we looked
        except OSError as err:
            raise KernelReadError(entry.path, err.strerror or str(err)) from err
    return out


def _exists(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read_small(path: str, dir_fd: int) -> bytes | None:
    """Read *path* relative to the directory open as *dir_fd* (one read: a
    sysfs attribute is at most a page, and is produced whole by one read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def _text(path: str, dir_fd: int) -> str | None:
    raw = _read_small(path, dir_fd)
    return None if raw is None else raw.decode("utf-8", "replace").strip()


def _parsed(path: str, dir_fd: int, parse: Callable[[bytes], T], faults: list[str]) -> T | None:
    """An attribute read and parsed: ``None`` when it is absent, or does not
    parse (a ``ValueError``, a :class:`NoteError`), then with a fault naming it."""
    raw = _read_small(path, dir_fd)
    if raw is None:
        return None
    try:
        return parse(raw)
    except (ValueError, NoteError) as e:
        faults.append(f"{path}: {e}")
        return None


def read_module(
    root: Root, name: str, proc: Mapping[str, ProcModule] | None = None
) -> ModuleState | None:
    """Read one module; ``None`` if it is gone or built in.

    Every file is read through one open descriptor of the module's directory,
    so a module unloaded and loaded again during the read never mixes the
    files of two loads (nor the inode of one with the addresses of another).
    """
    d = os.path.join(root / consts.SYS_MODULE, name)
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # not "gone": we could not look (EMFILE, ...)
        raise KernelReadError(d, e.strerror or str(e)) from e
    try:
        return _read_module_at(dfd, root, name, proc)
    finally:
        os.close(dfd)


def _read_sections(sfd: int, faults: list[str]) -> tuple[dict[str, int], bool, bool]:
    """The hex bases in an open ``sections/``: (bases, any read as zero
    (restricted), the directory was empty)."""
    sections: dict[str, int] = {}
    restricted = False
    names = sorted(os.listdir(sfd))
    if len(names) > consts.MAX_MODULE_SECTIONS:
        faults.append(f"sections/: {len(names):,} files, more than any module has")
        return {}, False, False
    for sname in names:
        raw = _read_small(sname, sfd)
        if raw is None:
            faults.append(f"sections/{sname}: unreadable")
            continue
        try:
            addr = hex_address(raw)
        except ValueError as e:
            faults.append(f"sections/{sname}: {e}")
            continue
        if addr == 0:
            restricted = True
        else:
            sections[sname] = addr
    return sections, restricted, not names


def _read_module_at(
    dfd: int, root: Root, name: str, proc: Mapping[str, ProcModule] | None
) -> ModuleState | None:
    inode = os.fstat(dfd).st_ino
    faults: list[str] = []
    initstate = _text("initstate", dfd)
    sections: dict[str, int] = {}
    restricted = False
    try:
        sfd = os.open("sections", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        sfd = -1
        if initstate is None:
            return None  # built-in, or gone
        faults.append("sections/ not present (still loading, or hidden)")
    except OSError as err:
        sfd = -1
        faults.append(f"sections/: {err.strerror}")
    if sfd >= 0:
        try:
            sections, restricted, empty = _read_sections(sfd, faults)
        finally:
            os.close(sfd)
        if empty:
            if initstate is None:
                return None  # torn down while we looked
            faults.append("sections/ empty (still loading, or going)")
    build_id = _parsed("notes/.note.gnu.build-id", dfd, find_build_id, faults)
    pm = (proc if proc is not None else read_proc_modules(root)).get(name)
    if pm is not None and pm.base is None and pm.size:
        restricted = True
    return ModuleState(
        name=name,
        build_id=build_id,
        sections=sections,
        coresize=_parsed("coresize", dfd, module_size, faults),
        initsize=_parsed("initsize", dfd, module_size, faults),
        initstate=initstate,
        srcversion=_text("srcversion", dfd),
        taint=_text("taint", dfd),
        core_base=pm.base if pm else None,
        restricted=restricted,
        inode=inode,
        faults=tuple(faults),
        source=AddressSource.SYSFS if sections and not restricted else None,
    )
