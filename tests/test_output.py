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


def test_assembler_on_an_incremental_decoder_emits_what_full_decoding_does():
    """The engine streams through `Tokenizer.incremental_decoder` where it exists: the same
    deltas, stop hits and flush as decoding the whole generation at every token, on a real
    tokenizer's random ids (byte tokens that cut characters, control tokens) with stop
    strings taken from the decoded text (and one that straddles tokens)."""
    import random
    from pathlib import Path

    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf")
    rng = random.Random(5)
    runs = 0
    for trial in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
        text = tok.decode(ids, skip_special=True)
        stops = []
        if text and trial % 3:
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randrange(1, 6)])
        outs = []
        for stream in (None, tok.incremental_decoder(skip_special=True)):
            asm = TextAssembler(lambda i: tok.decode(i, skip_special=True), stops, stream=stream)
            got = []
            for t in ids:
                got.append(asm.push(t))
                if got[-1][1]:
                    break
            else:
                got.append((asm.flush(), False))
            outs.append((got, asm.stop_hit))
        assert outs[0] == outs[1], (ids, stops)
        runs += bool(outs[0][1])
    assert runs > 5  # stop strings were hit, not only flushed
