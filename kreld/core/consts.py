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
    "DEFAULT_CAP_ROOT",
    "DEFAULT_CONFIG",
    "DEFAULT_DEBUGINFOD_MAX_BYTES",
    "DEFAULT_DEBUGINFOD_MAX_TIME",
    "DEFAULT_DEBUGINFOD_TIMEOUT",
    "DEFAULT_DEBUGINFO_CACHE_BYTES",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_LINE_BUILD_MEMORY",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_UID",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_POLL_INTERVAL_EVENTS",
    "DEFAULT_PUBLISH_INTERVAL",
    "DEFAULT_ROOT",
    "DEFAULT_SOCKET",
    "DEFAULT_STATE_DIR",
    "DEFAULT_SUBSCRIBE_QUEUE",
    "DEFAULT_WRITE_TIMEOUT",
    "FEW_ADDRESSES",
    "HEARTBEAT_INTERVAL",
    "HOSTNAME",
    "KALLSYMS",
    "KCORE",
    "KERNEL_CODE_AREA",
    "KERNEL_CODE_KEEP_CLOSED",
    "KERNEL_CODE_KEEP_LOSSES",
    "KERNEL_CODE_PAGE",
    "KERNEL_CODE_RECONCILE_INTERVAL",
    "KERNEL_CODE_RING_PAGES",
    "KERNEL_HALF",
    "KERNEL_MEMORY_RETRY",
    "KERNEL_NOTES",
    "KPTR_RESTRICT",
    "KVERSION",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MACHINE_ID",
    "MAX_BTF",
    "MAX_ELF_SECTIONS",
    "MAX_KALLSYMS",
    "MAX_KCORE_HEADERS",
    "MAX_KCORE_NOTES",
    "MAX_KERNEL_NOTES",
    "MAX_KERNEL_OFFSET",
    "MAX_MODULE_FILE",
    "MAX_MODULE_SECTIONS",
    "MAX_MODULE_SIZE",
    "MAX_MODULE_SYMBOLS",
    "MAX_PROC_MODULES",
    "MAX_SMALL_FILE",
    "MAX_SOCKET_PATH",
    "MAX_SYSTEM_MAP",
    "MAX_VMLINUX_SYMBOLS",
    "OSRELEASE",
    "PERF_EVENT_PARANOID",
    "PROC_MODULES",
    "PROJECT_URL",
    "STARTING_WAIT",
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
# while pyproject.toml names none (tests/server/test_varlink_reference.py holds the two equal).
PROJECT_URL: Final = ""


# 2: compact incarnation records (kreld.store.encoding); schema 1 records still read.
# 3: binary incarnation records; records of schemas 1 and 2 still read.
# 4: an incarnation may carry loaded_after and where its sections came from.
STORE_SCHEMA_VERSION: Final = 4
STORE_MAGIC: Final = b"kreld-store"
STORE_INITIAL_MAP_SIZE: Final = 16 << 20
STORE_MAX_MAP_SIZE: Final = 1 << 40

DEFAULT_POLL_INTERVAL: Final = 1.0
# The look at sys/module while kernel events (module tracepoints, uevents) tell
# of loads: only the safety net then, so rare.
DEFAULT_POLL_INTERVAL_EVENTS: Final = 60.0
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
# The address space of the process that reads a debug file's DWARF into a
# line table (a 6.1 vmlinux of 590 MB takes about 0.9 GiB of it).
DEFAULT_LINE_BUILD_MEMORY: Final = 4 << 30

# What one peer may cost the server ([limits] in kreld.toml; kreld.config.settings.Limits).
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 20
DEFAULT_MAX_CONNECTIONS: Final = 1024
# Connections one uid may hold at once (root and kreld's own uid too, unless
# [limits] cap_root is off).
DEFAULT_MAX_CONNECTIONS_PER_UID: Final = 64
DEFAULT_CAP_ROOT: Final = True
DEFAULT_IDLE_TIMEOUT: Final = 60.0
# Seconds a reply may wait for its peer to take it before the peer is dropped.
DEFAULT_WRITE_TIMEOUT: Final = 10.0
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
# ftrace and kprobe pages).  Where x86-64 allocates it: the module
# area (MODULES_VADDR .. MODULES_END, arch/x86/include/asm/pgtable_64_types.h:
# 0xffffffffa0000000 without KASLR, 0xffffffffc0000000 with it; BPF JIT images
# come from the same allocator).  A time inside a loss window makes an address
# here that no record names "uncertain", never nothing and never a wrong name.
KERNEL_CODE_AREA: Final = (0xFFFFFFFFA0000000, 0xFFFFFFFFFF000000)
# BPF trampolines, dispatchers and kprobe instruction pages are one page each;
# a record whose length is unknown is taken to span at most this much.
KERNEL_CODE_PAGE: Final = 4096
# Per boot, the newest closed records kept (open ones are always kept; the
# dropped ones become a loss window of reason "retention"), and loss windows
# (the oldest two merged into one past it).
KERNEL_CODE_KEEP_CLOSED: Final = 50_000
KERNEL_CODE_KEEP_LOSSES: Final = 1024
# Seconds between two reconciliations against /proc/kallsyms after losses.
KERNEL_CODE_RECONCILE_INTERVAL: Final = 1.0
# Data pages of each CPU's side-band ring (a power of two): 32 KiB holds
# some 400 KSYMBOL and BPF_EVENT records.
KERNEL_CODE_RING_PAGES: Final = 8
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

# -- What the kernel can produce: every number read from a kernel file is checked
# against these where it is parsed, and every kernel file is read only up to its
# bound (kreld/kernel/files.py), so nothing is stored that a reader of the store
# would refuse, and no file costs more than its bound.
#
# Kernel addresses lie in the upper half of the 64-bit space (x86-64 and arm64:
# the kernel's half starts at 0xffff800000000000 with 48-bit, 0xff00000000000000
# with 57-bit virtual addresses); zero is "restricted", never an address.
KERNEL_HALF: Final = (1 << 63, 1 << 64)
# The KASLR offset moves the image within the kernel's half: less than the widest
# kernel virtual address space (57 bits, 5-level paging).
MAX_KERNEL_OFFSET: Final = 1 << 57
# A module's core and init sizes: ``unsigned int`` in struct module_layout and
# struct module_memory (include/linux/module.h).
MAX_MODULE_SIZE: Final = 1 << 32
# Bytes of each kernel file kind read at most; past it the file is refused by name.
MAX_SMALL_FILE: Final = 64 << 10  # a sysctl, a sysfs attribute (a page at most)
MAX_KERNEL_NOTES: Final = 64 << 10  # /sys/kernel/notes (some 500 bytes)
MAX_KALLSYMS: Final = 64 << 20  # /proc/kallsyms (6.1 with 1,100 modules: ~15 MB)
MAX_PROC_MODULES: Final = 4 << 20  # /proc/modules (some 100 bytes a module)
MAX_MODULE_SECTIONS: Final = 4096  # files in a module's sections/ (a module has 20-60)
MAX_SYSTEM_MAP: Final = 64 << 20  # a System.map (6.1: 87,000 lines, 4 MB)
MAX_BTF: Final = 128 << 20  # /sys/kernel/btf/vmlinux (6.1: ~5 MB)
MAX_MODULE_FILE: Final = 128 << 20  # a .ko, inflated (the largest are some 30 MB)
MAX_KCORE_HEADERS: Final = 1 << 20  # /proc/kcore's program header table
MAX_KCORE_NOTES: Final = 1 << 20  # /proc/kcore's PT_NOTE segment (VMCOREINFO is ~4 KiB)
# Entries of one ELF symbol table: a module's (the largest have some 60,000), and a
# vmlinux's (6.1: ~150,000); and ELF section headers of one file.
MAX_MODULE_SYMBOLS: Final = 1 << 17
MAX_VMLINUX_SYMBOLS: Final = 1 << 20
MAX_ELF_SECTIONS: Final = 1 << 16

# Seconds a call waits for the daemon's start (the boot's record, the first
# look at the modules) before it is answered from what the store holds, or
# NotReady: a profiler started with the host gets its answer, not an error,
# unless the start is long (a large vmlinux to read).
STARTING_WAIT: Final = 5.0

# Addresses that Resolve looks up one by one rather than as a batch
# (kreld.symbols.batch, whose sort and runs cost more than so few lookups).
FEW_ADDRESSES = 32
