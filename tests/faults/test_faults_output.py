"""Where ``kreldctl export -o`` and ``kreldctl inject -o`` write: safely
whoever runs them and wherever.  Root writing into a directory other users can
write must not be turned into a write elsewhere by anything planted there; a
device or a FIFO is written in place, never replaced by a file; a directory, a
missing parent or a full disk is OutputError (exit 8) with nothing left behind.

kreldctl runs as a real subprocess against a real store snapshotted from a fake
tree; the planted links belong to ``nobody`` (lchown, so root's run is the
attacked one), the device is a real character device made with mknod (the
machine's own /dev/null is never put at risk), the FIFOs have real readers, and
the full disk is a real tmpfs.  The rules below the CLI (umask, kept modes, a
sticky directory, descriptors by name) are checked on kreld.core.safeout itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kreld.core.errors import ExitCode, OutputError
from kreld.core.safeout import safe_output, write_output

from support.faketree import FakeTree
from support.faultlib import NOBODY, fill, tiny_tmpfs
from support.inject import TEXT
from support.inject import store as store
from support.perffile import PerfFile
from support.run import bin_path, kreldctl

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another user: needs root")


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory like /tmp: world-writable and sticky."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def export(opts: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return kreldctl(*opts, "export", "kallsyms", *args, check=False)


def expected(opts: list[str]) -> str:
    return kreldctl(*opts, "export", "kallsyms").stdout


def plant_link(at: Path, target: Path | str, uid: int = NOBODY) -> None:
    at.symlink_to(target)
    os.lchown(at, uid, uid)


def refused(cp: subprocess.CompletedProcess[str], *words: str) -> None:
    assert cp.returncode == ExitCode.OUTPUT == 8, cp.stderr
    assert "Traceback" not in cp.stderr, cp.stderr
    for w in words:
        assert w in cp.stderr, (w, cp.stderr)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# -- planted links ------------------------------------------------------------------------


@ROOT_ONLY
def test_a_link_planted_at_the_old_temporary_name_is_neither_followed_nor_removed(
    store: tuple[list[str], FakeTree], shared: Path, tmp_path: Path
) -> None:
    """The attack seen: FILE.tmp planted as a link to a file root owns; before the fix
    root's export wrote through it.  Now the temporary name is unpredictable and
    created O_EXCL|O_NOFOLLOW, so the victim is untouched and the export lands."""
    opts, _ = store
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    plant_link(shared / "k.tmp", victim)
    cp = export(opts, "-o", str(shared / "k"))
    assert cp.returncode == 0, cp.stderr
    assert victim.read_text() == "root:secret\n"
    assert (shared / "k.tmp").is_symlink()
    assert (shared / "k").read_text() == expected(opts)
    assert names(shared) == ["k", "k.tmp"]  # no temporary file left either


@ROOT_ONLY
@pytest.mark.parametrize("owner", [NOBODY, 0], ids=["nobody's", "root's"])
def test_a_link_at_the_target_to_a_regular_file_is_refused_and_both_kept(
    store: tuple[list[str], FakeTree], shared: Path, tmp_path: Path, owner: int
) -> None:
    opts, _ = store
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    plant_link(shared / "k", victim, owner)
    cp = export(opts, "-o", str(shared / "k"))
    refused(cp, str(shared / "k"), "symbolic link")
    assert victim.read_text() == "root:secret\n"
    assert (shared / "k").is_symlink() and os.readlink(shared / "k") == str(victim)
    assert names(shared) == ["k"]


@ROOT_ONLY
def test_another_users_link_to_a_device_is_not_followed(
    store: tuple[list[str], FakeTree], shared: Path, tmp_path: Path
) -> None:
    """Even to a device: a link is followed only when root or the caller owns it."""
    opts, _ = store
    dev = tmp_path / "null"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    plant_link(shared / "k", dev)
    refused(export(opts, "-o", str(shared / "k")), "owned by uid 65534")
    assert stat.S_ISCHR(dev.lstat().st_mode)


def test_a_dangling_link_is_refused_and_nothing_is_created(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, _ = store
    d = tmp_path / "out"
    d.mkdir()
    (d / "k").symlink_to(tmp_path / "not-yet")
    refused(export(opts, "-o", str(d / "k")), "symbolic link to nothing")
    assert not (tmp_path / "not-yet").exists()
    assert names(d) == ["k"]


# -- written in place ---------------------------------------------------------------------


@ROOT_ONLY
def test_a_character_device_stays_a_device(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    """``-o /dev/null`` as root once replaced the machine's /dev/null with a file; the
    same device (1,3) made here takes the write and stays a character device."""
    opts, _ = store
    dev = tmp_path / "null"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    cp = export(opts, "-o", str(dev))
    assert cp.returncode == 0, cp.stderr
    st = dev.lstat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert names(tmp_path) == ["null", "root", "state"]


@ROOT_ONLY
def test_roots_own_link_to_a_device_is_followed(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    """What /dev/stdin-style links are: root's, ending at a device."""
    opts, _ = store
    dev = tmp_path / "null"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    plant_link(tmp_path / "alias", dev, 0)
    assert export(opts, "-o", str(tmp_path / "alias")).returncode == 0
    assert (tmp_path / "alias").is_symlink() and stat.S_ISCHR(dev.lstat().st_mode)


def test_a_fifo_is_fed_not_replaced(store: tuple[list[str], FakeTree], tmp_path: Path) -> None:
    """``-o >(gzip > k.gz)``: the reader gets the whole export; the FIFO stays a FIFO.
    The reader's end is open before kreldctl starts (else its open finds nobody)."""
    opts, _ = store
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got = bytearray()
    try:
        p = subprocess.Popen(
            [bin_path("kreldctl"), *opts, "export", "kallsyms", "-o", str(fifo)],
            stderr=subprocess.PIPE,
            text=True,
        )
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                chunk = b""
            got += chunk
            if not chunk:
                if p.poll() is not None:
                    break
                time.sleep(0.01)
        with contextlib.suppress(BlockingIOError):
            got += os.read(fd, 1 << 20)
        err = p.stderr.read() if p.stderr else ""
    finally:
        os.close(fd)
    assert p.returncode == 0, err
    assert bytes(got) == expected(opts).encode()
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_fifo_nobody_reads_is_a_named_error_not_a_hang(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, _ = store
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(export(opts, "-o", str(fifo)), "a FIFO that nobody reads")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_dev_stdout_and_dev_fd_write_through_kreldctls_own_descriptors(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    """``-o /dev/stdout`` with stdout redirected to a file (a link to a regular file
    by the rules above, so it is taken as the descriptor it names), and
    ``-o /dev/fd/N`` of an inherited pipe, as bash's process substitution gives."""
    opts, _ = store
    want = expected(opts)
    with open(tmp_path / "redirected", "wb") as f:
        cp = subprocess.run(
            [bin_path("kreldctl"), *opts, "export", "kallsyms", "-o", "/dev/stdout"],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert cp.returncode == 0, cp.stderr
    assert (tmp_path / "redirected").read_text() == want
    r, w = os.pipe()
    got: list[bytes] = []

    def drain() -> None:
        with os.fdopen(r, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=drain)
    t.start()
    p = subprocess.run(
        [bin_path("kreldctl"), *opts, "export", "kallsyms", "-o", f"/dev/fd/{w}"],
        pass_fds=(w,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.close(w)
    t.join(30)
    assert p.returncode == 0, p.stderr
    assert got == [want.encode()]
    refused(export(opts, "-o", "/dev/fd/999"), "descriptor 999 is not open")


# -- refused with nothing left ------------------------------------------------------------


def test_a_directory_a_missing_parent_and_a_trailing_slash_are_named_errors(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, _ = store
    d = tmp_path / "out"
    d.mkdir()
    refused(export(opts, "-o", str(d)), "refused as output: it is a directory")
    assert names(d) == []
    refused(export(opts, "-o", str(tmp_path / "nowhere" / "k")), "does not exist")
    refused(export(opts, "-o", f"{d}/"), "names a directory")
    (tmp_path / "plain").write_text("x")
    refused(export(opts, "-o", str(tmp_path / "plain" / "k")), "is not a directory")
    assert names(d) == []


def test_a_full_disk_is_a_named_error_the_old_file_kept_and_no_temporary_left(
    store: tuple[list[str], FakeTree],
) -> None:
    opts, _ = store
    with tiny_tmpfs("256k") as d:
        (d / "k").write_text("the previous export\n")
        fill(d)
        cp = export(opts, "-o", str(d / "k"))
        refused(cp, str(d / "k"), "No space left on device")
        assert (d / "k").read_text() == "the previous export\n"
        assert names(d) == ["filler", "k"]


def test_inject_takes_the_same_rules(store: tuple[list[str], FakeTree], tmp_path: Path) -> None:
    """The perf.data kreldctl inject writes: a link at the target refused, a new file
    0600 as perf writes its own, a full disk exit 8 with nothing left."""
    opts, tree = store
    src = PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release).write(
        tmp_path / "in.data"
    )
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "out.data").symlink_to(victim)
    cp = kreldctl(*opts, "inject", "-i", str(src), "-o", str(tmp_path / "out.data"), check=False)
    refused(cp, "symbolic link to a regular file")
    assert victim.read_text() == "keep\n"
    new = tmp_path / "new.data"
    kreldctl(*opts, "inject", "-i", str(src), "-o", str(new))
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    with tiny_tmpfs("128k") as d:
        fill(d)
        cp = kreldctl(*opts, "inject", "-i", str(src), "-o", str(d / "o.data"), check=False)
        refused(cp, "No space left on device")
        assert names(d) == ["filler"]


# -- the module's own rules ---------------------------------------------------------------


@pytest.fixture
def umask027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_file_gets_the_umask_and_a_replaced_one_keeps_its_mode(
    tmp_path: Path, umask027: None
) -> None:
    write_output(str(tmp_path / "new"), b"a\n")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o640
    old = tmp_path / "old"
    old.write_text("before\n")
    old.chmod(0o604)
    ino = old.stat().st_ino
    write_output(str(old), b"after\n")
    assert old.read_text() == "after\n" and stat.S_IMODE(old.stat().st_mode) == 0o604
    assert old.stat().st_ino != ino  # renamed over, not written through


def test_a_failure_inside_the_block_leaves_the_target_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "k"
    target.write_text("before\n")
    with pytest.raises(RuntimeError), safe_output(str(target)) as sink:
        sink.write(b"half")
        raise RuntimeError("the export failed half way")
    assert target.read_text() == "before\n" and names(tmp_path) == ["k"]


def test_a_hard_link_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    """A hard link to a file elsewhere (where protected_hardlinks allows one) keeps
    its other name's contents: the rename replaces the name, never the inode."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("theirs\n")
    os.link(elsewhere, tmp_path / "k")
    write_output(str(tmp_path / "k"), b"ours\n")
    assert elsewhere.read_text() == "theirs\n" and (tmp_path / "k").read_text() == "ours\n"


@pytest.fixture
def public() -> Iterator[Path]:
    """A sticky world-writable directory nobody can reach (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="kreld-sticky-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@ROOT_ONLY
def test_nobody_cannot_replace_roots_file_in_a_sticky_directory(public: Path) -> None:
    """The sticky bit's rule holds: nobody's write is refused by name, root's file and
    the directory are as they were."""
    shared = public
    (shared / "k").write_text("root's\n")
    code = (
        "import sys\n"
        "from kreld.core.errors import OutputError\n"
        "from kreld.core.safeout import write_output\n"
        "try:\n"
        f"    write_output({str(shared / 'k')!r}, b'nobody\\n')\n"
        "except OutputError as e:\n"
        "    print(e); sys.exit(8)\n"
    )
    cp = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable],
        input=code,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert cp.returncode == 8, (cp.stdout, cp.stderr)
    assert "cannot put it in place" in cp.stdout
    assert (shared / "k").read_text() == "root's\n" and names(shared) == ["k"]


def test_no_name_and_a_nul_are_refused() -> None:
    for bad in ("", "a\0b"):
        with pytest.raises(OutputError, match="not a file name"):
            write_output(bad, b"x")
