"""A module's own file: a ``.ko`` (or ``.ko.xz``, ``.ko.zst``) under
``lib/modules/<release>``, found by name and read for its symbol table when
kallsyms does not show the module's (restricted pointers, or the module gone
before kallsyms was read).

Such a file is trusted for nothing: it is inflated as a stream and refused once
it grows past ``consts.MAX_MODULE_FILE`` (a file of kilobytes may inflate to
gigabytes), its ELF headers are checked before they are used
(:func:`kreld.kernel.elf.check_elf`, at most ``consts.MAX_MODULE_SYMBOLS``
symbols), and its build-id must be the loaded module's.  Whatever is wrong with
it is a :class:`ModuleFileError` naming the file.
"""

from __future__ import annotations

import lzma
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.symtab import FROM_ELF, pack
from kreld.kernel.elf import elf_of_bytes, gnu_build_id, module_symbol_letter
from kreld.kernel.files import read_bounded
from kreld.kernel.info import Root

__all__ = ["MODULE_SUFFIXES", "ModuleFileError", "ModuleFiles", "ko_table", "read_module_file"]

MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst")
_CHUNK = 1 << 20


class ModuleFileError(KernelReadError):
    """A module's file that cannot be used: unreadable, inflating past its bound,
    not a whole compressed stream."""


def read_module_file(path: Path, limit: int = consts.MAX_MODULE_FILE) -> bytes:
    """A ``.ko``'s bytes, inflated from ``.xz`` or ``.zst`` as a stream, at most
    *limit* of them (:class:`ModuleFileError` past it, before more is inflated)."""
    if path.name.endswith(".xz"):
        inflate = _inflate_xz
    elif path.name.endswith(".zst"):
        inflate = _inflate_zst
    else:
        return read_bounded(path, limit)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise ModuleFileError(str(path), f"larger than {limit:,} bytes compressed")
            return inflate(f, str(path), limit)
    except OSError as e:
        raise ModuleFileError(str(path), e.strerror or str(e)) from e


def _too_large(path: str, limit: int) -> ModuleFileError:
    return ModuleFileError(path, f"inflates to more than {limit:,} bytes, more than any module")


def _inflate_xz(f: IO[bytes], path: str, limit: int) -> bytes:
    """Every xz stream of *f* (``lzma.decompress`` reads concatenated ones too)."""
    read = f.read
    out = bytearray()
    d = lzma.LZMADecompressor()
    streams = 0
    while True:
        if d.eof:
            streams += 1
            data = d.unused_data or read(_CHUNK)
            if not data:
                return bytes(out)
            d = lzma.LZMADecompressor()
        elif d.needs_input:
            data = read(_CHUNK)
            if not data:
                raise ModuleFileError(path, "ends inside its xz stream")
        else:
            data = b""
        try:
            out += d.decompress(data, max_length=limit + 1 - len(out))
        except lzma.LZMAError as e:
            if streams:  # what follows a whole stream is not one: ignored, as lzma does
                return bytes(out)
            raise ModuleFileError(path, f"not an xz file: {e}") from e
        if len(out) > limit:
            raise _too_large(path, limit)


def _inflate_zst(f: IO[bytes], path: str, limit: int) -> bytes:
    try:
        import zstandard
    except ImportError as e:
        raise ModuleFileError(path, "zstandard is not installed") from e
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
    try:
        while chunk := reader.read(_CHUNK):
            out += chunk
            if len(out) > limit:
                raise _too_large(path, limit)
    except zstandard.ZstdError as e:
        raise ModuleFileError(path, f"not a zstd file: {e}") from e
    return bytes(out)


def ko_table(data: bytes, build_id: str, path: str = "<ko>") -> bytes | None:
    """A module table from a ``.ko``'s bytes; ``None`` unless its build-id is
    *build_id* (or it has no symbols); :class:`ModuleFileError` when the file
    does not hold together."""
    from elftools.elf.sections import SymbolTableSection

    with elf_of_bytes(data, path, consts.MAX_MODULE_SYMBOLS) as elf:
        if gnu_build_id(elf) != build_id:
            return None
        symtab = elf.get_section_by_name(".symtab")
        if not isinstance(symtab, SymbolTableSection):
            return None
        sections: list[str] = []
        index: dict[str, int] = {}
        entries = []
        symbols = list(symtab.iter_symbols())
        # Exported with plain EXPORT_SYMBOL: a __ksymtab_<name> in __ksymtab
        # (module.lds merges the ___ksymtab+<name> sections into it).
        exported = set()
        for sym in symbols:
            shndx = sym["st_shndx"]
            if sym.name.startswith("__ksymtab_") and isinstance(shndx, int) and shndx:
                sec_name = elf.get_section(shndx).name
                if sec_name == "__ksymtab" or sec_name.startswith("___ksymtab+"):
                    exported.add(sym.name[len("__ksymtab_") :])
        for sym in symbols:
            shndx = sym["st_shndx"]
            kind = sym["st_info"]["type"]
            if not isinstance(shndx, int) or shndx == 0 or not sym.name:
                continue
            if kind in ("STT_SECTION", "STT_FILE"):
                continue
            sec = elf.get_section(shndx)
            if sec.name == ".data..percpu":
                continue  # printed at its per-cpu offset, known only at run time
            if sec.name not in index:
                index[sec.name] = len(sections)
                sections.append(sec.name)
            letter = module_symbol_letter(
                sec.name,
                sec["sh_flags"],
                sec["sh_type"],
                sym["st_info"]["bind"],
                kind,
                sym.name in exported,
            )
            entries.append((index[sec.name], int(sym["st_value"]), letter, sym.name.encode()))
        return pack(entries, sections, FROM_ELF) if entries else None


class ModuleFiles:
    """``.ko`` files under ``lib/modules/<release>``, indexed by module name once."""

    def __init__(self, root: Root, release: str, extra_dirs: Iterable[str] = ()) -> None:
        self.dirs = [root / f"lib/modules/{release}", root / f"usr/lib/modules/{release}"]
        self.dirs += [Path(d) for d in extra_dirs]
        self._index: dict[str, list[Path]] | None = None

    def _build(self) -> dict[str, list[Path]]:
        index: dict[str, list[Path]] = {}
        for d in self.dirs:
            for dirpath, _dirs, files in os.walk(d):
                for f in files:
                    for suffix in MODULE_SUFFIXES:
                        if f.endswith(suffix):
                            name = f[: -len(suffix)].replace("-", "_")
                            index.setdefault(name, []).append(Path(dirpath) / f)
        return index

    def table(
        self, name: str, build_id: str | None, refused: list[str] | None = None
    ) -> bytes | None:
        """The table of the first file of module *name* with *build_id*; why each
        file that could not be read was refused goes to *refused*."""
        if not build_id:
            return None
        if self._index is None:
            self._index = self._build()
        for path in self._index.get(name.replace("-", "_"), []):
            try:
                table = ko_table(read_module_file(path), build_id, str(path))
            except KernelReadError as e:
                if refused is not None:
                    refused.append(str(e))
                continue
            if table is not None:
                return table
        return None
