"""Hostile, corrupt or merely huge kernel-side files under ``--root``, and numbers in them
that the kernel cannot produce; a perf.data cut short while kreldctl reads it.

kreld runs as root and reads what the kernel shows.  Whatever one of those files holds,
kreld must end its read of it in a named error for that file, in bounded time and
memory, and keep every thread working: after each case the daemon is still answering,
a module loaded afterwards is tracked and its symbols looked for, and the store is read
by every reader (the Python client, ``kreldctl show``, ``modules``, ``export``,
``resolve``) without a traceback or an exit status outside the documented set.

Every daemon runs under RLIMIT_AS of 1.5 GiB; its peak resident memory (VmHWM) and the
time to its named error are checked against the case's bounds.
"""

from __future__ import annotations

import json
import lzma
import os
import resource
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client
from kreld.core.errors import ExitCode, KreldError

from support.faketree import FakeTree, kcore, note
from support.faultlib import proc_status, write_config
from support.kmembuild import BtfBuilder
from support.run import bin_path
from support.tmpdirs import fast_tmpdir

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

AS_LIMIT = 3 << 29  # 1.5 GiB of address space for the daemon
RSS_BOUND_KIB = 500 << 10
SECONDS = 10.0
GIB = 1 << 30
A = 0xFFFFFFFFC0400000
Z = 0xFFFFFFFFC0800000
# What kreldctl may end with on a store it can read (kreldctl --help); 5 (the store is
# unusable) is not among them.
READER_CODES = {ExitCode.OK, ExitCode.ERROR, ExitCode.NO_SUCH_BOOT, ExitCode.PERMISSION_DENIED}


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def sparse(path: Path, size: int, head: bytes = b"") -> None:
    """A file of *size* bytes that takes no disk: *head*, then a hole (read as NULs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def elf_core(phoff: int, phentsize: int, phnum: int, phdrs: bytes = b"") -> bytes:
    """An ELF64 little-endian core header with the program header table as given."""
    ehdr = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7, 4, 62, 1, 0,
        phoff, 0, 0, 64, phentsize, phnum, 0, 0, 0,
    )  # fmt: skip
    return ehdr + phdrs


def phdr(p_type: int, offset: int, vaddr: int, filesz: int) -> bytes:
    return struct.pack("<IIQQQQQQ", p_type, 0, offset, vaddr, 0, filesz, filesz, 0)


class Host:
    """A fake host, a daemon on it, and the readers of its store."""

    def __init__(self, fast: Path, tmp_path: Path, sockdir: Path, factory: Any, **tree: Any):
        self.tree = FakeTree(fast / "root", **tree)
        self.state = fast / "state"
        self.sock = sockdir / "kreld.sock"
        self.cfg = write_config(
            tmp_path / "kreld.toml", modules={"watch": "inotify", "poll_interval": 0.2}
        )
        self.factory = factory
        self.d: Any = None

    @property
    def release(self) -> str:
        return self.tree.release

    def start(self) -> float:
        """Start kreld under the memory limit; the monotonic time it was started at."""
        self.d = self.factory(
            "--root", str(self.tree.root), "--state-dir", str(self.state),
            "--socket", str(self.sock), "--config", str(self.cfg), "--log-level", "debug",
        )  # fmt: skip
        t0 = time.monotonic()
        self.d.start(timeout=SECONDS, preexec=limit_memory)
        return t0

    def named(self, t0: float, expect: Callable[[dict[str, Any]], bool], what: str) -> None:
        """The daemon logs the named error *expect* matches within the case's time."""
        left = max(0.1, SECONDS - (time.monotonic() - t0))
        self.d.wait_until(lambda evs: any(expect(e) for e in evs), what, timeout=left)
        print(f"{what}: {time.monotonic() - t0:.2f} s from start")

    def still_working(self) -> None:
        """The daemon answers, tracks a new load, looks for its symbols, and stays small."""
        with Client(str(self.sock)) as c:
            status = c.call("Status")
        assert status["boot_id"] == self.tree.boot_id
        self.tree.add_module("zz", Z)
        self.d.wait_for("module_loaded", module="zz")
        self.d.wait_until(
            lambda evs: any(
                e.get("event") in ("module_symbols", "module_symbols_unavailable")
                and e.get("module") == "zz"
                for e in evs
            ),
            "the symbol worker's answer for zz",
        )
        assert self.d.proc.poll() is None
        hwm = proc_status(self.d.proc.pid, "VmHWM")
        print(f"kreld's peak resident memory: {hwm >> 10} MiB")
        assert hwm < RSS_BOUND_KIB, f"kreld's peak resident memory {hwm} KiB"
        with Client(str(self.sock)) as c:
            c.call("GetBoot")
            c.call("GetModules")
            for call in (
                lambda: c.resolve([f"{self.tree.text + 0x1000:#x}", f"{Z + 0x10:#x}"]),
                lambda: c.call("ExportKallsyms"),
            ):
                try:
                    call()
                except KreldError as e:  # restricted, no symbols: named answers too
                    assert e.varlink_name != KreldError.varlink_name, e
        log = self.d.tail(1 << 22)
        assert "Traceback" not in log, log[-3000:]
        failed = [
            e
            for e in self.d.events()
            if e.get("event") in ("reconcile_failed", "idle_check_failed")
        ]
        assert not failed, failed[:3]
        assert self.d.stop() == 0

    def readers(self) -> None:
        """Every reader of the store, without the daemon: documented codes, no traceback."""
        common = ["--state-dir", str(self.state), "--socket", str(self.sock) + ".none"]
        common += ["--root", str(self.tree.root)]
        runs = [
            (["show", "--json"], {ExitCode.OK}),
            (["boots", "--json"], {ExitCode.OK}),
            (["modules", "--json"], {ExitCode.OK}),
            (["export", "kallsyms"], READER_CODES),
            (
                ["resolve", "--json", f"{self.tree.text + 0x1000:#x}", f"{A + 0x10:#x}"],
                READER_CODES,
            ),
        ]
        for args, codes in runs:
            cp = subprocess.run(
                [bin_path("kreldctl"), *common, *args], capture_output=True, text=True, timeout=60
            )
            assert cp.returncode in codes, (args, cp.returncode, cp.stderr[-2000:])
            assert "Traceback" not in cp.stderr, cp.stderr[-2000:]
            if "--json" in args and cp.returncode == 0:
                json.loads(cp.stdout)

    def check(
        self,
        expect: Callable[[dict[str, Any]], bool],
        what: str,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Start kreld (and do *then*: a load while it runs), see the named error in
        time, then that nothing stopped working and every reader reads the store."""
        t0 = self.start()
        if then is not None:
            then()
        self.named(t0, expect, what)
        self.still_working()
        self.readers()


def event_says(event: str, *words: str) -> Callable[[dict[str, Any]], bool]:
    """An event named *event* whose fields, as text, hold every one of *words*."""

    def match(e: dict[str, Any]) -> bool:
        text = json.dumps(e)
        return e.get("event") == event and all(w in text for w in words)

    return match


def any_event_says(*words: str) -> Callable[[dict[str, Any]], bool]:
    def match(e: dict[str, Any]) -> bool:
        text = json.dumps(e)
        return all(w in text for w in words)

    return match


@pytest.fixture
def host(daemon_factory: Any, tmp_path: Path, sockdir: Path) -> Any:
    with fast_tmpdir() as fast:
        yield lambda **tree: Host(fast, tmp_path, sockdir, daemon_factory, **tree)


# -- kernel files trusted for their size ---------------------------------------------------


def test_a_2_gib_kallsyms_is_refused_for_its_size_and_the_boot_still_recorded(host: Any) -> None:
    h = host()
    sparse(h.tree.root / "proc/kallsyms", 2 * GIB, (h.tree.root / "proc/kallsyms").read_bytes())
    h.tree.add_module("a", A)
    h.check(event_says("kernel_read_fault", "proc/kallsyms", "larger than"), "kallsyms refused")


def test_1_gib_of_kernel_notes_is_refused_for_its_size(host: Any) -> None:
    h = host()
    notes = h.tree.root / "sys/kernel/notes"
    sparse(notes, GIB, notes.read_bytes())
    h.check(event_says("kernel_read_fault", "sys/kernel/notes", "larger than"), "notes refused")


def test_a_system_map_of_one_2_gib_line_is_refused(host: Any) -> None:
    h = host()
    sparse(h.tree.root / f"boot/System.map-{h.release}", 2 * GIB, b"ffffffff81000000 T _text")
    h.check(any_event_says(f"System.map-{h.release}", "larger than"), "System.map refused")


@pytest.mark.parametrize(
    "core",
    [
        elf_core(phoff=(1 << 64) - 64, phentsize=56, phnum=2),
        elf_core(phoff=(1 << 63) + 8, phentsize=56, phnum=1),
        elf_core(64, 56, 1, phdr(4, (1 << 64) - 16, 0, 4096)),
    ],
    ids=["phoff-2^64", "phoff-2^63", "note-at-2^64"],
)
def test_a_kcore_whose_headers_point_anywhere_is_a_named_error(host: Any, core: bytes) -> None:
    h = host()
    h.tree.write("proc/kcore", core)
    h.check(event_says("kaslr_source_skipped", "proc/kcore"), "kcore refused")


def _bomb(path: Path, compress: Callable[[bytes], bytes], total: int) -> None:
    """A compressed file of some KiB that inflates to *total* bytes of zeros: one
    compressed frame of 64 MiB, repeated (both xz and zstd read concatenated frames)."""
    chunk = 64 << 20
    frame = compress(bytes(chunk))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frame * (total // chunk))


@pytest.mark.parametrize("suffix", [".ko.xz", ".ko.zst"])
def test_a_module_file_that_inflates_to_gigabytes_is_refused_while_inflating(
    host: Any, suffix: str
) -> None:
    h = host()
    if suffix == ".ko.xz":
        compress: Callable[[bytes], bytes] = lambda b: lzma.compress(b, preset=0)  # noqa: E731
    else:
        import zstandard

        compress = zstandard.ZstdCompressor(level=1).compress
    _bomb(h.tree.root / f"lib/modules/{h.release}/kernel/a{suffix}", compress, 4 * GIB)
    h.tree.add_module("a", A)
    h.check(event_says("module_file_refused", f"a{suffix}", "more than"), "bomb refused")


def _elf_ko(symbols: int, strtab: bytes, build_id: bytes) -> bytes:
    """A relocatable ELF64 with a .symtab of *symbols* entries, the string table *strtab*
    and a GNU build-id note: sections null, .note.gnu.build-id, .symtab, .strtab,
    .shstrtab."""
    shstr = b"\0.note.gnu.build-id\0.symtab\0.strtab\0.shstrtab\0"
    nb = note(b"GNU", 3, build_id)
    sym = struct.pack("<IBBHQQ", 1, 0x12, 0, 1, 0, 0)  # global func in section 1
    syms = bytes(24) + sym * (symbols - 1)
    body = [nb, syms, strtab, shstr]
    offs = []
    at = 64
    for b in body:
        offs.append(at)
        at += len(b)
    shoff = at
    sh = bytes(64)
    sh += struct.pack("<IIQQQQIIQQ", 1, 7, 2, 0, offs[0], len(nb), 0, 0, 4, 0)
    sh += struct.pack("<IIQQQQIIQQ", 20, 2, 0, 0, offs[1], len(syms), 3, 1, 8, 24)
    sh += struct.pack("<IIQQQQIIQQ", 28, 3, 0, 0, offs[2], len(strtab), 0, 0, 1, 0)
    sh += struct.pack("<IIQQQQIIQQ", 36, 3, 0, 0, offs[3], len(shstr), 0, 0, 1, 0)
    ehdr = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7, 1, 62, 1, 0,
        0, shoff, 0, 64, 0, 0, 64, 5, 4,
    )  # fmt: skip
    return ehdr + b"".join(body) + sh


@pytest.mark.parametrize(
    "symbols,strtab",
    [(1 << 18, b"\0a_function\0"), (4, b"\0" + b"x" * (64 << 20))],
    ids=["2^18-symbols", "strtab-without-end"],
)
def test_a_module_file_with_a_hostile_symbol_table_is_a_named_error(
    host: Any, symbols: int, strtab: bytes
) -> None:
    h = host()
    build_id = "a1" * 20
    ko = h.tree.root / f"lib/modules/{h.release}/kernel/a.ko"
    ko.parent.mkdir(parents=True, exist_ok=True)
    ko.write_bytes(_elf_ko(symbols, strtab, bytes.fromhex(build_id)))
    h.tree.add_module("a", A, build_id=build_id)
    h.check(event_says("module_file_refused", "a.ko"), "ko refused")


def test_a_vmlinux_whose_section_headers_lie_past_2_63_is_a_named_error(host: Any) -> None:
    h = host(kptr_restrict=0)
    ehdr = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7, 2, 62, 1, 0,
        0, (1 << 63) + 64, 0, 64, 0, 0, 64, 0xFFFF, 1,
    )  # fmt: skip
    h.tree.write(f"boot/vmlinux-{h.release}", ehdr + bytes(4096))
    h.check(any_event_says(f"vmlinux-{h.release}", "section headers"), "vmlinux refused")


def _btf_without_end(repeat: int, depth: int) -> bytes:
    """struct module of *repeat* anonymous members of one struct, itself of *repeat*
    anonymous members of the next, *depth* deep, none named ``name``: a search that
    looks into every one visits repeat**depth members."""
    b = BtfBuilder()
    u64 = b.int("unsigned long", 8)
    inner = b.struct("leaf", 8, [("x", u64, 0)])
    for i in range(depth):
        inner = b.struct(f"level{i}", 8, [("", inner, 0)] * repeat)
    b.struct("module", 8, [("", inner, 0)] * repeat)
    return b.build()


def test_btf_whose_anonymous_members_repeat_without_end_is_a_named_error(host: Any) -> None:
    h = host(kptr_restrict=2)
    h.tree.set_text(h.tree.text, zero=True)
    h.tree.write("proc/kcore", kcore(b"KERNELOFFSET=1c000000\n"))
    h.tree.write("sys/kernel/btf/vmlinux", _btf_without_end(repeat=2000, depth=6))
    h.check(any_event_says("btf/vmlinux", "members"), "BTF refused")


def _far_core_line(h: Host) -> None:
    """A line of the kernel's own, in the kernel's half but 2^47 bytes from _text."""
    path = h.tree.root / "proc/kallsyms"
    data = path.read_bytes()
    owned = data.rfind(b"\n", 0, data.find(b"\t[")) + 1
    path.write_bytes(data[:owned] + b"ffff800000000000 T far_away\n" + data[owned:])


def _absolute_module_line(h: Host) -> None:
    """Module a's lines, one a per-cpu (absolute) value past 2^63."""
    h.tree.add_module("a", A)
    with open(h.tree.root / "proc/kallsyms", "ab") as f:
        f.write(b"%016x t a_func\t[a]\nffffffffffff0000 a a_pcpu\t[a]\n" % (A + 0x10))


@pytest.mark.parametrize(
    "change,expect",
    [
        (_far_core_line, event_says("kernel_symbols", "stored")),
        (_absolute_module_line, event_says("module_symbols", '"a"', "kallsyms")),
    ],
    ids=["core-line-2^47-from-text", "module-absolute-past-2^63"],
)
def test_kallsyms_lines_no_table_can_hold_leave_the_symbol_worker_working(
    host: Any, change: Callable[[Host], None], expect: Callable[[dict[str, Any]], bool]
) -> None:
    """The symbol worker's thread ends only on a named error: a value its table's
    columns cannot hold is left out, and the worker goes on to the next load."""
    h = host()
    if change is _far_core_line:
        change(h)
        h.check(expect, "kernel table stored")
    else:
        h.check(expect, "module table stored", lambda: change(h))


# -- numbers the kernel cannot produce -------------------------------------------------------


@pytest.mark.parametrize("offset", ["-1", f"{1 << 80:x}", "8" + "0" * 15])
def test_a_kerneloffset_the_kernel_cannot_have_is_not_stored(host: Any, offset: str) -> None:
    h = host()
    h.tree.write("proc/kcore", kcore(f"KERNELOFFSET={offset}\n".encode()))
    h.check(event_says("kaslr_source_skipped", "KERNELOFFSET"), "offset refused")
    shown = subprocess.run(
        [
            bin_path("kreldctl"),
            "--state-dir",
            str(h.state),
            "--root",
            str(h.tree.root),
            "show",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(shown.stdout)["kaslr_offset"] is None


@pytest.mark.parametrize(
    "value", [f"0x{1 << 68:x}", "0x" + "f" * 60_000, "-0x10", "0x0000000000001000"]
)
def test_a_section_address_outside_the_kernels_half_is_not_stored(host: Any, value: str) -> None:
    h = host()
    files = {"sections/.data..bad": value.encode() + b"\n"}
    h.check(
        event_says("module_read_fault", "sections/.data..bad"),
        "section refused",
        lambda: h.tree.add_module("a", A, extra_files=files),
    )


@pytest.mark.parametrize("coresize", ["-1", str(1 << 70), "99999999999999999999"])
def test_a_module_size_no_module_can_have_is_not_stored(host: Any, coresize: str) -> None:
    h = host()
    files = {"coresize": coresize.encode() + b"\n"}
    h.check(
        event_says("module_read_fault", "coresize"),
        "coresize refused",
        lambda: h.tree.add_module("a", A, extra_files=files),
    )


# -- files that change while read ------------------------------------------------------------


def _fd_open(pid: int, path: Path) -> bool:
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


def _mapped(pid: int, path: Path) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return str(path) in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("keep", [0, 4096, 1 << 20], ids=["to-nothing", "to-a-page", "to-1-mib"])
def test_a_perf_data_cut_short_while_inject_reads_it_is_a_named_error(
    tmp_path: Path, keep: int
) -> None:
    """kreldctl inject is stopped once it has the input open (and, where it maps it,
    mapped), the input is cut to *keep* bytes, and inject goes on: it ends in a named
    error or a whole output, never in SIGBUS."""
    from support.perffile import PerfFile

    tree = FakeTree(tmp_path / "root")
    opts = ["--root", str(tree.root), "--state-dir", str(tmp_path / "state")]
    subprocess.run([bin_path("kreldctl"), *opts, "snapshot"], check=True, capture_output=True)
    src = PerfFile(
        text=tree.text, kernel_build_id=tree.build_id, osrelease=tree.release, samples=2_000_000
    ).write(tmp_path / "in.data")
    out = tmp_path / "out.data"
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            [bin_path("kreldctl"), *opts, "inject", "-i", str(src), "-o", str(out)],
            stderr=err, preexec_fn=limit_memory,
        )  # fmt: skip
        deadline = time.monotonic() + SECONDS
        while not _fd_open(p.pid, src) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        mapped = time.monotonic() + 0.05  # a reader that maps the file does so at once
        while not _mapped(p.pid, src) and p.poll() is None and time.monotonic() < mapped:
            time.sleep(0.001)
        assert p.poll() is None, "inject ended before it could be caught reading"
        os.kill(p.pid, 19)  # SIGSTOP
        os.truncate(src, keep)
        os.kill(p.pid, 18)  # SIGCONT
        rc = p.wait(timeout=SECONDS)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    assert rc in (ExitCode.OK, ExitCode.ERROR), (rc, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    if rc == ExitCode.ERROR:
        assert str(src) in stderr or "input" in stderr, stderr
