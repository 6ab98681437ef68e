"""``/proc/kallsyms``: read once and kept as the bytes the kernel printed, parsed,
(rendered again for a recorded boot by :mod:`kreld.symbols.export`).

Reading kallsyms is dear (the kernel formats every one of its ~120,000 lines
for each read) and so is parsing all of it into Python objects (a tenth of a
second and tens of MB).  So:

* a start reads it once: the snapshot's anchors and the symbol worker's first
  capture share that read (:meth:`KallsymsText.read`);
* a module's lines are picked out of the raw bytes by searching for its
  ``\\t[name]`` tag, over the bracketed tail only, without parsing the rest;
* the kernel's own lines are streamed, one match at a time, into the columns
  of a packed table (:meth:`KallsymsText.core`, streamed into
  :func:`kreld.core.symtab.kernel_table`): no list of tuples per
  line is ever built.

``/proc/kallsyms`` prints the core kernel's symbols first, then every
module's, then other bracketed owners (ftrace trampolines, ``[bpf]``):
``update_iter()`` in kernel/kallsyms.c walks the ``kallsyms_num_syms`` core
entries before ``get_ksymbol_mod()`` and the rest.  A core line has no tab, so
the first tab starts the tail.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.record import record
from kreld.kernel.files import KernelFileTooLarge
from kreld.kernel.info import Root

__all__ = [
    "TAIL_CHUNK",
    "CodeLine",
    "Kallsyms",
    "KallsymsText",
    "Line",
    "is_code_line",
    "parse_kallsyms",
]

Line = tuple[int, bytes, bytes]  # (address, type letter, name)
# The buffer the core lines pass through in KallsymsText.read_tail.
TAIL_CHUNK = 1 << 18

# address, type letter, name (a core line: no tab), one line at a time.
# An address of more than 16 hex digits is none the kernel prints: such a line
# does not match, and is left out rather than parsed into a number no reader takes.
_CORE_LINE = re.compile(rb"^([0-9a-fA-F]{1,16}) (\S) ([^\t\n]+)$", re.MULTILINE)
# the same with an owner: "name\t[owner]".
_OWNED_LINE = re.compile(rb"^([0-9a-fA-F]{1,16}) (\S) ([^\t\n]+)\t\[([^\]\n]+)\]", re.MULTILINE)
# a line of kernel code beyond the image and modules: owner [bpf] or [__builtin__*].
_CODE_LINE = re.compile(
    rb"^([0-9a-fA-F]{1,16}) (\S) ([^\t\n]+)\t\[(bpf|__builtin__[^\]\n]*)\]", re.MULTILINE
)
# How many lines with an owner decide whether the tail shows zeros.
_OWNED_PROBE = 64


@record
class CodeLine:
    """A ``[bpf]`` or ``[__builtin__*]`` line of kallsyms: kernel code."""

    addr: int
    type: str
    name: str
    owner: str


def is_code_line(line: str) -> bool:
    """Whether a kallsyms line (as text) is one of kernel code: ``[bpf]`` or
    ``[__builtin__*]`` (ftrace trampolines, kprobe pages)."""
    return line.rpartition("\t[")[2].startswith(("bpf]", "__builtin__"))


@record
class KallsymsText:
    """The raw text of one read, and where its bracketed tail starts."""

    data: bytes
    tail: int  # offset of the first line with an owner (len(data) if none)
    taken: int  # CLOCK_MONOTONIC ns just before the read

    @classmethod
    def of(cls, data: bytes, taken: int = 0) -> KallsymsText:
        tab = data.find(b"\t")  # one byte: memchr, not a search of a pattern
        tail = len(data) if tab < 0 else data.rfind(b"\n", 0, tab) + 1
        return cls(data, tail, taken)

    @classmethod
    def read(cls, root: Root) -> KallsymsText:
        """Read ``/proc/kallsyms`` under *root* (:class:`KernelReadError` if it cannot)."""
        taken = time.monotonic_ns()
        return cls.of(root.read_bytes(consts.KALLSYMS, consts.MAX_KALLSYMS), taken)

    @classmethod
    def read_tail(cls, root: Root, chunk: int = TAIL_CHUNK) -> KallsymsText:
        """Read ``/proc/kallsyms`` under *root*, keeping only its bracketed tail
        (the lines with an owner): what a module's capture needs.

        The core lines (megabytes) pass through one reused buffer of *chunk*
        bytes and are never kept: no buffer of the whole text is allocated,
        faulted in and freed again for each batch of loads.  The result has
        no core lines (:meth:`core` yields nothing).
        """
        taken = time.monotonic_ns()
        path = root / consts.KALLSYMS
        buf = bytearray(chunk)
        view = memoryview(buf)
        kept: list[bytes] = []
        partial = b""  # the start of a line that runs into the next chunk
        total = 0
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
                    if total > consts.MAX_KALLSYMS:
                        raise KernelFileTooLarge(str(path), consts.MAX_KALLSYMS)
                    if kept:
                        kept.append(bytes(view[:n]))
                        continue
                    tab = buf.find(b"\t", 0, n)  # a core line has none
                    end = n if tab < 0 else tab
                    nl = buf.rfind(b"\n", 0, end)
                    start = partial + bytes(view[:end]) if nl < 0 else bytes(view[nl + 1 : end])
                    if tab < 0:
                        partial = start
                    else:
                        kept += [start, bytes(view[tab:n])]
        except OSError as e:
            raise KernelReadError(str(path), e.strerror or str(e)) from e
        finally:
            view.release()
        return cls(b"".join(kept), 0, taken)

    def core(self) -> Iterator[Line]:
        """The kernel's own lines, in the kernel's order, one at a time."""
        for m in _CORE_LINE.finditer(self.data, 0, self.tail):
            yield int(m[1], 16), m[2], m[3]

    def zeroed(self, lines: int = 64) -> bool:
        """Whether the first *lines* core lines all show a zero address (restricted)."""
        for i, (value, _t, _n) in enumerate(self.core()):
            if value:
                return False
            if i + 1 >= lines:
                break
        return True

    def tail_zeroed(self) -> bool:
        """Whether the lines with an owner show zero addresses (kptr_restrict): an
        absent line then says nothing of what is loaded.  The first few decide (a
        module's per-cpu or absolute symbols may be 0 where nothing is)."""
        seen = 0
        for m in _OWNED_LINE.finditer(self.data, self.tail):
            if m[1].strip(b"0"):
                return False
            seen += 1
            if seen >= _OWNED_PROBE:
                break
        return seen > 0

    def code_lines(self) -> list[CodeLine]:
        """The kernel-code lines of the tail, in the kernel's order."""
        return [
            CodeLine(int(m[1], 16), m[2].decode(), m[3].decode("utf-8", "replace"), m[4].decode())
            for m in _CODE_LINE.finditer(self.data, self.tail)
        ]

    def module(self, name: str) -> list[Line]:
        """The lines of *name* (``…\\t[name]``), in the kernel's order; found by
        searching the tail for the tag, the other lines left unparsed."""
        data = self.data
        tag = b"\t[" + name.encode() + b"]"
        out: list[Line] = []
        pos = data.find(tag, self.tail)
        while pos >= 0:
            end = pos + len(tag)
            if end == len(data) or data[end] in b"\r\n":
                m = _OWNED_LINE.match(data, data.rfind(b"\n", 0, pos) + 1)
                if m is not None and m.end() == end:
                    out.append((int(m[1], 16), m[2], m[3]))
            pos = data.find(tag, end)
        return out

    def owned(self, skip: set[str]) -> list[str]:
        """Lines of bracketed owners not in *skip* (``[bpf]``, ftrace), as the
        kernel printed them: only the tail is parsed."""
        out = []
        for m in _OWNED_LINE.finditer(self.data, self.tail):
            owner = m[4].decode("ascii", "replace")
            if owner in skip:
                continue
            name = m[3].decode("utf-8", "replace")
            out.append(f"{int(m[1], 16):016x} {m[2].decode()} {name}\t[{owner}]")
        return out


# -- a whole read, parsed (what the fast paths above are checked against) --------


@record
class Kallsyms:
    """One read of ``/proc/kallsyms``, split as the kernel prints it."""

    core: list[tuple[int, bytes, bytes]]  # (address, type, name)
    modules: dict[str, list[tuple[int, bytes, bytes]]]  # module -> its lines, in order
    order: list[str]  # modules (and other bracketed owners) in file order


def parse_kallsyms(data: bytes) -> Kallsyms:
    core: list[tuple[int, bytes, bytes]] = []
    modules: dict[str, list[tuple[int, bytes, bytes]]] = {}
    order: list[str] = []
    for line in data.split(b"\n"):
        if not line:
            continue
        addr, sp, rest = line.partition(b" ")
        typ, sp2, name = rest.partition(b" ")
        if not sp or not sp2 or len(typ) != 1:
            continue
        try:
            value = int(addr, 16)
        except ValueError:
            continue
        sym, tab, owner = name.partition(b"\t")
        if tab:
            mod = owner.strip(b"[]").decode("ascii", "replace")
            if mod not in modules:
                modules[mod] = []
                order.append(mod)
            modules[mod].append((value, typ, sym))
        else:
            core.append((value, typ, sym))
    return Kallsyms(core, modules, order)
