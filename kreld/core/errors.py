"""The error family.

Every error kreld reports is a :class:`KreldError` subclass with typed
attributes, a readable message, the varlink error name the server answers
with and the exit code ``kreld``/``kreldctl`` end with.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, ClassVar

__all__ = [
    "AddressNotMapped",
    "AddressesRestricted",
    "AmbiguousBoot",
    "BtfError",
    "ConfigError",
    "ExitCode",
    "FleetError",
    "FleetObjectInvalid",
    "InterfaceNotFound",
    "InvalidArgument",
    "KernelMemoryError",
    "KernelReadError",
    "KreldError",
    "LineTableError",
    "MethodNotFound",
    "MethodNotImplemented",
    "ModuleListChanged",
    "NoBootForRecording",
    "NoSuchBoot",
    "NoteError",
    "OutputError",
    "PerfDataError",
    "PermissionDenied",
    "SocketError",
    "StoreCorrupt",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreTooNew",
    "SymbolsUnavailable",
]


class ExitCode(IntEnum):
    """Exit codes of ``kreld`` and ``kreldctl`` (documented in their --help)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NO_SUCH_BOOT = 3
    PERMISSION_DENIED = 4
    STORE = 5
    CONFIG = 6
    STORE_LOCKED = 7
    OUTPUT = 8


class KreldError(Exception):
    """Base of every error kreld reports to a user or a peer."""

    varlink_name: ClassVar[str] = "io.kreld.InternalError"
    exit_code: ClassVar[ExitCode] = ExitCode.ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def parameters(self) -> dict[str, Any]:
        """The varlink error parameters."""
        return {"message": self.message}


class NoteError(KreldError):
    """An ELF note blob is malformed (truncated, or a size that overruns it)."""

    varlink_name = "io.kreld.MalformedNote"

    def __init__(self, what: str, offset: int) -> None:
        super().__init__(f"malformed ELF note at byte {offset}: {what}")
        self.what = what
        self.offset = offset


class KernelReadError(KreldError):
    """A kernel interface could not be read or made no sense."""

    varlink_name = "io.kreld.KernelReadError"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class KernelMemoryError(KernelReadError):
    """Kernel memory read through ``/proc/kcore`` made no sense: a corrupt
    pointer chain, a record that does not hold together.  On the wire it stays
    a ``KernelReadError`` (it is one); kreld records the boot as restricted
    with this message rather than store an address it could not trust."""


class AddressNotMapped(KernelMemoryError):
    """A pointer read from kernel memory leads outside every ``PT_LOAD``
    segment of ``/proc/kcore``: corrupt, stale, or not a kernel address."""

    def __init__(self, path: str, address: int, length: int, what: str | None = None) -> None:
        where = f"{what} points to " if what else ""
        super().__init__(
            path, f"{where}{length} bytes at {address:#x}, outside every PT_LOAD segment"
        )
        self.address = address
        self.length = length
        self.what = what


class ModuleListChanged(KernelMemoryError):
    """The kernel's module list changed under every try of a walk (loads or
    unloads faster than it could be read twice alike): no answer rather than
    a torn one."""

    def __init__(self, path: str, tries: int) -> None:
        super().__init__(path, f"the module list changed during each of {tries} walks")
        self.tries = tries


class BtfError(KernelReadError):
    """BTF type information is malformed, or lacks a type or member kreld needs."""

    def __init__(self, path: str, reason: str, offset: int | None = None) -> None:
        where = path if offset is None else f"{path} (byte {offset})"
        KreldError.__init__(self, f"{where}: {reason}")
        self.path = path
        self.reason = reason
        self.offset = offset


class NoSuchBoot(KreldError):
    varlink_name = "io.kreld.NoSuchBoot"
    exit_code = ExitCode.NO_SUCH_BOOT

    def __init__(self, boot_id: str) -> None:
        super().__init__(f"no boot {boot_id!r} is recorded")
        self.boot_id = boot_id

    def parameters(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id}


class AmbiguousBoot(KreldError):
    varlink_name = "io.kreld.AmbiguousBoot"
    exit_code = ExitCode.NO_SUCH_BOOT

    def __init__(self, prefix: str, matches: list[str]) -> None:
        super().__init__(f"boot prefix {prefix!r} matches {len(matches)} boots")
        self.prefix = prefix
        self.matches = matches

    def parameters(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "matches": self.matches}


class AddressesRestricted(KreldError):
    """Addresses were hidden from kreld itself (kptr_restrict, no CAP_SYSLOG)."""

    varlink_name = "io.kreld.AddressesRestricted"
    exit_code = ExitCode.PERMISSION_DENIED

    def __init__(self, reason: str) -> None:
        super().__init__(f"kernel addresses are restricted: {reason}")
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"reason": self.reason}


class SymbolsUnavailable(KreldError):
    """No symbol table is recorded for a boot's kernel."""

    varlink_name = "io.kreld.SymbolsUnavailable"

    def __init__(self, boot_id: str, reason: str) -> None:
        super().__init__(f"no kernel symbols recorded for boot {boot_id}: {reason}")
        self.boot_id = boot_id
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "reason": self.reason}


class PermissionDenied(KreldError):
    varlink_name = "io.kreld.PermissionDenied"
    exit_code = ExitCode.PERMISSION_DENIED


class StoreError(KreldError):
    """The LMDB store cannot be used."""

    varlink_name = "io.kreld.StoreError"
    exit_code = ExitCode.STORE

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"store {path}: {reason}")
        self.path = path
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


class StoreCorrupt(StoreError):
    """The file is damaged, truncated, or not a kreld store at all."""

    varlink_name = "io.kreld.StoreCorrupt"


class StoreDamaged(StoreCorrupt):
    """An LMDB file that was kreld's store, cut short or with damaged pages.

    Unlike a foreign or garbage file it is set aside by the daemon, which
    then starts a fresh store (:mod:`kreld.store.lock`).
    """


class StoreLocked(StoreError):
    """Another kreld writes to this store (it holds the store's lock).

    A startup and kreldctl error, never a reply: the daemon that holds the
    lock is the one answering (on the wire it would be a StoreError)."""

    exit_code = ExitCode.STORE_LOCKED


class StoreTooNew(StoreError):
    """The store was written by a newer kreld with a schema this one cannot read."""

    varlink_name = "io.kreld.StoreTooNew"

    def __init__(self, path: str, found: int, supported: int) -> None:
        super().__init__(
            path, f"schema version {found} is newer than the supported version {supported}"
        )
        self.found = found
        self.supported = supported


class StoreFull(StoreError):
    """The disk under the store is full; nothing partial was written."""

    varlink_name = "io.kreld.StoreFull"


class SocketError(KreldError):
    """The listening socket cannot be had safely (in use, planted, unsafe directory)."""

    varlink_name = "io.kreld.SocketError"


class ConfigError(KreldError):
    """The configuration is unusable; names the file, key or line."""

    varlink_name = "io.kreld.ConfigError"
    exit_code = ExitCode.CONFIG

    def __init__(self, file: str, reason: str, key: str | None = None) -> None:
        where = f"{file}: {key}" if key else file
        super().__init__(f"{where}: {reason}")
        self.file = file
        self.key = key
        self.reason = reason


class OutputError(KreldError):
    """A file kreldctl was asked to write cannot be written safely or at all: a
    directory, a link it will not follow, a missing directory, a full disk."""

    varlink_name = "io.kreld.OutputError"
    exit_code = ExitCode.OUTPUT

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class PerfDataError(KreldError):
    """A perf.data file cannot be read: not one, truncated, or a size that overruns it."""

    varlink_name = "io.kreld.PerfDataError"
    exit_code = ExitCode.ERROR

    def __init__(self, path: str, reason: str, offset: int | None = None) -> None:
        where = f"{path}" if offset is None else f"{path} (byte {offset})"
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.reason = reason
        self.offset = offset


class PerfDataTooLarge(PerfDataError):
    """A perf.data goes past one of the reader's bounds (a compressed record that
    inflates too far, more module maps or build-ids than any kernel has): refused
    before it is expanded further."""

    varlink_name = "io.kreld.PerfDataTooLarge"

    def __init__(self, path: str, what: str, limit: int, offset: int | None = None) -> None:
        # *what* is counted: "module maps", "bytes inflated from one compressed record"
        super().__init__(path, f"more than {limit:,} {what}", offset)
        self.what = what
        self.limit = limit


class NoBootForRecording(NoSuchBoot):
    """No recorded boot has the kernel build and ``_text`` a perf.data was recorded on."""

    def __init__(self, path: str, reason: str, nearest: list[str]) -> None:
        KreldError.__init__(self, _no_boot_message(path, reason, nearest))
        self.boot_id = ""
        self.path = path
        self.reason = reason
        self.nearest = nearest


def _no_boot_message(path: str, reason: str, nearest: list[str]) -> str:
    lines = [f"no recorded boot matches {path}: {reason}"]
    if nearest:
        lines.append("nearest recorded boots (same kernel build, another _text):")
        lines += [f"  {n}" for n in nearest]
    return "\n".join(lines)


class FleetError(KreldError):
    """Object storage (the fleet bucket) cannot be used: unreachable, refused, misnamed."""

    varlink_name = "io.kreld.FleetError"

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"url": self.url, "reason": self.reason}


class FleetObjectInvalid(FleetError):
    """An object in the bucket is malformed, from a newer kreld, or not kreld's at all."""

    varlink_name = "io.kreld.FleetObjectInvalid"
    exit_code = ExitCode.STORE

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key = key


class InvalidArgument(KreldError):
    """A user-supplied value (address, time, boot-id) is malformed."""

    varlink_name = "org.varlink.service.InvalidParameter"
    exit_code = ExitCode.USAGE

    def __init__(self, parameter: str, reason: str) -> None:
        super().__init__(f"{parameter}: {reason}")
        self.parameter = parameter
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"parameter": self.parameter}


class MethodNotFound(KreldError):
    """A call named a method its interface does not have."""

    varlink_name = "org.varlink.service.MethodNotFound"
    exit_code = ExitCode.USAGE

    def __init__(self, method: str) -> None:
        super().__init__(f"no such method: {method}")
        self.method = method

    def parameters(self) -> dict[str, Any]:
        return {"method": self.method}


class MethodNotImplemented(MethodNotFound):
    """A declared method this server (or reader) cannot carry out."""

    varlink_name = "org.varlink.service.MethodNotImplemented"

    def __init__(self, method: str) -> None:
        KreldError.__init__(self, f"not implemented here: {method}")
        self.method = method


class LineTableError(KreldError):
    """A debug file cannot give source lines: not ELF, a layout or relocation
    kreld does not handle, or DWARF the reader refuses."""

    varlink_name = "io.kreld.LineTableError"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def parameters(self) -> dict[str, Any]:
        return {"message": self.message, "path": self.path, "reason": self.reason}


class InterfaceNotFound(KreldError):
    """A call named an interface kreld does not serve."""

    varlink_name = "org.varlink.service.InterfaceNotFound"
    exit_code = ExitCode.USAGE

    def __init__(self, interface: str | None) -> None:
        super().__init__(f"no such interface: {interface}")
        self.interface = interface

    def parameters(self) -> dict[str, Any]:
        return {"interface": self.interface}
