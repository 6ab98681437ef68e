"""kreld on a real kernel (tests/vm/conftest.py boots it twice): one kernel
symbol table for the build, shared by both boots, and ``export kallsyms``
equal to each boot's own /proc/kallsyms at a moment T, line for line."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import harness
from support.realboot import Boot, Facts, kreld_log, say
from support.realkernel import host_ctl

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


# -- 3b. the symbol cache: one kernel table for the build, kallsyms per boot -----------


@dataclass
class KallsymsAtT:
    """The guest's /proc/kallsyms read at T (between ``t0`` and ``t1``, CLOCK_MONOTONIC)."""

    text: str
    t0: int
    t1: int
    meta: dict[str, Any]

    @classmethod
    def read(cls, facts: Facts) -> KallsymsAtT:
        meta = json.loads((facts.dir / "kallsyms-T.json").read_text())
        text = (facts.dir / "kallsyms-at-T").read_text()
        return cls(text, int(meta["t0"]), int(meta["t1"]), meta)


@dataclass
class Split:
    """kallsyms lines: the core kernel's (no owner) and each owner's ([module], [bpf])."""

    core: list[str]
    owners: dict[str, list[str]]
    order: list[str]  # owners in the order their lines (first) appear
    scattered: list[str]  # owners whose lines are not one contiguous run

    @classmethod
    def of(cls, text: str) -> Split:
        core: list[str] = []
        owners: dict[str, list[str]] = {}
        order: list[str] = []
        scattered: list[str] = []
        last = None
        for line in text.splitlines():
            _, tab, owner = line.partition("\t")
            if not tab:
                core.append(line)
                continue
            name = owner.strip("[]")
            if name not in owners:
                owners[name] = []
                order.append(name)
            elif name != last and name not in scattered:
                scattered.append(name)
            owners[name].append(line)
            last = name
        return cls(core, owners, order, scattered)


def export_kallsyms(state: Path, boot_id: str, t: int, out: Path) -> str:
    """``kreldctl --state-dir S export kallsyms --boot B --at T --clock monotonic -o FILE``
    on the host (no daemon, the host's own boot not in the store)."""
    cp = host_ctl(
        state, "export", "kallsyms", "--boot", boot_id, "--at", str(t), "--clock", "monotonic",
        "-o", str(out), timeout=120,
    )  # fmt: skip
    assert cp.returncode == 0, f"kreldctl export kallsyms -> {cp.returncode}\n{cp.stderr}"
    return out.read_text()


def fields(line: str) -> tuple[str, str, str]:
    addr_, typ, rest = line.split(" ", 2)
    return addr_, typ, rest.partition("\t")[0]


def diff_core(kernel: list[str], kreld: list[str]) -> str | None:
    """None if equal line for line, else what differs."""
    if kernel == kreld:
        return None
    first = next(
        (i for i, (a, b) in enumerate(zip(kernel, kreld, strict=False)) if a != b),
        min(len(kernel), len(kreld)),
    )
    only_k = sorted(set(kernel) - set(kreld))
    only_x = sorted(set(kreld) - set(kernel))
    return (
        f"core kernel lines: kernel {len(kernel)}, export {len(kreld)}; first difference at "
        f"line {first}: kernel {kernel[first : first + 1]} export {kreld[first : first + 1]}; "
        f"{len(only_k)} lines only in the kernel's (e.g. {only_k[:3]}), "
        f"{len(only_x)} only in the export (e.g. {only_x[:3]})"
        + ("; same lines, other order" if not only_k and not only_x else "")
    )


def diff_owner(name: str, kernel: list[str], kreld: list[str]) -> str | None:
    """None if *name*'s lines are equal line for line, else how they differ."""
    if kernel == kreld:
        return None
    if sorted(kernel) == sorted(kreld):
        return f"[{name}]: the same {len(kernel)} lines in another order"
    kf = [fields(x) for x in kernel]
    xf = [fields(x) for x in kreld]
    parts = [f"[{name}]: kernel {len(kernel)} lines, export {len(kreld)}"]
    kn: dict[str, set[tuple[str, str]]] = {}
    for a, t, n in kf:
        kn.setdefault(n, set()).add((a, t))
    xn: dict[str, set[tuple[str, str]]] = {}
    for a, t, n in xf:
        xn.setdefault(n, set()).add((a, t))
    missing = [n for n in kn if n not in xn]
    extra = [n for n in xn if n not in kn]
    if missing:
        types = sorted({t for a, t, n in kf if n in set(missing)})
        examples = [x for x in kernel if fields(x)[2] in set(missing[:4])][:4]
        parts.append(f"{len(missing)} names missing from the export (types {types}): {examples}")
    if extra:
        types = sorted({t for a, t, n in xf if n in set(extra)})
        examples = [x for x in kreld if fields(x)[2] in set(extra[:4])][:4]
        parts.append(f"{len(extra)} names only in the export (types {types}): {examples}")
    both = [n for n in kn if n in xn]
    types_differ = [n for n in both if {t for _, t in kn[n]} != {t for _, t in xn[n]}]
    addrs_differ = [n for n in both if {a for a, _ in kn[n]} != {a for a, _ in xn[n]}]
    if types_differ:
        pairs = Counter(
            f"{'/'.join(sorted({t for _, t in kn[n]}))}->{'/'.join(sorted({t for _, t in xn[n]}))}"
            for n in types_differ
        )
        parts.append(
            f"{len(types_differ)} names with other types (kernel->export: "
            + ", ".join(f"{k} x{v}" for k, v in pairs.most_common())
            + "), e.g. "
            + ", ".join(
                f"{n} kernel {sorted(kn[n])} export {sorted(xn[n])}" for n in types_differ[:3]
            )
        )
    if addrs_differ:
        parts.append(
            f"{len(addrs_differ)} names at other addresses, e.g. "
            + ", ".join(
                f"{n} kernel {sorted(kn[n])} export {sorted(xn[n])}" for n in addrs_differ[:3]
            )
        )
    if not (missing or extra or types_differ or addrs_differ):
        parts.append("the same names, types and addresses; other duplicates or order")
    return "; ".join(parts)


def diff_owners(kernel: Split, kreld: Split) -> list[str]:
    out = []
    missing = [m for m in kernel.order if m not in kreld.owners]
    extra = [m for m in kreld.order if m not in kernel.owners]
    if missing:
        out.append(
            "owners missing from the export: "
            + ", ".join(f"{m} ({len(kernel.owners[m])} lines)" for m in missing)
        )
    if extra:
        out.append(
            "owners only in the export: "
            + ", ".join(f"{m} ({len(kreld.owners[m])} lines)" for m in extra)
        )
    for m in kernel.order:
        if m in kreld.owners:
            d = diff_owner(m, kernel.owners[m], kreld.owners[m])
            if d:
                out.append(d)
    return out


def diff_owner_order(kernel: Split, kreld: Split) -> list[str]:
    out = []
    common_k = [m for m in kernel.order if m in kreld.owners]
    common_x = [m for m in kreld.order if m in kernel.owners]
    if common_k != common_x:
        out.append(f"kernel {common_k},\nexport {common_x}")
    if kreld.scattered:
        out.append(f"owners whose lines the export does not keep together: {kreld.scattered}")
    return out


@dataclass
class KallsymsCheck:
    label: str
    facts: Facts
    kernel: Split
    kreld: Split
    t: int
    meta: dict[str, Any]


@pytest.fixture(scope="module")
def kallsyms_checks(
    first: Boot, second: Boot, state: Path, rw: Path, request: pytest.FixtureRequest
) -> list[KallsymsCheck]:
    out = []
    for label, b in (("first", first), ("second", second)):
        at = KallsymsAtT.read(b.facts)
        exported = export_kallsyms(state, b.facts.boot_id, at.t0, rw / f"export-{label}.kallsyms")
        check = KallsymsCheck(label, b.facts, Split.of(at.text), Split.of(exported), at.t0, at.meta)
        out.append(check)
        k, x = check.kernel, check.kreld
        say(
            request,
            f"[realkernel] kallsyms {label}: T {at.t0} (waited {at.meta['waited_s']}s for "
            f"kreld's tables; not captured then: {at.meta['modules_pending'] or 'none'}); "
            f"/proc/kallsyms {len(at.text.splitlines())} lines = {len(k.core)} core + "
            f"{sum(map(len, k.owners.values()))} in {len(k.owners)} owners; export "
            f"{len(exported.splitlines())} lines = {len(x.core)} core + "
            f"{sum(map(len, x.owners.values()))} in {len(x.owners)} owners",
        )
    return out


def test_kallsyms_stored_once_for_both_boots(first: Boot, second: Boot, state: Path) -> None:
    """One kernel table for the build (values relative to _text, so both
    KASLR slides share it): stored by boot A, shared by boot B."""
    a, b = first.facts, second.facts
    logged = {}
    for label, f in (("first", a), ("second", b)):
        recs = [r for r in kreld_log(f) if str(r.get("event", "")).startswith("kernel_symbols")]
        assert recs, f"boot {label}: kreld never logged kernel_symbols"
        assert [r["event"] for r in recs] == ["kernel_symbols"], (label, recs)
        logged[label] = recs[0]
    assert logged["first"]["action"] == "stored", logged
    assert logged["second"]["action"] == "shared", logged
    key = f"k:{a.build_id}"
    assert logged["first"]["table"] == logged["second"]["table"] == key, logged
    from kreld.store import Store  # imported late: the checkout's code as it is now

    with Store(state, readonly=True) as store:

        def table_keys(txn: Any) -> list[str]:
            cur = txn.cursor(db=store.env.dbs[b"symtabs"])
            return [k.decode() for k in cur.iternext(values=False)]

        keys = store.env.read(table_keys)
        assert [k for k in keys if not k.startswith("m:")] == [key], keys
        for f in (a, b):
            rec = store.boot_symbols(f.boot_id)
            assert rec is not None and rec.kernel == key, (f.boot_id, rec)


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_kernel_lines_equal_the_boots_own(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """``export kallsyms --boot B --at T``: the core kernel's lines, line for line
    as the guest's /proc/kallsyms showed them at T (this boot's _text)."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    assert c.meta["kernel"] is not None, f"kreld never logged kernel_symbols in boot {label}"
    assert len(c.kernel.core) > 50_000
    text = next(x for x in c.kernel.core if x.endswith(" _text"))
    assert int(text.split()[0], 16) == c.facts.anchors["_text"]
    d = diff_core(c.kernel.core, c.kreld.core)
    assert d is None, f"boot {label}: {d}"


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_module_lines_equal_the_boots_own(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """Each module's lines (and any other bracketed owner's) in the export,
    line for line as the guest's /proc/kallsyms showed them at T."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    assert not c.meta["modules_changed"], c.meta
    # brd is loaded after T, for the perf recordings (section 9)
    loaded_by_the_test = {
        d.name.rstrip("0123456789")
        for d in (c.facts.dir / "mod").iterdir()
        if d.name.rstrip("0123456789") != "brd"
    }
    assert loaded_by_the_test <= set(c.kernel.owners)
    problems = diff_owners(c.kernel, c.kreld)
    pending = c.meta["modules_pending"]
    # Where kreld took each module build's table from (logged by the boot that stored it).
    sources = {
        str(r.get("module")): str(r.get("source"))
        for k in kallsyms_checks
        for r in kreld_log(k.facts)
        if r.get("event") == "module_symbols"
    }
    differing = [m for m in c.kernel.order if any(x.startswith(f"[{m}]") for x in problems)]
    assert not problems, (
        f"boot {label}: module lines of the export differ from /proc/kallsyms at T "
        f"(modules kreld had still not logged module_symbols for after waiting "
        f"{c.meta['waited_s']}s: {pending or 'none'}; kreld's tables of the differing ones "
        f"came from: {', '.join(f'{m} {sources.get(m)}' for m in differing) or '-'}):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_lists_modules_in_the_kernels_order(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """The kernel prints each module's lines together, newest load first (the
    order of /proc/modules); the export must too."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    problems = diff_owner_order(c.kernel, c.kreld)
    assert not problems, f"boot {label}: module order of the export:\n" + "\n".join(problems)
