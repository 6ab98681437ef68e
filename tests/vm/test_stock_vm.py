"""A stock host at kptr_restrict=2 on a real kernel: nothing mounted, no
System.map but Debian's placeholder, no vmlinux.  kreld reads the kernel's own
kallsyms tables in its memory (tests/vm/guest_stock.sh): the store holds the
true ``_text``, every section of a module loaded and unloaded while it ran, and
an export whose kernel lines are /proc/kallsyms read at kptr_restrict=0
afterwards, line for line.  On Debian's 6.1 and, where installed, 6.12."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support import harness
from support.realkernel import addr, anchors_of, ctl

GUEST_SCRIPT = Path(__file__).resolve().parent / "guest_stock.sh"
BOOT_TIMEOUT = 420.0

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_a_stock_guest_at_kptr_restrict_2_records_the_truth_from_kernel_memory(
    tmp_path: Path, series: str
) -> None:
    kernel = harness.skip_unless_series(series)
    rw = tmp_path / "rw"
    rw.mkdir()
    facts, state = rw / "facts", rw / "state"
    run = harness.run_in_guest(
        f"sh {GUEST_SCRIPT}",
        rw,
        timeout=BOOT_TIMEOUT,
        env={"OUT": str(facts), "STATE": str(state)},
        name="stock",
        kernel=kernel,
    )
    log = facts / "kreld.log"
    tail = log.read_text()[-4000:] if log.exists() else "(no kreld.log)"
    assert run.status == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}\nlog:\n{tail}"
    assert (facts / "kreld.rc").read_text().strip() == "0", tail
    # Stock: the placeholder map, and kallsyms zeroed when kreld started.
    assert b"real System.map" in (facts / "system_map_head").read_bytes()
    assert (facts / "kallsyms_at_2_head").read_text().startswith("0000000000000000 ")
    boot = (facts / "boot_id").read_text().strip()
    show = ctl(state, "show", as_boot=boot)
    true = {line.split()[2]: int(line.split()[0], 16) for line in (facts / "anchors").open()}
    assert show["address_source"] == "kcore-kallsyms", show
    assert show["restricted"] is False
    assert anchors_of(show)["_text"] == true["_text"]
    assert anchors_of(show)["_stext"] == true["_stext"]
    # dummy, loaded and unloaded while kreld ran: every section it had.
    (dummy,) = [m for m in ctl(state, "modules", "--all", as_boot=boot) if m["name"] == "dummy"]
    assert dummy["unloaded"] is not None and dummy["address_source"] == "kcore"
    sections = {k: addr(v) for k, v in dummy["sections"].items()}
    truth = dict(line.split() for line in (facts / "dummy_sections").read_text().splitlines())
    assert sections == {k: int(v, 16) for k, v in truth.items()}
    assert ".text" in sections and all(sections.values()), sections
    # The export's kernel lines: /proc/kallsyms read at 0 afterwards, line for line.
    kallsyms = (facts / "kallsyms").read_text().splitlines()
    core = [line for line in kallsyms if "\t" not in line]
    export = (facts / "export").read_text().splitlines()
    assert export[: len(core)] == core
    shutil.rmtree(rw, ignore_errors=True)
