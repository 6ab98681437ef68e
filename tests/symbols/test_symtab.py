"""Packed symbol tables built from kallsyms lines (pure: no daemon)."""

from __future__ import annotations

import json
import random

from kreld.client import resolutions
from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Clock,
    Incarnation,
    ModuleState,
    SeenBy,
    Timestamp,
)
from kreld.core.symtab import (
    KEY_SPAN,
    MODULE_ABSOLUTE,
    SymbolTable,
    kernel_table,
    module_table,
)
from kreld.kernel.kallsyms import parse_kallsyms
from kreld.symbols.queries import FEW, AddressMap, Resolved

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


def test_of_symbols_at_one_address_the_last_perf_keeps_is_found() -> None:
    """perf's rule for a kallsyms file (tools/perf/util/symbol.c): of several
    symbols at one address the last in file order of the types perf keeps (a
    read-only data symbol there loses); a lone rodata symbol is still named."""
    core = [
        (TEXT, b"T", b"srso_alias_untrain_ret"),
        (TEXT, b"T", b"_stext"),
        (TEXT, b"T", b"_text"),
        (TEXT + 0x40, b"t", b"__pfx_f"),
        (TEXT + 0x50, b"T", b"f"),
        (TEXT + 0x50, b"t", b"f_local"),
        (TEXT + 0x60, b"W", b"weak"),
        (TEXT + 0x60, b"r", b"ro_after"),
        (TEXT + 0x80, b"r", b"ro_alone"),
        (0x1000, b"A", b"per_cpu_abs"),
    ]
    table = SymbolTable(kernel_table(core, TEXT))
    assert table.lookup(0, 0x4) == ("_text", 4)
    assert table.lookup(0, 0x48) == ("__pfx_f", 8)
    assert table.lookup(0, 0x51) == ("f_local", 1)
    assert table.lookup(0, 0x61) == ("weak", 1)
    assert table.lookup(0, 0x84) == ("ro_alone", 4)
    assert [e.name for e in table] == [n.decode() for _v, _t, n in core]


def test_bulk_resolve_names_each_address_as_a_plain_lookup_does() -> None:
    """The batch path (numpy over the table's keys, names gathered from the blob,
    escaping, the JSON it travels as) against SymbolTable.lookup one address at a
    time, on a kernel table and a module table whose names need JSON escaping."""
    amap, tables, mod_base = kernel_and_module()
    rng = random.Random(3)
    addrs = [TEXT + rng.randrange(0x40 * 6000 + 0x100) for _ in range(3000)]
    addrs += [mod_base + rng.randrange(0x2100) for _ in range(300)] + [TEXT - 1, 5]
    got = resolutions(addrs, json.loads(amap.resolve(addrs, tables).to_json()))
    for a, r in zip(addrs, got, strict=True):
        assert r["address"] == f"{a:#x}"
        if TEXT <= a < TEXT + 0x40 * 6000:
            want = tables["k:x"].lookup(0, a - TEXT)
        elif mod_base <= a < mod_base + 0x2000:
            data = a >= mod_base + 0x1080
            want = tables["m:" + "ab" * 20].lookup(int(data), a - mod_base - 0x1080 * data)
            if want is None:  # .data below its first symbol: placed, not named
                assert (r["section"], "symbol" in r) == (".data", False), r
                continue
        else:
            assert r == {"address": f"{a:#x}"}
            continue
        assert want is not None
        assert (r["symbol"], int(r["symbol_offset"], 16)) == want


def test_a_few_addresses_one_by_one_get_the_answers_of_the_bulk_path() -> None:
    """Resolve bisects a few addresses in plain Python and a batch with numpy:
    the same addresses get the same answers either way (kernel, module, none)."""
    amap, tables, mod_base = kernel_and_module()
    rng = random.Random(5)
    addrs = [TEXT + rng.randrange(0x40 * 6000 + 0x100) for _ in range(200)]
    addrs += [mod_base + rng.randrange(0x2100) for _ in range(100)] + [TEXT - 1, 5, 1 << 63]
    rng.shuffle(addrs)

    def spelt(r: Resolved, asked: list[int]) -> list[dict[str, object]]:
        return resolutions(asked, json.loads(r.to_json()))

    bulk = spelt(amap.resolve_bulk(addrs, tables), addrs)
    few = []
    for k in range(0, len(addrs), 7):
        few += spelt(amap.resolve_few(addrs[k : k + 7], tables), addrs[k : k + 7])
    assert few == bulk
    assert spelt(amap.resolve(addrs[:FEW], tables), addrs[:FEW]) == bulk[:FEW]


def test_a_batch_in_one_region_gets_the_answers_of_one_by_one_whatever_its_order() -> None:
    """A batch that lies in one region is named as it comes, its repeats once,
    and sorted only when some of it lies before its section's first symbol
    (or from its last on): the answers are those of the addresses looked up
    one by one, in each case."""
    amap, tables, mod_base = kernel_and_module()
    below = tables["k:x"].keys[0] - KEY_SPAN  # TEXT + below: the first symbol
    assert below > 0
    rng = random.Random(7)
    spread = [TEXT + rng.randrange(0x40 * 6000) for _ in range(3000)]
    cases = {
        "kernel text, no order": spread,
        "a few hot spots, repeated": [TEXT + 0x40 * rng.randrange(20) + 3 for _ in range(3000)],
        "some before the first symbol": [*spread, TEXT, TEXT + below - 1, *spread[:5]],
        "module .data, from before its first symbol": [
            mod_base + 0x1080 + rng.randrange(0xF80) for _ in range(500)
        ],
    }
    for case, addrs in cases.items():
        bulk = resolutions(addrs, json.loads(amap.resolve_bulk(addrs, tables).to_json()))
        few = resolutions(addrs, json.loads(amap.resolve_few(addrs, tables).to_json()))
        assert bulk == few, case
        assert sum("symbol" in r for r in bulk) >= len(addrs) - 600, case


def test_reply_states_each_region_and_name_once_with_no_nulls() -> None:
    """Facts shared by many addresses travel once: one region object per region
    that held an address (the kernel's with its build-id, the module's with its
    seq and build-id) with the count of its names, one name per distinct
    symbol, region by region; per address only two small integers: the
    symbol's index (-2 - the region's where it has none, -1 where nothing held
    the address) and the offset; no member is ever null."""
    amap, tables, mod_base = kernel_and_module()
    addrs = [mod_base + 0x101, TEXT + 0x61, TEXT + 0x62, 5, TEXT + 0x61, mod_base + 0x1FFF]
    addrs.append(mod_base + 0x10A0)  # in .data, before its first symbol
    k1, off = tables["k:x"].lookup(0, 0x61) or ("", 0)
    for path in (amap.resolve_few, amap.resolve_bulk):  # a few addresses, a batch
        reply = json.loads(path(addrs, tables).to_json())
        assert reply["regions"] == [
            {"image": "kernel", "section": ".text", "base": f"{TEXT:#x}", "build_id": "cd" * 20,
             "names": 1},
            {"image": "odd", "section": ".text", "base": f"{mod_base:#x}", "seq": 0,
             "build_id": "ab" * 20, "names": 1},
            {"image": "odd", "section": ".data", "base": f"{mod_base + 0x1080:#x}", "seq": 0,
             "build_id": "ab" * 20, "names": 1},
        ]  # fmt: skip
        assert reply["symbols"] == [k1, 'odd "name" \\1', 'odd "name" \\19']
        assert reply["symbol"] == [1, 0, 0, -1, 0, 2, -2 - 2]
        assert reply["symbol_offset"] == [1, off, off + 1, 0, off, 0x1FFF - 0x1300, 0]
        assert "null" not in json.dumps(reply)
        assert [(r.get("section"), r.get("symbol")) for r in resolutions(addrs, reply)] == [
            (".text", 'odd "name" \\1'), (".text", k1), (".text", k1), (None, None),
            (".text", k1), (".data", 'odd "name" \\19'), (".data", None),
        ]  # fmt: skip
        assert json.loads(path([], tables).to_json()) == {
            "regions": [], "symbols": [], "symbol": [], "symbol_offset": []
        }  # fmt: skip


def test_names_of_any_bytes_travel_as_json_reads_them_back() -> None:
    """A batch's names are joined as they are, unless one needs JSON's escapes
    (quotes, backslashes, control bytes, NUL, not ASCII): then each is encoded
    alone.  Both ways, a stdlib json client reads back the table's own names."""
    odd = [b"plain", b'quo"te', b"back\\slash", b"nul\0byte", b"tab\tbed", "caf\u00e9".encode(),
           b"\xff\xfe", b"del\x7f"]  # fmt: skip
    for names in (odd, [b"plain", b"nul\0byte"], [b"plain_%d" % k for k in range(20)]):
        core = [(TEXT + 0x40 * k, b"T", n) for k, n in enumerate(names * 200)]
        core.append((TEXT + 0x40 * len(core), b"T", b"_etext"))
        tables = {"k:x": SymbolTable(kernel_table(core, TEXT))}
        boot = BootSnapshot(
            "00000000-0000-0000-0000-000000000001", "6.1", "#1", "cd" * 20,
            Anchors(TEXT, TEXT, TEXT + 0x40 * len(core)), None, False, None, 0,
            Timestamp(1, 1, 1),
        )  # fmt: skip
        amap = AddressMap(boot, [], Clock.MONOTONIC, None, "k:x")
        addrs = [TEXT + 0x40 * k + 3 for k in range(len(core) - 1)]
        reply = json.loads(amap.resolve_bulk(addrs, tables).to_json())
        got = [reply["symbols"][i] for i in reply["symbol"]]
        assert got == [n.decode("utf-8", "replace") for n in names * 200]
        few = json.loads(amap.resolve_few(addrs, tables).to_json())
        assert resolutions(addrs, few) == resolutions(addrs, reply)


def test_a_symbol_found_from_two_regions_is_named_once_in_each() -> None:
    """Names travel region by region, so a symbol that names addresses of two
    regions (here the last kernel symbol before .init.text, which holds no
    symbol of its own) is listed under each; both paths agree."""
    amap, tables, _mod_base = kernel_and_module(init_text=True)
    last = TEXT + 0x40 * 6000  # _etext, inside .text here
    addrs = [last + 0x10, last + 0x1010, last + 0x11] * 20
    few = json.loads(amap.resolve_few(addrs, tables).to_json())
    bulk = json.loads(amap.resolve_bulk(addrs, tables).to_json())
    assert few == bulk
    assert [r["section"] for r in bulk["regions"]] == [".text", ".init.text"]
    assert bulk["symbols"] == ["_etext", "_etext"] and bulk["symbol"][:3] == [0, 1, 0]
    assert bulk["symbol_offset"][:3] == [0x10, 0x1010, 0x11]


def kernel_and_module(init_text: bool = False) -> tuple[AddressMap, dict[str, SymbolTable], int]:
    """A kernel table of 6,000 functions and a module whose names need escaping,
    with a .data section (from +0x1080) whose first symbol is at +0x1100.  With
    *init_text*, .text ends 0x100 past _etext and an .init.text without
    symbols lies 0x1000 past it."""
    rng = random.Random(3)
    core = [(TEXT + 0x40 * k + rng.randrange(0x20), b"T", f"k{k}".encode()) for k in range(6000)]
    core.append((TEXT + 0x40 * 6000, b"T", b"_etext"))
    ktab = kernel_table(core, TEXT)
    mod_base = 0xFFFFFFFFC0000000
    lines = [(mod_base + 0x100 * k, b"t", f'odd "name" \\{k}'.encode()) for k in range(20)]
    sections = {".text": mod_base, ".data": mod_base + 0x1080}
    mtab = module_table(lines, sections, {".text": 0x1080, ".data": 0xF80})
    assert mtab is not None
    boot = BootSnapshot(
        "00000000-0000-0000-0000-000000000001", "6.1", "#1", "cd" * 20,
        Anchors(TEXT, TEXT, TEXT + 0x40 * 6000 + 0x100 * init_text,
                TEXT + 0x40 * 6000 + 0x1000 if init_text else None,
                TEXT + 0x40 * 6000 + 0x2000 if init_text else None),
        None, False, None, 0, Timestamp(1, 1, 1),
    )  # fmt: skip
    state = ModuleState("odd", "ab" * 20, sections, 0x2000, 0, "live", None, None,
                        mod_base, False, None)  # fmt: skip
    inc = Incarnation(boot.boot_id, 0, state, Timestamp(1, 1, 1), SeenBy.STARTUP, False)
    amap = AddressMap(boot, [inc], Clock.MONOTONIC, None, "k:x")
    tables = {"k:x": SymbolTable(ktab), "m:" + "ab" * 20: SymbolTable(mtab)}
    return amap, tables, mod_base
