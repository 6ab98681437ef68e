"""perf.data files written here, byte by byte, for what ``perf record`` on the
test machine cannot produce: module maps (the machine has no modules), MMAP2
records carrying build-ids (perf >= 6.17), both compressed record types, and
damaged files.  The layout follows tools/perf/Documentation/perf.data-file-format.txt;
the reader is checked against real ``perf record`` output in test_perfdata.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

MISC_KERNEL = 1
MISC_USER = 2
MISC_MMAP_BUILD_ID = 1 << 14
MISC_BUILD_ID_SIZE = 1 << 15
ATTR_SIZE = 128


def _pad8(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def record(rtype: int, misc: int, body: bytes) -> bytes:
    return struct.pack("<IHH", rtype, misc, 8 + len(body)) + body


def build_id_event(name: str, build_id: str, kernel: bool = True) -> bytes:
    bid = bytes.fromhex(build_id)
    raw = bid.ljust(20, b"\0") + bytes([len(bid)]) + b"\0\0\0"
    misc = (MISC_KERNEL if kernel else MISC_USER) | MISC_BUILD_ID_SIZE
    return record(67, misc, struct.pack("<i", -1) + raw + _pad8(name.encode() + b"\0"))


def perf_string(s: str) -> bytes:
    b = s.encode() + b"\0"
    b += b"\0" * (-len(b) % 64)  # perf aligns strings to 64 bytes
    return struct.pack("<I", len(b)) + b


def mmap(
    name: str,
    start: int,
    length: int,
    pgoff: int,
    *,
    mmap2: bool = False,
    build_id: str | None = None,
    pid: int = -1,
) -> bytes:
    head = struct.pack("<iIQQQ", pid, 0 if pid == -1 else pid, start, length, pgoff)
    fname = _pad8(name.encode() + b"\0")
    misc = MISC_KERNEL if pid == -1 else MISC_USER
    if not mmap2:
        return record(1, misc, head + fname)
    if build_id is not None:
        bid = bytes.fromhex(build_id)
        union = struct.pack("<BBH", len(bid), 0, 0) + bid.ljust(20, b"\0")
        misc |= MISC_MMAP_BUILD_ID
    else:
        union = struct.pack("<IIQQ", 8, 1, 1234, 0)
    return record(10, misc, head + union + struct.pack("<II", 5, 2) + fname)


def comm(pid: int, name: str) -> bytes:
    return record(3, 0, struct.pack("<ii", pid, pid) + _pad8(name.encode() + b"\0"))


def sample(ip: int, t: int) -> bytes:
    return record(9, MISC_KERNEL, struct.pack("<QiiQII", ip, 1, 1, t, 0, 0))


FINISHED_INIT = record(82, 0, b"")


def attr(clockid: int | None) -> bytes:
    flags = 1 << 18  # sample_id_all
    if clockid is not None:
        flags |= 1 << 25  # use_clockid
    a = bytearray(ATTR_SIZE)
    struct.pack_into("<IIQQQQQ", a, 0, 1, ATTR_SIZE, 0, 4000, 0x107, 0, flags)
    struct.pack_into("<i", a, 92, clockid or 0)
    return bytes(a)


@dataclass
class PerfFile:
    """The facts a recording carries, to write as a perf.data."""

    text: int | None = 0xFFFFFFFF81000000
    kernel_build_id: str | None = "5e1f00d5a1b2c3d4e5f60718293a4b5c6d7e8f90"
    modules: list[tuple[str, int, int]] = field(default_factory=list)  # name, start, size
    module_build_ids: dict[str, str] = field(default_factory=dict)
    hostname: str = "testhost"
    osrelease: str = "6.1.0-fake"
    sample_time: tuple[int, int] = (5_000_000_000, 6_000_000_000)
    clock: tuple[int, int, int] | None = None  # clockid, realtime ns, clock ns
    mmap2: bool = False  # MMAP2 with build-ids, as perf >= 6.17 writes
    compress: bool = False
    samples: int = 4
    user_maps: int = 2

    def features(self) -> dict[int, bytes]:
        out = {
            3: perf_string(self.hostname),
            4: perf_string(self.osrelease),
            21: struct.pack("<QQ", *self.sample_time),
        }
        ids = b""
        if self.kernel_build_id:
            ids += build_id_event("[kernel.kallsyms]", self.kernel_build_id)
        for name, bid in self.module_build_ids.items():
            ids += build_id_event(f"/lib/modules/{self.osrelease}/kernel/{name}.ko", bid)
        ids += build_id_event("/usr/bin/true", "ab" * 20, kernel=False)
        out[2] = ids
        if self.clock is not None:
            out[23] = struct.pack("<Q", 1)
            out[29] = struct.pack("<IIQQ", 1, *self.clock)
        if self.compress:
            out[27] = struct.pack("<5I", 1, 1, 1, 5, 528384)
        return out

    def synthesized(self) -> bytes:
        """The records perf record writes before any sample."""
        recs = b""
        if self.text is not None:
            kb = self.kernel_build_id if self.mmap2 else None
            recs += mmap(
                "[kernel.kallsyms]_text", self.text, 0x1269A88, self.text, mmap2=self.mmap2,
                build_id=kb,
            )  # fmt: skip
        for name, start, size in self.modules:
            bid = self.module_build_ids.get(name) if self.mmap2 else None
            path = f"/lib/modules/{self.osrelease}/kernel/drivers/{name.replace('_', '-')}.ko.xz"
            recs += mmap(path, start, size, 0, mmap2=self.mmap2, build_id=bid)
        recs += mmap("__entry_SYSCALL_64_trampoline", 0xFFFFFE0000000000, 0x1000, 0)
        for i in range(self.user_maps):
            recs += comm(100 + i, "true")
            recs += mmap("/usr/bin/true", 0x400000, 0x1000, 0, mmap2=True, pid=100 + i)
        return recs

    def data(self) -> bytes:
        recs = self.synthesized()
        if self.compress:  # split mid-record: a record spans two compressed ones
            cut = len(recs) // 2 + 3
            z = zstandard.ZstdCompressor()
            one, two = z.compress(recs[:cut]), z.compress(recs[cut:])
            recs = record(81, 0, one) + record(83, 0, struct.pack("<Q", len(two)) + _pad8(two))
        recs += FINISHED_INIT
        t0 = self.sample_time[0]
        recs += b"".join(sample(0xFFFFFFFF81001000, t0 + i) for i in range(self.samples))
        return recs

    def clockid(self) -> int | None:
        return None if self.clock is None else self.clock[0]

    def write(self, path: Path, *, tail: bytes = b"", data: bytes | None = None) -> Path:
        """A file-mode perf.data; *tail* goes at the end of the data section,
        *data* (when given) stands for the whole of it."""
        feats = self.features()
        data = (self.data() if data is None else data) + tail
        attr_off = 104
        attrs = attr(self.clockid()) + struct.pack("<QQ", 0, 0)
        data_off = attr_off + len(attrs)
        table_off = data_off + len(data)
        bits = sorted(feats)
        # Sections in the reverse of bit order: the reader must follow the table.
        pos = table_off + 16 * len(bits)
        where: dict[int, tuple[int, int]] = {}
        blobs = b""
        for bit in reversed(bits):
            where[bit] = (pos + len(blobs), len(feats[bit]))
            blobs += feats[bit]
        flags = [0, 0, 0, 0]
        for bit in bits:
            flags[bit // 64] |= 1 << (bit % 64)
        header = b"PERFILE2" + struct.pack(
            "<QQQQQQQQ4Q",
            104,
            ATTR_SIZE + 16,
            attr_off,
            len(attrs),
            data_off,
            len(data),
            0,
            0,
            *flags,
        )
        table = b"".join(struct.pack("<QQ", *where[b]) for b in bits)
        path.write_bytes(header + attrs + data + table + blobs)
        return path

    def write_pipe(self, path: Path, *, data: bytes | None = None) -> Path:
        """A pipe-mode perf.data (``perf record -o -``): features as records."""
        path.write_bytes(self.pipe_bytes(data=data))
        return path

    def pipe_bytes(self, *, data: bytes | None = None) -> bytes:
        out = b"PERFILE2" + struct.pack("<Q", 16)
        out += record(64, 0, attr(self.clockid()) + struct.pack("<Q", 42))
        for bit, blob in sorted(self.features().items()):
            if bit not in (2, 21):  # not known when a pipe recording starts
                out += record(80, 0, struct.pack("<Q", bit) + blob)
        return out + (self.data() if data is None else data)

    def kernel_map(self) -> bytes:
        return mmap("[kernel.kallsyms]_text", self.text or 0, 0x1269A88, self.text or 0)


# -- hostile pieces: what no perf writes, built small -------------------------------------

ROUND = record(68, 0, b"")  # FINISHED_ROUND: the smallest record there is


def module_maps(n: int, base: int = 0xFFFFFFFFC0000000) -> bytes:
    """*n* module maps, one page apart."""
    return b"".join(mmap(f"[m{i}]", base + (i << 12), 0x1000, 0) for i in range(n))


def zstd_bomb(total: int, fill: int = 0x08, prefix: bytes = b"") -> bytes:
    """A zstd frame that inflates to *prefix* then *total* bytes of *fill*, in
    4 bytes a 128 KiB block (RLE blocks, RFC 8878 section 3.1.1.2): 2 GiB in
    64 KiB.  Without a content size, so nothing says how far it goes."""
    block = 128 << 10
    out = struct.pack("<IBB", 0xFD2FB528, 0, 7 << 3)  # no content size; 128 KiB window
    for i in range(0, len(prefix), block):  # raw blocks
        part = prefix[i : i + block]
        out += (len(part) << 3).to_bytes(3, "little") + part
    n = total // block
    rle = ((block << 3) | (1 << 1)).to_bytes(3, "little") + bytes([fill])
    last = ((block << 3) | (1 << 1) | 1).to_bytes(3, "little") + bytes([fill])
    return out + rle * (n - 1) + last


def compressed(frame: bytes, kind: int = 81) -> bytes:
    """*frame* as one PERF_RECORD_COMPRESSED (81) or COMPRESSED2 (83) record."""
    if kind == 81:
        return record(81, 0, frame)
    return record(83, 0, struct.pack("<Q", len(frame)) + _pad8(frame))
