"""A vmlinux-like ELF: the real System.map's symbols (repeated under new
names until *count*), a GNU build-id note to be filled in by the guest with
its kernel's own (:func:`fill_build_id`), and the anchors kreld looks for last
in ``.symtab``, so that a reader scans it all.  kreld takes it for the running
kernel's vmlinux (the build-id matches) and reads its anchors at start where
kallsyms shows zeros, as it would a debug vmlinux's, without a 590 MB
download."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

ANCHORS = ("_text", "_stext", "_etext", "_sinittext", "_einittext")
_SHN_ABS = 0xFFF1
_BUILD_ID_LEN = 20


def _system_map(path: Path) -> list[tuple[str, int, str]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((parts[2], int(parts[0], 16), parts[1]))
    return out


def make(sysmap: Path, out: Path, count: int) -> int:
    """Write the ELF; returns the build-id's offset in the file."""
    syms = _system_map(sysmap)
    anchors = [s for s in syms if s[0] in ANCHORS]
    others = [s for s in syms if s[0] not in ANCHORS]
    strtab = bytearray(b"\0")
    entries = [struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0)]
    k = 0
    while len(entries) < count - len(anchors):
        name, value, kind = others[k % len(others)]
        rep = k // len(others)
        sym = name if rep == 0 else f"{name}.copy{rep}"
        info = (1 if kind.isupper() else 0) << 4 | (2 if kind in "tT" else 1)
        entries.append(struct.pack("<IBBHQQ", len(strtab), info, 0, _SHN_ABS, value, 0))
        strtab += sym.encode() + b"\0"
        k += 1
    for name, value, _kind in anchors:
        entries.append(struct.pack("<IBBHQQ", len(strtab), 0x12, 0, _SHN_ABS, value, 0))
        strtab += name.encode() + b"\0"
    symtab = b"".join(entries)
    note = struct.pack("<III", 4, _BUILD_ID_LEN, 3) + b"GNU\0" + b"\0" * _BUILD_ID_LEN
    shstr = b"\0.note.gnu.build-id\0.symtab\0.strtab\0.shstrtab\0"
    names = {
        n: shstr.index(n.encode() + b"\0")
        for n in (".note.gnu.build-id", ".symtab", ".strtab", ".shstrtab")
    }
    body = [note, symtab, bytes(strtab), shstr]
    offsets = []
    pos = 64
    for b in body:
        pos = (pos + 7) & ~7
        offsets.append(pos)
        pos += len(b)
    shoff = (pos + 7) & ~7
    sh = [b"\0" * 64]
    sh.append(
        struct.pack(
            "<IIQQQQIIQQ", names[".note.gnu.build-id"], 7, 2, 0, offsets[0], len(note), 0, 0, 4, 0
        )
    )
    sh.append(
        struct.pack("<IIQQQQIIQQ", names[".symtab"], 2, 0, 0, offsets[1], len(symtab), 3, 1, 8, 24)
    )
    sh.append(
        struct.pack("<IIQQQQIIQQ", names[".strtab"], 3, 0, 0, offsets[2], len(strtab), 0, 0, 1, 0)
    )
    sh.append(
        struct.pack("<IIQQQQIIQQ", names[".shstrtab"], 3, 0, 0, offsets[3], len(shstr), 0, 0, 1, 0)
    )
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(sh), 4
    )
    data = bytearray(header)
    for off, b in zip(offsets, body, strict=True):
        data += b"\0" * (off - len(data)) + b
    data += b"\0" * (shoff - len(data)) + b"".join(sh)
    out.write_bytes(bytes(data))
    return offsets[0] + 16


def fill_build_id(path: Path, at: int, build_id: str) -> None:
    raw = bytes.fromhex(build_id)
    if len(raw) != _BUILD_ID_LEN:
        raise ValueError(f"a {len(raw)}-byte build-id")
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(raw)


if __name__ == "__main__":  # in the guest: fill-build-id PATH OFFSET
    from kreld.kernel.info import Root, read_kernel_build_id

    bid = read_kernel_build_id(Root(Path("/")))
    if bid is None:
        sys.exit("the kernel has no build-id")
    fill_build_id(Path(sys.argv[1]), int(sys.argv[2]), bid)
