"""Is ``data.mdb`` whole?  Checked before LMDB maps it, so that no read dies of SIGBUS.

LMDB trusts its meta pages and maps the file: a page it reads past the end
of a file cut short is a SIGBUS, not an error.  What LMDB keeps, read from
``mdb.c`` (LMDB 0.9, as bundled by the ``lmdb`` package):

* ``mdb_env_write_meta`` stores ``mm_last_pg = mt_next_pgno - 1``: the last
  page number ever *allocated*, not the last one written.
* ``mdb_page_alloc`` takes new pages from ``mt_next_pgno`` when the freeDB
  has none to reuse; ``mdb_page_loose`` keeps a page freed in the same
  transaction that dirtied it on ``mt_loose_pgs``, marked ``P_LOOSE``;
  ``mdb_page_flush`` skips ``P_LOOSE`` pages ("Don't flush this page yet"),
  and ``mdb_freelist_save`` records the loose page numbers in the freeDB and
  drops them from the dirty list.  So a transaction that grows the file and
  frees some of its new pages again commits an ``mm_last_pg`` past the end
  of the file: ``size >= (mm_last_pg + 1) * psize`` is not an invariant.
  (Spilled pages, ``mdb_page_spill``, are written before the commit; overflow
  pages are written as one run of ``mp_pages`` pages.)
* ``mdb_page_get`` reads a page straight from the map and only refuses
  numbers ``>= mt_next_pgno``; a reader reaches pages only from the meta
  chosen by ``mdb_env_pick_meta`` (the one with the higher ``mm_txnid``,
  also what ``mdb_env_read_header`` picks at open): the freeDB and main DB
  roots, named databases (``F_SUBDATA`` nodes), and overflow runs
  (``F_BIGDATA`` nodes).  Pages listed free are never read.

No field in the file says how far the written pages reach, so there is no
exact check cheaper than following the trees.  The rule used here: a file at
least ``(mm_last_pg + 1)`` pages long is whole (nothing reachable lies past
``mm_last_pg``); a shorter one is walked (every page the newer meta's trees
reference must lie inside the file, be the page it claims to be and hold
nodes inside its bounds; the walk visits each page at most once and at most
``mm_last_pg`` pages).  A file found whole is remembered by its identity
(device, inode, size, mtime) for the life of the process.

A writer is refused any damage.  A reader (kreldctl, or a store kreld set
aside) is refused only a damaged main tree: a named database with a page
past the end is left unread (:class:`~kreld.core.errors.StoreCorrupt` when a
call needs it) and the whole ones are read; readers never read the freeDB.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from kreld.core.errors import StoreCorrupt, StoreDamaged, StoreError
from kreld.core.record import record

__all__ = ["LMDB_MAGIC", "Meta", "check_datafile", "newest_meta", "reach"]

LMDB_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_PAGE_SIZES = (4096, 8192, 16384, 32768, 65536)
_PAGEHDRSZ = 16
_NODESIZE = 8
_P_INVALID = (1 << 64) - 1
# MDB_page.mp_flags
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
# MDB_node.mn_flags
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
# MDB_meta inside its page: magic and version at 16, the freeDB's MDB_db at 40
# (its md_pad holds the page size), the main DB's at 88, last page and txnid at 136.
_META = struct.Struct("<II8xQ")
_DB_ROOT = 40  # md_root inside an MDB_db
_FREE_DB, _MAIN_DB, _LAST_PG = 40, 88, 136
_HEAD = 152
_PAGE_HEAD = struct.Struct("<Q2xHHH")
_NODE = struct.Struct("<HHHH")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

# Files found whole, by identity: for a writer (every tree walked), and for a
# reader (the freeDB, which readers never read, left out).
_whole: set[tuple[int, int, int, int]] = set()
_readable: set[tuple[int, int, int, int]] = set()


@record
class Meta:
    """The fields of one meta page that say where the trees are."""

    txnid: int
    last_pg: int
    psize: int
    free_root: int
    main_root: int


def _meta_at(buf: bytes, off: int) -> Meta | None:
    if off + _HEAD > len(buf):
        return None
    magic, version, _mapsize = _META.unpack_from(buf, off + 16)
    flags = _PAGE_HEAD.unpack_from(buf, off)[1]
    if magic != LMDB_MAGIC or version != _DATA_VERSION or not flags & _P_META:
        return None
    last_pg, txnid = struct.unpack_from("<QQ", buf, off + _LAST_PG)
    return Meta(
        txnid=txnid,
        last_pg=last_pg,
        psize=_U32.unpack_from(buf, off + _FREE_DB)[0],
        free_root=_U64.unpack_from(buf, off + _FREE_DB + _DB_ROOT)[0],
        main_root=_U64.unpack_from(buf, off + _MAIN_DB + _DB_ROOT)[0],
    )


def newest_meta(path: Path, head: bytes, size: int) -> Meta:
    """The meta page LMDB opens with; StoreCorrupt if the file is not LMDB's,
    StoreDamaged if it is but its second meta page is cut off."""
    if size == 0:
        # What mdb_env_open leaves when killed before it wrote the meta pages
        # (LMDB itself would initialise it as a new environment).
        raise StoreDamaged(str(path.parent), "data.mdb is empty: its creation was cut short")
    if size < _HEAD:
        raise StoreCorrupt(
            str(path.parent), f"data.mdb is {size} bytes: not an LMDB file (or truncated)"
        )
    first = _meta_at(head, 0)
    if first is None or first.psize not in _PAGE_SIZES:
        raise StoreCorrupt(
            str(path.parent), "data.mdb is not an LMDB file: this is not a kreld store"
        )
    if size < first.psize + _HEAD:
        raise StoreDamaged(
            str(path.parent), f"data.mdb is truncated: {size} bytes, no second meta page"
        )
    second = _meta_at(head, first.psize)
    if second is None:
        raise StoreDamaged(str(path.parent), "data.mdb: the second meta page is damaged")
    return max(first, second, key=lambda m: m.txnid)


class _Walk:
    """Follow every page the trees of one meta page reference."""

    def __init__(self, fd: int, store: str, size: int, meta: Meta, salvage: bool = False) -> None:
        self.fd = fd
        self.salvage = salvage
        # With *salvage*, the named databases found damaged, and why.
        self.lost: dict[str, str] = {}
        self.store = store
        self.meta = meta
        self.psize = meta.psize
        self.pages_in_file = size // meta.psize
        self.seen: set[int] = set()
        self.budget = meta.last_pg
        self.highest = 1  # the highest page number referenced so far

    def damaged(self, what: str) -> StoreDamaged:
        return StoreDamaged(self.store, f"data.mdb: {what}")

    def _reach(self, pgno: int, count: int, what: str) -> None:
        """Pages *pgno* .. *pgno* + *count* - 1 must exist in the file."""
        self.budget -= count
        self.highest = max(self.highest, pgno + count - 1)
        if self.budget < 0:
            raise self.damaged("the trees reference more pages than the file was given")
        if pgno < 2 or pgno + count - 1 > self.meta.last_pg:
            raise self.damaged(
                f"{what} refers to page {pgno}, outside pages 2..{self.meta.last_pg}"
            )
        if pgno + count > self.pages_in_file:
            raise self.damaged(
                f"truncated: {what} needs page {pgno + count - 1}, "
                f"the file has only {self.pages_in_file} pages"
            )

    def page(self, pgno: int, what: str) -> tuple[bytes, int]:
        if pgno in self.seen:
            raise self.damaged(f"page {pgno} is referenced twice ({what})")
        self._reach(pgno, 1, what)
        self.seen.add(pgno)
        buf = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(buf) != self.psize:
            raise self.damaged(f"page {pgno} could not be read whole")
        stored, flags, _lower, _upper = _PAGE_HEAD.unpack_from(buf)
        if stored != pgno:
            raise self.damaged(f"page {pgno} holds page number {stored} ({what})")
        return buf, flags

    def overflow(self, pgno: int) -> None:
        buf, flags = self.page(pgno, "an overflow value")
        pages = _U32.unpack_from(buf, 12)[0]
        if not flags & _P_OVERFLOW or pages < 1:
            raise self.damaged(f"page {pgno} should start an overflow run")
        self._reach(pgno + 1, pages - 1, f"the overflow run at page {pgno}")

    def trees(self) -> None:
        if not self.salvage:  # readers never read the freeDB
            self.tree(self.meta.free_root, "the free-page database")
        self.tree(self.meta.main_root, "the main database")

    def tree(self, root: int, what: str) -> None:
        if root == _P_INVALID:
            return
        todo = [root]
        while todo:
            pgno = todo.pop()
            buf, flags = self.page(pgno, what)
            if flags & _P_BRANCH:
                todo.extend(self._children(pgno, buf))
            elif flags & _P_LEAF:
                if not flags & _P_LEAF2:
                    self._leaf(pgno, buf, what)
            else:
                raise self.damaged(f"page {pgno} of {what} is neither a branch nor a leaf")

    def _nodes(self, pgno: int, buf: bytes) -> list[int]:
        lower, upper = struct.unpack_from("<HH", buf, 12)
        if lower < _PAGEHDRSZ or lower > upper or upper > self.psize or lower % 2:
            raise self.damaged(f"page {pgno} has bounds {lower}..{upper}")
        offsets = struct.unpack_from(f"<{(lower - _PAGEHDRSZ) // 2}H", buf, _PAGEHDRSZ)
        for off in offsets:
            if off < upper or off + _NODESIZE > self.psize:
                raise self.damaged(f"page {pgno} has a node at {off}, outside its bounds")
        return list(offsets)

    def _children(self, pgno: int, buf: bytes) -> list[int]:
        out = []
        for off in self._nodes(pgno, buf):
            lo, hi, top, _ksize = _NODE.unpack_from(buf, off)
            out.append(lo | hi << 16 | top << 32)
        return out

    def _leaf(self, pgno: int, buf: bytes, what: str) -> None:
        for off in self._nodes(pgno, buf):
            lo, hi, flags, ksize = _NODE.unpack_from(buf, off)
            data = off + _NODESIZE + ksize
            size = 8 if flags & _F_BIGDATA else lo | hi << 16
            if data + size > self.psize:
                raise self.damaged(f"page {pgno} has a node that overruns it")
            if flags & _F_BIGDATA:
                self.overflow(_U64.unpack_from(buf, data)[0])
            elif flags & _F_SUBDATA:
                if size < _DB_ROOT + 8:
                    raise self.damaged(f"page {pgno} has a database record of {size} bytes")
                name = bytes(buf[off + _NODESIZE : data]).decode(errors="replace")
                root = _U64.unpack_from(buf, data + _DB_ROOT)[0]
                if flags & _F_DUPDATA:
                    self.tree(root, "a duplicate tree")
                elif not self.salvage:
                    self.tree(root, f"database {name!r}")
                else:
                    try:
                        self.tree(root, f"database {name!r}")
                    except StoreDamaged as e:
                        self.lost[name] = e.reason


def _open(store: Path) -> int | None:
    try:
        return os.open(store / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(str(store), f"cannot read data.mdb: {e.strerror}") from e


def reach(store: Path) -> tuple[int, Meta]:
    """The highest page the newer meta page's trees reference, and that meta
    (the walk of :func:`check_datafile`, done whatever the file's size)."""
    fd = _open(store)
    if fd is None:
        raise StoreError(str(store), "no data.mdb")
    try:
        size = os.fstat(fd).st_size
        meta = newest_meta(store / "data.mdb", os.pread(fd, 65536 + _HEAD, 0), size)
        walk = _Walk(fd, str(store), size, meta)
        walk.trees()
        return walk.highest, meta
    finally:
        os.close(fd)


def check_datafile(store: Path, readonly: bool = False) -> frozenset[str]:
    """Refuse a ``data.mdb`` under *store* that LMDB could not read whole.

    StoreCorrupt: not an LMDB file at all (nobody's kreld store we can name).
    StoreDamaged: an LMDB file cut short or with damaged tree pages.  A
    *readonly* opener is refused only when the main tree is damaged; it gets
    the names of the damaged named databases, which it must not read.
    A missing file passes (a new store is made).
    """
    fd = _open(store)
    if fd is None:
        return frozenset()
    try:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if identity in _whole or (readonly and identity in _readable):
            return frozenset()
        head = os.pread(fd, 65536 + _HEAD, 0)
        meta = newest_meta(store / "data.mdb", head, st.st_size)
        if st.st_size < (meta.last_pg + 1) * meta.psize:
            walk = _Walk(fd, str(store), st.st_size, meta, salvage=readonly)
            walk.trees()
            if walk.lost:
                return frozenset(walk.lost)
        (_readable if readonly else _whole).add(identity)
        return frozenset()
    except OSError as e:
        raise StoreError(str(store), f"cannot read data.mdb: {e.strerror}") from e
    finally:
        os.close(fd)
