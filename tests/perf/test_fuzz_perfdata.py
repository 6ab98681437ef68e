"""Fuzzing the perf.data reader: whatever the bytes, ``read_perf_header``
gives a :class:`PerfHeader` within its bounds or a named :class:`KreldError`, never
another exception.

The corpus is seeded from real ``perf record`` runs on this machine (a command,
system-wide, pipe mode, ``-z``; skipped, saying why, where perf cannot record) and
from the files tests/support/perffile.py writes (module maps, MMAP2 build-ids, both
compressed kinds, pipe mode); hypothesis mutates them (bit flips, cuts, length and
offset fields set to huge or boundary values, spliced and repeated runs of bytes)
and generates record streams of its own.  Bounded: a few hundred examples, some
seconds in all.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kreld.core.errors import KreldError
from kreld.perf import formats as perfrecords
from kreld.perf.reader import PerfHeader, read_perf_header

from support.perffile import FINISHED_INIT, PerfFile, compressed, mmap, record

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
MODS = [("brd", 0xFFFFFFFFC0A00000, 0x6000), ("nf_tables", 0xFFFFFFFFC0B00000, 0x48000)]
# Values a length or offset field is set to: the edges and far past them.
EDGES = [0, 1, 7, 8, 15, 16, 104, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 62, (1 << 64) - 1]


def synthetic_seeds(d: Path) -> list[bytes]:
    f = PerfFile(modules=MODS)
    out = [
        f.write(d / "s1.data").read_bytes(),
        f.write_pipe(d / "s2.data").read_bytes(),
        PerfFile(modules=MODS, compress=True).write(d / "s3.data").read_bytes(),
        PerfFile(modules=MODS, mmap2=True, module_build_ids={"brd": "12" * 20})
        .write(d / "s4.data")
        .read_bytes(),
        PerfFile(clock=(1, 10**18, 5 * 10**9)).write_pipe(d / "s5.data").read_bytes(),
    ]
    return out


def real_seeds(d: Path) -> tuple[list[bytes], str | None]:
    """Recordings the machine's perf makes here, or why there are none."""
    perf = shutil.which("perf")
    if perf is None:
        return [], "perf is not installed (Debian package linux-perf)"
    env = {**os.environ, "HOME": str(d)}
    runs = {
        "cmd": ["-o", str(d / "cmd.data"), "--", "true"],
        "all": ["-a", "-o", str(d / "all.data"), "--", "sleep", "0.1"],
        "z": ["-z", "-a", "-o", str(d / "z.data"), "--", "sleep", "0.1"],
        "pipe": ["-a", "-o", "-", "--", "sleep", "0.1"],
    }
    out: list[bytes] = []
    why = None
    for name, opts in runs.items():
        argv = [perf, "record", "-N", "-q", "-e", "cpu-clock", *opts]
        cp = subprocess.run(argv, capture_output=True, env=env, timeout=60, check=False)
        if cp.returncode != 0:
            why = f"perf record {' '.join(opts)} fails here: {cp.stderr.decode()[-200:]}"
            continue
        out.append(cp.stdout if name == "pipe" else (d / f"{name}.data").read_bytes())
    return out, (why if not out else None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    d = tmp_path_factory.mktemp("perfseed")
    real, _why = real_seeds(d)
    return {"synthetic": synthetic_seeds(d), "real": real}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("perffuzz") / "x.data"


def read_or_named_error(path: Path, data: bytes) -> PerfHeader | KreldError:
    """The property: a header within its bounds, or a KreldError."""
    path.write_bytes(data)
    try:
        h = read_perf_header(path)
    except KreldError as e:
        assert str(e), "a named error says what is wrong"
        return e
    assert isinstance(h, PerfHeader)
    assert len(h.modules) <= perfrecords.MAX_MODULE_MAPS
    assert len(h.build_ids) <= perfrecords.MAX_BUILD_IDS
    assert h.text is None or 0 < h.text < 1 << 64
    return h


# -- mutations of the seeds ------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        if n < 2:
            break
        at = draw(st.one_of(st.integers(0, min(n - 1, 112)), st.integers(0, n - 1)))
        kind = draw(st.sampled_from(["flip", "cut", "u16", "u32", "u64", "splice", "repeat"]))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind in ("u16", "u32", "u64"):
            width = {"u16": 2, "u32": 4, "u64": 8}[kind]
            v = draw(st.sampled_from(EDGES)) & ((1 << (8 * width)) - 1)
            data[at : at + width] = v.to_bytes(width, draw(st.sampled_from(["little", "big"])))
        elif kind == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        else:  # a run of bytes repeated: records counted many times over
            size = draw(st.integers(8, 256))
            data[at:at] = bytes(data[at : at + size]) * draw(st.integers(2, 300))
    return bytes(data)


@SETTINGS
@given(st.data())
def test_mutated_synthetic_recordings_give_a_header_or_a_named_error(
    corpus: dict[str, list[bytes]], scratch: Path, data: st.DataObject
) -> None:
    read_or_named_error(scratch, data.draw(mutated(corpus["synthetic"])))


@SETTINGS
@given(st.data())
def test_mutated_real_perf_record_outputs_give_a_header_or_a_named_error(
    corpus: dict[str, list[bytes]], scratch: Path, data: st.DataObject
) -> None:
    if not corpus["real"]:
        pytest.skip("perf cannot record on this machine: no real seeds")
    read_or_named_error(scratch, data.draw(mutated(corpus["real"])))


def test_the_real_seeds_themselves_are_read(corpus: dict[str, list[bytes]], scratch: Path) -> None:
    """The seeds are good recordings: each gives a header with the kernel map's _text."""
    if not corpus["real"]:
        pytest.skip("perf cannot record on this machine: no real seeds")
    for seed in corpus["real"]:
        h = read_or_named_error(scratch, seed)
        assert isinstance(h, PerfHeader), h
        assert h.scan_limit is None


# -- record streams made up here ------------------------------------------------------------

KNOWN_TYPES = [1, 3, 9, 10, 64, 66, 67, 68, 71, 80, 81, 82, 83, 7, 11]


@st.composite
def a_record(draw: st.DrawFn) -> bytes:
    rtype = draw(st.one_of(st.sampled_from(KNOWN_TYPES), st.integers(0, 0xFFFFFFFF)))
    misc = draw(st.sampled_from([0, 1, 2, 1 << 14, 1 << 15, 0xFFFF]))
    if rtype in (1, 10) and draw(st.booleans()):
        name = draw(st.sampled_from(["[kernel.kallsyms]_text", "[brd]", "/x/a.ko", "x"]))
        return mmap(name, draw(st.integers(0, (1 << 64) - 1)), 0x1000, 0, mmap2=rtype == 10)
    if rtype in (81, 83) and draw(st.booleans()):
        import zstandard

        inner = b"".join(draw(st.lists(a_record(), max_size=4)))
        return compressed(zstandard.ZstdCompressor().compress(inner), rtype)
    body = draw(st.binary(max_size=120))
    if rtype == 80 and len(body) >= 8:  # a feature number worth having
        body = struct.pack("<Q", draw(st.sampled_from([2, 3, 4, 21, 29, 255]))) + body[8:]
    return record(rtype, misc, body)


@SETTINGS
@given(st.lists(a_record(), max_size=30), st.booleans(), st.booleans())
def test_made_up_record_streams_give_a_header_or_a_named_error(
    scratch: Path, recs: list[bytes], pipe: bool, finished: bool
) -> None:
    f = PerfFile(modules=MODS)
    data = f.kernel_map() + b"".join(recs) + (FINISHED_INIT if finished else b"")
    raw = f.pipe_bytes(data=data) if pipe else f.write(scratch, data=data).read_bytes()
    read_or_named_error(scratch, raw)
