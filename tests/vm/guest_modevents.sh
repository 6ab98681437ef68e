#!/bin/sh
# Runs inside the VM that tests/vm/test_modevents_vm.py boots: kreld follows
# modules by the module tracepoints.
#
#  1. kreld starts at kptr_restrict=2 (the kernel's tables read in kcore)
#     with a vmlinux-like ELF to read (tests/vm/bigvmlinux.py, its build-id
#     filled in here): once its
#     tracepoints are open (logged before the store is opened), dummy is
#     loaded and unloaded while it still reads; startup.txt says whether kreld
#     was ready by then (it must not have been, or nothing is shown).
#  2. kptr_restrict back to 0 and a second kreld (its own store): a per-task
#     perf record -k monotonic of insmod of the test's own module, whose init
#     spins 2 s in its own .init.text; perf script of it with this boot's
#     /proc/kallsyms (init text freed by then) and no other symbols; the
#     module's .ko lies in kreld's debuginfo_dirs, as a debug file would.
#
# Environment: OUT (facts), RW, MODDIR (slowinit.ko), BIGVMLINUX, BUILD_ID_AT,
# KRELD_VENV, KRELD_REPO.  Marks are CLOCK_MONOTONIC ns in $OUT/times.
set -u
V=$KRELD_VENV/bin
HERE=$(dirname "$0")
KPID=
LOG=
mkdir -p "$OUT" "$OUT/empty" "$OUT/perf-home"
: >"$OUT/times"

fail() {
    echo "guest_modevents.sh: $*" >&2
    [ -n "$KPID" ] && kill -TERM "$KPID" 2>/dev/null
    exit 1
}

mark() {
    m=$(sed -n '/^now at /{s/^now at \([0-9]*\) nsecs$/\1/p;q}' /proc/timer_list)
    echo "$1 $m" >>"$OUT/times"
}

. "$(dirname "$0")/guestlib.sh"
wait_log() { wait_log_in "$LOG" 180 "$@"; } # COUNT EVENT [MODULE]

stop_kreld() { # NAME
    kill -TERM "$KPID"
    wait "$KPID"
    echo $? >"$OUT/kreld-$1.rc"
    KPID=
}

mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"
uname -r >"$OUT/release"
ls /sys/kernel/tracing/events/module >"$OUT/tracepoints" 2>&1

# 1. a load and an unload while kreld starts.
mkdir -p "$RW/debug"
cp "$BIGVMLINUX" "$RW/debug/vmlinux-$(uname -r)" || fail "copy the vmlinux"
PYTHONPATH=$KRELD_REPO "$V/python" "$HERE/bigvmlinux.py" "$RW/debug/vmlinux-$(uname -r)" \
    "$BUILD_ID_AT" || fail "build-id"
printf '[kernel]\ndebuginfo_dirs = ["%s"]\nfollow_code = false\n' "$RW/debug" >"$RW/start.toml"
sysctl -qw kernel.kptr_restrict=2 || fail "kptr_restrict=2"
LOG=$OUT/kreld-start.log
mark kreld_start
"$V/kreld" --config "$RW/start.toml" --root / --state-dir "$RW/state-start" \
    --socket /run/kreld-start.sock --log-format json >"$LOG" 2>&1 &
KPID=$!
wait_log 1 module_tracepoints
mark tracepoints_open
modprobe dummy || fail "modprobe dummy"
mark dummy_loaded
rmmod dummy || fail "rmmod dummy"
mark dummy_unloaded
if grep -qF '"event": "ready"' "$LOG"; then echo ready >"$OUT/startup.txt"; else
    echo starting >"$OUT/startup.txt"; fi
wait_log 1 ready
mark kreld_ready
wait_log 1 module_came_and_went dummy
"$V/kreldctl" --socket /run/kreld-start.sock status --json >"$OUT/status-start.json"
stop_kreld start
sysctl -qw kernel.kptr_restrict=0 || fail "kptr_restrict=0"

# 2. insmod of a module whose init spins 2 s, recorded per task.
# The module's .ko where a debug file would be: its table names init code
# that kallsyms no longer shows once init has ended.
LOG=$OUT/kreld.log
printf '[kernel]\ndebuginfo_dirs = ["%s"]\n' "$MODDIR" >"$RW/main.toml"
"$V/kreld" --config "$RW/main.toml" --root / --state-dir "$RW/state" --socket /run/kreld.sock \
    --log-format json >"$LOG" 2>&1 &
KPID=$!
wait_log 1 ready
mark insmod_start
HOME=$OUT/perf-home perf record -N -q -k monotonic -e cpu-clock -F 997 \
    -o "$OUT/perf-init.data" -- insmod "$MODDIR/slowinit.ko" 2>"$OUT/perf-init.err" ||
    fail "perf record insmod: $(cat "$OUT/perf-init.err")"
mark insmod_done
wait_log 1 module_loaded slowinit
wait_log 1 module_symbols slowinit
HOME=$OUT/perf-home perf script -i "$OUT/perf-init.data" --kallsyms=/proc/kallsyms \
    --symfs="$OUT/empty" >"$OUT/perf-init.script" 2>>"$OUT/perf-init.err" ||
    fail "perf script: $(cat "$OUT/perf-init.err")"
"$V/kreldctl" --socket /run/kreld.sock status --json >"$OUT/status.json"
rmmod slowinit || fail "rmmod slowinit"
wait_log 1 module_unloaded slowinit
stop_kreld main
sync
echo done >"$OUT/done"
