# Sourced by the guest scripts (tests/vm/guest*.sh) inside the VM.  The caller
# defines fail MESSAGE (its own clean-up, then exit 1) and sets KPID to kreld's pid.

# wait_log_in LOG SECONDS COUNT EVENT [MODULE]: until kreld has logged EVENT (for
# MODULE) COUNT times in LOG; fail if kreld exits first or SECONDS pass.
wait_log_in() {
    i=0
    while [ $i -lt $(($2 * 10)) ]; do
        if [ -n "${5:-}" ]; then
            c=$(grep -F "\"event\": \"$4\"" "$1" | grep -cF "\"module\": \"$5\"")
        else
            c=$(grep -cF "\"event\": \"$4\"" "$1")
        fi
        [ "$c" -ge "$3" ] && return 0
        kill -0 "$KPID" 2>/dev/null || fail "kreld exited while waiting for $4 ${5:-}"
        sleep 0.1
        i=$((i + 1))
    done
    fail "no $3 x $4 ${5:-} in $1 in $2 s"
}

# wait_line LOG SECONDS WHAT FIXED REGEX: until LOG has a line holding the string
# FIXED and matching the extended regex REGEX; fail naming WHAT after SECONDS.
wait_line() {
    i=0
    until grep -F "$4" "$1" | grep -qE "$5"; do
        i=$((i + 1))
        [ $i -gt $(($2 * 10)) ] && fail "$3: not in $1 in $2 s"
        sleep 0.1
    done
}
