"""Which recorded boot, and which module loads, a perf.data was recorded on.

Pure functions over the model and :class:`~kreld.perf.reader.PerfHeader`.  The
boot is the one whose kernel build-id and runtime ``_text`` both equal the
recording's (KASLR makes ``_text`` nearly unique to a boot); boots that tie
(KASLR off, or a slide that came up twice) are told apart by how many of the
recording's module maps they have an incarnation at, then by whether their
host's name is the recording's ``HOSTNAME`` (where the source knows each
boot's host: a fleet bucket holds many hosts, a local store one), then by how
close their boot instant is to the recording's clock data.

A recording taken while kallsyms was restricted (kptr_restrict) has no
``_text`` map: its boot is then told by time alone.  Its clock data (``perf
record -k monotonic`` or ``-k boottime``) gives the wall time of that clock's
zero, the boot instant, which must be within :data:`RESTRICTED_SLACK_NS` (and
the drift NTP may slew in the time between, :data:`SLEW_PPM`) of a boot of the
same kernel build on the same host; the nearest is chosen.  Without such clock
data, or with none near enough, no boot is guessed.

perf takes a module's start from ``/proc/modules``: the base of the module's
core allocation (``mod->core_layout.base``; since 6.4, commit ac3b43283923,
``mod->mem[MOD_TEXT].base``), which kreld records as ``core_base``; its
``.text`` section starts there too, and stands in when ``core_base`` is
unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kreld.core.errors import NoBootForRecording
from kreld.core.model import BootSnapshot, Clock, Incarnation, hexaddr
from kreld.core.record import record
from kreld.perf.reader import ClockId, ModuleMap, PerfHeader

__all__ = [
    "KRELD_CLOCKS",
    "NEAREST_SHOWN",
    "RESTRICTED_SLACK_NS",
    "SLEW_PPM",
    "BootMatch",
    "ModuleChoice",
    "SampleClock",
    "choose_modules",
    "match_boot",
    "module_base",
    "pick_incarnation",
    "sample_clock",
]

# The sample clocks that are kreld's own clocks.
KRELD_CLOCKS = {
    ClockId.MONOTONIC: Clock.MONOTONIC,
    ClockId.BOOTTIME: Clock.BOOTTIME,
    ClockId.REALTIME: Clock.REALTIME,
}
# Nearest candidates listed when nothing matches.
NEAREST_SHOWN = 5
# A restricted recording's boot instant and a boot's, as far apart as they may be.
RESTRICTED_SLACK_NS = 2_000_000_000
SLEW_PPM = 500  # the most an NTP daemon slews a clock (adjtimex's MAXFREQ)


@record
class SampleClock:
    """How a recording's sample times read on kreld's clocks.

    ``exact``: the samples are on *clock* itself (``perf record -k``).
    Otherwise the samples are on ``perf_clock()`` (``local_clock()``, which on
    x86 counts roughly from boot like CLOCK_MONOTONIC but drifts from it) and
    times are read as monotonic: approximate.
    """

    clock: Clock
    exact: bool
    start: int | None  # when recording started, on *clock*


@record
class ModuleChoice:
    map: ModuleMap
    inc: Incarnation | None  # None: kreld has no load of it at that base


@record
class BootMatch:
    boot: BootSnapshot
    modules: tuple[ModuleChoice, ...]
    incarnations: tuple[Incarnation, ...]  # all of the boot's, as recorded
    clock: SampleClock

    @property
    def chosen(self) -> list[Incarnation]:
        """The loads the recording's maps matched, each once: two maps of one load
        (inject's map and its map of no size among perf's start records) are one."""
        seen: dict[int, Incarnation] = {}
        for c in self.modules:
            if c.inc is not None:
                seen.setdefault(c.inc.seq, c.inc)
        return list(seen.values())

    @property
    def missing(self) -> list[ModuleMap]:
        return [c.map for c in self.modules if c.inc is None]


def sample_clock(h: PerfHeader) -> SampleClock:
    """The clock the recording's sample times are on, as kreld knows clocks."""
    if h.clockid is not None and h.clockid in KRELD_CLOCKS:
        clock = KRELD_CLOCKS[ClockId(h.clockid)]
        if h.clock_data is not None and h.clock_data.clockid == h.clockid:
            return SampleClock(clock, True, h.clock_data.clock_ns)
        return SampleClock(clock, True, h.sample_time[0] if h.sample_time else None)
    if h.clock_data is not None:  # another clock (TAI, MONOTONIC_RAW): start in realtime
        return SampleClock(Clock.MONOTONIC, False, None)
    return SampleClock(Clock.MONOTONIC, False, h.sample_time[0] if h.sample_time else None)


def module_base(inc: Incarnation) -> int | None:
    """Where perf puts a module's map: its core base (``/proc/modules``)."""
    s = inc.state
    return s.core_base if s.core_base is not None else s.sections.get(".text")


def _distance(inc: Incarnation, clock: Clock, t: int) -> int:
    """How far *t* lies outside the incarnation's lifetime (0: inside)."""
    lo = inc.loaded.on(clock)
    if t < lo:
        return lo - t
    if inc.unloaded is not None and t >= inc.unloaded.on(clock):
        return t - inc.unloaded.on(clock) + 1
    return 0


def pick_incarnation(candidates: Sequence[Incarnation], clock: SampleClock) -> Incarnation | None:
    """Of loads at one base, the one live when recording started (the newest
    when that time is unknown)."""
    if not candidates:
        return None
    if clock.start is None:
        return max(candidates, key=lambda i: (i.loaded.monotonic, i.seq))
    t = clock.start
    return min(candidates, key=lambda i: (_distance(i, clock.clock, t), -i.seq))


def choose_modules(
    h: PerfHeader, incs: Sequence[Incarnation], clock: SampleClock
) -> tuple[ModuleChoice, ...]:
    """For each module map of the recording, the incarnation at its start."""
    by_base: dict[tuple[str, int], list[Incarnation]] = {}
    for inc in incs:
        base = module_base(inc)
        if base is not None:
            by_base.setdefault((inc.name, base), []).append(inc)
    out = []
    for m in h.modules:
        cands = by_base.get((m.name, m.start), [])
        if m.build_id:
            cands = [i for i in cands if i.state.build_id in (None, m.build_id)]
        out.append(ModuleChoice(m, pick_incarnation(cands, clock)))
    return tuple(out)


def _same_build(h: PerfHeader, b: BootSnapshot) -> bool:
    if h.kernel_build_id and b.build_id:
        return h.kernel_build_id == b.build_id
    if h.osrelease:  # no build-id on one side (pipe mode): the release must agree
        return h.osrelease == b.release
    return True


def _clock_gap(h: PerfHeader, b: BootSnapshot) -> int:
    """How far the boot instant the recording implies is from the boot's (ns);
    0 when the recording has no clock data to tell."""
    cd = h.clock_data
    if cd is None or cd.clockid not in KRELD_CLOCKS:
        return 0
    clock = KRELD_CLOCKS[ClockId(cd.clockid)]
    if clock is Clock.REALTIME:
        return 0
    # realtime minus the clock: the wall time of the clock's zero, on both sides
    recorded = cd.realtime_ns - cd.clock_ns
    booted = b.first_seen.realtime - b.first_seen.on(clock)
    return abs(recorded - booted)


def match_boot(
    h: PerfHeader,
    boots: Sequence[BootSnapshot],
    incarnations: Callable[[str], Sequence[Incarnation]],
    hostname: Callable[[str], str | None] | None = None,
) -> BootMatch:
    """The boot *h* was recorded on, and the module loads it saw.

    *incarnations* gives a boot's recorded module loads, *hostname* its host's
    name where the source knows it (both asked only of the boots that match on
    kernel build and ``_text``).  Raises
    :class:`~kreld.core.errors.NoBootForRecording` naming the nearest candidates.
    """
    same_build = [b for b in boots if _same_build(h, b)]
    if h.text is None:
        return _match_by_time(h, same_build, incarnations, hostname)
    found = [b for b in same_build if _ref_address(b, h.ref_symbol) == h.text]
    if not found:
        build = h.kernel_build_id or f"release {h.osrelease or 'unknown'}"
        raise NoBootForRecording(
            h.path,
            f"none has kernel build {build} with {h.ref_symbol} at {h.text:#x}",
            [_describe(b) for b in same_build[:NEAREST_SHOWN]],
        )
    clock = sample_clock(h)
    scored = []
    for b in found:
        incs = tuple(incarnations(b.boot_id))
        mods = choose_modules(h, incs, clock)
        matched = sum(1 for c in mods if c.inc is not None)
        other_host = h.hostname is not None and (
            hostname is None or hostname(b.boot_id) != h.hostname
        )
        score = (-matched, other_host, _clock_gap(h, b), -b.first_seen.realtime)
        scored.append((score, BootMatch(b, mods, incs, clock)))
    return min(scored, key=lambda s: s[0])[1]


def _match_by_time(
    h: PerfHeader,
    same_build: Sequence[BootSnapshot],
    incarnations: Callable[[str], Sequence[Incarnation]],
    hostname: Callable[[str], str | None] | None,
) -> BootMatch:
    """A recording without a ``_text`` map: the boot whose instant its clock data gives."""
    why = (
        "it has no [kernel.kallsyms]_text map with the kernel's runtime _text (kallsyms "
        "was restricted when perf recorded, or the kernel was not recorded)"
    )
    nearest = [_describe(b) for b in same_build[:NEAREST_SHOWN]]
    cd = h.clock_data
    if cd is None or cd.clockid not in (ClockId.MONOTONIC, ClockId.BOOTTIME):
        raise NoBootForRecording(
            h.path, f"{why}, and no clock data to tell its boot by time (perf record -k "
            "monotonic or -k boottime writes it)", nearest,
        )  # fmt: skip
    clock = KRELD_CLOCKS[ClockId(cd.clockid)]
    near = []
    for b in same_build:
        host = hostname(b.boot_id) if hostname is not None else None
        if h.hostname is not None and host is not None and host != h.hostname:
            continue  # another host's boot (a fleet bucket)
        since = abs(cd.clock_ns - b.first_seen.on(clock))
        gap = _clock_gap(h, b)
        if b.anchors.text is not None and gap <= RESTRICTED_SLACK_NS + since * SLEW_PPM // 10**6:
            near.append((gap, b))
    if not near:
        raise NoBootForRecording(
            h.path, f"{why}, and no boot of its kernel build began within "
            f"{RESTRICTED_SLACK_NS / 1e9:g} s (and NTP's slew since) of the boot instant "
            "its clock data gives", nearest,
        )  # fmt: skip
    b = min(near, key=lambda n: n[0])[1]
    return BootMatch(b, (), tuple(incarnations(b.boot_id)), sample_clock(h))


def _ref_address(b: BootSnapshot, symbol: str) -> int | None:
    """The boot's address of the symbol perf's kernel map is relative to."""
    return b.anchors.stext if symbol == "_stext" else b.anchors.text


def _describe(b: BootSnapshot) -> str:
    text = hexaddr(b.anchors.text) or "unknown"
    return f"boot {b.boot_id} (release {b.release}, _text {text})"
