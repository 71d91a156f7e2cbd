"""Streaming text assembly with stop strings (kvshare.engine.output)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.output import TextAssembler, _overlap


def overlap_by_scan(text: str, stop: str) -> int:
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


@settings(max_examples=2000, deadline=None)
@given(st.text("abc", max_size=12), st.text("abc", min_size=1, max_size=12))
def test_overlap_equals_the_scan_over_every_prefix(text, stop):
    assert _overlap(text, stop) == overlap_by_scan(text, stop)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("ab c"), max_size=30), st.text("ab c", min_size=1, max_size=5))
def test_stream_is_the_text_up_to_the_first_stop(chars, stop):
    """One character per token: what is emitted, then flushed, is the text up to the first
    occurrence of the stop string, and nothing of the stop string is ever emitted."""
    asm = TextAssembler(lambda ids: "".join(chr(i) for i in ids), [stop])
    out, hit = "", False
    for ch in chars:
        delta, hit = asm.push(ord(ch))
        out += delta
        if hit:
            break
    if not hit:
        out += asm.flush()
    full = "".join(chars)
    cut = full.find(stop)
    assert out == (full[:cut] if cut >= 0 else full)
    assert hit == (cut >= 0)
