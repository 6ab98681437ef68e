#!/bin/sh
# Runs inside the VM that tests/vm/test_kcode_vm.py boots: kreld on the real
# /proc and /sys follows BPF programs while
#
#  1. a per-task perf record -k monotonic of a workload (dd reading /dev/zero,
#     so vfs_read runs in its context) goes on while bpftrace loads a kprobe
#     program on vfs_read, lets it run 3 s and exits (unloaded), then does the
#     same with a kfunc program (a BPF trampoline); perf script of the recording
#     with this boot's /proc/kallsyms and no other symbols (perf-task.script);
#  2. a burst of 300 short-lived programs is loaded, kreld stopped (SIGSTOP) for
#     the middle of it and continued after (guest_burst.py);
#  3. CPU 1 goes offline and back; programs are loaded on it before, in the gap
#     before kreld opens a new ring there, and after.
#
# Environment: OUT (facts directory), STATE (kreld's state dir), KRELD_VENV,
# KRELD_REPO.  Marks are CLOCK_MONOTONIC ns, one "name ns" line each in $OUT/times.
set -u
V=$KRELD_VENV/bin
LOG=$OUT/kreld.log
SOCK=/run/kreld-kcode.sock
HERE=$(dirname "$0")
KPID=
mkdir -p "$OUT" "$OUT/empty" "$OUT/perf-home"
: >"$OUT/times"

fail() {
    echo "guest_kcode.sh: $*" >&2
    [ -n "$KPID" ] && kill -CONT "$KPID" 2>/dev/null && kill -TERM "$KPID" 2>/dev/null
    exit 1
}

mark() {
    m=$(sed -n '/^now at /{s/^now at \([0-9]*\) nsecs$/\1/p;q}' /proc/timer_list)
    echo "$1 $m" >>"$OUT/times"
}

. "$(dirname "$0")/guestlib.sh"
wait_log() { wait_log_in "$LOG" 60 "$@"; } # COUNT EVENT

mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"
cat /proc/sys/net/core/bpf_jit_kallsyms /proc/sys/net/core/bpf_jit_harden >"$OUT/jit" 2>&1
"$V/kreld" --root / --state-dir "$STATE" --socket "$SOCK" --log-format json >>"$LOG" 2>&1 &
KPID=$!
wait_log 1 ready
mark kreld_ready
"$V/kreldctl" --socket "$SOCK" status --json >"$OUT/status-start.json"

# 1. the per-task recording while bpftrace loads and unloads two programs.
rm -f "$OUT/stop"
HOME=$OUT/perf-home perf record -N -q -k monotonic -e cpu-clock -F 997 -g \
    -o "$OUT/perf-task.data" -- sh -c \
    "while [ ! -e '$OUT/stop' ]; do dd if=/dev/zero of=/dev/null bs=1 count=20000 2>/dev/null; done" \
    2>"$OUT/perf-task.err" &
PPIDREC=$!
sleep 1
mark kprobe_start
timeout 100 bpftrace -e 'kprobe:vfs_read { @[comm] = count(); } interval:s:3 { exit(); }' \
    >"$OUT/bpftrace-kprobe.out" 2>&1 || fail "bpftrace kprobe: $(tail -5 "$OUT/bpftrace-kprobe.out")"
mark kprobe_done
timeout 100 bpftrace -e 'kfunc:vfs_read { @[comm] = count(); } interval:s:3 { exit(); }' \
    >"$OUT/bpftrace-kfunc.out" 2>&1 || fail "bpftrace kfunc: $(tail -5 "$OUT/bpftrace-kfunc.out")"
mark kfunc_done
sleep 1
touch "$OUT/stop"
wait "$PPIDREC" || fail "perf record: $(cat "$OUT/perf-task.err")"
HOME=$OUT/perf-home perf script -i "$OUT/perf-task.data" --kallsyms=/proc/kallsyms \
    --symfs="$OUT/empty" >"$OUT/perf-task.script" 2>>"$OUT/perf-task.err" ||
    fail "perf script: $(cat "$OUT/perf-task.err")"
mark recording_done

# 2. the burst, kreld stopped for its middle.
PYTHONPATH=$KRELD_REPO/tests "$V/python" "$HERE/guest_burst.py" "$KPID" 300 "$OUT/burst.json" \
    2>"$OUT/burst.err" || fail "burst: $(cat "$OUT/burst.err")"
mark burst_done
sleep 3 # the follower's look at kallsyms after the loss (rate-limited to 1 s)

# 3. CPU 1 offline and back: its event stays off for good; kreld opens a new one.
load() { # CPU NAME: load a socket filter on CPU and close it
    PYTHONPATH=$KRELD_REPO/tests taskset -c "$1" "$V/python" -c \
        'import os, sys; from support.bpfprog import load_socket_filter as f; os.close(f(sys.argv[1]))' \
        "$2" || fail "load $2 on CPU $1"
}
if [ -w /sys/devices/system/cpu/cpu1/online ]; then
    load 1 kcpu_before
    echo 0 >/sys/devices/system/cpu/cpu1/online || fail "cpu1 offline"
    mark cpu1_off
    sleep 1
    echo 1 >/sys/devices/system/cpu/cpu1/online || fail "cpu1 online"
    mark cpu1_on
    load 1 kcpu_gap # before kreld's next look at its CPUs: untold
    mark gap_done
    wait_line "$LOG" 30 "a new ring on CPU 1" '"event": "kernel_code_cpus"' '"opened": \[1\]'
    load 1 kcpu_after
    sleep 0.5
    mark cpu_done
fi
"$V/kreldctl" --socket "$SOCK" status --json >"$OUT/status-end.json"
kill -TERM "$KPID"
wait "$KPID"
echo $? >"$OUT/kreld.rc"
KPID=
sync
echo done >"$OUT/done"
