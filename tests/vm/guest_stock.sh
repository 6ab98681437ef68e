#!/bin/sh
# Runs inside the VM that tests/vm/test_stock_vm.py boots: a stock host (no
# System.map but Debian's placeholder, no vmlinux, nothing mounted).
#
#   1. kptr_restrict=2, then kreld starts (--root /, state $STATE);
#   2. modprobe dummy; once kreld has it, its sections copied at kptr_restrict=0
#      for a moment (kreld idle), back to 2, rmmod dummy; once kreld has that, the
#      export (kreldctl export kallsyms) taken still at kptr_restrict=2;
#   3. kreld stopped; kptr_restrict=0: /proc/kallsyms, the truth, copied.
#
# Environment: OUT (facts), STATE, KRELD_VENV, KRELD_REPO.
set -u
V=$KRELD_VENV/bin
CONFIG=$KRELD_REPO/etc/kreld/kreld.toml
SOCK=/run/kreld/kreld.sock
KPID=
mkdir -p "$OUT"

fail() {
    echo "guest_stock.sh: $*" >&2
    [ -n "$KPID" ] && kill -TERM "$KPID" 2>/dev/null && wait "$KPID"
    exit 1
}

. "$(dirname "$0")/guestlib.sh"
wait_log() { # wait_log LOG COUNT EVENT [MODULE]
    f=$1
    shift
    wait_log_in "$f" 90 "$@"
}

uname -r >"$OUT/release"
cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"
head -c 200 "/boot/System.map-$(uname -r)" >"$OUT/system_map_head"
sysctl -qw kernel.kptr_restrict=2 || fail "cannot set kptr_restrict"
head -1 /proc/kallsyms >"$OUT/kallsyms_at_2_head"
LOG=$OUT/kreld.log
"$V/kreld" --config "$CONFIG" --root / --state-dir "$STATE" --socket "$SOCK" \
    --log-format json --log-level debug >>"$LOG" 2>&1 &
KPID=$!
wait_log "$LOG" 1 ready
modprobe dummy || fail "modprobe dummy"
wait_log "$LOG" 1 module_loaded dummy
# The truth of dummy's sections, copied at 0 for a moment (kreld is idle).
sysctl -qw kernel.kptr_restrict=0
for f in /sys/module/dummy/sections/.[!.]* /sys/module/dummy/sections/*; do
    [ -f "$f" ] && echo "${f##*/} $(cat "$f")"
done >"$OUT/dummy_sections"
sysctl -qw kernel.kptr_restrict=2
rmmod dummy || fail "rmmod dummy"
wait_log "$LOG" 1 module_unloaded dummy
wait_log "$LOG" 1 kernel_symbols
"$V/kreldctl" --socket "$SOCK" export kallsyms >"$OUT/export" || fail "export"
kill -TERM "$KPID"
wait "$KPID"
echo $? >"$OUT/kreld.rc"
KPID=
sysctl -qw kernel.kptr_restrict=0
cat /proc/kallsyms >"$OUT/kallsyms"
grep -E " (_text|_stext)$" /proc/kallsyms >"$OUT/anchors"
