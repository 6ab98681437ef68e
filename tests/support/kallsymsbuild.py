"""An encoder of the kernel's kallsyms tables, written from scripts/kallsyms.c's
description of the format (token table and index, length-prefixed names with
two-byte "big" lengths, the address layouts), independently of the decoder in
kreld/kernel/memkallsyms.py, to lay them into a kcore image."""

from __future__ import annotations

import struct
from collections import Counter

from support.kmembuild import KcoreImage

Line = tuple[int, str, str]  # (address, type letter, name)
LAYOUTS = ("relative", "percpu", "absolute", "place")


def tokens_for(strings: list[bytes]) -> list[bytes]:
    """256 tokens: every byte the strings use, the commonest pairs in the rest."""
    singles = sorted({c for s in strings for c in s})
    if len(singles) > 256:
        raise ValueError("more than 256 distinct bytes")
    pairs = Counter(s[i : i + 2] for s in strings for i in range(len(s) - 1))
    tokens = [bytes([c]) for c in singles]
    for pair, _n in pairs.most_common(256 - len(tokens)):
        tokens.append(pair)
    while len(tokens) < 256:
        tokens.append(b"\x01" * 3)  # never used
    return tokens


def compress(s: bytes, code: dict[bytes, int]) -> bytes:
    out = bytearray()
    i = 0
    while i < len(s):
        if s[i : i + 2] in code and len(s[i : i + 2]) == 2:
            out.append(code[s[i : i + 2]])
            i += 2
        else:
            out.append(code[s[i : i + 1]])
            i += 1
    return bytes(out)


def encode_names(lines: list[Line]) -> tuple[bytes, bytes, bytes]:
    """(kallsyms_names, kallsyms_token_table, kallsyms_token_index)."""
    strings = [(t + n).encode() for _a, t, n in lines]
    tokens = tokens_for(strings)
    code = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    names = bytearray()
    for s in strings:
        c = compress(s, code)
        n = len(c)
        if n <= 0x7F:
            names.append(n)
        else:  # a "big" symbol: ULEB128 in two bytes
            names += bytes([(n & 0x7F) | 0x80, n >> 7])
        names += c
    table = bytearray()
    index = []
    for tok in tokens:
        index.append(len(table))
        table += tok + b"\0"
    return bytes(names), bytes(table), struct.pack("<256H", *index)


def place(img: KcoreImage, at: int, lines: list[Line], layout: str) -> dict[str, str]:
    """Write the tables for *lines* at *at* onwards in *img*; their VMCOREINFO
    entries.  *layout*: ``relative`` (offsets from kallsyms_relative_base),
    ``percpu`` (the same with ``A`` lines absolute), ``absolute``
    (kallsyms_addresses), ``place`` (offsets from each entry's own address)."""
    names, table, index = encode_names(lines)
    info: dict[str, str] = {}
    pos = at

    def put(label: str, data: bytes) -> int:
        nonlocal pos
        where = pos
        img.write(where, data)
        info[f"SYMBOL({label})"] = f"{where:x}"
        pos = (pos + len(data) + 7) & ~7
        return where

    put("kallsyms_num_syms", struct.pack("<I", len(lines)))
    put("kallsyms_names", names)
    put("kallsyms_token_table", table)
    put("kallsyms_token_index", index)
    addrs = [a for a, _t, _n in lines]
    if layout == "absolute":
        put("kallsyms_addresses", struct.pack(f"<{len(addrs)}Q", *addrs))
        return info
    if layout == "place":
        start = pos
        rel = [(a - (start + 4 * i)) & (1 << 64) - 1 for i, a in enumerate(addrs)]
        rel = [r - (1 << 64) if r >= 1 << 63 else r for r in rel]
        put("kallsyms_offsets", struct.pack(f"<{len(rel)}i", *rel))
        return info
    if layout == "percpu":
        base = min(a for a, t, _n in lines if t != "A")
        offs = [a if t == "A" else base - a - 1 for a, t, _n in lines]
    else:
        base = min(addrs)
        offs = [a - base for a in addrs]
    put("kallsyms_offsets", struct.pack(f"<{len(offs)}i", *offs))
    put("kallsyms_relative_base", struct.pack("<Q", base))
    return info


def kallsyms_text(lines: list[Line], *, zero: bool) -> str:
    return "".join(f"{0 if zero else a:016x} {t} {n}\n" for a, t, n in lines)
