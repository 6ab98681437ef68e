"""The retention policy: kreld forgets old boots by itself, never the current one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kreld.store import Store

from support.faketree import FakeTree
from support.run import Daemon, start


def test_daemon_applies_retention_at_start(
    daemon_factory: Any, tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    boots = []
    for i in range(3):
        if i:
            tree.new_boot(text=tree.text + 0x200000 * i)
        tree.add_module(f"m{i}", 0xFFFFFFFFC0000000 + i * 0x100000)
        d: Daemon = start(daemon_factory, tree, state_dir, sockdir / f"k{i}.sock")
        d.wait_for("kernel_symbols")
        assert d.stop() == 0
        boots.append(tree.boot_id)
    with Store(state_dir, readonly=True) as store:
        assert [b.boot_id for b in store.list_boots()] == boots[::-1]
    cfg = tmp_path / "kreld.toml"
    cfg.write_text("[retention]\nkeep_boots = 1\n")
    # A fourth boot: the three recorded ones are all older than the current one.
    tree.new_boot(text=tree.text + 0x800000)
    d = start(daemon_factory, tree, state_dir, sockdir / "k.sock", "--config", str(cfg))
    ev = d.wait_for("retention")
    assert ev["boots"] == 3 and ev["incarnations"] >= 3
    with Store(state_dir, readonly=True) as store:
        assert [b.boot_id for b in store.list_boots()] == [tree.boot_id]
        assert store.incarnations(boots[0]) == []
    assert d.stop() == 0


def test_gc_forgets_a_boots_per_cpu_values_with_its_incarnations(tmp_path: Path) -> None:
    """What one load printed for its per-cpu variables goes with the boot it belongs to."""
    from support.records import incarnation, snap

    with Store(tmp_path / "st") as store:
        old, new = snap(n=1), snap(n=2)
        for b in (old, new):
            store.boots.record_boot(b)
            (inc,) = store.modules.apply_module_changes(b.boot_id, [incarnation()], [], [], None)
            store.symbols.put_absolutes(b.boot_id, inc.seq, [0x34000, -8, 2**63 - 1])
        assert store.absolutes(old.boot_id) == {0: [0x34000, -8, 2**63 - 1]}
        removed = store.retention.gc(keep_boots=1, keep_days=0, protect=new.boot_id, now_realtime=0)
        assert (removed["boots"], removed["incarnations"]) == (1, 1)
        assert store.absolutes(old.boot_id) == {}
        assert store.absolutes(new.boot_id) == {0: [0x34000, -8, 2**63 - 1]}
