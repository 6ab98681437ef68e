"""kreld restarted by systemd when one of its threads fails: the Debian cloud
kernel under QEMU (tests/support/harness.py), one boot running
tests/vm/guest_supervised.sh.

In the guest kreld runs as a transient ``Type=notify`` unit with
``WatchdogSec=`` and ``Restart=on-failure`` under a real systemd manager
(root's user manager: vng's init is not systemd), its module tracepoints' and
uevent threads made to raise by the fault hook (``KRELD_TEST_FAULTS`` with
``KRELD_TEST=1``; these two threads need a real kernel's event sources, which
the fault suite's fake trees have not).  Status names what failed while
degraded, the log holds each failure once with its traceback, the watchdog's
silence makes systemd restart the service (``NRestarts`` 1 or more, a new
``MainPID``), the restarted daemon answers and is healthy, and the module
loaded before the fault is still in the store.  (The user manager starts only
where /run/systemd/system exists, as sd_booted(3) asks: the guest makes it.)

Opt-in (``-m realkernel``); skips with the reason where QEMU, vng or the
kernel are missing (``scripts/setup-vm`` installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from support import harness

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(1200)]

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest_supervised.sh"
FAULTS = ("module-tracepoints", "uevent")


def _show(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@pytest.fixture(scope="module")
def facts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    harness.skip_unless_selected(request.config.getoption("markexpr"))
    keep = os.environ.get("KRELD_VM_DIR")
    rw = Path(keep).resolve() / "supervised" if keep else tmp_path_factory.mktemp("vm-supervised")
    rw.mkdir(parents=True, exist_ok=True)
    out = rw / "facts"
    if not (os.environ.get("KRELD_VM_REUSE") and (out / "done").exists()):
        shutil.rmtree(out, ignore_errors=True)
        env = {"OUT": str(out), "FAULTS": ",".join(FAULTS)}
        run = harness.run_in_guest(f"sh {GUEST}", rw, timeout=900, env=env, name="supervised")
        logs = "".join(
            f"\n{p.name} tail:\n{p.read_text(errors='replace')[-3000:]}"
            for p in (out / "kreld.log", out / "manager.log")
            if p.exists()
        )
        assert run.status == 0, (
            f"guest_supervised.sh exited {run.status} after {run.elapsed:.1f}s\n"
            f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}{logs}"
        )
        print(f"[realkernel] supervised boot: {run.elapsed:.1f}s", file=sys.stderr)
    return out


def test_a_failed_thread_is_named_in_status_while_degraded(facts: Path) -> None:
    status = json.loads((facts / "status-degraded.json").read_text())
    named = {f["name"]: f["reason"] for f in status["degraded"]}
    assert set(named) & set(FAULTS), named
    assert all("InjectedFault" in r for r in named.values()), named


def test_each_failure_is_logged_once_with_its_traceback(facts: Path) -> None:
    events = _events(facts / "kreld.log")
    readies = [i for i, e in enumerate(events) if e.get("event") == "ready"]
    assert len(readies) >= 2, "started, then restarted"
    first_run = events[: readies[1]]
    failed = [e for e in first_run if e.get("event") == "supervised_failed"]
    names = [e["name"] for e in failed]
    assert len(names) == len(set(names)), names
    assert set(names) & set(FAULTS), names
    assert all("InjectedFault" in e["traceback"] for e in failed)
    assert any(e.get("event") == "watchdog_withheld" for e in first_run)


def test_systemd_restarts_the_service_on_the_watchdogs_silence(facts: Path) -> None:
    before, after = _show(facts / "show-before"), _show(facts / "show-after")
    assert int(after["NRestarts"]) >= 1
    assert after["MainPID"] not in ("0", before["MainPID"])
    assert before["Type"] == "notify" and before["WatchdogUSec"] != "0"


def test_the_restarted_daemon_serves_healthy(facts: Path) -> None:
    status = json.loads((facts / "status-after.json").read_text())
    assert status["degraded"] == []


def test_a_module_loaded_before_the_fault_is_still_in_the_store(facts: Path) -> None:
    boot = (facts / "boot_id").read_text().strip()
    modules = json.loads((facts / "modules.json").read_text())
    assert any(m["name"] == "dummy" and m["boot_id"] == boot for m in modules)
