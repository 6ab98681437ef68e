"""Packed symbol tables built from kallsyms lines (pure: no daemon)."""

from __future__ import annotations

from kreld.symtab import MODULE_ABSOLUTE, SymbolTable, module_table, parse_kallsyms

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
