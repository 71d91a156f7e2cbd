"""Character sets as sorted ranges of Unicode scalar values, and their UTF-8 lead bytes as bit
masks (the lexer reads bytes, so conflicts between lexemes are checked at that level)."""

from __future__ import annotations

MAX_CP = 0x10FFFF
UNIVERSE = ((0, 0xD7FF), (0xE000, MAX_CP))  # Unicode scalar values
TOKEN_BIT = 1 << 256  # "a token element comes next" in lead-byte masks


def normalize(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, clipped to scalar values (surrogates and > U+10FFFF dropped)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for ulo, uhi in UNIVERSE:
            a, b = max(lo, ulo), min(hi, uhi)
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return normalize(out)


def lead(c: int) -> int:
    """The first byte of c in UTF-8."""
    if c < 0x80:
        return c
    if c < 0x800:
        return 0xC0 | (c >> 6)
    if c < 0x10000:
        return 0xE0 | (c >> 12)
    return 0xF0 | (c >> 18)


_LEAD_CACHE: dict[tuple[tuple[int, int], ...], int] = {}


def lead_mask(ranges: tuple[tuple[int, int], ...]) -> int:
    """The lead bytes of the characters in `ranges`, as a bit mask."""
    m = _LEAD_CACHE.get(ranges)
    if m is None:
        m = 0
        for lo, hi in ranges:
            for slo, shi in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CP)):
                a, b = max(lo, slo), min(hi, shi)
                if a <= b:
                    m |= (1 << (lead(b) + 1)) - (1 << lead(a))
        if len(_LEAD_CACHE) < 100_000:
            _LEAD_CACHE[ranges] = m
    return m


def intersects(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


def bits(mask: int):
    """The positions of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
