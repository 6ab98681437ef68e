"""Packed symbol tables built from kallsyms lines (pure: no daemon)."""

from __future__ import annotations

import bisect
import json
import random

from kreld.model import Anchors, BootSnapshot, Clock, Incarnation, ModuleState, SeenBy, Timestamp
from kreld.queries import AddressMap
from kreld.symtab import (
    MODULE_ABSOLUTE,
    Accel,
    SymbolTable,
    kernel_table,
    module_table,
    parse_kallsyms,
)

TEXT = 0xFFFFFFFF9A000000

KVM = b"""\
ffffffffc0a00000 t kvm_vcpu_kick\t[kvm]
ffffffffc0a00040 T kvm_exported\t[kvm]
ffffffffc0a02000 d kvm_debugfs\t[kvm]
0000000000034008 a kvm_running_vcpu\t[kvm]
ffffffffc0a03000 b kvm_count\t[kvm]
0000000000034010 a cpu_tsc_khz\t[kvm]
"""
SECTIONS = {".text": 0xFFFFFFFFC0A00000, ".data": 0xFFFFFFFFC0A02000, ".bss": 0xFFFFFFFFC0A03000}


def test_per_cpu_lines_are_kept_at_their_printed_values() -> None:
    """kvm's per-cpu variables print as type a below every section (the
    kernel keeps .data..percpu out of sysfs): the table still forms, and
    gives every line back, in order, at its address."""
    ks = parse_kallsyms(KVM)
    packed = module_table(ks.modules["kvm"], SECTIONS, {})
    assert packed is not None
    table = SymbolTable(packed)
    assert table.sections[-1] == MODULE_ABSOLUTE
    bases = [SECTIONS.get(n, 0) for n in table.sections]
    back = [f"{bases[e.section] + e.value:016x} {e.type} {e.name}\t[kvm]" for e in table]
    assert back == KVM.decode().splitlines()
    text = table.section_index(".text")
    assert text is not None
    assert table.lookup(text, 0x44) == ("kvm_exported", 4)


def test_lines_of_another_load_are_refused() -> None:
    """A symbol below every section base (and not type a) belongs to another load."""
    ks = parse_kallsyms(b"ffffffffc0000000 t old_code\t[kvm]\n")
    assert module_table(ks.modules["kvm"], SECTIONS, {}) is None


def test_page_index_finds_what_a_whole_bisect_finds() -> None:
    """A kernel-sized table (20,000 relocated symbols: dense pages, empty pages, several
    at one address, absolute ones after them): the page-indexed search gives the same
    entry as bisecting every key, for each symbol's address, its neighbours, gaps, and
    keys below, above and between the sections."""
    rng = random.Random(11)
    value, core = 0, []
    for k in range(20_000):
        value += rng.choice((0, 0x10, 0x40, 0x300, 0x1000, 0x5000, 0x23000))
        core.append((TEXT + value, b"t", f"fn_{k}".encode()))
    core += [(0x1000 + 8 * k, b"A", f"percpu_{k}".encode()) for k in range(50)]
    table = SymbolTable(kernel_table(core, TEXT))
    acc = Accel(table, 0)
    assert acc.first is not None and acc.npages > 1000
    zero = 1 << 39
    probes = [
        zero + v + d for _a, _t, _n in core[:20_000] for v in (_a - TEXT,) for d in (-1, 0, 1)
    ]
    probes += [zero + rng.randrange(-0x10000, value + 0x10000) for _ in range(20_000)]
    probes += [0, zero - 1, (1 << 40) - 1, (1 << 40) + zero + 0x1000, (2 << 40) + 5]
    for key in probes:
        assert acc.find(table, key) == bisect.bisect_right(table.keys, key) - 1, hex(key)


def test_resolve_json_names_each_address_as_a_plain_lookup_does() -> None:
    """The batch path (page index, names straight from the blob, escaping) against
    SymbolTable.lookup one address at a time, on a kernel table and a module table
    whose names need JSON escaping."""
    rng = random.Random(3)
    core = [(TEXT + 0x40 * k + rng.randrange(0x20), b"T", f"k{k}".encode()) for k in range(6000)]
    core.append((TEXT + 0x40 * 6000, b"T", b"_etext"))
    ktab = kernel_table(core, TEXT)
    mod_base = 0xFFFFFFFFC0000000
    lines = [(mod_base + 0x100 * k, b"t", f'odd "name" \\{k}'.encode()) for k in range(20)]
    mtab = module_table(lines, {".text": mod_base}, {".text": 0x2000})
    assert mtab is not None
    boot = BootSnapshot(
        "00000000-0000-0000-0000-000000000001", "6.1", "#1", None,
        Anchors(TEXT, TEXT, TEXT + 0x40 * 6000), None, False, None, 0, Timestamp(1, 1, 1),
    )  # fmt: skip
    state = ModuleState("odd", "ab" * 20, {".text": mod_base}, 0x2000, 0, "live", None, None,
                        mod_base, False, None)  # fmt: skip
    inc = Incarnation(boot.boot_id, 0, state, Timestamp(1, 1, 1), SeenBy.STARTUP, False)
    amap = AddressMap(boot, [inc], Clock.MONOTONIC, None, "k:x")
    tables = {"k:x": SymbolTable(ktab), "m:" + "ab" * 20: SymbolTable(mtab)}
    addrs = [TEXT + rng.randrange(0x40 * 6000 + 0x100) for _ in range(3000)]
    addrs += [mod_base + rng.randrange(0x2100) for _ in range(300)] + [TEXT - 1, 5]
    got = json.loads(amap.resolve_json(addrs, tables))
    for a, r in zip(addrs, got, strict=True):
        assert r["address"] == f"{a:#x}"
        if TEXT <= a < TEXT + 0x40 * 6000:
            want = tables["k:x"].lookup(0, a - TEXT)
        elif mod_base <= a < mod_base + 0x2000:
            want = tables["m:" + "ab" * 20].lookup(0, a - mod_base)
        else:
            assert r["image"] is None
            continue
        assert want is not None
        assert (r["symbol"], int(r["symbol_offset"], 16)) == want
