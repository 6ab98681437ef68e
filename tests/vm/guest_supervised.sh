#!/bin/sh
# Runs inside the VM that tests/vm/test_vm_supervised.py boots: kreld as a
# Type=notify service with a watchdog under a real systemd manager, its
# module-following threads made to fail (the fault hook, KRELD_TEST_FAULTS),
# and systemd restarting it.
#
# vng's init is not systemd, so the manager is systemd's own, run as root's
# user manager (systemd --user: the same service engine, Type=notify,
# WatchdogSec=, Restart=), and systemd-run --user asks it for a transient
# unit over its private socket.  The faults come from an EnvironmentFile,
# read at each start: emptied once the fault is seen, the restart runs clean.
#
# Environment: OUT (facts), FAULTS (names), KRELD_VENV.  Writes to $OUT:
# kreld.log (both runs' JSON log), status-degraded.json (Status while
# degraded), show-before/show-after (systemctl show), status-after.json,
# modules.json (kreldctl modules --all of the store), manager.log.
set -u
V=$KRELD_VENV/bin
UNIT=kreld-supervised
mkdir -p "$OUT"

fail() {
    echo "guest_supervised.sh: $*" >&2
    exit 1
}

# A user manager starts only where sd_booted(3) holds: /run/systemd/system.
mkdir -p /run/systemd/system 2>/dev/null ||
    { mount -t tmpfs none /run && mkdir -p /run/systemd/system; } || fail "no /run/systemd/system"
export XDG_RUNTIME_DIR=/run/user/0
mkdir -p "$XDG_RUNTIME_DIR"
chmod 700 "$XDG_RUNTIME_DIR"

show() { systemctl --user show -p "$1" --value "$UNIT" 2>/dev/null; }

mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
grep -q cgroup2 /proc/mounts || mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null
cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"

/lib/systemd/systemd --user --log-target=console >"$OUT/manager.log" 2>&1 &
i=0
until [ -S "$XDG_RUNTIME_DIR/systemd/private" ]; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "no user manager after 120 s: $(tail -5 "$OUT/manager.log")"
    sleep 0.1
done

# Loaded before kreld starts, recorded by its first look: in the store after
# the failure and the restart.
modprobe dummy || fail "modprobe dummy"
printf 'KRELD_TEST=1\nKRELD_TEST_FAULTS=%s\n' "$FAULTS" >"$OUT/faults.env"
systemd-run --user --unit="$UNIT" -p Type=notify -p NotifyAccess=main -p WatchdogSec=30 \
    -p Restart=on-failure -p RestartSec=1 -p TimeoutStartSec=300 \
    -p EnvironmentFile="$OUT/faults.env" \
    -p StandardOutput=append:"$OUT/kreld.log" -p StandardError=append:"$OUT/kreld.log" \
    "$V/kreld" --root / --state-dir "$OUT/state" --socket /run/kreld-supervised.sock --log-format json \
    >"$OUT/systemd-run.out" 2>&1 || fail "systemd-run: $(cat "$OUT/systemd-run.out")"

# Type=notify: active once kreld said READY=1.
i=0
until [ "$(show ActiveState)" = active ]; do
    i=$((i + 1))
    [ $i -gt 3000 ] && fail "kreld not active in 300 s: $(show ActiveState) $(tail -5 "$OUT/kreld.log")"
    sleep 0.1
done
systemctl --user show "$UNIT" >"$OUT/show-before"
# A load and an unload wake both threads (a tracepoint record, a uevent) to
# run kreld's code: armed by then (the first ping), they raise.  The
# watchdog's interval leaves the slow kreldctl of an emulated guest time to
# read Status while the daemon is degraded.
n=0
until [ -s "$OUT/status-degraded.json" ]; do
    n=$((n + 1))
    [ "$(show NRestarts)" -ge 1 ] 2>/dev/null && fail "restarted before Status was read degraded"
    [ $n -gt 100 ] && fail "not degraded after 100 tries: $(tail -5 "$OUT/kreld.log")"
    modprobe veth && rmmod veth
    "$V/kreldctl" --socket /run/kreld-supervised.sock --json status >"$OUT/status.tmp" 2>&1
    if grep -q InjectedFault "$OUT/status.tmp"; then
        : >"$OUT/faults.env" # the restart runs without the fault
        mv "$OUT/status.tmp" "$OUT/status-degraded.json"
    fi
done
n=0
until [ "$(show NRestarts)" -ge 1 ] 2>/dev/null; do
    n=$((n + 1))
    [ $n -gt 300 ] && fail "no restart in 300 s: $(show NRestarts) $(tail -5 "$OUT/kreld.log")"
    sleep 1
done
: >"$OUT/faults.env"
systemctl --user show "$UNIT" >"$OUT/show-after"
i=0
until "$V/kreldctl" --socket /run/kreld-supervised.sock --json status >"$OUT/status-after.json" 2>/dev/null &&
    [ "$(show ActiveState)" = active ]; do
    i=$((i + 1))
    [ $i -gt 3000 ] && fail "the restarted kreld does not answer in 300 s"
    sleep 0.1
done
"$V/kreldctl" --state-dir "$OUT/state" --json modules --all >"$OUT/modules.json" ||
    fail "kreldctl modules"
systemctl --user stop "$UNIT"
sync
echo done >"$OUT/done"
