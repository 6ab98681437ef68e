"""The DWARF reader's process and its bounds, on files gcc builds here: a
reader past its memory bound (``RLIMIT_AS``) or its deadline is a named
:class:`LineTableError`, and the process that asked goes on building."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kreld.core.errors import LineTableError
from kreld.debuginfo import lines_spawn
from kreld.debuginfo.lines_build import build_line_table

SRC = Path(__file__).parent / "lines_src"
BOUND = 64 << 20

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("objcopy") is None,
    reason="gcc or objcopy is not installed",
)


def _executable(out: Path, pad: int = 0) -> Path:
    """prog.c linked; with *pad* bytes of a non-allocated section beside its
    DWARF, which the reader maps with the rest of the file."""
    subprocess.run(["gcc", "-g", "-O2", "-o", str(out), "prog.c"], cwd=SRC, check=True)
    if pad:
        blob = out.with_suffix(".pad")
        with open(blob, "wb") as f:
            f.truncate(pad)
        subprocess.run(["objcopy", f"--add-section=.kreld_pad={blob}", str(out)], check=True)
        blob.unlink()
    return out


def test_a_reader_over_its_memory_bound_is_named_and_the_next_build_is_not_hurt(
    tmp_path: Path,
) -> None:
    big = _executable(tmp_path / "big", pad=2 * BOUND)
    with pytest.raises(LineTableError) as e:
        build_line_table(big, bound=BOUND)
    assert e.value.path == str(big)
    assert e.value.reason == (
        "the DWARF reader went over its memory bound of 64 MiB ([kernel] line_build_memory)"
    )
    # The same program without the padding builds under the same bound; the
    # reader's peak is said, and is its own (this process's is not in it).
    table = build_line_table(_executable(tmp_path / "small"), bound=BOUND)
    assert table.frames(int(table.starts[len(table.starts) // 2]) + table.base)
    assert 0 < table.reader_peak_rss < BOUND


def test_a_reader_past_its_deadline_is_killed_and_named(tmp_path: Path) -> None:
    exe = _executable(tmp_path / "prog")
    reading = lines_spawn.start(str(exe), "prog")
    with pytest.raises(LineTableError, match=r"the DWARF reader took over 0 s: killed"):
        reading.finish(timeout=0)
    assert reading.proc.returncode is not None  # reaped, not left a zombie


def test_a_file_the_reader_refuses_is_named_with_its_reason(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x7fELF" + b"\0" * 200)
    reading = lines_spawn.start(str(junk), "junk")
    with pytest.raises(LineTableError) as e:
        reading.finish()
    assert e.value.path == "junk" and e.value.reason
    assert "memory" not in e.value.reason and "status" not in e.value.reason


@pytest.mark.skipif(
    shutil.which("python3", path="/usr/bin") is None
    or subprocess.run(["/usr/bin/python3", "-c", "import symbolic"], capture_output=True).returncode
    == 0,
    reason="needs a python3 without symbolic",
)
def test_a_reader_without_symbolic_says_so(tmp_path: Path) -> None:
    """The reader's process run by a Python that lacks the reader: refused,
    naming what to install, not a traceback."""
    from kreld.debuginfo import lines_child

    exe = _executable(tmp_path / "prog")
    cp = subprocess.run(["/usr/bin/python3", "-I", lines_child.__file__, str(exe), str(BOUND)],
                        capture_output=True, text=True)  # fmt: skip
    assert cp.returncode == lines_child.EXIT_REFUSED
    assert cp.stderr.startswith("symbolic is not installed (kreld's [lines] extra): ")
    assert cp.stdout == ""
