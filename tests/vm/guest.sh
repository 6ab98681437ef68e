#!/bin/sh
# Runs inside the VM that tests/vm/conftest.py boots for tests/vm/test_realkernel_*.py (through
# tests/support/harness.py): kreld on the real /proc and /sys, and, read
# independently with cat/grep/od/cp, what the kernel itself says.  Everything is
# written as files under $OUT for the host to compare.
#
#   sh guest.sh first    boot facts; kreld running, a client subscribed to it
#                        (watch.jsonl), while dummy, veth, rmmod dummy, dummy
#                        again; /proc/kallsyms at a moment T once kreld has
#                        captured the symbols; then kreldctl snapshots with
#                        /proc/kcore hidden (stock /boot System.map, and the
#                        real one over it in a mount namespace of its own)
#   sh guest.sh second   boot facts; kreld running while dummy is loaded;
#                        /proc/kallsyms at T as in "first"
#
# In both boots, kreld still running, perf records the whole system while
# brd is kept busy (perf-brd.data) and reports it live (perf-brd.report: this
# boot's own /proc/kallsyms, no .ko files); brd is loaded after dummy and veth
# in the first boot, after dummy alone in the second, so it lies elsewhere.
# In the second, brd is loaded by the workload of a perf record -k monotonic
# that started before it (perf-late.data, and its perf script output); then
# unloaded and loaded again by the workload of a per-task perf record
# -k monotonic (perf-task.data, for kreldctl inject).
#
# Environment: OUT (facts directory), STATE (kreld's state dir), KRELD_VENV,
# KRELD_REPO, for "first" SYSMAP (the real System.map, may be empty), for
# "second" PREV_LOG (the first boot's kreld.log: which module builds already
# have symbol tables).  Times are CLOCK_MONOTONIC ns ("now at" of
# /proc/timer_list) and CLOCK_REALTIME ns (date), one line per mark in
# $OUT/times; the kallsyms moment T is in $OUT/kallsyms-T.json.
set -u
mode=$1
V=$KRELD_VENV/bin
CONFIG=$KRELD_REPO/etc/kreld/kreld.toml
LOG=$OUT/kreld.log
SOCK=/run/kreld/kreld.sock
HERE=$(dirname "$0")
KPID=
WPID=
mkdir -p "$OUT"
: >"$OUT/times"

fail() {
    echo "guest.sh: $*" >&2
    [ -n "$WPID" ] && kill -TERM "$WPID" 2>/dev/null
    [ -n "$KPID" ] && kill -TERM "$KPID" 2>/dev/null && wait "$KPID"
    exit 1
}

mark() {
    m=$(sed -n '/^now at /{s/^now at \([0-9]*\) nsecs$/\1/p;q}' /proc/timer_list)
    echo "$1 $m $(date +%s%N)" >>"$OUT/times"
}

facts() {
    # Boot's own module loads (udev's coldplug: CPU crypto drivers and the like)
    # may still be running; let them finish before the list kreld is held to.
    udevadm settle --timeout=60 2>/dev/null || true
    cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"
    uname -r >"$OUT/release"
    od -An -v -tx1 /sys/kernel/notes >"$OUT/kernel_notes.hex"
    grep -E ' (_text|_stext|_etext|_sinittext|_einittext)$' /proc/kallsyms >"$OUT/anchors"
    cat /proc/modules >"$OUT/modules.start"
    cat /proc/sys/kernel/kptr_restrict >"$OUT/kptr_restrict"
}

# copy_module NAME LABEL: the module's sysfs files, as the kernel shows them now
# (a few commands only: every exec costs ~0.2 s under software emulation).
copy_module() {
    d=/sys/module/$1
    o=$OUT/mod/$2
    mkdir -p "$o"
    cp -r "$d/sections" "$o/sections" || fail "cannot copy $d/sections"
    cp "$d/notes/.note.gnu.build-id" "$d/coresize" "$d/initsize" "$d/initstate" "$o/" ||
        fail "cannot copy $d"
    cat /proc/modules >"$o/proc_modules"
}

. "$(dirname "$0")/guestlib.sh"
# wait_log COUNT EVENT [MODULE]: until kreld has logged EVENT (for MODULE) COUNT times.
wait_log() { wait_log_in "$LOG" 60 "$@"; }

start_kreld() {
    "$V/kreld" --config "$CONFIG" --root / --state-dir "$STATE" --socket "$SOCK" \
        --log-format json --log-level debug >>"$LOG" 2>&1 &
    KPID=$!
    wait_log 1 ready
    mark kreld_ready
    cat /proc/modules >"$OUT/modules.ready"
}

stop_kreld() {
    mark kreld_stopping
    kill -TERM "$KPID"
    wait "$KPID"
    echo $? >"$OUT/kreld.rc"
    KPID=
}

# load NAME LABEL COUNT: modprobe, wait until kreld has it, copy sysfs.
load() {
    mark "$2.before"
    modprobe "$1" || fail "modprobe $1"
    mark "$2.returned"
    wait_log "$3" module_loaded "$1"
    mark "$2.seen"
    copy_module "$1" "$2"
    mark "$2.copied"
    sleep 0.3
}

unload() {
    mark "$2.before_rmmod"
    rmmod "$1" || fail "rmmod $1"
    mark "$2.rmmod_returned"
    wait_log "$3" module_unloaded "$1"
    mark "$2.unload_seen"
    sleep 0.3
}

# start_watch: a client subscribed to kreld (Subscribe, guest_subscribe.py), in
# the background, started before kreld: its start-up overlaps kreld's.
start_watch() {
    PYTHONPATH=$KRELD_REPO "$V/python" -S "$HERE/guest_subscribe.py" "$SOCK" \
        "$OUT/watch.jsonl" 2>"$OUT/watch.err" &
    WPID=$!
}

# watch_ready: until the subscriber has written the snapshot (kreld is ready).
watch_ready() {
    i=0
    until [ -s "$OUT/watch.jsonl" ]; do
        kill -0 "$WPID" 2>/dev/null || fail "the subscriber exited: $(cat "$OUT/watch.err")"
        [ $i -lt 600 ] || fail "the subscriber had no snapshot in 60 s"
        sleep 0.1
        i=$((i + 1))
    done
    mark watch_ready
}

# stop_watch LOADS UNLOADS: once the subscriber printed that many load and
# unload events (or after 20 s), stop it.
stop_watch() {
    i=0
    while [ $i -lt 200 ]; do
        [ "$(grep -cF '"event": "load"' "$OUT/watch.jsonl")" -ge "$1" ] &&
            [ "$(grep -cF '"event": "unload"' "$OUT/watch.jsonl")" -ge "$2" ] && break
        sleep 0.1
        i=$((i + 1))
    done
    kill -TERM "$WPID"
    wait "$WPID"
    echo $? >"$OUT/watch.rc"
    WPID=
    mark watch_stopped
}

# capture_kallsyms [PREV_LOG]: once kreld has captured the symbols, the kernel's
# own /proc/kallsyms at a moment T (see guest_kallsyms.py).
capture_kallsyms() {
    mark kallsyms_wait
    "$V/python" -S "$HERE/guest_kallsyms.py" "$LOG" "$OUT" ${1:+"$1"} ||
        fail "guest_kallsyms.py failed"
    mark kallsyms_captured
}

# load_brd LABEL COUNT: brd with a RAM disk big enough for guest_busy.sh.
load_brd() {
    modprobe brd rd_nr=1 rd_size=32768 || fail "modprobe brd"
    wait_log "$2" module_loaded brd
    copy_module brd "$1"
}

# perf_brd: perf records the system while brd is busy; the live report.
perf_brd() {
    mkdir -p "$OUT/empty" "$OUT/perf-home"
    HOME=$OUT/perf-home perf record -N -q -e cpu-clock -F 997 -a -o "$OUT/perf-brd.data" \
        -- sh "$HERE/guest_busy.sh" 3 2>"$OUT/perf-brd.err" || fail "perf record: $(cat "$OUT/perf-brd.err")"
    HOME=$OUT/perf-home perf report -i "$OUT/perf-brd.data" --kallsyms=/proc/kallsyms \
        --symfs="$OUT/empty" --stdio --sort sym >"$OUT/perf-brd.report" 2>>"$OUT/perf-brd.err" ||
        fail "perf report: $(cat "$OUT/perf-brd.err")"
    mark perf_brd_done
}

# perf_load NAME COUNT LABEL [PERF OPTIONS]: brd loaded by the workload of a perf
# record -k monotonic that had started (kreld logs its COUNTth load of brd; its
# facts under mod/LABEL); perf script of NAME.data with this boot's /proc/kallsyms.
perf_load() {
    name=$1
    count=$2
    label=$3
    shift 3
    mkdir -p "$OUT/empty" "$OUT/perf-home"
    HOME=$OUT/perf-home perf record -N -q -k monotonic -e cpu-clock -F 997 "$@" \
        -o "$OUT/$name.data" -- sh "$HERE/guest_busy.sh" 3 load 2>"$OUT/$name.err" ||
        fail "perf record -k monotonic $*: $(cat "$OUT/$name.err")"
    wait_log "$count" module_loaded brd
    copy_module brd "$label"
    HOME=$OUT/perf-home perf script -i "$OUT/$name.data" --kallsyms=/proc/kallsyms \
        --symfs="$OUT/empty" >"$OUT/$name.script" 2>>"$OUT/$name.err" ||
        fail "perf script: $(cat "$OUT/$name.err")"
    mark "${name}_done"
}

snapshot() { # LABEL: kreldctl snapshot into its own state dir
    "$V/kreldctl" --config "$CONFIG" --root / --state-dir "$OUT/state-$1" \
        snapshot --json >"$OUT/snapshot-$1.json" 2>"$OUT/snapshot-$1.err"
    echo $? >"$OUT/snapshot-$1.rc"
}

mark script_start
case $mode in
first)
    facts
    mark facts_done
    start_watch
    start_kreld
    watch_ready
    load dummy dummy1 1
    load veth veth 1
    unload dummy dummy1 1
    load dummy dummy2 2
    stop_watch 3 1 # dummy, veth, dummy again; dummy unloaded
    capture_kallsyms
    load_brd brd 1
    wait_log 1 module_symbols brd
    perf_brd
    stop_kreld
    # The KASLR offset from a System.map: hide VMCOREINFO (/proc/kcore) first.
    mount --bind /dev/null /proc/kcore || fail "cannot hide /proc/kcore"
    release=$(uname -r)
    cp "/boot/System.map-$release" "$OUT/stock-system-map"
    # Both snapshots at once (two vCPUs); the real map is bind-mounted over the
    # stock one only in a mount namespace of its own.
    snapshot stock-map &
    spid=$!
    if [ -n "${SYSMAP:-}" ]; then
        unshare -m sh -c '
            map=/boot/System.map-$1
            mount --bind "$SYSMAP" "$map" || exit 1
            grep -E " (_text|_stext|_etext|_sinittext|_einittext)\$" "$map" \
                >"$OUT/system-map-anchors"
            "$2/kreldctl" --config "$3" --root / --state-dir "$OUT/state-system-map" \
                snapshot --json >"$OUT/snapshot-system-map.json" 2>"$OUT/snapshot-system-map.err"
            echo $? >"$OUT/snapshot-system-map.rc"' sh "$release" "$V" "$CONFIG" ||
            fail "cannot mount $SYSMAP over /boot/System.map-$release"
    fi
    wait "$spid"
    umount /proc/kcore
    mark snapshots_done
    ;;
second)
    facts
    mark facts_done
    start_kreld
    load dummy dummy 1
    capture_kallsyms "${PREV_LOG:-}"
    perf_load perf-late 1 brd -a # the whole system
    perf_brd
    rmmod brd || fail "rmmod brd"
    wait_log 1 module_unloaded brd
    perf_load perf-task 2 brd2 # the workload alone: no KSYMBOL or module events asked for
    stop_kreld
    ;;
*)
    fail "unknown mode $mode"
    ;;
esac
sync
echo done >"$OUT/done"
