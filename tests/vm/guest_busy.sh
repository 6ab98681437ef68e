#!/bin/sh
# Runs inside the VM (tests/vm/guest.sh), as the workload of a perf record:
# keep the brd RAM disk busy for about SECONDS, so that perf's samples land in
# the module.  With "load", modprobe brd first (the recording then started
# before brd was loaded: perf has no map for it).
#
#   sh guest_busy.sh SECONDS [load]
set -u
if [ "${2:-}" = load ]; then
    modprobe brd rd_nr=1 rd_size=32768 || exit 1
fi
end=$(($(date +%s) + $1))
while [ "$(date +%s)" -lt "$end" ]; do
    dd if=/dev/zero of=/dev/ram0 bs=64k count=256 oflag=direct 2>/dev/null || exit 1
done
