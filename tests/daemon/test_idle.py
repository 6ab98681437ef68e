"""At rest kreld's threads block on what they serve: none wakes on a short
timer only to see whether it should stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kreld.core import consts
from kreld.core.stopping import StopEvent, WakeFd, wake_on_stop

from support.faketree import FakeTree
from support.run import start

# The shortest interval of anything due at rest: the status line's pace check.
SHORTEST_AT_REST_S = 10.0
WINDOW_S = 10.0


def thread_wakes(pid: int) -> dict[str, int]:
    """Voluntary context switches of each thread of *pid* (each is a wake)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # ended meanwhile
        out[task.name] = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return out


def test_an_idle_daemon_on_100_modules_wakes_no_thread_more_than_its_intervals_allow(
    daemon_factory: Any, tree: FakeTree, state_dir: Path, tmp_path: Path
) -> None:
    for i in range(100):
        tree.add_module(f"m{i:03d}", 0xFFFFFFFFC0000000 + i * 0x100000)
    d = start(daemon_factory, tree, state_dir, tmp_path / "k.sock")
    d.wait_for("kernel_symbols")
    # The capture's last work of the start: the last module's symbols.
    d.wait_until(
        lambda ev: any(
            e.get("module") == "m099" and str(e.get("event")).startswith("module_symbols")
            for e in ev
        ),
        "the last module's symbols looked for",
    )
    before = thread_wakes(d.proc.pid)
    t0 = time.monotonic()
    time.sleep(WINDOW_S)  # the window measured, not a synchronization
    after = thread_wakes(d.proc.pid)
    window = time.monotonic() - t0
    # Each thread: what is due in the window at the shortest interval, a
    # little for the tail of startup, and one status line (the change, its
    # 1 s gathering, the pace check's answer).  A thread on a 0.5 s or 1 s
    # timeout (as the capture, uevent and tracker threads were) woke 10 to 20
    # times.
    bound = 5 + window / min(SHORTEST_AT_REST_S, consts.HEARTBEAT_INTERVAL)
    woke = {tid: n - before.get(tid, 0) for tid, n in after.items()}
    assert max(woke.values()) <= bound, (woke, bound)
    assert d.stop() == 0


def test_setting_a_stop_event_runs_every_wake_once_also_one_registered_after() -> None:
    stop = StopEvent()
    calls: list[str] = []
    assert wake_on_stop(stop, lambda: calls.append("a")) is None
    stop.when_set(lambda: calls.append("b"))
    stop.set()
    stop.set()
    stop.when_set(lambda: calls.append("late"))
    assert calls == ["a", "b", "late"]
    # A plain Event cannot wake anyone: a bounded wait instead.
    assert wake_on_stop(threading.Event(), lambda: None) is not None


def test_a_thread_blocked_on_a_wake_fd_ends_when_stop_is_set_and_a_closed_fd_takes_no_wake() -> (
    None
):
    import select

    stop = StopEvent()
    wake = WakeFd()
    assert wake_on_stop(stop, wake.wake) is None
    woke = threading.Event()

    def block() -> None:
        p = select.poll()
        p.register(wake.fileno(), select.POLLIN)
        p.poll(None)
        woke.set()

    t = threading.Thread(target=block, daemon=True)
    t.start()
    stop.set()
    assert woke.wait(30)
    wake.close()
    wake.wake()  # after close: nothing written anywhere
    assert wake.fileno() == -1
