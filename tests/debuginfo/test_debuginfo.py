"""Debug files found by build-id in the three layouts, never by trust: real
gcc-built ELF files laid out in temp dirs, decoys of other builds refused."""

from __future__ import annotations

import lzma
import os
import shutil
from pathlib import Path

import pytest
import zstandard

from kreld.core.errors import DebuginfoNotFound, InvalidArgument
from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.finder import DebuginfoFinder, Origin
from kreld.debuginfo.places import Kind, Layout, Wanted, search_roots

from support.debuginfo_elves import build, build_id_of, section_flags

R = "6.1.0-57-cloud-amd64"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def finder(tmp_path: Path, *dirs: Path, root: Path | None = None) -> DebuginfoFinder:
    system = root or tmp_path / "sysroot"
    cache = DebugCache(tmp_path / "state" / "debuginfo", 1 << 30)
    (tmp_path / "state").mkdir(exist_ok=True, mode=0o700)
    return DebuginfoFinder(
        search_roots(system, (), [str(d) for d in dirs]), cache=cache, system_root=system
    )


@pytest.mark.parametrize(
    ("rel", "layout"),
    [(f"boot/vmlinux-{R}", Layout.DEBIAN), (f"lib/modules/{R}/vmlinux", Layout.FEDORA)],
)
def test_the_image_is_found_by_path_in_each_layout_and_checked(
    tmp_path: Path, rel: str, layout: Layout
) -> None:
    d = tmp_path / "debug"
    bid = build(d / rel, 1)
    got = finder(tmp_path, d).find(Wanted(bid, Kind.IMAGE, R))
    assert got.path == d / rel and got.layout is layout and got.origin is Origin.LOCAL
    assert got.root is not None and got.root.named_by == "--debuginfo-dir"
    assert str(d / rel) in got.describe()


def test_the_build_id_layout_follows_its_link_to_the_file(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere" / "prog.debug"
    bid = build(real, 2)
    link = tmp_path / "debug" / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    got = finder(tmp_path, tmp_path / "debug").find(Wanted(bid, Kind.IMAGE, R))
    assert got.layout is Layout.BUILD_ID and got.path == link


def test_a_decoy_of_another_build_is_refused_and_the_search_goes_on(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    decoy = build(first / "boot" / f"vmlinux-{R}", 3)
    bid = build(second / "lib" / "modules" / R / "vmlinux", 4)
    assert decoy != bid
    got = finder(tmp_path, first, second).find(Wanted(bid, Kind.IMAGE, R))
    assert got.path == second / "lib" / "modules" / R / "vmlinux"


def test_nothing_but_decoys_is_an_error_saying_where_it_looked(tmp_path: Path) -> None:
    d = tmp_path / "debug"
    decoy = build(d / "boot" / f"vmlinux-{R}", 5)
    wanted = "ab" * 20
    with pytest.raises(DebuginfoNotFound) as e:
        finder(tmp_path, d).find(Wanted(wanted, Kind.IMAGE, R))
    assert e.value.varlink_name == "io.kreld.DebuginfoNotFound"
    assert any(str(d) in place for place in e.value.looked)
    assert f"build-id {decoy}, refused" in str(e.value)
    assert not list((tmp_path / "state" / "debuginfo").glob("*"))


@pytest.mark.parametrize("compress", ["zlib", "zstd"])
def test_a_file_with_compressed_debug_sections_is_checked_by_its_build_id(
    tmp_path: Path, compress: str
) -> None:
    d = tmp_path / "debug"
    path = d / "boot" / f"vmlinux-{R}"
    bid = build(path, 6, compress=compress)
    debug_info = next(line for line in section_flags(path).splitlines() if ".debug_info" in line)
    assert " C " in debug_info, debug_info  # SHF_COMPRESSED
    assert finder(tmp_path, d).find(Wanted(bid, Kind.IMAGE, R)).path == path


def test_a_module_is_found_under_its_path_with_dashes_and_underscores_alike(
    tmp_path: Path,
) -> None:
    d = tmp_path / "debug"
    ko = d / "lib" / "modules" / R / "kernel" / "sound" / "pci" / "snd-fake-hda.ko"
    bid = build(ko, 7, kind="module")
    # A module of the same name elsewhere in the tree, of another build.
    build(d / "lib" / "modules" / R / "updates" / "snd_fake_hda.ko", 8, kind="module")
    got = finder(tmp_path, d).find(Wanted(bid, Kind.MODULE, R, "snd_fake_hda"))
    assert got.path == ko and got.layout is Layout.DEBIAN


def test_a_fedora_module_debug_file_is_found(tmp_path: Path) -> None:
    d = tmp_path / "debug"
    dbg = d / "lib" / "modules" / R / "kernel" / "drivers" / "block" / "brd.ko.debug"
    bid = build(dbg, 9, kind="module")
    got = finder(tmp_path, d).find(Wanted(bid, Kind.MODULE, R, "brd"))
    assert got.path == dbg and got.layout is Layout.FEDORA


def test_modules_dep_of_the_system_names_the_path_looked_at(tmp_path: Path) -> None:
    d = tmp_path / "debug"
    system = tmp_path / "sysroot"
    ko = d / "lib" / "modules" / R / "kernel" / "drivers" / "block" / "brd.ko"
    bid = build(ko, 10, kind="module")
    dep = system / "lib" / "modules" / R / "modules.dep"
    dep.parent.mkdir(parents=True)
    dep.write_text("kernel/drivers/block/brd.ko.xz:\nkernel/fs/xfs/xfs.ko.xz: kernel/lib/x.ko.xz\n")
    f = finder(tmp_path, d, root=system)
    assert f._module_paths(f.roots[0], Wanted(bid, Kind.MODULE, R, "brd"))[0] == (
        "kernel/drivers/block/brd"
    )
    assert f.find(Wanted(bid, Kind.MODULE, R, "brd")).path == ko


@pytest.mark.parametrize("suffix", [".xz", ".zst"])
def test_a_compressed_module_is_unpacked_into_the_cache_once_checked(
    tmp_path: Path, suffix: str
) -> None:
    d = tmp_path / "debug"
    plain = tmp_path / "build" / "brd.ko"
    bid = build(plain, 11, kind="module")
    packed = d / "lib" / "modules" / R / "kernel" / "drivers" / "block" / f"brd.ko{suffix}"
    packed.parent.mkdir(parents=True)
    raw = plain.read_bytes()
    packed.write_bytes(
        lzma.compress(raw) if suffix == ".xz" else zstandard.ZstdCompressor().compress(raw)
    )
    f = finder(tmp_path, d)
    got = f.find(Wanted(bid, Kind.MODULE, R, "brd"))
    assert got.origin is Origin.LOCAL and got.source == str(packed)
    assert got.path == tmp_path / "state" / "debuginfo" / f"{bid}.debug"
    assert got.path.read_bytes() == raw and build_id_of(got.path) == bid
    assert got.path.stat().st_mode & 0o777 == 0o600


def test_a_cut_compressed_module_is_never_kept(tmp_path: Path) -> None:
    d = tmp_path / "debug"
    plain = tmp_path / "build" / "brd.ko"
    bid = build(plain, 12, kind="module")
    packed = d / "lib" / "modules" / R / "kernel" / "brd.ko.zst"
    packed.parent.mkdir(parents=True)
    whole = zstandard.ZstdCompressor().compress(plain.read_bytes())
    packed.write_bytes(whole[: len(whole) - 20])
    with pytest.raises(DebuginfoNotFound) as e:
        finder(tmp_path, d).find(Wanted(bid, Kind.MODULE, R, "brd"))
    assert "cut short" in str(e.value)
    assert not os.listdir(tmp_path / "state" / "debuginfo")


def test_a_cached_file_of_another_build_is_removed_not_answered(tmp_path: Path) -> None:
    cache_dir = tmp_path / "state" / "debuginfo"
    cache_dir.mkdir(parents=True, mode=0o700)
    (tmp_path / "state").chmod(0o700)
    other = build(tmp_path / "other", 13)
    wanted = "cd" * 20
    shutil.copy(tmp_path / "other", cache_dir / f"{wanted}.debug")
    assert other != wanted
    cache = DebugCache(cache_dir, 1 << 30)
    assert cache.lookup(wanted) is None
    assert not (cache_dir / f"{wanted}.debug").exists()


def test_the_cache_evicts_the_least_recently_used_past_its_bound(tmp_path: Path) -> None:
    files = [tmp_path / f"p{i}" for i in range(3)]
    ids = [build(p, 20 + i) for i, p in enumerate(files)]
    size = max(p.stat().st_size for p in files)
    cache = DebugCache(tmp_path / "cache", 2 * size)
    for i, (p, bid) in enumerate(zip(files, ids, strict=True)):
        cache.store(bid, str(p), lambda fd, p=p: os.write(fd, p.read_bytes()) and None)
        os.utime(cache.directory / f"{bid}.debug", (1000 + i, 1000 + i))
        if i == 1:
            assert cache.lookup(ids[0]) is not None  # used: now the newest
    kept = sorted(x.name for x in cache.directory.glob("*.debug"))
    assert kept == sorted([f"{ids[0]}.debug", f"{ids[2]}.debug"])


def test_a_wanted_build_that_could_name_another_path_is_refused(tmp_path: Path) -> None:
    f = finder(tmp_path, tmp_path)
    for want in (
        Wanted("../../etc", Kind.IMAGE, R),
        Wanted("ab" * 20, Kind.IMAGE, "../.."),
        Wanted("ab" * 20, Kind.MODULE, R, "a/b"),
        Wanted("ab" * 20, Kind.MODULE, R, "brd", "kernel/../../x"),
    ):
        with pytest.raises(InvalidArgument):
            f.find(want)


def test_given_dirs_come_before_the_system_and_the_configured_ones(tmp_path: Path) -> None:
    roots = search_roots("/srv/root", ["/conf/a"], ["/cli/a", "/cli/b"])
    assert [(r.path, r.named_by) for r in roots] == [
        ("/cli/a", "--debuginfo-dir"),
        ("/cli/b", "--debuginfo-dir"),
        ("/srv/root/usr/lib/debug", "--root"),
        ("/conf/a", "debuginfo_dirs"),
    ]


def test_servers_come_from_the_config_key_else_debuginfod_urls_and_bad_ones_are_said(
    tmp_path: Path,
) -> None:
    from kreld.config.settings import load_bytes
    from kreld.core.errors import ConfigError
    from kreld.debuginfo.finder import finder_for

    env = {"DEBUGINFOD_URLS": "http://a.example/ ftp://b.example https://c.example"}
    cfg = load_bytes(f'[paths]\nstate_dir = "{tmp_path}"\n'.encode(), "t.toml")
    f = finder_for(cfg, tmp_path, ["/given"], env)
    assert f.servers == ("http://a.example/", "https://c.example")
    assert any("ftp://b.example" in n for n in f.notes)
    assert f.cache is not None and f.cache.directory == tmp_path / "debuginfo"
    assert f.roots[0].path == "/given"
    cfg = load_bytes(b'[kernel]\ndebuginfod_urls = ["http://d.example"]\n', "t.toml")
    assert finder_for(cfg, tmp_path, (), env).servers == ("http://d.example",)
    with pytest.raises(ConfigError, match=r"kernel\.debuginfod_urls"):
        load_bytes(b'[kernel]\ndebuginfod_urls = ["file:///x"]\n', "t.toml")
