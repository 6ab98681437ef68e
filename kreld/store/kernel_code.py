"""Kernel code beyond the image and modules: the ``kcode`` table (its
on-disk name, kept from the first stores that had it).

One named database, keyed by boot-id (16 bytes) and a letter:

``c`` + seq (8 bytes BE)
    a :class:`~kreld.core.kernel_code.KernelCode` record (JSON).
``o`` + seq
    ``b""`` while that record is open (not seen unloaded).
``l`` + seq
    a :class:`~kreld.core.kernel_code.LossWindow` (JSON).
``w``
    the time of the last records written (JSON): where a restart's
    "kreld was not running" window starts.

Retention (:meth:`KernelCodeTables.prune`): per boot, every open record and
the newest :data:`~kreld.core.consts.KERNEL_CODE_KEEP_CLOSED` closed ones (by seq,
which is load order) are kept; the older closed ones are deleted and become
one loss window of reason ``retention`` (from the boot to the last unload
dropped), so that their addresses at their times answer as uncertain, not as
nothing; at most :data:`~kreld.core.consts.KERNEL_CODE_KEEP_LOSSES` windows are
kept, the oldest two merged into one past that.  Boots the store no longer
holds lose their records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import partial
from typing import Any

from kreld.core import consts
from kreld.core.kernel_code import KernelCode, LossReason, LossWindow
from kreld.core.model import BOOT_START, Timestamp
from kreld.store.env import SEQ, StoreEnv, Table, boot_key, decoded, dumps

__all__ = ["KernelCodeTables"]


class KernelCodeTables:
    """The ``kcode`` table of a store (created by a writer's open)."""

    def __init__(self, env: StoreEnv) -> None:
        self.env = env
        # None: a read-only open of a store from before this table (nothing
        # recorded); a damaged table is StoreCorrupt when read (env.dbs).
        self.db: Any = env.dbs[Table.KERNEL_CODE]

    # -- writing ------------------------------------------------------------------

    def apply(
        self,
        boot_id: str,
        written: Iterable[KernelCode],
        losses: Iterable[LossWindow],
        watch: Timestamp | None,
    ) -> None:
        """Write records, loss windows and the watch time in one transaction."""
        b = boot_key(boot_id)
        recs = [(c.seq, dumps(c.to_json()), c.unloaded is None) for c in written]
        wins = [dumps(w.to_json()) for w in losses]

        def fn(txn: Any) -> None:
            for seq, raw, is_open in recs:
                k = SEQ.pack(seq)
                txn.put(b + b"c" + k, raw, db=self.db)
                if is_open:
                    txn.put(b + b"o" + k, b"", db=self.db)
                else:
                    txn.delete(b + b"o" + k, db=self.db)
            if wins:
                n = self._next(txn, b + b"l")
                for i, raw in enumerate(wins):
                    txn.put(b + b"l" + SEQ.pack(n + i), raw, db=self.db)
            if watch is not None:
                txn.put(b + b"w", dumps(watch.to_json()), db=self.db)

        self.env.write(fn)

    def _next(self, txn: Any, prefix: bytes) -> int:
        """One past the last seq under *prefix*."""
        cur = txn.cursor(db=self.db)
        moved = cur.prev() if cur.set_range(prefix + b"\xff" * 8) else cur.last()
        k = bytes(cur.key()) if moved else b""
        if k[: len(prefix)] != prefix or len(k) != len(prefix) + SEQ.size:
            return 0
        return int(SEQ.unpack(k[len(prefix) :])[0]) + 1

    # -- reading --------------------------------------------------------------------

    def _scan(self, txn: Any, prefix: bytes, start: bytes = b"") -> list[tuple[bytes, bytes]]:
        """The rows under *prefix*, from *prefix* + *start* on."""
        if self.db is None:
            return []
        cur = txn.cursor(db=self.db)
        out = []
        if cur.set_range(prefix + start):
            for k, v in cur:
                if k[: len(prefix)] != prefix:
                    break
                out.append((bytes(k), bytes(v)))
        return out

    def _decode(self, raw: bytes) -> KernelCode:
        path = self.env.path
        return decoded(path, "kernel code record", lambda: KernelCode.from_json(json.loads(raw)))

    def codes(
        self, boot_id: str, seqs: Iterable[int] = (), since: int | None = None
    ) -> list[KernelCode]:
        """The records of *boot_id* in seq order: every one, or with *since*
        those of *seqs* and those from seq *since* on."""
        prefix = boot_key(boot_id) + b"c"

        def fn(txn: Any) -> list[bytes]:
            if since is None:
                return [v for _, v in self._scan(txn, prefix)]
            picked = [txn.get(prefix + SEQ.pack(q), db=self.db) for q in sorted(set(seqs))]
            out = [bytes(v) for v in picked if v is not None]
            return out + [v for _, v in self._scan(txn, prefix, SEQ.pack(since))]

        return [self._decode(v) for v in self.env.read(fn)]

    def raw_codes(self, boot_id: str) -> list[tuple[int, bytes]]:
        """The records of *boot_id* as stored (seq, JSON), undecoded: what the
        publisher digests each round, decoding only those that changed."""
        prefix = boot_key(boot_id) + b"c"
        rows = self.env.read(lambda txn: self._scan(txn, prefix))
        return [(int(SEQ.unpack(k[len(prefix) :])[0]), v) for k, v in rows]

    def decode(self, raw: bytes) -> KernelCode:
        """One record as :meth:`raw_codes` gave it (StoreCorrupt when it is damaged)."""
        return self._decode(raw)

    def open_codes(self, boot_id: str) -> list[KernelCode]:
        b = boot_key(boot_id)

        def fn(txn: Any) -> list[bytes]:
            keys = [k[len(b) + 1 :] for k, _ in self._scan(txn, b + b"o")]
            return [bytes(txn.get(b + b"c" + k, db=self.db) or b"") for k in keys]

        return [self._decode(v) for v in self.env.read(fn)]

    def losses(self, boot_id: str) -> list[LossWindow]:
        """The loss windows of *boot_id*, oldest start first."""
        rows = self.env.read(lambda txn: self._scan(txn, boot_key(boot_id) + b"l"))
        path = self.env.path
        wins = [decoded(path, "loss window", partial(_loss, v)) for _, v in rows]
        return sorted(wins, key=lambda w: w.start.monotonic)

    def next_seq(self, boot_id: str) -> int:
        if self.db is None:
            return 0
        return self.env.read(lambda txn: self._next(txn, boot_key(boot_id) + b"c"))

    def watch(self, boot_id: str) -> Timestamp | None:
        if self.db is None:
            return None
        raw = self.env.read(lambda txn: txn.get(boot_key(boot_id) + b"w", db=self.db))
        if raw is None:
            return None
        path = self.env.path
        return decoded(path, "watch time", lambda: Timestamp.from_json(json.loads(raw)))

    # -- retention ----------------------------------------------------------------

    def prune(
        self,
        boot_id: str,
        keep_closed: int = consts.KERNEL_CODE_KEEP_CLOSED,
        keep_losses: int = consts.KERNEL_CODE_KEEP_LOSSES,
    ) -> int:
        """Apply retention to *boot_id* (see the module's docstring); returns
        how many records were deleted."""
        b = boot_key(boot_id)

        def fn(txn: Any) -> int:
            opened = {k[len(b) + 1 :] for k, _ in self._scan(txn, b + b"o")}
            closed = [(k, v) for k, v in self._scan(txn, b + b"c") if k[len(b) + 1 :] not in opened]
            drop = closed[: max(0, len(closed) - keep_closed)]
            last = BOOT_START
            for k, v in drop:
                code = self._decode(v)
                if code.unloaded is not None and code.unloaded.monotonic > last.monotonic:
                    last = code.unloaded
                txn.delete(k, db=self.db)
            wins = [(k, LossWindow.from_json(json.loads(v))) for k, v in self._scan(txn, b + b"l")]
            if drop:
                n = self._next(txn, b + b"l")
                win = LossWindow(BOOT_START, last, LossReason.RETENTION, len(drop))
                k = b + b"l" + SEQ.pack(n)
                txn.put(k, dumps(win.to_json()), db=self.db)
                wins.append((k, win))
            _merge_oldest(txn, self.db, wins, keep_losses)
            return len(drop)

        return 0 if self.db is None else self.env.write(fn)

    def drop_boots(self, keep: set[str]) -> int:
        """Delete the records of every boot not in *keep* (boot-ids); returns how many keys."""
        wanted = {boot_key(x) for x in keep}

        def fn(txn: Any) -> int:
            cur = txn.cursor(db=self.db)
            gone = [bytes(k) for k, _ in cur if bytes(k[:16]) not in wanted]
            for k in gone:
                txn.delete(k, db=self.db)
            return len(gone)

        return 0 if self.db is None else self.env.write(fn)


def _loss(raw: bytes) -> LossWindow:
    return LossWindow.from_json(json.loads(raw))


def _merge_oldest(txn: Any, db: Any, wins: list[tuple[bytes, LossWindow]], keep: int) -> None:
    """Merge the two oldest windows into the first's key until *keep* are left."""
    wins.sort(key=lambda kw: kw[1].start.monotonic)
    while len(wins) > max(keep, 1):
        (k1, a), (k2, b) = wins[0], wins[1]
        end = a.end if a.end.monotonic >= b.end.monotonic else b.end
        reason = a.reason if a.reason == b.reason else LossReason.RETENTION
        merged = LossWindow(a.start, end, reason, a.lost + b.lost)
        txn.delete(k2, db=db)
        txn.put(k1, dumps(merged.to_json()), db=db)
        wins[:2] = [(k1, merged)]
