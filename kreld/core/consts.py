"""One place for paths, defaults and kernel constants.

The daemon, the CLI, the config loader and the man pages all read their
defaults from here so that they cannot disagree.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Final

__all__ = [
    "ANCHOR_SYMBOLS",
    "BOOT_ID",
    "CAP_SYSLOG",
    "DEBUGINFO_CACHE",
    "DEBUGINFO_ROOT",
    "DEFAULT_CONFIG",
    "DEFAULT_DEBUGINFOD_MAX_BYTES",
    "DEFAULT_DEBUGINFOD_MAX_TIME",
    "DEFAULT_DEBUGINFOD_TIMEOUT",
    "DEFAULT_DEBUGINFO_CACHE_BYTES",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_UID",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_PUBLISH_INTERVAL",
    "DEFAULT_ROOT",
    "DEFAULT_SOCKET",
    "DEFAULT_STATE_DIR",
    "DEFAULT_SUBSCRIBE_QUEUE",
    "FEW_ADDRESSES",
    "HEARTBEAT_INTERVAL",
    "HOSTNAME",
    "KALLSYMS",
    "KCODE_AREA",
    "KCODE_KEEP_CLOSED",
    "KCODE_KEEP_LOSSES",
    "KCODE_RECONCILE_INTERVAL",
    "KCODE_RING_PAGES",
    "KCORE",
    "KERNEL_MEMORY_RETRY",
    "KERNEL_NOTES",
    "KPTR_RESTRICT",
    "KVERSION",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MACHINE_ID",
    "MAX_SOCKET_PATH",
    "OSRELEASE",
    "PERF_EVENT_PARANOID",
    "PROC_MODULES",
    "PROJECT_URL",
    "STORE_INITIAL_MAP_SIZE",
    "STORE_MAGIC",
    "STORE_MAX_MAP_SIZE",
    "STORE_SCHEMA_VERSION",
    "SYSTEM_MAP_CANDIDATES",
    "SYS_MODULE",
    "VMLINUX_CANDIDATES",
]

DEFAULT_CONFIG: Final = "/etc/kreld/kreld.toml"
DEFAULT_STATE_DIR: Final = "/var/lib/kreld"
DEFAULT_SOCKET: Final = "/run/kreld/kreld.sock"
DEFAULT_ROOT: Final = "/"
# The longest socket path kreld takes, in bytes: sockaddr_un's sun_path holds 108 with
# its NUL (UNIX_PATH_MAX, include/uapi/linux/un.h), and kreld binds under a temporary
# name up to 9 bytes longer (".NAME.PID"; a pid has at most 7 digits, PID_MAX_LIMIT
# being 4,194,304) before renaming it into place (kreld.server.listener.bind_socket).
MAX_SOCKET_PATH: Final = 108 - 1 - 9

# The project's public address, as org.varlink.service.GetInfo gives it: empty
# while pyproject.toml names none (tests/test_varlink_reference.py holds the two equal).
PROJECT_URL: Final = ""


# 2: compact incarnation records (kreld.store.records); schema 1 records still read.
# 3: binary incarnation records; records of schemas 1 and 2 still read.
# 4: an incarnation may carry loaded_after and where its sections came from.
STORE_SCHEMA_VERSION: Final = 4
STORE_MAGIC: Final = b"kreld-store"
STORE_INITIAL_MAP_SIZE: Final = 16 << 20
STORE_MAX_MAP_SIZE: Final = 1 << 40

DEFAULT_POLL_INTERVAL: Final = 1.0
# A heartbeat bounds the unload window of a module that vanishes while kreld is down.
HEARTBEAT_INTERVAL: Final = 30.0

# Seconds between publishing rounds to object storage ([publish] interval).
DEFAULT_PUBLISH_INTERVAL: Final = 10.0
# Debug files: the distribution's own place (under --root), the cache of those
# fetched from debuginfod (under the state directory), and the bounds of a
# download: seconds to connect and of silence while reading, seconds for one
# whole file, bytes of one file (a Debian vmlinux with DWARF is some 600 MB),
# and bytes of the whole cache before the least recently used files go.
DEBUGINFO_ROOT: Final = "usr/lib/debug"
DEBUGINFO_CACHE: Final = "debuginfo"
DEFAULT_DEBUGINFOD_TIMEOUT: Final = 30.0
DEFAULT_DEBUGINFOD_MAX_TIME: Final = 900.0
DEFAULT_DEBUGINFOD_MAX_BYTES: Final = 2 << 30
DEFAULT_DEBUGINFO_CACHE_BYTES: Final = 8 << 30

# What one peer may cost the server ([limits] in kreld.toml; kreld.server.listener.Limits).
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 20
DEFAULT_MAX_CONNECTIONS: Final = 1024
# Connections one uid may hold at once (root and kreld's own uid are not counted).
DEFAULT_MAX_CONNECTIONS_PER_UID: Final = 64
DEFAULT_IDLE_TIMEOUT: Final = 60.0
DEFAULT_SUBSCRIBE_QUEUE: Final = 4096

# [log] level and format (--log-level, --log-format), least severe level first.
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("auto", "console", "json", "journal")

# Paths of kernel interfaces, relative to --root.
BOOT_ID: Final = PurePosixPath("proc/sys/kernel/random/boot_id")
OSRELEASE: Final = PurePosixPath("proc/sys/kernel/osrelease")
KVERSION: Final = PurePosixPath("proc/sys/kernel/version")
KPTR_RESTRICT: Final = PurePosixPath("proc/sys/kernel/kptr_restrict")
PERF_EVENT_PARANOID: Final = PurePosixPath("proc/sys/kernel/perf_event_paranoid")
KALLSYMS: Final = PurePosixPath("proc/kallsyms")
KCORE: Final = PurePosixPath("proc/kcore")
PROC_MODULES: Final = PurePosixPath("proc/modules")
HOSTNAME: Final = PurePosixPath("proc/sys/kernel/hostname")
MACHINE_ID: Final = PurePosixPath("etc/machine-id")
KERNEL_NOTES: Final = PurePosixPath("sys/kernel/notes")
SYS_MODULE: Final = PurePosixPath("sys/module")

# Kernel symbols that mark out the image; _text is the relocation anchor.
ANCHOR_SYMBOLS: Final = ("_text", "_stext", "_etext", "_sinittext", "_einittext")

# Linux capability number of CAP_SYSLOG (include/uapi/linux/capability.h).
CAP_SYSLOG: Final = 34

# Kernel code beyond the image and modules (BPF programs, trampolines,
# ftrace and kprobe pages; issue 21).  Where x86-64 allocates it: the module
# area (MODULES_VADDR .. MODULES_END, arch/x86/include/asm/pgtable_64_types.h:
# 0xffffffffa0000000 without KASLR, 0xffffffffc0000000 with it; BPF JIT images
# come from the same allocator).  A time inside a loss window makes an address
# here that no record names "uncertain", never nothing and never a wrong name.
KCODE_AREA: Final = (0xFFFFFFFFA0000000, 0xFFFFFFFFFF000000)
# Per boot, the newest closed records kept (open ones are always kept; the
# dropped ones become a loss window of reason "retention"), and loss windows
# (the oldest two merged into one past it).
KCODE_KEEP_CLOSED: Final = 50_000
KCODE_KEEP_LOSSES: Final = 1024
# Seconds between two reconciliations against /proc/kallsyms after losses.
KCODE_RECONCILE_INTERVAL: Final = 1.0
# Data pages of each CPU's side-band ring (a power of two): 32 KiB holds
# some 400 KSYMBOL and BPF_EVENT records.
KCODE_RING_PAGES: Final = 8
# Seconds between two tries to open kernel memory (kptr_restrict raised to 2
# while kreld runs; kreld/kernel/addresses.py) after one failed.
KERNEL_MEMORY_RETRY: Final = 60.0

# Places where distributions put a vmlinux with symbols; {release} and
# {xx}/{rest} (the build-id split after its first byte) are filled in.
VMLINUX_CANDIDATES: Final = (
    "usr/lib/debug/.build-id/{xx}/{rest}.debug",
    "usr/lib/debug/boot/vmlinux-{release}",
    "usr/lib/debug/lib/modules/{release}/vmlinux",
    "boot/vmlinux-{release}",
    "lib/modules/{release}/build/vmlinux",
    "usr/lib/modules/{release}/build/vmlinux",
)
SYSTEM_MAP_CANDIDATES: Final = (
    "boot/System.map-{release}",
    "lib/modules/{release}/build/System.map",
    "usr/lib/debug/boot/System.map-{release}",
)

# Addresses that Resolve looks up one by one rather than with numpy (whose
# fixed cost, some 200 us a call, is that of about 50 lookups in Python).
FEW_ADDRESSES = 32
