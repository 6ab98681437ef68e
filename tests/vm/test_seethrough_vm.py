"""kptr_restrict=2 seen through on a real kernel.

One boot of Debian's cloud kernel (tests/vm/guest_restricted.sh): kreld starts
at kernel.kptr_restrict=2, where /proc/kallsyms and /sys/module/*/sections show
zeros to root too; dummy and brd load while it runs, dummy unloads; then
kptr_restrict goes back to 0 and the guest copies what the kernel shows.  Here,
on the host, kreld's store is held to that truth.  A perf recording
taken at kptr_restrict=2 (where perf writes no kernel map) is injected and
reported on the host, and must equal its live report at 0.  In the same boot kreld runs
again without CAP_SYS_RAWIO, and must record the boot restricted, with the
reason and no address; and once more started at kptr_restrict=0, which is
then raised to 2 for a load and lowered again for another.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import harness
from support.realkernel import addr, anchors_of, ctl, host_ctl

GUEST_SCRIPT = Path(__file__).resolve().parent / "guest_restricted.sh"
BOOT_TIMEOUT = 420.0

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guest's facts; KRELD_VM_DIR=DIR keeps them (under DIR/restricted)."""
    keep = os.environ.get("KRELD_VM_DIR")
    rw = Path(keep).resolve() / "restricted" if keep else tmp_path_factory.mktemp("vm-restricted")
    shutil.rmtree(rw, ignore_errors=True)
    rw.mkdir(parents=True)
    kernel = harness.find_kernel()
    sysmap = harness.real_system_map(harness.kernel_release(kernel)) if kernel else None
    if sysmap is None:
        pytest.skip("no real System.map: run scripts/setup-vm")
    facts = rw / "facts"
    run = harness.run_in_guest(
        f"sh {GUEST_SCRIPT}",
        rw,
        timeout=BOOT_TIMEOUT,
        env={"OUT": str(facts), "STATE": str(rw / "state"), "SYSMAP": str(sysmap)},
        name="restricted",
    )
    log = facts / "kreld.log"
    tail = log.read_text()[-4000:] if log.exists() else "(no kreld.log)"
    assert run.status == 0, (
        f"guest_restricted.sh exited {run.status} after {run.elapsed:.1f}s\n"
        f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}\nkreld.log tail:\n{tail}"
    )
    assert (facts / "kreld.rc").read_text().strip() == "0", tail
    yield facts
    if not keep:
        shutil.rmtree(rw, ignore_errors=True)


def boot_id(out: Path) -> str:
    return (out / "boot_id").read_text().strip()


def kallsyms(path: Path) -> list[tuple[int, str, str]]:
    lines = []
    for line in path.read_text().splitlines():
        f = line.split(None, 2)
        lines.append((int(f[0], 16), f[1], f[2]))
    return lines


def sections(path: Path) -> dict[str, int]:
    return {n: int(a, 16) for n, a in (line.split() for line in path.read_text().splitlines())}


def store(out: Path, *args: str) -> Any:
    return ctl(out.parent / "state", *args, as_boot=boot_id(out))


def test_the_guest_really_hid_every_pointer(out: Path) -> None:
    """The premise: at kptr_restrict=2 kallsyms and sysfs showed zeros to root."""
    assert (out / "kallsyms.head-at-2").read_text().startswith("0000000000000000 ")
    assert int((out / "dummy.text-at-2").read_text(), 16) == 0


def test_the_boot_record_has_the_kernels_text_from_kernel_memory(out: Path) -> None:
    boot = store(out, "show", boot_id(out))
    truth = {n: a for a, _t, n in kallsyms(out / "kallsyms") if n in ("_text", "_stext", "_etext")}
    assert boot["restricted"] is False and boot["address_source"] == "kcore"
    got = anchors_of(boot)
    assert all(got[n] == a for n, a in truth.items()), (got, truth)
    assert boot["kaslr_source"] == "vmcoreinfo"
    assert addr(boot["kaslr_offset"]) == truth["_text"] - 0xFFFFFFFF81000000
    status = json.loads((out / "status.json").read_text())
    assert status["address_source"] == "kcore" and status["restricted"] is False


def test_every_section_of_every_module_is_the_kernels_init_ones_included(out: Path) -> None:
    mods = store(out, "modules", "--boot", boot_id(out), "--all")
    by_name = {m["name"]: m for m in mods}
    for name in ("dummy", "brd"):
        m = by_name[name]
        truth = sections(out / f"{name}.sections")
        assert any(s.startswith(".init") for s in truth)
        got = {k: int(v, 16) for k, v in m["sections"].items()}
        assert got == truth, name
        assert m["address_source"] == "kcore" and m["restricted"] is False
    assert by_name["dummy"]["unloaded"] is not None and by_name["brd"]["unloaded"] is None
    # The modules loaded at the start, too: each core base is the one /proc/modules shows.
    proc = {
        f[0]: int(f[5], 16)
        for f in (line.split() for line in (out / "modules").read_text().splitlines())
    }
    live = [m for m in mods if m["unloaded"] is None]
    assert {m["name"]: addr(m["core_base"]) for m in live} == proc
    assert all(m["address_source"] == "kcore" for m in live)


def test_exported_kernel_lines_equal_the_kernels_own(out: Path) -> None:
    """export kallsyms (kernel lines from System.map moved by KERNELOFFSET, in
    kallsyms' own order and names) equals /proc/kallsyms at kptr_restrict=0."""
    truth = [x for x in kallsyms(out / "kallsyms") if "\t[" not in x[2]]
    got = [x for x in kallsyms(out / "export") if "\t[" not in x[2]]
    assert got == truth


def test_exported_module_lines_and_the_whole_file_equal_the_kernels_own(out: Path) -> None:
    """Each module's lines come from its own symbol table in kernel memory
    (``mod->kallsyms``; kallsyms names them with zero addresses at 2): module
    lines, brd's among them, and so the whole export, equal /proc/kallsyms at
    kptr_restrict=0 line for line, per-cpu offsets and exported letters too."""
    truth = (out / "kallsyms").read_text().splitlines()
    export = (out / "export").read_text().splitlines()
    assert any(line.endswith("\t[brd]") for line in export), "no brd line exported"
    assert [x for x in export if "\t[" in x] == [x for x in truth if "\t[" in x]
    assert export == truth
    log = (out / "kreld.log").read_text()
    assert '"module": "brd"' in log and '"source": "kcore"' in log


def test_without_cap_sys_rawio_the_boot_is_restricted_with_the_reason_and_no_address(
    out: Path,
) -> None:
    capeff = int((out / "norawio.capeff").read_text().split()[1], 16)
    assert not capeff >> 17 & 1, "kreld still had CAP_SYS_RAWIO"
    state = out.parent / "state-norawio"
    boot = ctl(state, "show", boot_id(out), as_boot=boot_id(out))
    assert boot["restricted"] is True and boot["address_source"] is None
    assert "kernel.kptr_restrict=2" in boot["restricted_reason"]
    assert "CAP_SYS_RAWIO" in boot["restricted_reason"]
    mods = ctl(state, "modules", "--boot", boot_id(out), "--all", as_boot=boot_id(out))
    text = json.dumps([boot, mods])
    assert not re.search(r'"0x[0-9a-f]{8,}"', text.replace(boot["kaslr_offset"] or "-", "")), text[
        :2000
    ]
    assert any(m["name"] == "veth" and m["restricted"] for m in mods)


def test_pointers_hidden_after_the_start_are_read_in_kernel_memory_then_in_sysfs_again(
    out: Path,
) -> None:
    """kreld started at kptr_restrict=0 (sysfs); raised to 2, veth's load (zeros
    in sysfs) has every section the kernel shows at 0, read in kernel memory
    opened then; lowered to 0, dummy's load is read in sysfs again."""
    assert int((out / "veth.text-at-2").read_text(), 16) == 0
    assert (out / "kreld-raised.rc").read_text().strip() == "0"
    state = out.parent / "state-raised"
    boot = ctl(state, "show", boot_id(out), as_boot=boot_id(out))
    assert boot["restricted"] is False and boot["address_source"] == "kallsyms"
    mods = ctl(state, "modules", "--boot", boot_id(out), "--all", as_boot=boot_id(out))
    by_name = {m["name"]: m for m in mods}
    for name, truth, source in (
        ("veth", "veth.sections", "kcore"),
        ("dummy", "dummy-lowered.sections", "sysfs"),
    ):
        m = by_name[name]
        assert {k: int(v, 16) for k, v in m["sections"].items()} == sections(out / truth), name
        assert m["address_source"] == source and m["restricted"] is False, name
    log = (out / "kreld-raised.log").read_text()
    events = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    opened = [e for e in events if e.get("event") == "kernel_memory"]
    assert len(opened) == 1 and opened[0]["system_map"], opened


def _perf_report(data: Path, kallsyms: Path, empty: Path, home: Path, flat: bool) -> list[str]:
    opts = ["--no-children", "--sort", "dso,sym", "-g", "none"] if flat else []
    cp = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", f"--symfs={empty}",
         f"--kallsyms={kallsyms}", *opts],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "HOME": str(home)},
    )  # fmt: skip
    return _report_lines(cp.stdout)


def _report_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_perf_report_of_a_recording_at_2_injected_equals_the_live_report_at_0(
    out: Path, tmp_path: Path
) -> None:
    """perf at kptr_restrict=2 wrote no kernel map.  On the host, ``kreldctl
    inject`` (the boot told by the recording's clock data) and ``perf report
    --symfs=<empty> --kallsyms=<export --for OUT>`` give, line for line, the
    report the guest made of the same recording at 0 with perf's own kernel maps
    and /proc/kallsyms, call graphs included; kernel samples named, and samples
    in the maps of several modules loaded at the start (virtio's, fuse's; brd's
    own code takes too few samples under emulation to count on)."""
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed on the host")
    src = out / "perf-at-2.data"
    state = out.parent / "state"
    injected, ks, empty = tmp_path / "out.data", tmp_path / "kallsyms", tmp_path / "empty"
    empty.mkdir()
    for args in (("inject", "-i", str(src), "-o", str(injected)),
                 ("export", "kallsyms", "--for", str(injected), "-o", str(ks))):  # fmt: skip
        cp = host_ctl(state, *args, timeout=300)
        assert cp.returncode == 0, cp.stderr
    blind = _perf_report(src, out / "kallsyms", empty, tmp_path, True)
    assert not [ln for ln in blind if "[kernel.kallsyms]" in ln or "[brd]" in ln], blind[:20]
    for kind, flat in (("flat", True), ("graph", False)):
        live = _report_lines((out / f"report-live-{kind}.txt").read_text())
        ours = _perf_report(injected, ks, empty, tmp_path, flat)
        assert ours == live, "\n".join(
            f"{a!r} | {b!r}" for a, b in zip(live, ours, strict=False) if a != b
        )[:3000]
        if flat:  # named kernel samples, and samples named in several modules' maps
            kernel = [ln for ln in live if "[kernel.kallsyms]" in ln and "[k] 0x" not in ln]
            modules = {
                m.group(1)
                for ln in live
                if (m := re.search(r"\[(\w+)\]\s+\[k\] [A-Za-z_]", ln)) and m.group(1) != "kernel"
            }
            assert len(kernel) >= 10 and len(modules) >= 3, live[:30]
