"""In the guest, at kptr_restrict=0: the reference for a recording perf took at
kptr_restrict=2.  perf then wrote no kernel map; this writes OUT as
IN with, before its first record, the kernel maps perf itself synthesized in
MAPS, a recording of nothing taken at 0 on the same boot with the same options
(``[kernel.kallsyms]_text`` and one map per module, as ``/proc/kallsyms`` and
``/proc/modules`` showed them to perf).  Nothing here computes an address: the
records are perf's, byte for byte; only the data section's size and the
feature sections' offsets move.

Usage: perf_splice.py IN MAPS OUT (file-mode perf.data, one event, same attr).
"""

from __future__ import annotations

import struct
import sys

_HEADER = struct.Struct("<8sQQ QQ QQ QQ 4Q")  # perf_file_header
_MAGIC = b"PERFILE2"
_MMAP, _KERNEL = 1, 1


def _parts(buf: bytes) -> tuple[int, int, int]:
    f = _HEADER.unpack_from(buf)
    assert f[0] == _MAGIC, "not a little-endian file-mode perf.data"
    attrs_off, data_off, data_size = f[3], f[5], f[6]
    assert attrs_off < data_off, "attrs after the data"
    features = bin(f[9] | f[10] << 64 | f[11] << 128 | f[12] << 192).count("1")
    return data_off, data_size, features


def kernel_maps(buf: bytes) -> bytes:
    """Every kernel MMAP record of pid -1 (perf's synthesized kernel maps)."""
    off, size, _ = _parts(buf)
    out, at = [], off
    while at + 8 <= off + size:
        rtype, misc, rsize = struct.unpack_from("<IHH", buf, at)
        assert rsize >= 8, f"a record of {rsize} bytes at {at}"
        pid = struct.unpack_from("<i", buf, at + 8)[0]
        if rtype == _MMAP and misc & 7 == _KERNEL and pid == -1:
            out.append(buf[at : at + rsize])
        at += rsize
    return b"".join(out)


def splice(rec: bytes, maps: bytes) -> bytes:
    off, size, features = _parts(rec)
    grown = len(maps)
    table = off + size
    out = bytearray(rec[:off] + maps + rec[off:])
    struct.pack_into("<Q", out, 48, size + grown)  # data.size
    for k in range(features):  # perf_file_section {offset, size} each, after the data
        at = table + grown + 16 * k
        struct.pack_into("<Q", out, at, struct.unpack_from("<Q", out, at)[0] + grown)
    return bytes(out)


def main() -> None:
    src, maps, dst = sys.argv[1:4]
    with open(src, "rb") as f:
        rec = f.read()
    with open(maps, "rb") as f:
        found = kernel_maps(f.read())
    assert found, f"{maps} has no kernel map: was it recorded at kptr_restrict=0?"
    with open(dst, "wb") as f:
        f.write(splice(rec, found))


if __name__ == "__main__":
    main()
