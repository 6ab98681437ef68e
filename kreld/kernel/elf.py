"""ELF files (vmlinux, System.map companions, /proc/kcore) read with pyelftools.

pyelftools is imported by the functions that use it, not with this module:
most starts never open an ELF file (kcore's notes are read without it).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from kreld.core.errors import NoteError
from kreld.kernel.notes import NoteType, iter_notes, parse_vmcoreinfo

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

__all__ = [
    "elf_build_id",
    "elf_symbol_entries",
    "elf_symbols",
    "fd_build_id",
    "gnu_build_id",
    "kcore_vmcoreinfo",
    "module_symbol_letter",
    "symbol_letter",
]

_PT_NOTE = 4
_SHT_NOTE = 7
# Bounds of fd_build_id: section headers read (e_shnum is 16 bits, but an
# extended count in section 0 is not followed), bytes of one note section, and
# of all note sections together.  A build-id note is 36 bytes.
_MAX_SECTIONS = 1 << 16
_MAX_NOTE_SECTION = 1 << 20
_MAX_NOTES = 4 << 20


def _open_elf(path: Path) -> tuple[ELFFile, object] | None:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the caller through the tuple
    except OSError:
        return None
    try:
        return ELFFile(f), f
    except (ELFError, struct.error, ValueError):
        f.close()
        return None


def gnu_build_id(elf: ELFFile) -> str | None:
    """The GNU build-id note of an open ELF file, as lowercase hex."""
    from elftools.elf.sections import NoteSection

    for section in elf.iter_sections():
        if isinstance(section, NoteSection):
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                    return str(note["n_desc"])
    return None


def elf_build_id(path: Path) -> str | None:
    """The GNU build-id of an ELF file, or ``None`` if unreadable or absent."""
    from elftools.common.exceptions import ELFError

    opened = _open_elf(path)
    if opened is None:
        return None
    elf, f = opened
    try:
        return gnu_build_id(elf)
    except (ELFError, struct.error, ValueError, UnicodeDecodeError):
        return None
    finally:
        f.close()  # type: ignore[attr-defined]


def fd_build_id(fd: int) -> str | None:
    """The GNU build-id of the ELF file open at *fd*, as lowercase hex, or
    ``None`` when it is no ELF file, is malformed or carries none.

    Bounded, with ``pread`` alone: the ELF header, the section headers and the
    ``SHT_NOTE`` sections (a note is never compressed, so a file whose debug
    sections are ``SHF_COMPRESSED`` reads the same), else the ``PT_NOTE``
    segments of a file without section headers.  Never the rest of the file,
    which for a kernel's debug file is hundreds of megabytes.
    """
    try:
        ident = os.pread(fd, 64, 0)
    except OSError:
        return None
    if (
        ident[:4] != b"\x7fELF"
        or ident[4:5] not in (b"\1", b"\2")
        or ident[5:6] not in (b"\1", b"\2")
    ):
        return None
    wide = ident[4] == 2
    if len(ident) < (64 if wide else 52):
        return None
    e = "<" if ident[5] == 1 else ">"
    order = "little" if ident[5] == 1 else "big"
    if wide:
        phoff, shoff = struct.unpack_from(e + "QQ", ident, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(e + "HHHH", ident, 54)
    else:
        phoff, shoff = struct.unpack_from(e + "II", ident, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(e + "HHHH", ident, 42)
    try:
        if shoff and 0 < shnum <= _MAX_SECTIONS and shentsize >= (64 if wide else 40):
            spans = _note_spans(fd, e, wide, shoff, shentsize, shnum, section=True)
        elif phoff and 0 < phnum <= _MAX_SECTIONS and phentsize >= (56 if wide else 32):
            spans = _note_spans(fd, e, wide, phoff, phentsize, phnum, section=False)
        else:
            return None
        total = 0
        for offset, size in spans:
            total += size
            if size > _MAX_NOTE_SECTION or total > _MAX_NOTES:
                return None
            blob = os.pread(fd, size, offset)
            for note in iter_notes(blob, order):
                if note.name == b"GNU" and note.type == NoteType.NT_GNU_BUILD_ID and note.desc:
                    return note.desc.hex()
    except (OSError, NoteError, struct.error):
        return None
    return None


def _note_spans(
    fd: int, e: str, wide: bool, table: int, entsize: int, count: int, section: bool
) -> list[tuple[int, int]]:
    """(offset, size) of each note section (or ``PT_NOTE`` segment) in a header table."""
    raw = os.pread(fd, entsize * count, table)
    spans = []
    for i in range(min(count, len(raw) // entsize)):
        at = i * entsize
        if section:
            kind = struct.unpack_from(e + "I", raw, at + 4)[0]
            offset, size = struct.unpack_from(
                e + ("QQ" if wide else "II"), raw, at + (24 if wide else 16)
            )
        elif wide:
            kind, _flags, offset = struct.unpack_from(e + "IIQ", raw, at)
            size = struct.unpack_from(e + "Q", raw, at + 32)[0]
        else:
            kind, offset = struct.unpack_from(e + "II", raw, at)
            size = struct.unpack_from(e + "I", raw, at + 16)[0]
        if kind == (_SHT_NOTE if section else _PT_NOTE) and size:
            spans.append((offset, size))
    return spans


def elf_symbols(path: Path, names: set[str]) -> dict[str, int]:
    """Values of the named symbols from the ELF's ``.symtab``."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.sections import SymbolTableSection

    opened = _open_elf(path)
    if opened is None:
        return {}
    elf, f = opened
    found: dict[str, int] = {}
    try:
        symtab = elf.get_section_by_name(".symtab")
        if isinstance(symtab, SymbolTableSection):
            for sym in symtab.iter_symbols():
                if sym.name in names and sym.name not in found:
                    found[sym.name] = int(sym["st_value"])
                    if len(found) == len(names):
                        break
    except (ELFError, struct.error, ValueError, UnicodeDecodeError):
        pass
    finally:
        f.close()  # type: ignore[attr-defined]
    return found


def kcore_vmcoreinfo(path: Path) -> dict[str, str] | None:
    """VMCOREINFO from the PT_NOTE segment of ``/proc/kcore`` (an ELF core).

    Reads only the ELF and program headers and the note segment with
    ``pread``: the rest of kcore is the kernel's memory.  ``None`` when the
    file cannot be opened (needs CAP_SYS_RAWIO) or carries no VMCOREINFO
    (added to kcore in Linux 4.19, commit 23c85094fe18).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        ident = os.pread(fd, 64, 0)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2:
            return None
        endian = "<" if ident[5] == 1 else ">"
        (phoff,) = struct.unpack_from(endian + "Q", ident, 32)
        phentsize, phnum = struct.unpack_from(endian + "HH", ident, 54)
        if phentsize < 56 or phnum > 4096:
            return None
        phdrs = os.pread(fd, phentsize * phnum, phoff)
        for i in range(phnum):
            base = i * phentsize
            if base + 56 > len(phdrs):
                break
            p_type, _flags, p_offset = struct.unpack_from(endian + "IIQ", phdrs, base)
            (p_filesz,) = struct.unpack_from(endian + "Q", phdrs, base + 32)
            if p_type != _PT_NOTE or p_filesz > 1 << 24:
                continue
            blob = os.pread(fd, p_filesz, p_offset)
            try:
                for note in iter_notes(blob, "little" if endian == "<" else "big"):
                    if note.name == b"VMCOREINFO" and note.type == NoteType.NT_VMCOREINFO:
                        return parse_vmcoreinfo(note.desc)
            except NoteError:
                continue
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def symbol_letter(section: str, flags: int, bind: str) -> int:
    """The kallsyms/nm type letter for a symbol in *section*, from its flags."""
    if section.startswith((".text", ".init.text", ".exit.text")) or flags & 0x4:  # SHF_EXECINSTR
        letter = "t"
    elif section.startswith((".bss", ".tbss")):
        letter = "b"
    elif section.startswith((".rodata", "__param", "__ksymtab")) or not flags & 0x1:  # SHF_WRITE
        letter = "r"
    else:
        letter = "d"
    if bind in ("STB_GLOBAL", "STB_WEAK"):
        letter = letter.upper()
    return ord(letter)


def module_symbol_letter(
    section: str, flags: int, sh_type: str, bind: str, kind: str, exported: bool
) -> int:
    """The letter /proc/kallsyms shows for a module symbol.

    ``elf_type()`` in kernel/module/kallsyms.c picks it from the section, and
    ``s_show()`` in kernel/kallsyms.c prints it upper case only when the
    module exports the symbol with plain EXPORT_SYMBOL (``is_exported()``
    looks in ``mod->syms``, not the GPL table).
    """
    if bind == "STB_WEAK":
        letter = "v" if kind == "STT_OBJECT" else "w"
    elif flags & 0x4:  # SHF_EXECINSTR
        letter = "t"
    elif flags & 0x2 and sh_type != "SHT_NOBITS":  # SHF_ALLOC
        letter = "d" if flags & 0x1 else "r"  # SHF_WRITE
    elif sh_type == "SHT_NOBITS":
        letter = "b"
    elif section.startswith(".debug"):
        letter = "n"
    else:
        letter = "?"
    return ord(letter.upper() if exported else letter)


def elf_symbol_entries(path: Path) -> list[tuple[int, bytes, bytes]]:
    """Every named function/object symbol of a linked ELF (vmlinux), in symtab
    order, as ``(value, type letter, name)`` like parsed kallsyms lines."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.sections import SymbolTableSection

    opened = _open_elf(path)
    if opened is None:
        return []
    elf, f = opened
    out: list[tuple[int, bytes, bytes]] = []
    try:
        symtab = elf.get_section_by_name(".symtab")
        if not isinstance(symtab, SymbolTableSection):
            return []
        names = {}
        for sym in symtab.iter_symbols():
            shndx = sym["st_shndx"]
            if not sym.name or not isinstance(shndx, int) or shndx == 0:
                continue
            if sym["st_info"]["type"] in ("STT_SECTION", "STT_FILE"):
                continue
            if shndx not in names:
                sec = elf.get_section(shndx)
                names[shndx] = (sec.name, sec["sh_flags"])
            sec_name, flags = names[shndx]
            letter = symbol_letter(sec_name, flags, sym["st_info"]["bind"])
            out.append((int(sym["st_value"]), bytes([letter]), sym.name.encode()))
    except (ELFError, struct.error, ValueError, UnicodeDecodeError):
        return []
    finally:
        f.close()  # type: ignore[attr-defined]
    return out
