"""``kreldctl symbolize --for PERF.DATA --lines``: ``perf script`` output with
each kernel frame's source lines and inline chain.

The output is ``symbolize --for``'s (every ``[unknown]`` kernel frame named
at its sample's time), and after each line holding kernel frames, each
frame's chain, innermost first, indented under it::

    <TAB>ffffffffc0100410 cold_path+0x10 ([prog])
    <TAB>                 leaf at /src/lines_src/helpers.h:7 (inlined)
    <TAB>                 cold_path at /src/lines_src/prog.c:10

or ``(no lines: WHY)``.  With ``--json``, one object per sample that has
kernel frames: ``sample`` (its first line), ``time`` (ns on the recording's
clock, or null) and ``kernel_frames``, each ``address``, ``symbol``, ``dso``
(``possible`` where named from a load seen late) and ``frames`` as ``resolve
--lines --json`` gives them (``no_lines`` where there are none).  Without
``--lines``, ``--json`` gives the same objects without ``frames`` and
``no_lines``.

A frame is placed where :class:`~kreld.perf.commands.Symbolizer` places it
(the load live at the sample's time), and its lines come from the build's
line table (:mod:`kreld.ctl.lines`' session: ``--debuginfo-dir``, the
configured places, debuginfod, the store's kept tables).  A recording holds
hundreds of thousands of samples over a few thousand addresses: frames are
answered a batch at a time, each build's table asked for once, the
addresses of one build looked up together
(:func:`~kreld.symbols.linequery.lines_in`), and an address already
answered in the same place comes from a bounded memo.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TextIO

from kreld.ctl.lines import frame_text
from kreld.symbols.linequery import LineAnswer, lines_in
from kreld.symbols.linetables import wanted_for

if TYPE_CHECKING:
    from kreld.core.textin import Line
    from kreld.ctl.lines import LineSession
    from kreld.perf.commands import LinesHook, ScriptNamer
    from kreld.perf.match import BootMatch
    from kreld.symbols.queries import Region

__all__ = ["BATCH", "FrameLines", "kernel_frames", "lines_hook"]

# Frames answered together (one numpy look-up per build per batch), and the
# most text held meanwhile (lines are up to 64 KiB: kreld/core/textin.py).
BATCH = 8192
BATCH_BYTES = 4 << 20
# A sample's kernel frames in one JSON object at most (perf's own call chains
# stop at kernel.perf_event_max_stack, 127 by default): a longer run of frame
# lines goes on in another object of the same sample, so memory stays bounded.
SAMPLE_FRAMES = 1024
# Distinct (address, place) answers remembered across batches at most.
MEMO = 1 << 16
_KERNEL_HALF = 0xFFFF800000000000
# A frame as symbolize --for writes it: "ADDRESS SYMBOL[ (possible)] (DSO)";
# the symbol has no space nor parenthesis, each part is bounded.
_FRAME = re.compile(
    r"(?<![0-9A-Za-z_])([0-9a-f]{16}) ([^\s()]{1,4096})( \(possible\))? \(([^()\n]{0,4096})\)"
)
# Under a frame's symbol: a tab and the 16 digits of its address and a space.
_INDENT = "\t" + " " * 17


# Lines held until their frames are answered: (text, sample time, kernel frames).
Pending = list[tuple[str, "int | None", list[tuple[int, str, bool, str]]]]


def kernel_frames(line: str) -> list[tuple[int, str, bool, str]]:
    """The kernel frames of one written line: (address, symbol, possible, dso)."""
    out = []
    for m in _FRAME.finditer(line):
        address = int(m.group(1), 16)
        if address >= _KERNEL_HALF:
            out.append((address, m.group(2), m.group(3) is not None, m.group(4)))
    return out


class FrameLines:
    """The lines of kernel frames of one recording, asked a batch at a time."""

    def __init__(self, session: LineSession, m: BootMatch, namer: ScriptNamer) -> None:
        wanted = wanted_for(m.boot.build_id, m.incarnations, m.boot.release)
        self.source = session.provider.source_for(wanted)
        self.kernel_build_id = m.boot.build_id
        self.sym = namer.sym
        self.memo: dict[tuple[int, int], LineAnswer] = {}

    def answers(self, asked: list[tuple[int, int | None]]) -> list[LineAnswer]:
        """Each (address, sample time)'s answer."""
        regions = [self.sym.region(a, t) for a, t in asked]
        keys = [(a, id(r)) for (a, _), r in zip(asked, regions, strict=True)]
        todo: dict[tuple[int, int], Region] = {}
        for r, k in zip(regions, keys, strict=True):
            if r is not None and k not in self.memo:
                todo.setdefault(k, r)
        got = lines_in([(a, r) for (a, _), r in todo.items()], self.kernel_build_id, self.source)
        fresh = dict(zip(todo, got, strict=True))
        out = [
            self._elsewhere(a, t) if r is None else (fresh[k] if k in fresh else self.memo[k])
            for (a, t), r, k in zip(asked, regions, keys, strict=True)
        ]
        if len(self.memo) + len(fresh) > MEMO:
            self.memo.clear()
        self.memo.update(fresh)
        return out

    def _elsewhere(self, address: int, t: int | None) -> LineAnswer:
        """A frame in neither the kernel image nor a module: kernel code (a
        BPF program, a trampoline) has no debuginfo; else nothing held it."""
        f = self.sym.frame(address, t)
        if f is not None:
            return LineAnswer((), f"{f.dso} code has no debuginfo")
        return LineAnswer((), "not in the kernel image nor in a module loaded then")


def lines_hook(session: LineSession | None, as_json: bool) -> LinesHook | None:
    """What :func:`~kreld.perf.commands.symbolize_for` calls to write its output
    with lines (a *session*: ``--lines``) or as JSON: text with each frame's
    lines, or with *as_json* the samples' JSON array, each frame's lines in it
    when there is a *session*.  None for plain text without lines."""
    if session is None and not as_json:
        return None
    kept = session

    def run(m: BootMatch, namer: ScriptNamer, lines: Iterable[Line], out: TextIO) -> None:
        writer = _JsonWriter(out) if as_json else _TextWriter(out)
        answering = None if kept is None else FrameLines(kept, m, namer)
        pending: Pending = []
        asked = held = 0
        for line, whole in lines:
            text = namer.line(line) if whole else line
            frames = kernel_frames(text) if whole else []
            pending.append((text, namer.t, frames))
            asked += len(frames)
            held += len(text)
            if asked >= BATCH or len(pending) >= BATCH or held >= BATCH_BYTES:
                writer.write(pending, answering)
                pending, asked, held = [], 0, 0
        writer.write(pending, answering)
        writer.close()
        if kept is not None:
            kept.report_unkept()

    return run


def _answered(pending: Pending, answering: FrameLines | None) -> list[list[LineAnswer | None]]:
    """Each pending line's frames' answers, asked in one batch (None: no lines asked)."""
    asked = [(f[0], t) for _, t, frames in pending for f in frames]
    got: list[LineAnswer | None] = [None] * len(asked)
    if answering is not None:
        got = list(answering.answers(asked))
    out, k = [], 0
    for _, _, frames in pending:
        out.append(got[k : k + len(frames)])
        k += len(frames)
    return out


class _TextWriter:
    """perf script's lines as they came (kernel frames named), each frame's
    chain after its line."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, pending: Pending, answering: FrameLines | None) -> None:
        for (text, _, _), answers in zip(pending, _answered(pending, answering), strict=True):
            self.out.write(text)
            if answers and not text.endswith("\n"):
                self.out.write("\n")
            for a in answers:
                if a is None:
                    continue
                for f in a.frames:
                    self.out.write(f"{_INDENT}{frame_text(f)}\n")
                if not a.frames:
                    self.out.write(f"{_INDENT}(no lines: {a.why_not or 'no line known'})\n")

    def close(self) -> None:
        pass


class _JsonWriter:
    """A JSON array written as it grows: one object per sample with kernel frames."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.first = True
        self.sample: dict[str, Any] | None = None
        out.write("[")

    def write(self, pending: Pending, answering: FrameLines | None) -> None:
        for (text, t, frames), answers in zip(pending, _answered(pending, answering), strict=True):
            if not text.startswith("\t") and text.strip():  # a sample's first line
                self._emit()
                self.sample = {"sample": text.strip(), "time": t, "kernel_frames": []}
            if self.sample is None:
                continue
            for (address, symbol, possible, dso), a in zip(frames, answers, strict=True):
                if len(self.sample["kernel_frames"]) >= SAMPLE_FRAMES:
                    head = self.sample["sample"]
                    self._emit()
                    self.sample = {"sample": head, "time": t, "kernel_frames": []}
                item: dict[str, Any] = {"address": hex(address), "symbol": symbol, "dso": dso}
                if possible:
                    item["possible"] = True
                if a is not None:
                    item["frames"] = [f.to_json() for f in a.frames]
                    if not a.frames:
                        item["no_lines"] = a.why_not or "no line known"
                self.sample["kernel_frames"].append(item)

    def _emit(self) -> None:
        s, self.sample = self.sample, None
        if s is None or not s["kernel_frames"]:
            return
        body = json.dumps(s, indent=2).replace("\n", "\n  ")
        self.out.write(("\n  " if self.first else ",\n  ") + body)
        self.first = False

    def close(self) -> None:
        self._emit()
        self.out.write("]\n" if self.first else "\n]\n")
