"""ELF files (vmlinux, ``.ko``) read with pyelftools, after a bounded check.

pyelftools trusts an ELF file's headers: a section header table said to lie
past 2^63, a symbol table of millions of entries or a string table with no
NUL would cost it an exception of any kind, or unbounded time.  So every file
is first checked here (:func:`check_elf`: the headers and sections lie inside
the file, the counts within ``consts``' bounds, the string tables ended), and
whatever pyelftools still raises is one named error, :class:`ElfFileError`.
``/proc/kcore`` is an ELF core too: :mod:`kreld.kernel.kcore` reads its
headers and notes with the bounded readers here (:func:`elf_header`,
:func:`program_headers`, :func:`note_segment`), the same as :func:`fd_build_id`.

pyelftools is imported by the functions that use it, not with this module:
most starts never open an ELF file.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kreld.core import consts
from kreld.core.errors import KernelReadError, NoteError
from kreld.core.record import record
from kreld.kernel.files import pread_exact
from kreld.kernel.notes import NoteType, iter_notes

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

__all__ = [
    "ET_CORE",
    "PT_LOAD",
    "PT_NOTE",
    "ElfFileError",
    "ElfHeader",
    "ElfSource",
    "ProgramHeader",
    "SectionHeader",
    "check_elf",
    "elf_build_id",
    "elf_header",
    "elf_of_bytes",
    "elf_symbol_entries",
    "elf_symbols",
    "fd_build_id",
    "gnu_build_id",
    "module_symbol_letter",
    "note_segment",
    "open_elf",
    "program_headers",
    "section_headers",
    "symbol_letter",
]

# What pyelftools may raise on a file that is not what its headers say: turned
# into one named error (ElfFileError) by the functions here.
_PARSE_ERRORS: tuple[type[Exception], ...] = (
    struct.error,
    ValueError,
    KeyError,
    IndexError,
    OverflowError,
    UnicodeDecodeError,
    AttributeError,
    TypeError,
    RecursionError,
)
# The longest name a string table may hold: kallsyms' names are at most
# KSYM_NAME_LEN (512) bytes; C++ or Rust names in a module's table are longer.
MAX_ELF_NAME = 4096
# A string table holds no more names than kallsyms prints.
MAX_STRINGS = consts.MAX_KALLSYMS
_LONG_NAME = re.compile(rb"[^\0]{%d}" % (MAX_ELF_NAME + 1))
_SHT_SYMTAB = 2
_SHT_NOTE = 7
_SHT_NOBITS = 8
ET_CORE = 4  # e_type of a core file (/proc/kcore)
PT_LOAD = 1
PT_NOTE = 4
# The header layouts without their byte order, which the file's ident gives.
_EHDR64 = "4sBBBBB7xHHIQQQIHHHHHH"
_EHDR32 = "4sBBBBB7xHHIIIIIHHHHHH"
_SHDR64 = "IIQQQQIIQQ"
_SHDR32 = "IIIIIIIIII"
_PHDR64 = "IIQQQQQQ"  # type, flags, offset, vaddr, paddr, filesz, memsz, align
_PHDR32 = "IIIIIIII"  # type, offset, vaddr, paddr, filesz, memsz, flags, align
# Bounds of the header tables and notes read by hand (no pyelftools): program
# headers (an ELF core such as /proc/kcore has one per memory range, hundreds on
# a large NUMA machine, and one PT_NOTE) and the bytes of their table; one note
# section or segment (VMCOREINFO is ~4 KiB, a build-id note 36 bytes), and all
# of a file's note sections together.
MAX_PROGRAM_HEADERS = 4097
MAX_NOTE_SEGMENT = consts.MAX_KCORE_NOTES
_MAX_NOTES = 4 << 20


class ElfFileError(KernelReadError):
    """An ELF file (a vmlinux, a ``.ko``) whose headers do not hold together, or
    that is larger than kreld reads of its kind."""


class ElfSource:
    """Bytes of an ELF file at an offset: of an open file (``pread``) or of bytes.
    A read that lies past the file's end is :class:`ElfFileError`, never a
    short answer."""

    __slots__ = ("data", "fd", "path", "size")

    def __init__(self, path: str, size: int, fd: int = -1, data: bytes | None = None) -> None:
        self.path, self.size, self.fd, self.data = path, size, fd, data

    @classmethod
    def of_fd(cls, fd: int, path: str) -> ElfSource:
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise ElfFileError(path, e.strerror or str(e)) from e
        return cls(path, size, fd=fd)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length >= 1 << 63:
            raise ElfFileError(self.path, f"{length} bytes at {offset:#x}: past any file")
        if offset + length > self.size:
            raise ElfFileError(self.path, f"{length} bytes at {offset:#x}: past its end")
        if self.data is not None:
            return self.data[offset : offset + length]
        return pread_exact(self.fd, length, offset, self.path)


@record
class ElfHeader:
    """What an ELF header (``Elf32_Ehdr``/``Elf64_Ehdr``) says of the file."""

    wide: bool  # ELFCLASS64
    endian: str  # "<" or ">", for struct
    type: int  # e_type: ET_REL (a .ko) 1, ET_EXEC (vmlinux) 2, ET_CORE (kcore) 4
    machine: int  # e_machine: EM_X86_64 62
    phoff: int
    phentsize: int
    phnum: int
    shoff: int
    shentsize: int
    shnum: int
    shstrndx: int

    @property
    def byteorder(self) -> str:
        return "little" if self.endian == "<" else "big"


class SectionHeader(NamedTuple):
    name: int
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    align: int
    entsize: int


@record
class ProgramHeader:
    type: int
    offset: int
    vaddr: int
    filesz: int


def elf_header(src: ElfSource) -> ElfHeader:
    """The ELF header of *src* (:class:`ElfFileError`: not an ELF file)."""
    ident = src.read(0, 16) if src.size >= 16 else b""
    if ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise ElfFileError(src.path, "not an ELF file")
    wide, endian = ident[4] == 2, "<" if ident[5] == 1 else ">"
    ehdr = struct.Struct(endian + (_EHDR64 if wide else _EHDR32))
    f = ehdr.unpack(src.read(0, ehdr.size))
    return ElfHeader(wide, endian, f[6], f[7], f[10], f[14], f[15], f[11], f[16], f[17], f[18])


def section_headers(src: ElfSource, h: ElfHeader) -> list[SectionHeader]:
    """The section header table, bounded: at most ``consts.MAX_ELF_SECTIONS``
    entries (an extended count, in section 0's ``sh_size``, included), inside
    the file."""
    if h.shoff == 0:
        return []
    shdr = struct.Struct(h.endian + (_SHDR64 if h.wide else _SHDR32))
    if h.shentsize < shdr.size:
        raise ElfFileError(src.path, f"section headers of {h.shentsize} bytes, not {shdr.size}")
    shnum = h.shnum
    if shnum == 0:  # extended numbering: the count is section 0's sh_size
        shnum = shdr.unpack(src.read(h.shoff, shdr.size))[5]
    if shnum > consts.MAX_ELF_SECTIONS:
        raise ElfFileError(
            src.path, f"{shnum:,} section headers (limit {consts.MAX_ELF_SECTIONS:,})"
        )
    if h.shoff + shnum * h.shentsize > src.size:
        raise ElfFileError(
            src.path, f"section headers at {h.shoff:#x} lie past its end ({src.size:,} bytes)"
        )
    table = src.read(h.shoff, shnum * h.shentsize)
    return [SectionHeader._make(shdr.unpack_from(table, i * h.shentsize)) for i in range(shnum)]


def program_headers(src: ElfSource, h: ElfHeader) -> list[ProgramHeader]:
    """The program header table, bounded: at most :data:`MAX_PROGRAM_HEADERS`
    entries in at most ``consts.MAX_KCORE_HEADERS`` bytes, inside the file."""
    if h.phoff == 0 or h.phnum == 0:
        return []
    phdr = struct.Struct(h.endian + (_PHDR64 if h.wide else _PHDR32))
    if h.phentsize < phdr.size or h.phnum > MAX_PROGRAM_HEADERS:
        raise ElfFileError(src.path, f"{h.phnum} program headers of {h.phentsize} bytes")
    if h.phentsize * h.phnum > consts.MAX_KCORE_HEADERS:
        raise ElfFileError(
            src.path,
            f"program headers of {h.phentsize * h.phnum:,} bytes "
            f"(limit {consts.MAX_KCORE_HEADERS:,})",
        )
    table = src.read(h.phoff, h.phentsize * h.phnum)
    out = []
    for i in range(h.phnum):
        f = phdr.unpack_from(table, i * h.phentsize)
        if h.wide:
            out.append(ProgramHeader(f[0], f[2], f[3], f[5]))
        else:
            out.append(ProgramHeader(f[0], f[1], f[2], f[4]))
    return out


def note_segment(src: ElfSource, offset: int, size: int) -> bytes:
    """The bytes of one note section or ``PT_NOTE`` segment, at most
    :data:`MAX_NOTE_SEGMENT` of them."""
    if size > MAX_NOTE_SEGMENT:
        raise ElfFileError(
            src.path, f"a note segment of {size:,} bytes (limit {MAX_NOTE_SEGMENT:,})"
        )
    return src.read(offset, size)


def check_elf(src: ElfSource, max_symbols: int) -> None:
    """That the section headers, the sections and the symbol tables of an ELF file
    lie inside it, within ``consts.MAX_ELF_SECTIONS`` sections and *max_symbols*
    symbols a table, each string table ending in a NUL: what pyelftools then reads
    is bounded by the file.  :class:`ElfFileError` says what does not hold."""
    path = src.path
    h = elf_header(src)
    if h.shoff == 0:
        return  # no section headers: nothing pyelftools would read
    headers = section_headers(src, h)
    for i, (_name, sh_type, _fl, _ad, offset, size, link, _in, _al, entsize) in enumerate(headers):
        if sh_type != _SHT_NOBITS and offset + size > src.size:
            raise ElfFileError(path, f"section {i} at {offset:#x} (+{size:,}) lies past its end")
        if sh_type == _SHT_SYMTAB:
            if entsize < (24 if h.wide else 16) or entsize % 4 or size // entsize > max_symbols:
                raise ElfFileError(
                    path, f"a symbol table of {size:,} bytes in entries of {entsize} "
                    f"(limit {max_symbols:,} symbols)",
                )  # fmt: skip
            names = _name_offsets(src.read(offset, size - size % entsize), entsize, h.endian)
            _check_strings(src, headers, link, f"section {i}'s string table", names)
    if h.shstrndx not in (0, 0xFFFF):
        _check_strings(src, headers, h.shstrndx, "the section names", [s.name for s in headers])


def _name_offsets(table: bytes, entsize: int, endian: str) -> Sequence[int]:
    """The ``st_name`` of each symbol (the first word of an entry, ELF32 or ELF64)."""
    words = array("I", table)
    if (endian == "<") != (sys.byteorder == "little"):
        words.byteswap()
    return words[:: entsize // 4]


def _check_strings(
    src: ElfSource, headers: list[SectionHeader], index: int, what: str, names: Sequence[int]
) -> None:
    """That section *index* is a string table every one of *names* (offsets)
    starts inside, whose strings end: in a NUL, within ``MAX_ELF_NAME`` bytes
    (pyelftools reads a name until its NUL)."""
    if not 0 < index < len(headers):
        raise ElfFileError(src.path, f"{what}: section {index} does not exist")
    offset, size = headers[index].offset, headers[index].size
    if size > MAX_STRINGS:
        raise ElfFileError(src.path, f"{what} of {size:,} bytes (limit {MAX_STRINGS:,})")
    table = src.read(offset, size)
    if not table or table[-1] != 0:
        raise ElfFileError(src.path, f"{what} (section {index}) does not end in a NUL")
    if names and max(names) >= size:
        raise ElfFileError(src.path, f"a name at {max(names):#x}, past {what} ({size:,} bytes)")
    if _LONG_NAME.search(table):
        raise ElfFileError(src.path, f"{what} holds a name of more than {MAX_ELF_NAME} bytes")


@contextlib.contextmanager
def open_elf(path: Path, max_symbols: int = consts.MAX_VMLINUX_SYMBOLS) -> Iterator[ELFFile]:
    """An ELF file checked (:func:`check_elf`) and opened with pyelftools; what
    goes wrong reading it, then or inside the ``with``, is :class:`ElfFileError`."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise ElfFileError(str(path), e.strerror or str(e)) from e
    try:
        check_elf(ElfSource(str(path), os.fstat(f.fileno()).st_size, fd=f.fileno()), max_symbols)
        yield ELFFile(f)
    except (ELFError, *_PARSE_ERRORS) as e:  # type: ignore[misc]
        raise ElfFileError(str(path), f"{type(e).__name__}: {e}") from e
    finally:
        f.close()


@contextlib.contextmanager
def elf_of_bytes(data: bytes, path: str, max_symbols: int) -> Iterator[ELFFile]:
    """:func:`open_elf` of an ELF file already in memory (an inflated ``.ko``)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        check_elf(ElfSource(path, len(data), data=data), max_symbols)
        yield ELFFile(io.BytesIO(data))
    except (ELFError, *_PARSE_ERRORS) as e:  # type: ignore[misc]
        raise ElfFileError(path, f"{type(e).__name__}: {e}") from e


def gnu_build_id(elf: ELFFile) -> str | None:
    """The GNU build-id note of an open ELF file, as lowercase hex."""
    from elftools.elf.sections import NoteSection

    for section in elf.iter_sections():
        if isinstance(section, NoteSection):
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                    return str(note["n_desc"])
    return None


def elf_build_id(path: Path, *, strict: bool = False) -> str | None:
    """The GNU build-id of an ELF file, or ``None`` if absent (or, unless
    *strict*, unreadable: strict, that is :class:`ElfFileError`)."""
    try:
        with open_elf(path) as elf:
            return gnu_build_id(elf)
    except KernelReadError:
        if strict:
            raise
        return None


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
        src = ElfSource.of_fd(fd, f"fd {fd}")
        h = elf_header(src)
        if h.shoff:
            spans = [(s.offset, s.size) for s in section_headers(src, h) if s.type == _SHT_NOTE]
        else:
            spans = [(p.offset, p.filesz) for p in program_headers(src, h) if p.type == PT_NOTE]
        total = 0
        for offset, size in spans:
            total += size
            if total > _MAX_NOTES:
                return None
            for note in iter_notes(note_segment(src, offset, size), h.byteorder):
                if note.name == b"GNU" and note.type == NoteType.NT_GNU_BUILD_ID and note.desc:
                    return note.desc.hex()
    except (KernelReadError, NoteError):
        return None
    return None


def elf_symbols(path: Path, names: set[str]) -> dict[str, int]:
    """Values of the named symbols from the ELF's ``.symtab`` (of each name,
    the first in table order; none past ``consts.MAX_VMLINUX_SYMBOLS`` or
    :data:`MAX_STRINGS`): the names' places in the string table, then one
    pass over the ``st_name`` column (a debug vmlinux's 119,000 symbols took
    pyelftools 7 s, decoded one by one; this, tens of milliseconds)."""
    try:
        with open(path, "rb") as f:
            src = ElfSource.of_fd(f.fileno(), str(path))
            h = elf_header(src)
            headers = section_headers(src, h)
            tab = next((sh for sh in headers if sh.type == _SHT_SYMTAB), None)
            entsize = 24 if h.wide else 16
            if tab is None or tab.entsize != entsize or not 0 < tab.link < len(headers):
                return {}
            count = tab.size // entsize
            strs = headers[tab.link]
            if count > consts.MAX_VMLINUX_SYMBOLS or strs.size > MAX_STRINGS:
                return {}
            table = src.read(tab.offset, count * entsize)
            strings = src.read(strs.offset, strs.size)
    except (OSError, KernelReadError):
        return {}
    places: dict[int, str] = {}  # where a name is read (it may end another)
    for name in names:
        key = name.encode() + b"\0"
        at = strings.find(key)
        while at >= 0:
            places[at] = name
            at = strings.find(key, at + 1)
    value = struct.Struct(h.endian + ("8xQ" if h.wide else "4xI"))
    found: dict[str, int] = {}
    if not places:
        return found
    for i, at in enumerate(_name_offsets(table, entsize, h.endian)):
        named = places.get(at)
        if named is not None and named not in found:
            found[named] = value.unpack_from(table, i * entsize)[0]
            if len(found) == len(names):
                break
    return found


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
    from elftools.elf.sections import SymbolTableSection

    out: list[tuple[int, bytes, bytes]] = []
    try:
        with open_elf(path) as elf:
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
    except KernelReadError:
        return []
    return out
