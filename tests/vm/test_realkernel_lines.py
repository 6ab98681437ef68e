"""kreld on a real kernel (tests/vm/conftest.py boots it): source lines of the
recorded boot from Debian's -dbg files on the host, equal to llvm-symbolizer's
and eu-addr2line's."""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from support import harness
from support.linerefs import eu, instructions, llvm
from support.realboot import Boot
from support.realkernel import addr, host_ctl

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


# -- 5. source lines of the recorded boot, from Debian's -dbg files on the host ---------------

DBG = Path("/var/cache/kreld-vm/dbg/usr/lib/debug")
BRD_TEXT = (".text", ".text.unlikely", ".init.text", ".exit.text")


@pytest.fixture(scope="module")
def debuginfo_dir(second: Boot, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A debuginfo dir in Debian's layout holding the -dbg vmlinux and brd.ko
    and nothing else (hard links to scripts/setup-vm's extracted copies)."""
    release = second.facts.release
    files = {
        f"boot/vmlinux-{release}": DBG / f"boot/vmlinux-{release}",
        f"lib/modules/{release}/kernel/drivers/block/brd.ko":
            DBG / f"lib/modules/{release}/kernel/drivers/block/brd.ko",
    }  # fmt: skip
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        pytest.skip(f"no -dbg files (scripts/setup-vm extracts them): {missing}")
    root = tmp_path_factory.mktemp("debuginfo")
    for rel, src in files.items():
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    return root


def _spread(values: list[int], n: int) -> list[int]:
    return values[:: max(1, len(values) // n)][:n]


def test_lines_of_the_image_and_of_each_brd_text_section_equal_the_references(
    second: Boot, state: Path, debuginfo_dir: Path
) -> None:
    """The second boot loaded brd (its sysfs sections copied), unloaded it,
    and stopped.  ``kreldctl resolve --lines --json --boot B --at T --debuginfo-dir DIR`` on
    the host, T the time brd was loaded: every frame (function, file, line,
    innermost first) of addresses spread over the kernel image equals
    ``llvm-symbolizer --inlines`` on vmlinux at the address minus the KASLR
    offset, and over each of brd's text sections equals ``eu-addr2line -i -f
    -j SECTION -e brd.ko OFFSET``, at the bases the guest's sysfs showed.
    Where only the DWARF line program covers the code (assembly such as
    ``irq_entries_start``) kreld gives the reference's function without a
    line: at most 1 %, never a wrong line (kreld/debuginfo/lines.py says why)."""
    from kreld.debuginfo.lines_reloc import symbol_value  # the checkout's code as it is now

    f = second.facts
    brd = second.incs("brd")[0]
    assert brd["unloaded"] is not None, brd
    bases = f.module("brd").sections
    assert {k: addr(v) for k, v in brd["sections"].items()} == bases
    vmlinux = debuginfo_dir / f"boot/vmlinux-{f.release}"
    ko = debuginfo_dir / f"lib/modules/{f.release}/kernel/drivers/block/brd.ko"
    with open(vmlinux, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        link_text = symbol_value(m, str(vmlinux), "_text")
    assert link_text is not None
    slide = f.anchors["_text"] - link_text
    image = _spread(list(range(link_text + 0x1000, f.anchors["_etext"] - slide, 4099)), 300)
    code = instructions(ko)
    assert set(BRD_TEXT) <= set(code) <= set(bases), sorted(code)
    picks = [(s, o) for s in BRD_TEXT for o in _spread(code[s], 60)]
    addresses = [a + slide for a in image] + [bases[s] + o for s, o in picks]
    t = str(brd["loaded"]["monotonic"])
    cp = host_ctl(state, "resolve", "--lines", "--json", "--boot", f.boot_id, "--at", t,
                  "--debuginfo-dir", str(debuginfo_dir), *map(hex, addresses),
                  timeout=600)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    got = json.loads(cp.stdout)
    refs = llvm(vmlinux, image)
    for sec in BRD_TEXT:
        refs += eu(ko, sec, [o for s, o in picks if s == sec])
    where = [("kernel", hex(a)) for a in image] + [(s, hex(o)) for s, o in picks]
    compared, by_section, wrong, no_line = 0, Counter[str](), [], 0
    for w, ans, ref in zip(where, got, refs, strict=True):
        if not ref or ref[0][0] in ("", "??"):
            continue  # padding between functions: no reference names it
        ours = [(fr["function"], fr["file"], fr["line"]) for fr in ans.get("frames", [])]
        compared += 1
        by_section[w[0]] += 1
        if ours == [(fn, p, n) for fn, p, n, _ in ref]:
            continue
        if len(ref) == 1 and ref[0][2] > 0 and ours == [(ref[0][0], None, 0)]:
            no_line += 1  # only the line program covers it (assembly): the name, no line
            continue
        wrong.append(f"{w}: kreld {ours or ans.get('no_lines')} reference {ref}")
    assert not wrong, f"{len(wrong)} of {compared} differ:\n" + "\n".join(wrong[:20])
    assert no_line * 100 <= compared, (no_line, compared)
    assert by_section["kernel"] >= 250 and all(by_section[s] >= 5 for s in BRD_TEXT), by_section
