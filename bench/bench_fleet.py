"""The fleet bucket at scale (10,000 hosts x 10 boots x 100 modules, 20 builds).

Objects are generated with kreld's own encoders (:mod:`kreld.fleet.objects`, as the publisher
writes them) into obstore's in-memory store, and read back with the real reader
(:class:`kreld.fleet.bucket.BucketStore` and :class:`kreld.server.service.Service`, as ``kreldctl
--from`` runs them); what a real server would add is its request latency, so the
requests each step makes are counted and printed beside its time.

* Bucket bytes per host-boot beyond the shared tables: one boot's manifest, its one
  batch of 100 incarnations and its index entry.  Goal < 64 KiB.  Baseline: the same
  incarnations as plain JSON (what one object per incarnation, uncompressed, would hold).
* ``boots`` over 100,000 boots (``--quick``: 20,000): the listing of index/, 1,000 names a
  page.  Goal < 10 s.  Baseline: decoding the same 100,000 boot records from JSON.
* A cold ``resolve`` of one module address of one boot, by boot-id prefix, on a fresh
  reader: index lookup, manifest, batch, module table.  Goal < 1 s.  Baseline: the same
  resolve on the warm reader.

Run alone: ``.venv/bin/python bench/bench_fleet.py [--quick]``.
"""

from __future__ import annotations

import json
import random
import sys
import uuid

from common import Result, bench_main, log, now_ns

from kreld.client import resolutions
from kreld.core.model import BootSnapshot, BootSymbols, Incarnation
from kreld.core.symtab import kernel_table, module_table
from kreld.fleet import objects as fleet
from kreld.fleet.bucket import BucketStore
from kreld.fleet.s3 import Bucket
from kreld.server import methods
from kreld.server.service import Service

MODULES = 100
BUILDS = 20


def ts(t: int) -> dict[str, int]:
    return {"monotonic": t, "boottime": t, "realtime": 1_790_000_000_000_000_000 + t}


def boot_record(boot_id: str, build: int, t: int) -> BootSnapshot:
    text = 0xFFFFFFFF81000000 + random.randrange(512) * 0x200000
    return BootSnapshot.from_json(
        {
            "boot_id": boot_id,
            "release": f"6.1.0-{build}-cloud-amd64",
            "version": "#1 SMP PREEMPT_DYNAMIC Debian 6.1.158-1 (2026-10-30)",
            "build_id": f"{build:040x}",
            "anchors": {"_text": f"{text:#x}", "_stext": f"{text:#x}"},
            "kaslr_offset": f"{text - 0xFFFFFFFF81000000:#x}",
            "kaslr_source": "vmlinux",
            "kaslr_path": f"/usr/lib/debug/boot/vmlinux-6.1.0-{build}-cloud-amd64",
            "restricted": False,
            "first_seen": ts(t),
        }
    )


def incarnations(boot_id: str, build: int) -> list[Incarnation]:
    out = []
    for seq in range(MODULES):
        base = 0xFFFFFFFFC0000000 + seq * 0x40000 + random.randrange(64) * 0x1000
        secs = {
            s: f"{base + i * 0x2000:#x}"
            for i, s in enumerate(
                (".text", ".data", ".rodata", ".bss", ".init.text", ".exit.text",
                 ".gnu.linkonce.this_module", ".note.gnu.build-id", "__ksymtab", ".rodata.str1.1",
                 ".data..ro_after_init", "__param", ".altinstructions", "__bug_table")
            )
        }  # fmt: skip
        out.append(
            Incarnation.from_json(
                {
                    "boot_id": boot_id,
                    "seq": seq,
                    "name": f"mod{seq}",
                    "build_id": f"{build:08x}{seq:032x}",
                    "sections": secs,
                    "coresize": 0x40000,
                    "initsize": 0x1000,
                    "initstate": "live",
                    "srcversion": "0123456789ABCDEF0123456",
                    "taint": "",
                    "core_base": secs[".text"],
                    "restricted": False,
                    "inode": 1000 + seq,
                    "faults": [],
                    "loaded": ts(5_000_000_000 + seq),
                    "seen_by": "startup",
                    "init_live": False,
                    "init_done": None,
                    "unloaded": None,
                    "unloaded_after": None,
                    "unload_seen_by": None,
                }
            )
        )
    return out


def run(quick: bool) -> list[Result]:
    from obstore.store import MemoryStore

    random.seed(15)
    bucket = Bucket(MemoryStore(), "memory://fleet")
    boots_total = 20_000 if quick else 100_000
    hosts = boots_total // 10
    log(f"generating {boots_total} index entries ({hosts} hosts x 10 boots)")
    # One full boot (manifest, batch, tables) to resolve; index entries for all.
    boot_id = str(uuid.uuid4())
    build = 7
    snap = boot_record(boot_id, build, 1)
    host = fleet.Host(uuid.uuid4().hex, "web-00001.example.internal")
    incs = incarnations(boot_id, build)
    batch = fleet.encode_batch(boot_id, incs, {})
    symbols = BootSymbols(f"k:{build:040x}")
    manifest = fleet.encode_manifest(fleet.Manifest(host, snap, symbols, ("batch-00000000",)))
    index = fleet.index_object(snap, host, 0)
    per_boot = len(batch) + len(manifest) + len(index)
    plain = sum(len(json.dumps(i.to_json())) for i in incs)
    bucket.put(fleet.batch_object(boot_id, "batch-00000000"), batch)
    bucket.put(fleet.manifest_object(boot_id), manifest)
    core = [(0xFFFFFFFF81000000 + i * 64, b"T", f"kernel_fn_{i}".encode()) for i in range(60_000)]
    bucket.put(
        fleet.table_object(symbols.kernel), fleet.encode_table(kernel_table(core, core[0][0]))
    )
    for inc in incs:
        base = int(inc.state.sections[".text"])
        lines = [(base + j * 32, b"t", f"{inc.name}_fn{j}".encode()) for j in range(200)]
        packed = module_table(lines, dict(inc.state.sections), {".text": 0x2000})
        if packed is not None:
            bucket.put(fleet.table_object(f"m:{inc.state.build_id}"), fleet.encode_table(packed))
    bucket.put(index, b"")
    for h in range(hosts):
        mid = uuid.uuid4().hex
        for b in range(10):
            other = boot_record(str(uuid.uuid4()), (h + b) % BUILDS, h * 10 + b + 2)
            bucket.put(fleet.index_object(other, fleet.Host(mid, f"host-{h:05d}"), 0), b"")

    log("listing boots")
    bucket.requests = 0
    t0 = now_ns()
    rows = BucketStore(bucket).index()
    list_ns = now_ns() - t0
    list_requests = bucket.requests
    if len(rows) != boots_total + 1:
        raise RuntimeError(f"listed {len(rows)} boots, expected {boots_total + 1}")
    t0 = now_ns()
    for _ in range(boots_total):
        BootSnapshot.from_json(json.loads(json.dumps(snap.to_json())))
    decode_ns = now_ns() - t0

    log("cold resolve")
    addr = f"{int(incs[42].state.sections['.text']) + 0x24:#x}"

    def resolve(reader: BucketStore) -> dict[str, object]:
        svc = Service(reader, current_boot=lambda: snap, current_id=lambda: None, loaded=list)
        res: dict[str, object] = methods.call(
            svc, "Resolve", {"addresses": [addr], "boot_id": boot_id[:12]}
        )
        return res

    cold = BucketStore(bucket)
    bucket.requests = 0
    t0 = now_ns()
    got = resolve(cold)
    cold_ns = now_ns() - t0
    cold_requests = bucket.requests
    t0 = now_ns()
    resolve(cold)
    warm_ns = now_ns() - t0
    image = resolutions([addr], got)[0].get("image")
    if image != "mod42":
        raise RuntimeError(f"resolved to {image!r}")
    results = real_server_listing(boots_total, list_ns, list_requests, quick)
    return [
        Result(
            "bucket bytes per host-boot beyond shared tables (100 modules)",
            per_boot, "", plain, "json", "the same incarnations as plain JSON",
            "< 64 KiB", per_boot < 64 * 1024,
        ),
        Result(
            f"boots over {boots_total} boots ({list_requests} LIST pages, memory store)",
            list_ns, "ns", decode_ns, "decode", f"decoding {boots_total} boot records from JSON",
            "< 10 s", list_ns < 10e9,
            notes=[f"on S3 add {list_requests} LIST round trips (~30-100 ms each)"],
        ),
        Result(
            f"cold resolve of one module address ({cold_requests} requests, memory store)",
            cold_ns, "ns", warm_ns, "warm", "the same resolve on the warm reader",
            "< 1 s", cold_ns < 1e9,
            notes=[f"on S3 add ~{cold_requests} sequential round trips"],
        ),
        *results,
    ]  # fmt: skip


def real_server_listing(boots_total: int, memory_ns: int, pages: int, quick: bool) -> list[Result]:
    """The same listing's page latency on a real S3 server (SeaweedFS, started here on
    127.0.0.1 with ports of its own, as the tests do), measured over a few thousand boots
    and projected to *boots_total*: the memory-store time (which decodes the names) plus
    one round trip a page."""
    import asyncio
    import os
    import tempfile
    from pathlib import Path

    from common import REPO

    sys.path.insert(0, str(REPO / "tests"))
    import obstore

    from kreld.fleet.s3 import open_bucket

    from support.s3server import running_s3, weed_binary

    if weed_binary() is None:
        log("no weed binary: the real-server listing is skipped")
        return []
    n = 2000 if quick else 5000
    with tempfile.TemporaryDirectory(prefix="kreld-bench-weed-") as d, running_s3(Path(d)) as s3:
        os.environ.update(s3.env())
        bucket = open_bucket("s3://fleet/bench")
        names = []
        for h in range(n // 10):
            mid = uuid.uuid4().hex
            for b in range(10):
                snap = boot_record(str(uuid.uuid4()), b % BUILDS, h * 10 + b)
                names.append(fleet.index_object(snap, fleet.Host(mid, f"host-{h:05d}"), 0))

        async def put_all() -> None:
            gate = asyncio.Semaphore(32)

            async def one(name: str) -> None:
                async with gate:
                    await obstore.put_async(bucket.store, name, b"")

            await asyncio.gather(*(one(x) for x in names))

        log(f"putting {n} index names into SeaweedFS")
        asyncio.run(put_all())
        if len(BucketStore(bucket).index()) != n:
            raise RuntimeError(f"the reader did not list the {n} boots")
        samples = []  # round trips alone: the names' decoding is in memory_ns already
        for _ in range(3):
            last = now_ns()
            for _page in obstore.list(bucket.store, "index", chunk_size=1000):
                samples.append(now_ns() - last)
                last = now_ns()
        per_page = sorted(samples)[len(samples) // 2]
    projected = memory_ns + pages * per_page
    return [
        Result(
            f"boots over {boots_total} boots projected on SeaweedFS here ({pages} pages)",
            projected, "ns", memory_ns, "memory", "the same listing from the memory store",
            "< 10 s", projected < 10e9,
            notes=[f"SeaweedFS LIST page of 1000 names here: {per_page / 1e6:.0f} ms (median)"],
        )
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench_main("fleet", run))
