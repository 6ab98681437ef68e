"""kreld following modules by the module tracepoints on a real kernel: the
Debian cloud kernels 6.1 and 6.12 under QEMU (tests/support/harness.py;
``KRELD_VM_KERNEL`` picks the 6.1 one), one boot each running
tests/vm/guest_modevents.sh.

* A module of the test's own (tests/vm/slowinit, built here against the
  guest's headers: ``linux-headers-<release>``) whose init spins 2 s in its
  own ``.init.text``: its load is recorded before its init ended, and the
  samples a per-task ``perf record -k monotonic`` of insmod took there, which
  the guest's own perf leaves ``[unknown]`` (init text is freed when perf
  script runs), are named by ``kreldctl symbolize --for`` and, through
  ``inject``'s KSYMBOL records for the init functions, by perf script.
* ``dummy`` loaded and unloaded while kreld starts at kptr_restrict=2 (the
  kernel's tables read in kcore) with a vmlinux to read: recorded with both
  times, each exact.

Opt-in (``-m realkernel``); skips with the reason where QEMU, vng, the kernel
or its headers are missing (``scripts/setup-vm`` installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bigvmlinux

from kreld.core.model import Incarnation

from support import harness

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(1200)]

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest_modevents.sh"
CTL = Path(sys.executable).parent / "kreldctl"
# In the vmlinux-like ELF, its anchors last.  kreld's start under emulation is
# slow by its reading of the kernel's tables in kcore at kptr_restrict=2 (some
# 40 s), where dummy comes and goes in 1 s; the ELF's anchors are found without
# decoding the other symbols (150,000 took pyelftools 265 s here).
_SYMBOLS = 20_000
# The init function and its alias: module_init() names it init_module too, at
# the same address (a .ko's table may keep either).
INIT_NAMES = ("slowinit_init", "init_module")
_FRAME = re.compile(r"^\s*\S.*?\s([0-9a-f]{16}) (\S+) \((\S+)\)$")


class Guest(NamedTuple):
    out: Path
    rw: Path
    boot_id: str
    times: dict[str, int]


def _kernel(series: str) -> Path | None:
    """6.1: the default kernel (``KRELD_VM_KERNEL`` may pick another); 6.12 by series."""
    return harness.find_kernel(None if series == "6.1" else series)


def _build_module(release: str, dest: Path) -> Path:
    headers = Path(f"/usr/src/linux-headers-{release}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in (HERE / "slowinit").iterdir():
        shutil.copy(f, dest / f.name)
    cp = subprocess.run(
        ["make", "-s", "-C", str(headers), f"M={dest}", "modules"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    return dest / "slowinit.ko"


@pytest.fixture(scope="module", params=["6.1", "6.12"])
def guest(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Guest:
    kernel = _kernel(request.param)
    release = None if kernel is None else harness.kernel_release(kernel)
    why = None
    if release is None:
        why = f"no /boot/vmlinuz-{request.param}.*cloud* installed: run scripts/setup-vm"
    elif not Path(f"/usr/src/linux-headers-{release}/Makefile").exists():
        why = f"no linux-headers-{release} to build a module against"
    elif harness.real_system_map(release) is None:
        why = f"no real System.map-{release} in {harness.SYSMAP_DIR}"
    harness.skip_unless_selected(request.config.getoption("markexpr"), why)
    assert release is not None
    keep = os.environ.get("KRELD_VM_DIR")
    rw = (
        Path(keep).resolve() / f"modevents-{request.param}"
        if keep
        else tmp_path_factory.mktemp(f"vm-modevents-{request.param}")
    )
    rw.mkdir(parents=True, exist_ok=True)
    out = rw / "facts"
    if not (os.environ.get("KRELD_VM_REUSE") and (out / "done").exists()):
        for d in (out, rw / "state", rw / "state-start", rw / "debug"):
            shutil.rmtree(d, ignore_errors=True)
        ko = _build_module(release, rw / "mod")
        sysmap = harness.real_system_map(release)
        assert sysmap is not None
        big = rw / "bigvmlinux"
        at = bigvmlinux.make(sysmap, big, _SYMBOLS)
        env = {
            "OUT": str(out), "MODDIR": str(ko.parent), "BIGVMLINUX": str(big),
            "BUILD_ID_AT": str(at),
        }  # fmt: skip
        run = harness.run_in_guest(
            f"sh {GUEST}", rw, timeout=900, env=env, name="modevents", kernel=kernel
        )
        logs = "".join(
            f"\n{p.name} tail:\n{p.read_text()[-3000:]}" for p in sorted(out.glob("kreld*.log"))
        )
        assert run.status == 0, (
            f"guest_modevents.sh exited {run.status} after {run.elapsed:.1f}s\n"
            f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}{logs}"
        )
        print(f"[realkernel] modevents boot: {run.elapsed:.1f}s", file=sys.stderr)
    for name in ("start", "main"):
        assert (out / f"kreld-{name}.rc").read_text().strip() == "0"
    times = {k: int(v) for k, v in (ln.split() for ln in (out / "times").read_text().splitlines())}
    return Guest(out, rw, (out / "boot_id").read_text().strip(), times)


def ctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(
        [str(CTL), "--config", str(harness.REPO / "etc/kreld/kreld.toml"), *args],
        input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cp.returncode == 0, f"kreldctl {' '.join(args)} -> {cp.returncode}\n{cp.stderr}"
    return cp


def incarnations(state: Path, boot_id: str, name: str) -> list[Incarnation]:
    reply = json.loads(ctl("--state-dir", str(state), "modules", "--all", "--boot", boot_id,
                           "--json").stdout)  # fmt: skip
    rows: list[dict[str, Any]] = reply["modules"] if isinstance(reply, dict) else reply
    return [Incarnation.from_json(m) for m in rows if m["name"] == name]


def test_the_tracepoints_are_opened_in_the_guest_and_status_says_they_follow(guest: Guest) -> None:
    st = json.loads((guest.out / "status.json").read_text())
    by = {f["name"]: f for f in st["module_followers"]}
    assert by["tracepoint"]["following"], by["tracepoint"]
    assert by["watch-poll"]["interval_s"] == 60.0  # events flow: the look is only a safety net


def test_a_module_whose_init_runs_2_s_is_recorded_as_loaded_before_its_init_ended(
    guest: Guest,
) -> None:
    (inc,) = incarnations(guest.rw / "state", guest.boot_id, "slowinit")
    t = guest.times
    assert inc.seen_by.value == "tracepoint" and inc.init_live
    loaded = inc.loaded.monotonic
    assert t["insmod_start"] < loaded < t["insmod_done"]
    # The init spins 2 s after the load, so the load is 1.5 s at least before insmod returned.
    assert loaded + 1_500_000_000 < t["insmod_done"], (loaded, t["insmod_done"])
    assert inc.loaded_after == inc.loaded  # exact: no interval
    assert ".init.text" in inc.state.sections  # read at once, before init ended
    assert inc.unloaded is not None and inc.unload_seen_by is not None
    assert inc.unload_seen_by.value == "tracepoint"


def _init_range(guest: Guest) -> tuple[int, int]:
    (inc,) = incarnations(guest.rw / "state", guest.boot_id, "slowinit")
    base = inc.state.sections[".init.text"]
    return base, base + (inc.state.initsize or 1 << 16)


def host_perf(*args: str, scratch: Path) -> str:
    """perf on the host as a user runs it with kreld's export: an empty --symfs
    and a HOME with no build-id cache."""
    perf = shutil.which("perf")
    if perf is None:
        pytest.skip("perf is not installed on the host (Debian package linux-perf)")
    (scratch / "empty").mkdir(parents=True, exist_ok=True)
    (scratch / "home").mkdir(exist_ok=True)
    cp = subprocess.run(
        [perf, *args, f"--symfs={scratch}/empty"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "HOME": str(scratch / "home")},
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def test_symbolize_for_names_the_init_samples_the_recording_left_unknown(
    guest: Guest, tmp_path: Path
) -> None:
    """slowinit was loaded after the recording started: with the kallsyms of
    its start (export --for) perf script leaves its init samples [unknown]
    (the guest's own perf, after init, gives them a neighbour's name), and
    symbolize --for names each one by the init function."""
    state, data = str(guest.rw / "state"), guest.out / "perf-init.data"
    ks = tmp_path / "kallsyms"
    ctl("--state-dir", state, "export", "kallsyms", "--for", str(data), "-o", str(ks))
    script = host_perf("script", "-i", str(data), f"--kallsyms={ks}", scratch=tmp_path)
    lo, hi = _init_range(guest)
    lines = script.splitlines(keepends=True)
    inside = {
        i
        for i, ln in enumerate(lines)
        if (m := _FRAME.match(ln.rstrip("\n"))) and lo <= int(m[1], 16) < hi
    }
    assert len(inside) >= 20, f"only {len(inside)} samples in slowinit's init text"
    assert all("[unknown]" in lines[i] for i in inside)
    cp = ctl("--state-dir", state, "symbolize", "--for", str(data), stdin=script)
    out = cp.stdout.splitlines(keepends=True)
    assert len(out) == len(lines)
    for i in inside:
        named = re.search(r" (\w+)\+0x[0-9a-f]+ \(\[slowinit\]\)$", out[i].rstrip("\n"))
        assert named and named[1] in INIT_NAMES, out[i]
    print(f"[realkernel] {len(inside)} init samples named by symbolize --for", file=sys.stderr)


def test_inject_names_the_init_samples_by_the_init_functions(guest: Guest, tmp_path: Path) -> None:
    """inject registers each of slowinit's init functions as code of its own
    (KSYMBOL) while its init ran: perf script of its output names the init
    samples by them, where the recording alone leaves them [unknown]."""
    state, data = str(guest.rw / "state"), guest.out / "perf-init.data"
    out = tmp_path / "injected.data"
    ctl("--state-dir", state, "inject", "-i", str(data), "-o", str(out))
    ks = tmp_path / "kallsyms"
    ctl("--state-dir", state, "export", "kallsyms", "--for", str(out), "-o", str(ks))
    script = host_perf("script", "-i", str(out), "-F", "ip,sym", f"--kallsyms={ks}",
                       scratch=tmp_path)  # fmt: skip
    lo, hi = _init_range(guest)
    named = [
        ln.split()[1] if len(ln.split()) > 1 else "[unknown]"
        for ln in script.splitlines()
        if ln.split()
        and re.fullmatch(r"[0-9a-f]+", ln.split()[0])
        and lo <= int(ln.split()[0], 16) < hi
    ]
    assert len(named) >= 20, f"only {len(named)} samples in slowinit's init text"
    assert all(n in INIT_NAMES for n in named), sorted(set(named))
    print(f"[realkernel] {len(named)} init samples named by inject", file=sys.stderr)


def test_a_module_loaded_and_unloaded_while_kreld_starts_is_recorded_with_both_times(
    guest: Guest,
) -> None:
    t = guest.times
    assert (guest.out / "startup.txt").read_text().strip() == "starting", (
        "kreld was ready before dummy came and went: the start was too quick to show anything"
    )
    (inc,) = incarnations(guest.rw / "state-start", guest.boot_id, "dummy")
    assert inc.seen_by.value == "tracepoint" and inc.unload_seen_by is not None
    assert inc.unload_seen_by.value == "tracepoint"
    assert inc.unloaded is not None
    assert t["tracepoints_open"] < inc.loaded.monotonic < t["dummy_loaded"]
    assert t["dummy_loaded"] < inc.unloaded.monotonic < t["dummy_unloaded"] < t["kreld_ready"]
    assert inc.unloaded_after == inc.unloaded  # exact
