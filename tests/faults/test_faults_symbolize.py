"""Hostile text on ``kreldctl symbolize``'s standard input, with and
without ``--for``: invalid UTF-8 under a real UTF-8 locale, a sample time of
thousands of digits, a line of unclosed ``[unknown] (`` frames, a line of tens of
megabytes with no newline.  Each is read in bounded memory and time and copied
through byte for byte where it is not a frame kreld names; none is a traceback.

kreldctl runs as a child (tests/support/peak.py: its own peak memory and CPU from
wait4) against a real store snapshotted from a fake tree whose kernel starts at
TEXT, so that TEXT+0x1010 is start_kernel+0x10; the recording for ``--for`` is
a perf.data of that boot written by tests/support/perffile.py.  Times are compared only
as ratios against a baseline run in the same test.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from kreld.varlink.requests import MAX_RESOLVE_ADDRESSES

from support.faketree import FakeTree
from support.faultlib import Measured, run_measured
from support.inject import TEXT
from support.inject import store as store
from support.perffile import PerfFile
from support.run import bin_path

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

IP = TEXT + 0x1010
NAMED = "start_kernel+0x10 ([kernel.kallsyms])"
RSS_BOUND_KIB = 120 << 10


@pytest.fixture(autouse=True)
def utf8_locale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real UTF-8 locale, where Python's stdin is strict UTF-8 unless told."""
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.delenv("PYTHONUTF8", raising=False)
    monkeypatch.delenv("PYTHONIOENCODING", raising=False)


@pytest.fixture
def rec(store: tuple[list[str], FakeTree], tmp_path: Path) -> Path:
    _, tree = store
    f = PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release)
    return f.write(tmp_path / "perf.data")


AS_LIMIT = 512 << 20


class Out:
    """One kreldctl child: its exit code, stdout as bytes, stderr, and the kernel's
    account of its memory and CPU."""

    def __init__(self, m: Measured, out: bytes, err: str) -> None:
        self.m, self.out, self.err = m, out, err
        self.rc = m.rc

    def __repr__(self) -> str:
        return f"rc={self.rc} maxrss={self.m.maxrss_kib} KiB cpu={self.m.cpu_s:.2f}s\n{self.err}"


def symbolize(opts: list[str], data: bytes, *args: str) -> Out:
    with (
        tempfile.TemporaryFile() as f,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        f.write(data)
        f.seek(0)
        m = run_measured(
            [bin_path("kreldctl"), *opts, "symbolize", *args],
            stdin=f,
            stdout=out,
            stderr=err,
            timeout=120,
            as_limit=AS_LIMIT,
        )
        if m.timed_out:
            pytest.fail(f"kreldctl symbolize {args} still running after 120 s")
        out.seek(0)
        err.seek(0)
        r = Out(m, out.read(), err.read().decode(errors="replace"))
    assert "Traceback" not in r.err, r
    return r


def frame(ip: int = IP) -> bytes:
    return f"\t{ip:16x} [unknown] ([kernel.kallsyms])\n".encode()


def named(ip: int = IP) -> bytes:
    return f"\t{ip:16x} {NAMED}\n".encode()


def sample(time: bytes = b"5291.345926") -> bytes:
    return b"    kworker/0:1    42 [000] " + time + b":     250000 cpu-clock:\n"


def test_invalid_utf8_is_copied_byte_for_byte_and_the_frames_still_named(
    store: tuple[list[str], FakeTree], rec: Path
) -> None:
    """Under C.UTF-8 the old reader died on the first bad byte; now every byte
    comes back out as it went in, around the frame that is named."""
    opts, _ = store
    bad = b"    caf\xe9 \xff\xfe\x80 42 [000] 5291.345926:     250000 cpu-clock:\n"
    tail = b"\t    7f0011223344 [unknown] (/usr/lib/\xc3\x28libc.so.6)\n\n"
    r = symbolize(opts, bad + frame() + tail, "--for", str(rec))
    assert r.rc == 0, r
    assert r.out == bad + named() + tail
    plain = symbolize(opts, b"\xff\xfe " + f"{IP:#x}".encode() + b" \xe9\n")
    assert plain.rc == 0, plain
    assert plain.out == f"{IP:#x} start_kernel+0x10\n".encode()


def test_a_sample_time_of_5000_digits_is_no_time_not_a_traceback(
    store: tuple[list[str], FakeTree], rec: Path
) -> None:
    opts, _ = store
    huge = sample(b"9" * 5000 + b".345926")
    r = symbolize(opts, huge + frame() + b"\n" + sample() + frame(), "--for", str(rec))
    assert r.rc == 0, r
    assert r.out == huge + named() + b"\n" + sample() + named()


def _cpu(opts: list[str], rec: Path, data: bytes) -> tuple[Out, float]:
    r = symbolize(opts, data, "--for", str(rec))
    assert r.rc == 0, r
    return r, r.m.cpu_s


def test_lines_of_unclosed_frames_cost_what_as_many_closed_ones_do(
    store: tuple[list[str], FakeTree], rec: Path
) -> None:
    """A line of ``ffff… [unknown] (`` repeated, never closed, scanned the rest of
    the line for each candidate frame (580 KB: 48 s).  The DSO is now bounded and
    ends at the next '(': 2 MB of such lines (each under the line limit) against
    2 MB of closed frames of the same length, CPU compared in the same run."""
    opts, _ = store
    unit = f"{IP:016x} [unknown] (".encode()
    per_line = (60 << 10) // len(unit)
    attack = (b"\t" + unit * per_line + b"\n") * 34
    closed_unit = f"{IP:016x} [unknown] ([kernel.kallsyms])".encode()
    closed = (b"\t" + closed_unit * ((60 << 10) // len(closed_unit)) + b"\n") * 34
    base, base_cpu = _cpu(opts, rec, closed)
    hit, hit_cpu = _cpu(opts, rec, attack)
    assert hit.out == attack  # nothing there is a frame: copied as it came
    print(f"unclosed frames: {hit_cpu:.2f} s CPU, closed ones {base_cpu:.2f} s")
    assert hit_cpu < 3 * base_cpu, (hit, base)


def test_a_64_mib_line_without_a_newline_passes_through_in_bounded_memory(
    store: tuple[list[str], FakeTree], rec: Path
) -> None:
    """Read 64 KiB at a time and copied unchanged (a piece of an over-long line is
    never parsed, so a frame in it is not named: perf writes no such line)."""
    opts, _ = store
    line = frame().rstrip(b"\n") * ((64 << 20) // 48)
    r = symbolize(opts, sample() + frame() + line, "--for", str(rec))
    assert r.rc == 0, r
    assert r.out == sample() + named() + line
    assert r.m.maxrss_kib < RSS_BOUND_KIB, r


def test_addresses_are_resolved_a_batch_at_a_time_and_all_answered(
    store: tuple[list[str], FakeTree],
) -> None:
    """Past one Resolve batch: every address answered, in order, text and JSON."""
    opts, _ = store
    n = MAX_RESOLVE_ADDRESSES + 7
    data = "".join(f"{IP + (i % 64):#x}\n" for i in range(n)).encode()
    r = symbolize(opts, data)
    assert r.rc == 0, r
    lines = r.out.decode().splitlines()
    assert len(lines) == n
    assert lines[0] == f"{IP:#x} start_kernel+0x10" and lines[-1].startswith(
        f"{IP + (n - 1) % 64:#x} "
    )
    j = symbolize(opts, data, "--json")
    got = json.loads(j.out)
    assert len(got) == n and got[n - 1]["address"] == f"{IP + (n - 1) % 64:#x}"
    empty = symbolize(opts, b"no address here\n", "--json")
    assert json.loads(empty.out) == [] and empty.out == b"[]\n"


def test_a_pipe_of_perf_script_text_is_read_as_it_comes(
    store: tuple[list[str], FakeTree], rec: Path
) -> None:
    """stdin a real pipe (not a file): the same bytes out."""
    opts, _ = store
    data = sample() + frame() + b"\n"
    cp = subprocess.run(
        [bin_path("kreldctl"), *opts, "symbolize", "--for", str(rec)],
        input=data,
        capture_output=True,
        timeout=60,
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == sample() + named() + b"\n"
