"""Kernel code in Resolve's address map (kreld/symbols/kernel_code.py): a reused
address names what was there at the time asked, an unknowable time is
uncertain and names nothing, and the bulk path answers as the one-by-one path."""

from __future__ import annotations

from pathlib import Path

from kreld.core.kernel_code import (
    CodeKind,
    CodeSeen,
    CodeSource,
    KernelCode,
    LossReason,
    LossWindow,
)
from kreld.core.model import BOOT_START, Anchors, BootSnapshot, Clock, Timestamp
from kreld.symbols.kernel_code import CodeHistory, CodeIndex, kallsyms_lines
from kreld.symbols.queries import AddressMap

TEXT = 0xFFFFFFFF81000000
A = 0xFFFFFFFFC0010000
OTHER = 0xFFFFFFFFC0300000  # in the kernel-code area, never held by a record


def ts(t: int) -> Timestamp:
    return Timestamp(t, t, t)


def boot() -> BootSnapshot:
    return BootSnapshot(
        boot_id="0d3c5f0e-9a61-4a8e-8f4e-0c1a2b3c4d5e",
        release="6.1.0",
        version="#1",
        build_id="ab" * 20,
        anchors=Anchors(TEXT, TEXT, TEXT + 0x100000, None, None),
        kaslr=None,
        restricted=False,
        restricted_reason=None,
        kptr_restrict=0,
        first_seen=ts(1),
    )


def code(seq: int, name: str, loaded: int, unloaded: int | None, **kw: object) -> KernelCode:
    base: dict[str, object] = {
        "boot_id": boot().boot_id,
        "seq": seq,
        "kind": CodeKind.BPF_PROGRAM,
        "name": name,
        "owner": "bpf",
        "addr": A,
        "length": 0x100,
        "loaded": ts(loaded),
        "seen_by": CodeSeen.KSYMBOL,
        "source": CodeSource.PERF,
        "unloaded": None if unloaded is None else ts(unloaded),
    }
    return KernelCode(**(base | kw))  # type: ignore[arg-type]


BOOT_ID = boot().boot_id
FIRST = code(0, "bpf_prog_1111111111111111_first", 100, 200)
SECOND = code(1, "bpf_prog_2222222222222222_second", 300, None)
HIST = CodeHistory((FIRST, SECOND), (LossWindow(ts(400), ts(500), LossReason.LOST_RECORDS, 3),))


def resolve(hist: CodeHistory, t: int | None, addrs: list[int]) -> list[tuple[str, str]]:
    """(image and uncertain flag, symbol) per address, by the few and the bulk paths alike."""
    amap = AddressMap(boot(), [], Clock.MONOTONIC, t, None, hist)
    few, bulk = amap.resolve_few(addrs), amap.resolve_bulk(addrs * 20)
    assert list(bulk.symbol)[: len(addrs)] == list(few.symbol)
    assert list(bulk.symbol_offset)[: len(addrs)] == list(few.symbol_offset)
    import json

    names = json.loads(few.symbols_json)
    out = []
    for si in few.symbol:
        if si >= 0:
            out.append(("named", names[si]))
        elif si == -1:
            out.append(("none", ""))
        else:
            region = few.regions[-2 - si]
            out.append(("uncertain" if region.get("uncertain") else str(region["image"]), ""))
    return out


def test_a_reused_address_names_what_was_there_at_the_time_asked() -> None:
    assert resolve(HIST, 150, [A + 8]) == [("named", FIRST.name)]
    assert resolve(HIST, 350, [A + 8]) == [("named", SECOND.name)]
    assert resolve(HIST, 250, [A + 8]) == [("none", "")]  # nothing was there
    assert resolve(HIST, None, [A + 8]) == [("named", SECOND.name)]


def test_a_region_of_kernel_code_says_its_owner_kind_and_record() -> None:
    amap = AddressMap(boot(), [], Clock.MONOTONIC, 150, None, HIST)
    r = amap.resolve_few([A + 8])
    assert r.regions == [
        {"image": "[bpf]", "section": "bpf_program", "base": hex(A), "code_seq": 0, "names": 1}
    ]
    assert list(r.symbol_offset) == [8]


def test_inside_a_loss_window_the_code_area_is_uncertain_and_named_code_stays_named() -> None:
    got = resolve(HIST, 450, [A + 8, OTHER, TEXT + 0x10])
    assert got[0] == ("named", SECOND.name)  # certainly there before and after
    assert got[1] == ("uncertain", "")
    assert got[2][0] == "kernel"  # the kernel's own text is never uncertain
    assert resolve(HIST, 600, [OTHER]) == [("none", "")]


def test_a_piece_whose_unload_fell_in_a_window_is_uncertain_there_never_named() -> None:
    late = code(0, "bpf_prog_3333333333333333_late", 100, 500, unloaded_after=ts(400))
    hist = CodeHistory((late,), ())
    assert resolve(hist, 350, [A]) == [("named", late.name)]
    assert resolve(hist, 450, [A]) == [("uncertain", "")]
    assert resolve(hist, 550, [A]) == [("none", "")]


def test_symbolize_names_a_sample_only_where_one_piece_certainly_was() -> None:
    idx = CodeIndex(HIST)
    assert idx.at(A + 4, Clock.MONOTONIC, 150) == FIRST
    assert idx.at(A + 4, Clock.MONOTONIC, 250) is None
    assert idx.at(A + 4, Clock.MONOTONIC, None) is None  # two held it: no time, no name
    found = code(0, "bpf_prog_4444444444444444_x", 100, None, loaded_after=BOOT_START, length=None)
    assert CodeIndex(CodeHistory((found,), ())).at(A + 4, Clock.MONOTONIC, 50) is None


def test_exported_kallsyms_lines_are_in_the_kernels_order_at_the_time() -> None:
    ftrace = code(2, "ftrace_trampoline", 1, None, owner="__builtin__ftrace", addr=A + 0x9000)
    kprobe = code(3, "kprobe_insn_page", 2, None, owner="__builtin__kprobes", addr=A + 0xA000)
    hist = CodeHistory((kprobe, SECOND, FIRST, ftrace), ())
    lines = kallsyms_lines(hist, ["ffffffffc0000000 t x\t[other]"], Clock.MONOTONIC, 150)
    assert [ln.split("\t")[1] for ln in lines] == [
        "[other]",
        "[__builtin__ftrace]",
        "[bpf]",
        "[__builtin__kprobes]",
    ]
    assert f"{A:016x} t {FIRST.name}" in lines[2]


def test_candidates_by_bisection_are_the_pieces_possible_at_each_time() -> None:
    """The index a 50,000-record boot is asked through gives what a scan gives."""
    import random

    rng = random.Random(3)
    codes = []
    for i in range(400):
        lo = rng.randrange(10_000)
        hi = None if rng.random() < 0.1 else lo + rng.randrange(1, 500)
        after = ts(lo - 50) if rng.random() < 0.2 else None
        codes.append(code(i, f"bpf_prog_{i:016x}_p", lo, hi, loaded_after=after))
    hist = CodeHistory(codes, ())
    for t in [*range(0, 11_000, 97), None]:
        want = [c for c in codes if c.possible_at(Clock.MONOTONIC, t)]
        assert hist.candidates(Clock.MONOTONIC, t) == want, t


def test_a_history_read_again_reads_only_the_open_and_the_new_records(tmp_path: Path) -> None:
    from kreld.store import Store
    from kreld.symbols.kernel_code import code_history

    with Store(tmp_path / "s") as store:
        kc = store.kernel_code
        kc.apply(BOOT_ID, [FIRST, code(1, SECOND.name, 300, None)], [], None)
        known = code_history(store, BOOT_ID)
        closed = code(1, SECOND.name, 300, 400)
        late = code(2, "bpf_prog_5555555555555555_late", 450, None)
        kc.apply(BOOT_ID, [closed, late], [LossWindow(ts(1), ts(2), LossReason.LOST_RECORDS)], None)
        again = code_history(store, BOOT_ID, known)
        assert again.codes == (FIRST, closed, late) and len(again.losses) == 1
        assert code_history(store, BOOT_ID).codes == again.codes
