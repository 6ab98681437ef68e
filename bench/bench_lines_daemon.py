"""Source lines through the daemon: Resolve with ``lines`` over its socket.

kreld runs as a real subprocess on a fake tree whose kernel is Debian's
6.1.0-57-cloud-amd64 (the build-id of its -dbg vmlinux, ``_text`` at a KASLR
address of its own), with ``[kernel] debuginfo_dirs`` naming the extracted
-dbg files (bench_lines.py fetches them once into /var/cache/kreld-vm/dbg).
The same random ``.text`` addresses as a profiler would send them: 10,000,
then 100,000, with inline frames.

* cold: the first Resolve of the build, its table built by the daemon's
  builder thread from the vmlinux and kept: wall time of the call (retried
  while the answer is "being built") against ``llvm-symbolizer --inlines``'s
  total for the 10,000 (goal within 2x); the daemon's peak RSS meanwhile
  (goal <= 512 MiB: the daemon's own footprint is part of it);
* warm: the 100,000 again, over the socket, the reply decoded by the client
  (kreld's ``Client.call``, its columns not spelt out into a dict per frame):
  addresses/s against llvm-symbolizer's loaded rate (its 100,000 minus its
  10,000; goal >= 5x); the 10,000 too;
* the table kept in the store against vmlinux's .debug_* sections (<= 1/4);
* answers equal to llvm-symbolizer's (function, normalized file, line, every
  frame) where it names a function; drgn's 10,000 beside (``pip install drgn``).

Run alone: ``.venv/bin/python bench/bench_lines_daemon.py [--quick]``.
"""

from __future__ import annotations

import mmap
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_lines import (
    MIB,
    RELEASE,
    VMLINUX,
    Frames,
    _Child,
    compare,
    drgn_frames,
    dwarf_bytes,
    ensure_debug_files,
    llvm_frames,
    no_line_only,
    text_range,
)
from common import Kreld, Result, bench_main, load_faketree, log

from kreld.client import Client, resolutions
from kreld.debuginfo.lines_reloc import symbol_value
from kreld.kernel.elf import fd_build_id

RUNTIME_TEXT = 0xFFFFFFFF9D000000


def _build_id(path: Path) -> str:
    with open(path, "rb") as f:
        found = fd_build_id(f.fileno())
    if not found:
        raise RuntimeError(f"{path} has no build-id")
    return found


def _link_text(path: Path) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        text = symbol_value(m, str(path), "_text")
    if text is None:
        raise RuntimeError(f"{path} has no _text")
    return text


def _vm(pid: int, what: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(what + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _start(work: Path, link_text: int, text_end: int) -> tuple[Kreld, Path]:
    """kreld on a fake tree whose kernel is the -dbg vmlinux's build."""
    faketree = load_faketree()
    tree = faketree.FakeTree(
        work / "root", text=RUNTIME_TEXT, build_id=_build_id(VMLINUX), release=RELEASE
    )
    # kallsyms spanning the real .text, so every address asked lies in the image.
    end = RUNTIME_TEXT + (text_end - link_text)
    tree.write("proc/kallsyms", f"{RUNTIME_TEXT:016x} T _text\n{RUNTIME_TEXT:016x} T _stext\n"
                                f"{end:016x} T _etext\n")  # fmt: skip
    cfg = work / "kreld.toml"
    cfg.write_text(f'[kernel]\ndebuginfo_dirs = ["{VMLINUX.parents[1]}"]\n')
    sock = work / "k.sock"
    k = Kreld(["--config", str(cfg), "--root", str(tree.root), "--state-dir",
               str(work / "state"), "--socket", str(sock)], work / "kreld.log")  # fmt: skip
    k.wait_for("ready", timeout=90)
    return k, sock


def _frames(results: list[dict[str, Any]]) -> list[Frames]:
    return [[(f["function"], f["file"], f["line"]) for f in r["frames"]] for r in results]


def _timed(c: Client, hexes: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """The call's wall time (sent, answered, the reply decoded: what a
    profiler reading the columns pays), and its answers spelt out."""
    t0 = time.perf_counter()
    reply = c.call("Resolve", addresses=hexes, lines=True)
    dt = time.perf_counter() - t0
    return dt, resolutions(hexes, reply)


def run(quick: bool) -> list[Result]:
    """Resolve with lines over the daemon's socket against llvm-symbolizer and drgn."""
    if not ensure_debug_files():
        log("no -dbg files: nothing measured")
        return []
    rng = random.Random(28)
    lo, size = text_range(VMLINUX, ".text")
    big = sorted(rng.randrange(lo, lo + size) for _ in range(20_000 if quick else 100_000))
    small = big[:: len(big) // 10_000][:10_000]
    llvm = ["llvm-symbolizer", "--inlines", "--output-style=JSON", "-e", str(VMLINUX)]
    log("llvm-symbolizer, 10,000 and all")
    l10, _, lout10 = _Child.run(llvm, "\n".join(map(hex, small)).encode())
    lbig, _, loutbig = _Child.run(llvm, "\n".join(map(hex, big)).encode())
    refs_small, refs_big = llvm_frames(lout10), llvm_frames(loutbig)
    loaded_rate = (len(big) - len(small)) / max(lbig - l10, 1e-9)
    link_text = _link_text(VMLINUX)
    runtime = lambda addrs: [f"{RUNTIME_TEXT + a - link_text:#018x}" for a in addrs]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-lines-daemon-") as tmp:
        k, sock = _start(Path(tmp), link_text, lo + size)
        try:
            assert k.proc is not None
            base_rss = _vm(k.proc.pid)
            with Client(str(sock)) as c:
                c.sock.settimeout(600)
                log("cold: the first Resolve with lines builds the table")
                t0 = time.perf_counter()
                while True:
                    _, cold = _timed(c, runtime(small))
                    if not any("being built" in r.get("no_lines", "") for r in cold):
                        break
                cold_dt = time.perf_counter() - t0
                hwm = _vm(k.proc.pid)
                log("warm: the 10,000 and the 100,000 again, five times each")
                w10 = sorted(_timed(c, runtime(small))[0] for _ in range(5))[2]
                reps = [_timed(c, runtime(big)) for _ in range(5)]
                wbig = sorted(dt for dt, _ in reps)[2]
                warm = reps[0][1]
                kept = c.call("Status")["line_tables"]["kept"]
                rss_after = _vm(k.proc.pid, "VmRSS")
        finally:
            k.stop()
    ours_small, ours_big = _frames(cold), _frames(warm)
    eq_s, n_s = compare(ours_small, refs_small, "vmlinux", small)
    eq_b, n_b = compare(ours_big, refs_big, "vmlinux", big)
    nl_b = no_line_only(ours_big, refs_big)
    log("drgn, the 10,000")
    d_dt, _ = drgn_frames(VMLINUX, small, lo, lo + size)
    table_bytes = sum(t["size"] for t in kept)
    dwarf = dwarf_bytes(VMLINUX)
    warm_rate = len(big) / wbig
    llvm_desc = "llvm-symbolizer --inlines on the same addresses, same run"
    return [
        Result("daemon cold: first Resolve+lines of 10,000 (table built), vs llvm 10,000",
               cold_dt * 1e9, "ns", l10 * 1e9, "llvm", llvm_desc, "<= 2x", cold_dt <= 2 * l10),
        Result("daemon peak RSS (MiB) through the build, vs before it", hwm / MIB, "",
               base_rss / MIB, "before", "the daemon's peak RSS before the first build",
               "<= 512 MiB", hwm <= 512 * MIB),
        Result("daemon RSS (MiB) after the build and the warm calls, vs before the build",
               rss_after / MIB, "", base_rss / MIB, "before"),
        Result(f"daemon warm: addresses/s, Resolve+lines of {len(big)} over the socket",
               warm_rate, "", loaded_rate, "llvm-loaded",
               "llvm-symbolizer: (N - 10,000) / (t(N) - t(10,000))", ">= 5x",
               warm_rate >= 5 * loaded_rate),
        Result("daemon warm: Resolve+lines of 10,000 over the socket (s), vs llvm 10,000",
               w10 * 1e9, "ns", l10 * 1e9, "llvm", llvm_desc),
        Result("daemon's kept table bytes, vs vmlinux's DWARF sections", table_bytes, "", dwarf,
               "dwarf", ".debug_* sections of vmlinux", "<= 1/4", table_bytes * 4 <= dwarf),
        Result(f"daemon answers equal to llvm-symbolizer, {n_s} named of 10,000 (cold)", eq_s,
               "", n_s, "named", "addresses llvm-symbolizer names a function at", "all",
               eq_s == n_s),
        Result(f"daemon answers equal to llvm-symbolizer, {n_b} named of {len(big)} (warm)",
               eq_b, "", n_b, "named", "", "all", eq_b == n_b),
        Result("  of the rest: the reference's function, no line (line program only)", nl_b, "",
               n_b - eq_b, "differing", "addresses where the answers differ"),
        Result("drgn 10,000 (s), vs llvm-symbolizer 10,000", d_dt * 1e9, "ns", l10 * 1e9,
               "llvm", llvm_desc),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench_main("lines-daemon", run))
