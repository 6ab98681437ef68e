"""Which ways of learning of module loads kreld uses, said in Status, and the
look at sys/module slow only while kernel events flow.  The module
tracepoints themselves are proven on a real kernel (tests/vm/): this
machine's kernel has no loadable modules."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import structlog

from kreld.config.settings import Config
from kreld.core.model import HintAction, SeenBy
from kreld.tracker.sources import TracepointSource, WatchSource, poll_interval

from support.faketree import FakeTree
from support.run import ctl_json, kreldctl, start
from support.wait import wait_until


def followers(sock: Path) -> dict[str, dict[str, Any]]:
    st = ctl_json("--socket", str(sock), "status")
    return {f["name"]: f for f in st["module_followers"]}


def test_on_a_fake_tree_only_the_fast_look_follows_and_status_says_why_the_others_do_not(
    daemon_factory: Any, tree: FakeTree, state_dir: Path, sockdir: Path
) -> None:
    sock = sockdir / "s"
    start(daemon_factory, tree, state_dir, sock)
    f = followers(sock)
    assert not f["tracepoint"]["following"] and "real root" in f["tracepoint"]["reason"]
    assert not f["uevent"]["following"] and "real root" in f["uevent"]["reason"]
    (watch,) = (v for k, v in f.items() if k.startswith("watch-"))
    assert watch["following"] and watch["interval_s"] == 1.0  # nothing else works: fast
    text = kreldctl("--socket", str(sock), "status").stdout
    said = r"^modules by +tracepoint: off: kreld does not run on the real root$"
    assert re.search(said, text, re.M)


def test_on_the_real_root_uevents_follow_the_look_is_slow_and_the_tracepoints_say_why_not(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    sock = sockdir / "s"
    conf = tmp_path / "kreld.toml"
    conf.write_text("[modules]\npoll_interval_events = 45.0\n")
    d = daemon_factory(
        "--root",
        "/",
        "--state-dir",
        str(tmp_path / "st"),
        "--socket",
        str(sock),
        "--config",
        str(conf),
    )
    d.start(timeout=60)
    f = followers(sock)
    assert f["uevent"]["following"]
    # This kernel has no modules, so no module tracepoints (or no tracefs, or no right).
    assert not f["tracepoint"]["following"] and f["tracepoint"]["reason"]
    assert f["watch-poll"]["following"] and f["watch-poll"]["interval_s"] == 45.0


def test_the_look_goes_fast_when_the_last_event_source_stops_and_sees_a_load_then(
    tree: FakeTree,
) -> None:
    log = structlog.get_logger()
    hints: list[tuple[SeenBy, HintAction, str | None]] = []
    seen = threading.Event()

    def notify(source: SeenBy, action: HintAction, name: str | None = None) -> None:
        hints.append((source, action, name))
        seen.set()

    cfg = Config(root=str(tree.root), poll_interval=0.05, poll_interval_events=3600.0)
    tp = TracepointSource(None, "off", log)
    assert poll_interval(cfg, [tp]) == 0.05  # closed tracepoints tell of nothing
    watch = WatchSource(notify, str(tree.root / "sys/module"), "poll", 3600.0, log)
    watch.start(threading.Event())
    try:
        assert not watch.set_interval(3600.0)  # unchanged: the observer stays
        assert watch.set_interval(poll_interval(cfg, [tp]))
        tree.add_module("late", 0xFFFFFFFFC0800000)
        wait_until("the fast look sees the load", seen.is_set, timeout=20)
        assert (SeenBy.POLL, HintAction.ADD, "late") in hints
    finally:
        watch.stop()
