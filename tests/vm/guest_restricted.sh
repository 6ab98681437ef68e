#!/bin/sh
# Runs inside the VM that tests/vm/test_seethrough_vm.py boots:
# kreld at kernel.kptr_restrict=2, where kallsyms and /sys/module/*/sections
# show zeros to root too, then the truth read at kptr_restrict=0.
#
#   1. the real System.map over /boot's placeholder; kptr_restrict=2, then kreld
#      starts (--root /, state $STATE);
#   2. modprobe dummy; once kreld has it, kptr_restrict=0 just long enough to
#      copy its sections (kreld is idle), back to 2; modprobe brd; rmmod dummy;
#      then perf records dd reading brd's disk (no kernel map: perf reads zeros);
#   3. kptr_restrict=0: /proc/kallsyms and kreldctl export kallsyms at the same
#      moment, brd's sections; the live report of that recording (perf's own
#      kernel maps of now put in front of it); kreld stopped;
#   4. kptr_restrict=2 again: kreld without CAP_SYS_RAWIO (setpriv), state
#      $STATE-norawio, while veth loads; stopped;
#   5. kreld starts at kptr_restrict=0 (state $STATE-raised), veth unloaded first;
#      kptr_restrict=2, modprobe veth; 0 again, its sections copied; modprobe dummy
#      (read in sysfs again); stopped.
#
# Environment: OUT (facts), STATE, SYSMAP (the real System.map), KRELD_VENV, KRELD_REPO.
set -u
V=$KRELD_VENV/bin
CONFIG=$KRELD_REPO/etc/kreld/kreld.toml
SOCK=/run/kreld/kreld.sock
KPID=
HERE=$(dirname "$0")
mkdir -p "$OUT" "$OUT/empty" "$OUT/perf-home"

fail() {
    echo "guest_restricted.sh: $*" >&2
    [ -n "$KPID" ] && kill -TERM "$KPID" 2>/dev/null && wait "$KPID"
    exit 1
}

. "$(dirname "$0")/guestlib.sh"
# wait_log LOG COUNT EVENT [MODULE]
wait_log() {
    f=$1
    shift
    wait_log_in "$f" 90 "$@"
}

# start LOG STATE [PREFIX...]: kreld in the background, until ready
start() {
    log=$1
    state=$2
    shift 2
    "$@" "$V/kreld" --config "$CONFIG" --root / --state-dir "$state" --socket "$SOCK" \
        --log-format json --log-level debug >>"$log" 2>&1 &
    KPID=$!
    wait_log "$log" 1 ready
}

stop() {
    kill -TERM "$KPID"
    wait "$KPID"
    echo $? >"$1"
    KPID=
}

sections() { # sections NAME FILE: "name address" lines, as the kernel shows them now
    for f in /sys/module/$1/sections/.[!.]* /sys/module/$1/sections/*; do
        [ -f "$f" ] && echo "${f##*/} $(cat "$f")"
    done >"$2"
}

udevadm settle --timeout=60 2>/dev/null || true
release=$(uname -r)
[ -s "${SYSMAP:-}" ] || fail "no real System.map given (scripts/setup-vm)"
mount --bind "$SYSMAP" "/boot/System.map-$release" || fail "cannot mount the System.map"
cat /proc/sys/kernel/random/boot_id >"$OUT/boot_id"

# -- 1, 2: kreld at kptr_restrict=2 ----------------------------------------------------------
sysctl -q -w kernel.kptr_restrict=2 || fail "kptr_restrict=2"
head -n 1 /proc/kallsyms >"$OUT/kallsyms.head-at-2"
LOG=$OUT/kreld.log
start "$LOG" "$STATE"
modprobe dummy || fail "modprobe dummy"
wait_log "$LOG" 1 module_loaded dummy
sleep 0.3
sysctl -q -w kernel.kptr_restrict=0
sections dummy "$OUT/dummy.sections"
sysctl -q -w kernel.kptr_restrict=2
cat /sys/module/dummy/sections/.text >"$OUT/dummy.text-at-2"
modprobe brd rd_nr=1 rd_size=1024 || fail "modprobe brd"
wait_log "$LOG" 1 module_loaded brd
rmmod dummy || fail "rmmod dummy"
wait_log "$LOG" 1 module_unloaded dummy
wait_log "$LOG" 1 kernel_symbols
# brd's table (from its .ko: kallsyms shows it no address), after the start's modules
wait_line "$LOG" 120 "brd's symbol table" '"module": "brd"' '"event": "module_symbols(_unavailable)?"'

# perf at kptr_restrict=2 reads zeros: it records no kernel map (brd's code runs under dd)
HOME=$OUT/perf-home perf record -N -q -k monotonic -e cpu-clock -F 997 -g \
    -o "$OUT/perf-at-2.data" -- sh -ec \
    'for i in $(seq 200); do dd if=/dev/ram0 of=/dev/null bs=4k iflag=direct status=none; done' \
    2>"$OUT/perf-at-2.err" || fail "perf record at 2: $(cat "$OUT/perf-at-2.err")"

# Status while still at 2: it says how the last module read went, and from here
# on a read at 0 would see the addresses shown.
"$V/kreldctl" --config "$CONFIG" --socket "$SOCK" status --json >"$OUT/status.json"

# -- 3: the truth, at kptr_restrict=0, while kreld still runs ----------------------------------
sysctl -q -w kernel.kptr_restrict=0
cat /proc/kallsyms >"$OUT/kallsyms"
# The live report at 0 of that recording: perf's own kernel maps, synthesized now
# by a recording of nothing, put in front of its records (perf_splice.py), and
# kallsyms as the kernel shows it now (a copy: given /proc/kallsyms itself, perf
# reads /proc/kcore instead and names module code [kernel.kallsyms]).
HOME=$OUT/perf-home perf record -N -q -k monotonic -e cpu-clock -F 997 -g \
    -o "$OUT/perf-at-0.data" -- true 2>"$OUT/perf-at-0.err" ||
    fail "perf record at 0: $(cat "$OUT/perf-at-0.err")"
"$V/python" "$HERE/perf_splice.py" "$OUT/perf-at-2.data" "$OUT/perf-at-0.data" \
    "$OUT/perf-live.data" 2>"$OUT/splice.err" || fail "perf_splice: $(cat "$OUT/splice.err")"
for g in graph flat; do
    opts=""
    [ $g = flat ] && opts="--no-children --sort dso,sym -g none"
    # shellcheck disable=SC2086
    HOME=$OUT/perf-home perf report -i "$OUT/perf-live.data" --stdio --symfs="$OUT/empty" \
        --kallsyms="$OUT/kallsyms" $opts >"$OUT/report-live-$g.txt" 2>>"$OUT/report-live.err" ||
        fail "perf report at 0: $(cat "$OUT/report-live.err")"
done
"$V/kreldctl" --config "$CONFIG" --socket "$SOCK" export kallsyms -o "$OUT/export" \
    2>"$OUT/export.err" || fail "export kallsyms: $(cat "$OUT/export.err")"
cat /proc/kallsyms >"$OUT/kallsyms.after"
sections brd "$OUT/brd.sections"
cat /proc/modules >"$OUT/modules"
stop "$OUT/kreld.rc"

# -- 4: without CAP_SYS_RAWIO -------------------------------------------------------------------
sysctl -q -w kernel.kptr_restrict=2
LOG2=$OUT/kreld-norawio.log
start "$LOG2" "$STATE-norawio" setpriv --inh-caps=-sys_rawio --bounding-set=-sys_rawio --
grep CapEff "/proc/$KPID/status" >"$OUT/norawio.capeff"
modprobe veth || fail "modprobe veth"
wait_log "$LOG2" 1 module_loaded veth
stop "$OUT/kreld-norawio.rc"
sysctl -q -w kernel.kptr_restrict=0

# -- 5: kptr_restrict raised to 2 while kreld runs, then lowered ----------------------------------
rmmod veth || fail "rmmod veth"
LOG3=$OUT/kreld-raised.log
start "$LOG3" "$STATE-raised"
sysctl -q -w kernel.kptr_restrict=2 || fail "kptr_restrict=2 (raised)"
modprobe veth || fail "modprobe veth (raised)"
wait_log "$LOG3" 1 module_loaded veth
cat /sys/module/veth/sections/.text >"$OUT/veth.text-at-2"
sysctl -q -w kernel.kptr_restrict=0
sections veth "$OUT/veth.sections"
modprobe dummy || fail "modprobe dummy (lowered)"
wait_log "$LOG3" 1 module_loaded dummy
sections dummy "$OUT/dummy-lowered.sections"
stop "$OUT/kreld-raised.rc"
echo done >"$OUT/done"
