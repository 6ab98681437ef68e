"""The boots of the real-kernel tests (tests/vm/test_realkernel_*.py): kreld on
a real kernel, a Debian cloud kernel with KASLR and loadable
modules, booted under QEMU (software emulation) with virtme-ng.

Two boots share one state dir on a writable host directory:

* boot A (``guest.sh first``): kreld runs as the real daemon on the guest's
  ``/proc`` and ``/sys``, with a ``kreld.client`` subscriber (``Subscribe``,
  tests/vm/guest_subscribe.py) following it, while ``modprobe dummy``, ``modprobe veth``, ``rmmod
  dummy`` and ``modprobe dummy`` happen; once kreld has captured the symbol
  tables the guest copies its ``/proc/kallsyms`` at a moment T; then
  ``kreldctl snapshot`` runs with ``/proc/kcore`` hidden, once with Debian's
  stock ``/boot/System.map`` and once with the real one bind-mounted over it;
* boot B (``guest.sh second``): kreld again, on the same state dir, while
  ``dummy`` is loaded; ``/proc/kallsyms`` at T as in boot A.

The guest script reads the kernel's own answers with cat/grep/od/cp and
writes them as files; the host compares them with what kreld recorded, read
back with ``kreldctl`` on the host (the store is portable: that is its point).

Opt-in: these tests run only when selected with ``-m realkernel`` (each boot
takes 30-120 s of emulation), and skip with the reason where QEMU, vng or
the kernel are missing (``scripts/setup-vm`` installs them).

The boots are session fixtures: one boot each per run, however the tests
are split into files (a boot is minutes of emulation).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import harness
from support.realboot import Boot, boot


@pytest.fixture(scope="session")
def rw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guest's writable host directory: facts, the state dir, logs.

    KRELD_VM_DIR=DIR keeps it in DIR (left in place for a look afterwards);
    with KRELD_VM_REUSE=1 as well, boots whose facts are complete there are
    not run again (to iterate on the host-side checks without booting).
    """
    keep = os.environ.get("KRELD_VM_DIR")
    if keep:
        d = Path(keep).resolve()
        if not os.environ.get("KRELD_VM_REUSE") and d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        yield d
        return
    d = tmp_path_factory.mktemp("vm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def state(rw: Path) -> Path:
    return rw / "state"


@pytest.fixture(scope="session")
def sysmap() -> Path | None:
    kernel = harness.find_kernel()
    assert kernel is not None
    return harness.real_system_map(harness.kernel_release(kernel))


@pytest.fixture(scope="session")
def first(rw: Path, state: Path, sysmap: Path | None, request: pytest.FixtureRequest) -> Boot:
    harness.skip_unless_selected(request.config.getoption("markexpr"))
    return boot(rw, "first", state, request, {"SYSMAP": str(sysmap or "")})


@pytest.fixture(scope="session")
def second(first: Boot, rw: Path, state: Path, request: pytest.FixtureRequest) -> Boot:
    return boot(rw, "second", state, request, {"PREV_LOG": str(first.facts.dir / "kreld.log")})
