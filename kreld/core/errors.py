"""The error family.

Every error kreld reports is a :class:`KreldError` subclass with typed
attributes, a readable message, the varlink error name the server answers
with and the exit code ``kreld``/``kreldctl`` end with.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any, ClassVar

__all__ = [
    "EXIT_STATUS",
    "AddressNotMapped",
    "AddressesRestricted",
    "AmbiguousBoot",
    "BtfError",
    "ConfigError",
    "DebuginfoError",
    "DebuginfoMismatch",
    "DebuginfoNotFound",
    "DebuginfodError",
    "DebuginfodMissing",
    "DebuginfodTimeout",
    "DebuginfodTooLarge",
    "DebuginfodTruncated",
    "ExitCode",
    "FleetError",
    "FleetObjectInvalid",
    "InterfaceNotFound",
    "InvalidArgument",
    "InvalidRequest",
    "KallsymsTableError",
    "KernelMemoryError",
    "KernelReadError",
    "KreldError",
    "LineTableError",
    "MessageTooLarge",
    "MethodNotFound",
    "MethodNotImplemented",
    "ModuleListChanged",
    "NoBootForRecording",
    "NoSuchBoot",
    "NotReady",
    "NoteError",
    "OutputError",
    "PerfDataError",
    "PermissionDenied",
    "RecordRefused",
    "SocketError",
    "StoreCorrupt",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreTooNew",
    "SubscriberTooSlow",
    "SymbolsUnavailable",
    "TooManyConnections",
    "TooManyConnectionsPerUid",
    "error_classes",
    "exit_status_help",
]


class ExitCode(IntEnum):
    """Exit codes of ``kreld`` and ``kreldctl``; what each means to each program is
    :data:`EXIT_STATUS`, the one table their ``--help``, man pages and README are
    made from (``scripts/gendocs``, checked by tests/project/test_docs.py)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NO_SUCH_BOOT = 3
    PERMISSION_DENIED = 4
    STORE = 5
    CONFIG = 6
    STORE_LOCKED = 7
    OUTPUT = 8


#: Per program, the exit codes it can end with and what each means: a short
#: phrase (README) and a sentence (``--help`` and the man page's EXIT STATUS).
EXIT_STATUS: dict[str, dict[ExitCode, tuple[str, str]]] = {
    "kreld": {
        ExitCode.OK: ("stopped cleanly", "Stopped cleanly on SIGTERM or SIGINT."),
        ExitCode.ERROR: (
            "an error kept it from running",
            "An error kept it from running (it is logged), for example the socket is in use.",
        ),
        ExitCode.USAGE: ("usage", "The command line is malformed."),
        ExitCode.STORE: (
            "store unusable",
            "The store is unusable: corrupt or truncated before its meta pages, not a kreld"
            " store, or written by a newer kreld.",
        ),
        ExitCode.CONFIG: (
            "bad configuration",
            "The configuration is invalid or past one of its bounds; the message names the"
            " file and the key or line.",
        ),
        ExitCode.STORE_LOCKED: (
            "store locked",
            "Another kreld writes to this store (it holds the store's lock); the message"
            " names its pid.",
        ),
    },
    "kreldctl": {
        ExitCode.OK: ("ok", "Success."),
        ExitCode.ERROR: (
            "error",
            "An error; the message says which. resolve also exits 1 when an address lies"
            " in no recorded image.",
        ),
        ExitCode.USAGE: ("usage", "Usage: a malformed option, address or time."),
        ExitCode.NO_SUCH_BOOT: (
            "no such boot",
            "No such boot is recorded, or a boot prefix matches several.",
        ),
        ExitCode.PERMISSION_DENIED: (
            "permission denied or addresses restricted",
            "Permission denied by the daemon, or the kernel's addresses were restricted"
            " when the boot was recorded.",
        ),
        ExitCode.STORE: (
            "store unusable",
            "The store is unusable: missing, corrupt, not a kreld store, or written by a"
            " newer kreld.",
        ),
        ExitCode.CONFIG: (
            "bad configuration",
            "The configuration is invalid; the message names the file and the key.",
        ),
        ExitCode.STORE_LOCKED: (
            "another kreld writes to the store",
            "snapshot or gc with no daemon answering: another kreld writes to the store"
            " (it holds the store's lock), so kreldctl does not write beside it.",
        ),
        ExitCode.OUTPUT: (
            "-o FILE cannot be written safely",
            "An output file (-o) cannot be written safely or at all: a directory, a link"
            " to a file, a full disk (see OUTPUT FILES in kreldctl(1)).",
        ),
    },
}


def exit_status_help(program: str, width: int = 78) -> str:
    """The ``exit status:`` part of *program*'s ``--help`` epilog."""
    import textwrap

    lines = ["exit status:"]
    for code, (_short, sentence) in EXIT_STATUS[program].items():
        lines += textwrap.wrap(
            sentence, width, initial_indent=f"  {int(code)}  ", subsequent_indent="     "
        )
    return "\n".join(lines) + "\n"


class KreldError(Exception):
    """Base of every error kreld reports to a user or a peer."""

    varlink_name: ClassVar[str] = "io.kreld.InternalError"
    exit_code: ClassVar[ExitCode] = ExitCode.ERROR
    #: The varlink error's parameters, each an attribute of the same name: the
    #: IDL declares the same list (tests/core/test_errors.py holds the two together).
    fields: ClassVar[tuple[str, ...]] = ("message",)

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def parameters(self) -> dict[str, Any]:
        """The varlink error parameters."""
        return {f: getattr(self, f) for f in self.fields}

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> KreldError:
        """The error a reply names, rebuilt from its parameters: the inverse of
        :meth:`parameters`.  A class whose constructor takes more than its wire
        fields comes back with the server's message and its fields."""
        if cls.fields == ("message",) and cls.__init__ is not KreldError.__init__:
            return cls._rebuilt(str(params.get("message", "")))
        return cls(*(params.get(f, "") for f in cls.fields))

    @classmethod
    def _rebuilt(cls, message: str, **attrs: Any) -> KreldError:
        """An instance made from a reply whose parameters do not hold all the
        constructor wants (the message as the server wrote it, the rest as sent)."""
        e = cls.__new__(cls)
        KreldError.__init__(e, message)
        e.__dict__.update(attrs)
        return e


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


class KallsymsTableError(KernelMemoryError):
    """The kernel's kallsyms tables in its memory are not named, not mapped, do
    not hold together, or decode to another table than ``/proc/kallsyms``
    lists: no symbol is taken from them."""


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
    fields = ("boot_id",)

    def __init__(self, boot_id: str) -> None:
        super().__init__(f"no boot {boot_id!r} is recorded")
        self.boot_id = boot_id


class NotReady(KreldError):
    """The daemon is still starting (reading the kernel, a vmlinux, the modules)
    and cannot yet answer this from what it has recorded."""

    varlink_name = "io.kreld.NotReady"
    exit_code = ExitCode.ERROR
    fields = ("starting",)

    def __init__(self, starting: list[str]) -> None:
        super().__init__(f"kreld is still starting: {', '.join(starting) or 'almost done'}")
        self.starting = starting


class AmbiguousBoot(KreldError):
    varlink_name = "io.kreld.AmbiguousBoot"
    exit_code = ExitCode.NO_SUCH_BOOT
    fields = ("prefix", "matches")

    def __init__(self, prefix: str, matches: list[str]) -> None:
        super().__init__(f"boot prefix {prefix!r} matches {len(matches)} boots")
        self.prefix = prefix
        self.matches = matches


class AddressesRestricted(KreldError):
    """Addresses were hidden from kreld itself (kptr_restrict, no CAP_SYSLOG)."""

    varlink_name = "io.kreld.AddressesRestricted"
    exit_code = ExitCode.PERMISSION_DENIED
    fields = ("reason",)

    def __init__(self, reason: str) -> None:
        super().__init__(f"kernel addresses are restricted: {reason}")
        self.reason = reason


class SymbolsUnavailable(KreldError):
    """No symbol table is recorded for a boot's kernel."""

    varlink_name = "io.kreld.SymbolsUnavailable"
    fields = ("boot_id", "reason")

    def __init__(self, boot_id: str, reason: str) -> None:
        super().__init__(f"no kernel symbols recorded for boot {boot_id}: {reason}")
        self.boot_id = boot_id
        self.reason = reason


class PermissionDenied(KreldError):
    varlink_name = "io.kreld.PermissionDenied"
    exit_code = ExitCode.PERMISSION_DENIED


class StoreError(KreldError):
    """The LMDB store cannot be used."""

    varlink_name = "io.kreld.StoreError"
    exit_code = ExitCode.STORE
    fields = ("path", "reason")

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"store {path}: {reason}")
        self.path = path
        self.reason = reason


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

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> KreldError:
        path, reason = str(params.get("path", "")), str(params.get("reason", ""))
        return cls._rebuilt(f"store {path}: {reason}", path=path, reason=reason)


class RecordRefused(StoreError):
    """A record the store's own readers would refuse (a number past what its
    encoding holds): refused before it is written, the store left as it was."""


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
    fields = ("url", "reason")

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class FleetObjectInvalid(FleetError):
    """An object in the bucket is malformed, from a newer kreld, or not kreld's at all."""

    varlink_name = "io.kreld.FleetObjectInvalid"
    exit_code = ExitCode.STORE

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key = key


class DebuginfoError(KreldError):
    """Debug information for a kernel build cannot be had: the base of the
    errors of finding, fetching and checking debug files."""

    varlink_name = "io.kreld.DebuginfoError"
    fields: ClassVar[tuple[str, ...]] = ("build_id", "reason")

    def __init__(self, build_id: str, reason: str) -> None:
        super().__init__(f"debuginfo for build {build_id}: {reason}")
        self.build_id = build_id
        self.reason = reason

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> KreldError:
        # The subclasses' constructors take more than the wire carries (where
        # it looked, the found build-id): each comes back with the reason the
        # server wrote, which already says all of it.
        attrs = {f: str(params.get(f, "")) for f in cls.fields}
        message = f"debuginfo for build {attrs['build_id']}: {attrs['reason']}"
        return cls._rebuilt(message, **attrs)


class DebuginfoMismatch(DebuginfoError):
    """A debug file (a local one, or a debuginfod reply) is of another build,
    or has no build-id at all: refused, never cached."""

    varlink_name = "io.kreld.DebuginfoMismatch"

    def __init__(self, build_id: str, source: str, found: str | None) -> None:
        got = f"build-id {found}" if found else "no GNU build-id note"
        super().__init__(build_id, f"{source} has {got}")
        self.source = source
        self.found = found


class DebuginfoNotFound(DebuginfoError):
    """No debug file of the build anywhere kreld was told to look; says where
    it looked and what each debuginfod server answered."""

    varlink_name = "io.kreld.DebuginfoNotFound"

    def __init__(
        self, build_id: str, what: str, looked: tuple[str, ...], failures: tuple[str, ...]
    ) -> None:
        where = "; ".join(looked) if looked else "no debuginfo directory is configured"
        reason = f"no debug file of {what}: looked in {where}"
        if failures:
            reason += "; " + "; ".join(failures)
        super().__init__(build_id, reason)
        self.what = what
        self.looked = looked
        self.failures = failures


class DebuginfodError(DebuginfoError):
    """A debuginfod server could not give the file: unreachable, or an answer
    other than the file (the subclasses name the usual ones)."""

    varlink_name = "io.kreld.DebuginfodError"
    fields = ("build_id", "url", "reason")

    def __init__(self, build_id: str, url: str, reason: str) -> None:
        super().__init__(build_id, f"debuginfod {url}: {reason}")
        self.url = url


class DebuginfodMissing(DebuginfodError):
    """The server answered 404: it has no debug file of this build."""

    varlink_name = "io.kreld.DebuginfodMissing"


class DebuginfodTimeout(DebuginfodError):
    """The server did not connect, went silent, or took longer than the whole
    download may take."""

    varlink_name = "io.kreld.DebuginfodTimeout"


class DebuginfodTruncated(DebuginfodError):
    """The reply ended before the length it announced (or its chunked body broke off)."""

    varlink_name = "io.kreld.DebuginfodTruncated"


class DebuginfodTooLarge(DebuginfodError):
    """The reply announced, or ran to, more bytes than one debug file may have."""

    varlink_name = "io.kreld.DebuginfodTooLarge"

    def __init__(self, build_id: str, url: str, limit: int) -> None:
        super().__init__(build_id, url, f"the file is larger than {limit:,} bytes")
        self.limit = limit


class InvalidArgument(KreldError):
    """A user-supplied value (address, time, boot-id) is malformed."""

    varlink_name = "org.varlink.service.InvalidParameter"
    exit_code = ExitCode.USAGE
    fields = ("parameter",)

    def __init__(self, parameter: str, reason: str) -> None:
        super().__init__(f"{parameter}: {reason}")
        self.parameter = parameter
        self.reason = reason

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> KreldError:
        # org.varlink.service.InvalidParameter carries the parameter's name alone.
        return cls(str(params.get("parameter", "")), "rejected by kreld")


class MethodNotFound(KreldError):
    """A call named a method its interface does not have."""

    varlink_name = "org.varlink.service.MethodNotFound"
    exit_code = ExitCode.USAGE
    fields = ("method",)

    def __init__(self, method: str) -> None:
        super().__init__(f"no such method: {method}")
        self.method = method


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
    fields = ("path", "reason")

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class InterfaceNotFound(KreldError):
    """A call named an interface kreld does not serve."""

    varlink_name = "org.varlink.service.InterfaceNotFound"
    exit_code = ExitCode.USAGE
    fields = ("interface",)

    def __init__(self, interface: str | None) -> None:
        super().__init__(f"no such interface: {interface}")
        self.interface = interface


# -- refusals of the socket's listener: a peer's message or connection, not a call ----


class InvalidRequest(KreldError):
    """A message that is not a varlink call: not JSON, not an object, nested too deep."""

    varlink_name = "io.kreld.InvalidRequest"
    exit_code = ExitCode.USAGE
    fields = ("reason",)

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid request: {reason}")
        self.reason = reason


class MessageTooLarge(KreldError):
    """A message longer than ``[limits] max_message_bytes``."""

    varlink_name = "io.kreld.MessageTooLarge"
    fields = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__(f"a message is limited to {limit} bytes")
        self.limit = limit


class TooManyConnections(KreldError):
    """kreld holds ``[limits] max_connections`` connections already."""

    varlink_name = "io.kreld.TooManyConnections"
    fields = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__(f"kreld holds its limit of {limit} connections")
        self.limit = limit


class TooManyConnectionsPerUid(KreldError):
    """The peer's uid holds ``[limits] max_connections_per_uid`` connections already."""

    varlink_name = "io.kreld.TooManyConnectionsPerUid"
    fields = ("uid", "limit")

    def __init__(self, uid: int, limit: int) -> None:
        super().__init__(f"uid {uid} holds its limit of {limit} connections")
        self.uid = uid
        self.limit = limit


class SubscriberTooSlow(KreldError):
    """A subscriber left this many events unread: it is dropped, no one waits on it."""

    varlink_name = "io.kreld.SubscriberTooSlow"
    fields = ("queued",)

    def __init__(self, queued: int) -> None:
        super().__init__(f"subscriber too slow: {queued} events unread")
        self.queued = queued


def error_classes() -> dict[str, type[KreldError]]:
    """Every varlink error name of the family, to the class that names it first
    (a subclass that keeps its parent's name, as :class:`NoBootForRecording`,
    travels as the parent): what a client turns a reply back into."""
    found: dict[str, type[KreldError]] = {KreldError.varlink_name: KreldError}

    def walk(cls: type[KreldError]) -> None:
        for sub in cls.__subclasses__():
            if "varlink_name" in vars(sub):
                found.setdefault(sub.varlink_name, sub)
            walk(sub)

    walk(KreldError)
    return found
