"""Fuzzing the ``perf script`` reader of ``kreldctl symbolize --for``:
whatever the bytes on its input, every line comes out (as many newlines out as
in), a line without ``[unknown]`` comes out byte for byte, and nothing raises.

The corpus is seeded from the real ``perf script`` of a ``perf record -g -a``
made on this machine (its kernel frames turned ``[unknown]`` and moved into the
fake kernel this store recorded, so that the reader has frames to name; skipped
where perf cannot record here), and from lines in perf script's format written
here; hypothesis mutates them (bytes flipped, cut, invalid UTF-8 and long runs
of digits, parentheses and frames spliced in, lines repeated) and draws lines of
its own.  The reader runs in process against a real store, a few hundred
examples in some seconds.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kreld.core.textin import bounded_lines
from kreld.perf.commands import symbolize_for
from kreld.perf.reader import read_perf_header
from kreld.store import Store

from support.faketree import FakeTree
from support.perffile import PerfFile
from support.run import kreldctl

TEXT = 0xFFFFFFFF9D000000
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
LIMIT = 4096  # a small line limit, so that over-long lines are drawn often


def synthetic() -> bytes:
    lines = [
        b"    kworker/0:1    42 [000]  5291.345926:     250000 cpu-clock: \n",
        f"\t{TEXT + 0x1010:16x} [unknown] ([kernel.kallsyms])\n".encode(),
        f"\t{TEXT + 0x2008:16x} [unknown] ([unknown])\n".encode(),
        b"\t    7f0011223344 [unknown] (/usr/lib/x86_64-linux-gnu/libc.so.6)\n",
        b"\n",
        f"swapper 0 [001] 5291.4: 1 cpu-clock: {TEXT + 0x1000:x} [unknown] ([kernel.kallsyms])\n"
        .encode(),
    ]  # fmt: skip
    return b"".join(lines)


def real(d: Path) -> bytes | None:
    """This machine's perf script output, kernel frames made unknown and moved into
    the fake kernel (None where perf cannot record here)."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    env = {**os.environ, "HOME": str(d)}
    data = d / "real.data"
    rec = [perf, "record", "-N", "-q", "-g", "-a", "-e", "cpu-clock", "-o", str(data)]
    cp = subprocess.run([*rec, "--", "sleep", "0.05"], capture_output=True, env=env, timeout=60)
    if cp.returncode != 0:
        return None
    cp = subprocess.run([perf, "script", "-i", str(data)], capture_output=True, env=env, timeout=60)
    if cp.returncode != 0 or not cp.stdout:
        return None
    text = cp.stdout[: 16 << 10]

    def unknown(m: re.Match[bytes]) -> bytes:
        return f"{TEXT + int(m.group(1), 16) % 0x3000:16x} [unknown] ([kernel.kallsyms])".encode()

    return re.sub(rb"\b(ffff[0-9a-f]{12}) \S+ \(\[kernel\.kallsyms\]\)", unknown, text)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[bytes]]:
    d = tmp_path_factory.mktemp("scriptfuzz")
    tree = FakeTree(d / "root", text=TEXT)
    state = d / "state"
    kreldctl("--root", str(tree.root), "--state-dir", str(state), "snapshot")
    rec = PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release).write(
        d / "perf.data"
    )
    seeds = [synthetic()]
    r = real(d)
    if r is not None:
        seeds.append(r)
    return state, rec, seeds


def run(state: Path, rec: Path, data: bytes) -> bytes:
    out, err = io.StringIO(), io.StringIO()
    with Store(state, readonly=True) as store:
        rc = symbolize_for(
            store, read_perf_header(rec), bounded_lines(io.BytesIO(data), LIMIT), out, err
        )
    assert rc == 0
    return out.getvalue().encode("utf-8", "surrogateescape")


def check(data: bytes, got: bytes) -> None:
    assert got.count(b"\n") == data.count(b"\n")
    for a, b in zip(data.split(b"\n"), got.split(b"\n"), strict=True):
        if b"[unknown]" not in a or len(a) + 1 >= LIMIT:
            assert a == b


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    pieces = [
        b"\xff\xfe\xc3(",
        b"9" * 5000 + b".1:",
        f"{TEXT + 0x1010:016x} [unknown] (".encode() * 40,
        b"(" * 300,
        b"\t",
        b"\n",
        f" {TEXT + 0x1010:016x} [unknown] ([kernel.kallsyms])".encode(),
    ]
    for _ in range(draw(st.integers(1, 5))):
        n = len(data)
        at = draw(st.integers(0, max(n - 1, 0)))
        kind = draw(st.sampled_from(["flip", "cut", "splice", "piece", "repeat"]))
        if kind == "flip" and n:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "piece":
            data[at:at] = draw(st.sampled_from(pieces))
        else:
            size = draw(st.integers(1, 200))
            data[at:at] = bytes(data[at : at + size]) * draw(st.integers(2, 50))
    return bytes(data)


@SETTINGS
@given(st.data())
def test_mutated_perf_script_output_comes_out_whole(
    world: tuple[Path, Path, list[bytes]], data: st.DataObject
) -> None:
    state, rec, seeds = world
    text = data.draw(mutated(seeds))
    check(text, run(state, rec, text))


@SETTINGS
@given(st.binary(max_size=3000))
def test_any_bytes_come_out_whole(world: tuple[Path, Path, list[bytes]], text: bytes) -> None:
    state, rec, _ = world
    check(text, run(state, rec, text))


def test_the_seeds_have_frames_to_name(world: tuple[Path, Path, list[bytes]]) -> None:
    """The corpus is worth fuzzing from: kreld names frames in every seed."""
    state, rec, seeds = world
    for seed in seeds:
        got = run(state, rec, seed)
        check(seed, got)
        assert got != seed
    assert b"start_kernel+0x10 ([kernel.kallsyms])" in run(state, rec, seeds[0])
