"""A real `kvshare serve` on a mixture-of-experts model: the tiny qwen35moe hybrid answers chat
and completions, a second session of the same agent reuses the first one's prefix; and MoE
files with a bad expert layout stop startup with one line and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tier_helpers import Server

MODELS = Path(__file__).parent / "data" / "models"
SYSTEM = ("You are the build agent. Tools: search(q), open(path), run(cmd), diff(a, b). "
          "Answer in one line and never guess file names. ") * 3


def test_serve_answers_chat_and_completions_on_a_moe_model(launcher):
    s = Server(launcher, "--ctx-size", "2048", model=MODELS / "tiny-qwen35moe.gguf")
    try:
        first = s.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Where is the linker script?"}],
                       max_tokens=8, temperature=0)
        msg = first["choices"][0]["message"]
        assert msg["role"] == "assistant" and isinstance(msg["content"], str)
        assert first["usage"]["completion_tokens"] > 0
        assert first["choices"][0]["finish_reason"] in ("stop", "length")
        again = s.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Which test is flaky today?"}],
                       max_tokens=4, temperature=0)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.8 * first["usage"]["prompt_tokens"], again["usage"]
        done = s.post("/v1/completions", {"prompt": "The build failed because", "max_tokens": 8,
                                          "temperature": 0})
        assert isinstance(done["choices"][0]["text"], str)
        assert done["usage"]["completion_tokens"] > 0
    finally:
        assert s.terminate() == 0


# ---------------------------------------------------------------------------- bad expert files

def rewrite(src: Path, dst: Path, set_keys: dict | None = None, drop: tuple[str, ...] = (),
            arch: str | None = None) -> Path:
    """`src` copied through gguf-py with some metadata values replaced and tensors dropped."""
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    keys = dict(set_keys or {})
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, keys.pop(name, f.contents()), f.types[0], sub_type=sub)
    assert not keys, f"no such keys: {keys}"
    for t in r.tensors:
        if t.name in drop:
            continue
        raw = None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _truncated_in_experts(src: Path, dst: Path) -> Path:
    """`src` cut inside its last tensor, an expert tensor of the last layer."""
    from gguf import GGUFReader

    last = max(GGUFReader(str(src)).tensors, key=lambda t: t.data_offset)
    assert "_exps" in last.name, last.name
    data = src.read_bytes()
    dst.write_bytes(data[: last.data_offset + last.n_bytes // 2])
    return dst


BAD = {
    "used-over-count": (lambda d: rewrite(MODELS / "tiny-qwen3moe.gguf", d,
                                          {"qwen3moe.expert_used_count": 17}),
                        ["qwen3moe.expert_used_count 17", "expert_count (16)"]),
    "missing-up-exps": (lambda d: rewrite(MODELS / "tiny-qwen35moe.gguf", d,
                                          drop=("blk.1.ffn_up_exps.weight",)),
                        ["missing tensor", "blk.1.ffn_up_exps.weight"]),
    "missing-down-exps": (lambda d: rewrite(MODELS / "tiny-gpt-oss.gguf", d,
                                            drop=("blk.2.ffn_down_exps.weight",)),
                          ["missing tensor", "blk.2.ffn_down_exps.weight"]),
    "experts-fewer-than-tensors": (lambda d: rewrite(MODELS / "tiny-lfm2moe.gguf", d,
                                                     {"lfm2moe.expert_count": 4}),
                                   ["router has shape", "expected (4,"]),
    "truncated-experts": (lambda d: _truncated_in_experts(MODELS / "tiny-lfm2moe.gguf", d),
                          ["blk.3.ffn_down_exps.weight", "past the end of the file"]),
    "unsupported-arch": (lambda d: rewrite(MODELS / "tiny-qwen3moe.gguf", d, arch="dbrx"),
                         ["'dbrx' is not supported", "qwen3moe", "gpt-oss", "lfm2moe"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_moe_file_is_one_line_and_exit_2(case, tmp_path):
    make, words = BAD[case]
    path = make(tmp_path / f"{case}.gguf")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", "serve", "--port", "0",
                        "--model", str(path)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvshare: error: "), p.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in p.stderr + p.stdout
