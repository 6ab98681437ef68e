"""A fake machine for the symbol cache: kallsyms of a fake kernel and modules, the daemons
serving it, and a symbol worker without a daemon."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kreld.core.model import BootSnapshot
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store
from kreld.symbols.capture import SymbolCapture
from kreld.symbols.table_sources import TableSources

from support.faketree import FakeTree
from support.run import Daemon, kreldctl

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


@contextlib.contextmanager
def symbol_worker(
    tree: FakeTree, state: Path, log: FilteringBoundLogger | None = None
) -> Iterator[tuple[Store, BootSnapshot, SymbolCapture]]:
    """A symbol worker on *tree* (no daemon), its boot recorded in a store at
    *state*, started on the start's own read of kallsyms and through that
    first capture; stopped on leaving."""
    root = Root(tree.root)
    snap, _ = take_snapshot(root, [], None)
    stop = threading.Event()
    with Store(str(state)) as store:
        stored, _, _ = store.boots.record_boot(snap)
        capture = SymbolCapture(TableSources(store, root, stored, log))
        capture.start(stop, [], KallsymsText.read(root))
        try:
            assert capture.idle.wait(30)
            yield store, stored, capture
        finally:
            stop.set()


LINK = 0xFFFFFFFF81000000  # where x86-64 links _text


RELEASE = "6.1.0-fake"


BUILD_ID = "5e1f00d5a1b2c3d4e5f60718293a4b5c6d7e8f90"


SLIDES = (0x2A600000, 0x0E200000, 0x31C00000, 0x05400000)  # KASLR slides: 2 MiB multiples


BASE_A = 0xFFFFFFFFC0400000


BASE_B = 0xFFFFFFFFC0900000


BASE_C = 0xFFFFFFFFC1200000


INIT = 0x100000  # where FakeTree puts a module's .init.text, from its .text


# The fake kernel as kallsyms prints it: (value, absolute, type, name).  Per-cpu
# symbols are absolute (they do not move with KASLR); the rest is relative to _text.
# Several names share an address, as _text/_stext/startup_64 do on x86-64.
CORE: list[tuple[int, bool, str, str]] = [
    (0x0, True, "A", "fixed_percpu_data"),
    (0x1000, True, "A", "cpu_debug_store"),
    (0x0, False, "T", "startup_64"),
    (0x0, False, "T", "_stext"),
    (0x0, False, "T", "_text"),
    (0x60, False, "T", "secondary_startup_64"),
    (0x1000, False, "t", "verify_cpu"),
    (0x2000, False, "T", "do_one_initcall"),
    (0x2400, False, "t", "trace_initcall_start_cb"),
    (0x10000, False, "T", "schedule"),
    (0x10000, False, "T", "schedule_alias"),
    (0x10480, False, "t", "__schedule"),
    (0x1000000, False, "T", "_etext"),
    (0x1200000, False, "R", "__start_rodata"),
    (0x1200040, False, "r", "kernel_banner"),
    (0x2000000, False, "D", "jiffies"),
    (0x3000000, False, "T", "_sinittext"),
    (0x3000000, False, "T", "start_kernel"),
    (0x3000200, False, "t", "init_setup"),
    (0x3100000, False, "T", "_einittext"),
    (0x3800000, False, "B", "__bss_start"),
]


CoreSym = tuple[int, bool, str, str]


# A module's symbols, in its symtab's order (not address order), as offsets from
# the base FakeTree gives .text: .exit.text +0x1800, .data +0x2000, .rodata +0x3000,
# .gnu.linkonce.this_module +0x3800, .init.text +0x100000.
MOD: list[tuple[int, str, str]] = [
    (0x0, "t", "{}_open"),
    (0x1C0, "T", "{}_ioctl"),
    (0x80, "t", "{}_read"),
    (0x1800, "t", "{}_exit"),
    (0x2000, "d", "{}_state"),
    (0x3000, "r", "{}_fops"),
    (0x3800, "D", "__this_module"),
    (INIT, "t", "{}_init"),
]


def core_lines(text: int, core: list[CoreSym] = CORE) -> list[str]:
    return [f"{v if ab else text + v:016x} {t} {n}" for v, ab, t, n in core]


def mod_lines(name: str, base: int, *, init: bool = False) -> list[str]:
    """A module's kallsyms lines; its init symbols only while its init runs."""
    return [
        f"{base + off:016x} {t} {n.format(name)}\t[{name}]"
        for off, t, n in MOD
        if init or off != INIT
    ]


def mod_build_id(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kreld-sym-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemons() -> Iterator[list[Daemon]]:
    """Daemons started by module-scoped fixtures: killed at the end if still running."""
    started: list[Daemon] = []
    yield started
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
            d._log.close()


class Machine:
    """A fake machine whose kallsyms is written here, and kreld runs on it."""

    def __init__(
        self, base: Path, sock: Path, started: list[Daemon], *, kptr_restrict: int = 0
    ) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.tree = FakeTree(
            base / "root",
            text=LINK + SLIDES[0],
            build_id=BUILD_ID,
            release=RELEASE,
            kptr_restrict=kptr_restrict,
        )
        self.state = base / "state"
        self.sock = sock
        self.config = base / "kreld.toml"
        self.config.write_text("[modules]\npoll_interval = 0.2\n")
        self.started = started
        self.runs = 0
        self.core = core_lines(LINK + SLIDES[0])
        self.loaded: dict[str, int] = {}  # module -> .text base, in load order
        self.in_init: set[str] = set()  # modules whose init has not returned
        self.extras: list[str] = []  # lines of owners that are not modules ([bpf])
        self.percpu: dict[str, int] = {}  # module -> its per-cpu area, for its "a" lines
        self.write_kallsyms()

    @property
    def opts(self) -> list[str]:
        return [
            "--root",
            str(self.tree.root),
            "--state-dir",
            str(self.state),
            "--config",
            str(self.config),
        ]

    def kallsyms(self) -> str:
        """What the kernel prints: core lines, then modules newest first."""
        lines = list(self.core)
        for name in reversed(self.loaded):
            lines += mod_lines(name, self.loaded[name], init=name in self.in_init)
            if name in self.percpu:  # per-cpu variables print at their per-cpu offset
                area = self.percpu[name]
                lines += [f"{area + 8 * k:016x} a {name}_pcpu{k}\t[{name}]" for k in range(3)]
        return "".join(line + "\n" for line in [*lines, *self.extras])

    def write_kallsyms(self, content: str | None = None) -> None:
        tmp = self.tree.root / "proc/.kallsyms.tmp"
        tmp.write_text(self.kallsyms() if content is None else content)
        os.rename(tmp, self.tree.root / "proc/kallsyms")

    def new_boot(self, slide: int, core: list[CoreSym] = CORE) -> str:
        boot = self.tree.new_boot()
        self.core = core_lines(LINK + slide, core)
        self.write_kallsyms()
        return boot

    def write_proc_modules(self) -> None:
        """/proc/modules as the kernel lists it: newest first, as kallsyms does."""
        lines = [
            f"{n} {size} 0 - Live 0x{base:016x}\n"
            for n, (base, size) in reversed(self.tree.modules.items())
        ]
        tmp = self.tree.root / "proc/.modules.tmp"
        tmp.write_text("".join(lines))
        os.rename(tmp, self.tree.root / "proc/modules")

    def load(self, name: str, base: int, initstate: str = "live", **kw: Any) -> None:
        """kallsyms shows the module's lines, then its sysfs directory appears."""
        self.loaded[name] = base
        if initstate == "coming":
            self.in_init.add(name)
        self.write_kallsyms()
        self.tree.add_module(name, base, build_id=mod_build_id(name), initstate=initstate, **kw)
        self.write_proc_modules()

    def init_done(self, name: str) -> None:
        """The init returns: its symbols leave kallsyms, initstate says "live"."""
        self.in_init.discard(name)
        self.write_kallsyms()
        self.tree.write(f"sys/module/{name}/initstate", "live\n")

    def unload(self, name: str) -> None:
        del self.loaded[name]
        self.tree.remove_module(name)
        self.write_proc_modules()
        self.write_kallsyms()

    def start(self) -> Daemon:
        self.runs += 1
        d = Daemon([*self.opts, "--socket", str(self.sock)], self.base / f"kreld-{self.runs}.log")
        self.started.append(d)
        return d.start(timeout=30)

    def ctl(self, *args: str) -> Any:
        return json.loads(kreldctl(*args, *self.opts, "--json").stdout)

    def export(self, *args: str) -> str:
        return kreldctl("export", "kallsyms", *args, *self.opts).stdout

    def resolve(self, at: int | None, *addrs: int, boot: str | None = None) -> list[dict[str, Any]]:
        when = [] if at is None else ["--at", str(at)]
        if boot is not None:
            when += ["--boot", boot]
        cp = kreldctl(
            "resolve", *(f"{a:#x}" for a in addrs), *when, *self.opts, "--json", check=False
        )
        assert cp.returncode in (0, 1), cp.stderr
        out: list[dict[str, Any]] = json.loads(cp.stdout)
        return out

    def history(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.ctl("modules", "--all")
        return out
