"""data.mdb checked before LMDB maps it (kreld/store/lmdbcheck.py), on real LMDB files.

The check must accept every file LMDB reads whole, including one whose meta
page counts pages past the end of the file (pages a commit allocated and freed
again, never written), and refuse a file really cut short, before any process
maps it and dies of SIGBUS.  Damaged records are StoreCorrupt, also under
``python -O``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kreld.core.errors import StoreCorrupt
from kreld.core.model import BootSnapshot, Incarnation
from kreld.store import Store, inc_key, lmdbcheck

from support.faketree import FakeTree
from support.queries import incarnation
from support.records import snap
from support.run import bin_path, kreldctl


def grow_and_free_again(store: Store) -> None:
    """One commit that takes new pages at the end of the file and frees them
    again, newest first: LMDB keeps them as loose pages (mdb_page_loose),
    never writes them (mdb_page_flush skips P_LOOSE) but counts them in the
    meta page's mm_last_pg.  The store's contents are what they were."""
    keys = [b"x%05d" % i for i in range(400)]

    def fn(txn: Any) -> None:
        db = store.env.dbs[b"watch"]
        for k in keys:
            txn.put(k, b"y" * 200, db=db)
        for k in reversed(keys):
            txn.delete(k, db=db)

    store.env.write(fn)


BOOT0 = snap(n=0).boot_id


def make_short_store(d: Path) -> tuple[list[BootSnapshot], list[Incarnation]]:
    """A kreld store whose file is shorter than its last page number says."""
    boots = [snap(BOOT0 if i == 0 else None, n=i) for i in range(20)]
    with Store(d) as store:
        for b in boots:
            store.boots.record_boot(b)
        opened = [
            incarnation(f"mod{i}", i, 0xFFFFFFFFC0000000 + i * 0x10000, 0x4000, 0) for i in range(8)
        ]
        incs = store.modules.apply_module_changes(boots[0].boot_id, opened, [], [], None)
        grow_and_free_again(store)
    return boots, incs


def page_counts(d: Path) -> tuple[int, int, int]:
    """(pages in the file, pages the meta page counts, highest page referenced)."""
    highest, meta = lmdbcheck.reach(d)
    return (d / "data.mdb").stat().st_size // meta.psize, meta.last_pg + 1, highest


def test_a_file_shorter_than_its_last_page_number_once_refused_is_accepted_and_reads_back_whole(
    tmp_path: Path,
) -> None:
    """The state the kill -9 fault test once hit (seed 2049086507): LMDB counts
    pages it never wrote.  The old rule (size >= (last_pg + 1) * page size)
    refused it; every page the trees reference is in the file, so it is
    accepted, and every record reads back as written."""
    state = tmp_path / "st"
    boots, incs = make_short_store(state)
    in_file, counted, highest = page_counts(state)
    assert in_file < counted, "the reproducer no longer leaves the file short"
    assert highest < in_file
    lmdbcheck.check_datafile(state)
    with Store(state, readonly=True) as ro:
        assert sorted(b.boot_id for b in ro.list_boots()) == sorted(b.boot_id for b in boots)
        for b in boots:
            assert ro.get_boot(b.boot_id) == b
        assert ro.incarnations(boots[0].boot_id) == incs
    out = json.loads(kreldctl("--state-dir", str(state), "boots", "--json").stdout)
    assert len(out) == len(boots)
    with Store(state) as rw:  # and a writer opens it and goes on
        rw.boots.record_boot(snap(n=99))
        assert len(rw.list_boots()) == len(boots) + 1


def test_a_data_mdb_cut_short_at_several_points_is_refused_and_nothing_dies_of_a_signal(
    tmp_path: Path, tree: FakeTree
) -> None:
    """Cut anywhere before the end of the pages the trees reference: the check
    refuses it with StoreCorrupt before LMDB maps it; a writer's open
    (kreldctl snapshot) exits 5 by name; a reader (kreldctl boots, modules)
    reads what is whole or exits 5, and no process dies of SIGBUS."""
    state = tmp_path / "st"
    make_short_store(state)
    _in_file, _counted, highest = page_counts(state)
    psize = lmdbcheck.reach(state)[1].psize
    cuts = {
        "100-bytes": 100,
        "one-meta-page": psize,
        "meta-pages-only": 2 * psize,
        "half-the-trees": highest // 2 * psize,
        "last-referenced-page-missing": highest * psize,
        "last-referenced-page-half": highest * psize + psize // 2,
    }
    readers_refused = set()
    for what, size in cuts.items():
        cut = tmp_path / what
        shutil.copytree(state, cut)
        os.truncate(cut / "data.mdb", size)
        with pytest.raises(StoreCorrupt):
            lmdbcheck.check_datafile(cut)
        for argv in (["snapshot"], ["boots"], ["modules", "--boot", BOOT0]):
            cp = subprocess.run(
                [bin_path("kreldctl"), "--root", str(tree.root), "--state-dir", str(cut), *argv],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cp.returncode >= 0, (what, argv, f"killed by signal {-cp.returncode}")
            assert "Traceback" not in cp.stderr, cp.stderr
            if argv == ["snapshot"]:
                assert cp.returncode == 5, (what, cp.stderr)
            else:
                assert cp.returncode in (0, 5), (what, argv, cp.stderr)
                if cp.returncode == 5:
                    assert "truncated" in cp.stderr or "not an LMDB file" in cp.stderr
                    readers_refused.add(what)
        assert (cut / "data.mdb").stat().st_size == size, f"{what}: the file was changed"
    assert {"100-bytes", "one-meta-page", "meta-pages-only"} <= readers_refused


def test_the_walk_refuses_a_referenced_page_that_holds_another_page(tmp_path: Path) -> None:
    """A file of the right length whose tree page was overwritten (here with a
    copy of another page) is damaged: the walk says which page."""
    state = tmp_path / "st"
    make_short_store(state)
    highest, meta = lmdbcheck.reach(state)
    data = state / "data.mdb"
    with open(data, "r+b") as f:
        f.seek(2 * meta.psize)
        other = f.read(meta.psize)
        f.seek(highest * meta.psize)
        if int.from_bytes(f.read(8), "little") != highest:
            pytest.skip("the highest referenced page is an overflow page")
        f.seek(highest * meta.psize)
        f.write(other)
    with pytest.raises(StoreCorrupt, match=f"page {highest} holds page number 2"):
        lmdbcheck.reach(state)


MISSING_FIELD = textwrap.dedent(
    """
    import json, sys
    from kreld.core.errors import StoreCorrupt
    from kreld.store import Store, inc_key
    state, boot_id, kind = sys.argv[1:4]
    with Store(state, readonly=True) as store:
        try:
            if kind == "incarnation":
                store.incarnations(boot_id)
            else:
                store.get_boot(boot_id)
        except StoreCorrupt as e:
            print("StoreCorrupt", e)
            sys.exit(0)
    print("read without an error")
    sys.exit(1)
    """
)


@pytest.mark.parametrize("kind", ["incarnation", "boot"])
def test_a_record_that_lacks_a_required_field_is_store_corrupt_also_under_python_O(
    tmp_path: Path, kind: str
) -> None:
    """An incarnation record (the JSON form of older stores) without its load
    time, a boot record without its anchors: StoreCorrupt, with asserts on or
    off (``python -O`` strips them: kreld must not rely on one)."""
    state = tmp_path / "st"
    b = snap()
    with Store(state) as store:
        store.boots.record_boot(b)
        if kind == "incarnation":
            inc = incarnation("broken", 0, 0xFFFFFFFFC0000000, 0x4000, 0)
            rec = inc.to_json()
            del rec["loaded"]
            store.env.write(
                lambda txn: txn.put(
                    inc_key(b.boot_id, 0),
                    json.dumps(rec).encode(),
                    db=store.env.dbs[b"incarnations"],
                )
            )
        else:
            rec = b.to_json()
            del rec["anchors"]
            store.env.write(
                lambda txn: txn.put(
                    b.boot_id.encode(), json.dumps(rec).encode(), db=store.env.dbs[b"boots"]
                )
            )
    for flags in ([], ["-O"]):
        cp = subprocess.run(
            [sys.executable, *flags, "-c", MISSING_FIELD, str(state), b.boot_id, kind],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cp.returncode == 0, (flags, cp.stdout, cp.stderr)
        assert cp.stdout.startswith("StoreCorrupt"), (flags, cp.stdout)
