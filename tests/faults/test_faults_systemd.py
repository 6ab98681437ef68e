"""kreld restarted by systemd itself when a supervised thread fails, on this
host: systemd's own service manager (root's user manager, ``systemd --user``:
the same engine as PID 1's, Type=notify, WatchdogSec=, Restart=) runs kreld as
a transient unit made with ``systemd-run``, on a fake tree.  PID 1 here need
not be systemd: the manager runs in a mount namespace of its own whose /run
says it was (sd_booted(3)).  The real kernel's case is
tests/vm/test_vm_supervised.py.

The fault hook's variables come from an EnvironmentFile, read at each start:
emptied once Status names the failure, the restart runs clean.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.faketree import FakeTree
from support.run import bin_path, ctl_json
from support.wait import quick_heartbeat

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

BASE = 0xFFFFFFFFC2000000
MANAGER = Path("/lib/systemd/systemd")

SCRIPT = r"""
set -u
mount -t tmpfs none /run && mkdir -p /run/systemd/system /run/user/0 || exit 90
chmod 700 /run/user/0
export XDG_RUNTIME_DIR=/run/user/0
"$MANAGER" --user --log-target=console >"$D/manager.log" 2>&1 &
i=0
until [ -S /run/user/0/systemd/private ]; do
    i=$((i + 1)); [ $i -gt 600 ] && exit 91; sleep 0.1
done
show() { systemctl --user show -p "$1" --value kreld-fault; }
systemd-run --user --unit=kreld-fault -p Type=notify -p NotifyAccess=main -p WatchdogSec=3 \
    -p Restart=on-failure -p RestartSec=1 -p EnvironmentFile="$D/faults.env" \
    -p StandardOutput=append:"$D/kreld.log" -p StandardError=append:"$D/kreld.log" \
    "$KRELD" --root "$D/root" --state-dir "$D/state" --socket "$D/k.sock" --log-format json \
    --config "$D/kreld.toml" \
    >"$D/systemd-run.out" 2>&1 || exit 92
i=0
until [ "$(show ActiveState)" = active ]; do
    i=$((i + 1)); [ $i -gt 600 ] && exit 93; sleep 0.1
done
systemctl --user show kreld-fault >"$D/show-before"
i=0
until [ "$(show NRestarts)" -ge 1 ] 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 900 ] && exit 94
    if [ ! -s "$D/status-degraded.json" ] &&
        "$KRELDCTL" --socket "$D/k.sock" --json status >"$D/status.tmp" 2>/dev/null &&
        grep -q InjectedFault "$D/status.tmp"; then
        mv "$D/status.tmp" "$D/status-degraded.json"
        : >"$D/faults.env"
    fi
    sleep 0.1
done
: >"$D/faults.env"
systemctl --user show kreld-fault >"$D/show-after"
i=0
until [ "$(show ActiveState)" = active ] &&
    "$KRELDCTL" --socket "$D/k.sock" --json status >"$D/status-after.json" 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 600 ] && exit 95; sleep 0.1
done
systemctl --user show kreld-fault >"$D/show-served"
systemctl --user stop kreld-fault
"""


def _show(path: Path) -> dict[str, str]:
    return dict(line.partition("=")[::2] for line in path.read_text().splitlines())


# A thread, a task and the pinger itself (every name is made to fail in
# tests/faults/test_faults_supervised.py; here systemd's side of it).
@pytest.mark.parametrize("name", ["tracker", "status-updates", "watchdog"])
def test_systemd_restarts_kreld_when_a_supervised_part_fails_and_no_record_is_lost(
    name: str, tmp_path: Path
) -> None:
    for tool in ("unshare", "systemd-run", "systemctl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if not MANAGER.exists() or os.geteuid() != 0:
        pytest.skip("needs systemd's manager and root (a mount namespace)")
    tree = FakeTree(tmp_path / "root")
    tree.add_module("before", BASE)
    (tmp_path / "faults.env").write_text(f"KRELD_TEST=1\nKRELD_TEST_FAULTS={name}\n")
    quick_heartbeat(tmp_path / "kreld.toml")  # the tracker's own code runs each second
    env = dict(
        os.environ,
        D=str(tmp_path),
        MANAGER=str(MANAGER),
        KRELD=bin_path("kreld"),
        KRELDCTL=bin_path("kreldctl"),
    )
    cp = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    logs = "".join(
        f"\n{p.name}:\n{p.read_text(errors='replace')[-3000:]}"
        for p in (tmp_path / "kreld.log", tmp_path / "manager.log", tmp_path / "systemd-run.out")
        if p.exists()
    )
    assert cp.returncode == 0, f"rc {cp.returncode}\n{cp.stdout}\n{cp.stderr}{logs}"
    degraded = json.loads((tmp_path / "status-degraded.json").read_text())["degraded"]
    assert name in [f["name"] for f in degraded]
    before, after = _show(tmp_path / "show-before"), _show(tmp_path / "show-after")
    served = _show(tmp_path / "show-served")
    assert int(after["NRestarts"]) >= 1
    assert served["MainPID"] not in ("0", before["MainPID"])
    assert json.loads((tmp_path / "status-after.json").read_text())["degraded"] == []
    modules = ctl_json(
        "--state-dir", str(tmp_path / "state"), "modules", "--boot", tree.boot_id, "--all"
    )
    assert "before" in {m["name"] for m in modules}
