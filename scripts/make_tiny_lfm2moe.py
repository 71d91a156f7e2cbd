#!/usr/bin/env python3
"""Write the tiny LFM2 MoE test model from the tiny dense LFM2 one: the same metadata
(`lfm2.*` keys renamed `lfm2moe.*`), tokenizer, embeddings, short-conv and attention layers,
and in place of the dense FFN of every layer from `leading_dense_block_count` on the MoE
block llama.cpp's `lfm2moe` graph reads: a router `ffn_gate_inp [n_expert, n_embd]` (F32),
the experts' selection bias `exp_probs_b.bias [n_expert]` (F32), stacked experts
`ffn_{gate,up,down}_exps` (F16); `expert_gating_func` sigmoid, as LFM2-8B-A1B's GGUF says.

    python scripts/make_tiny_lfm2moe.py --out tests/data/models/tiny-lfm2moe.gguf

Random values: normal of std 1/sqrt(fan-in) (the router's twice that, the bias 0.5), seeded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "data" / "models" / "tiny-lfm2.gguf"
N_EXPERT, N_USED, FF_EXP, DENSE_LEAD = 8, 2, 32, 1


def write(out: Path, base: Path = BASE, seed: int = 0) -> None:
    r = GGUFReader(str(base))
    w = GGUFWriter(str(out), "lfm2moe")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if key == "general.name":
            val = "tiny-lfm2moe-random"
        w.add_key_value(key.replace("lfm2.", "lfm2moe.", 1), val, vtype, sub_type=sub)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_USED)
    w.add_expert_feed_forward_length(FF_EXP)
    w.add_leading_dense_block_count(DENSE_LEAD)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    rng = np.random.default_rng(seed)

    def normal(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    n_embd = int(r.fields["lfm2.embedding_length"].contents())
    for t in r.tensors:
        name = t.name
        il = int(name.split(".")[1]) if name.startswith("blk.") else -1
        moe = il >= DENSE_LEAD
        if moe and name.endswith(("ffn_gate.weight", "ffn_up.weight")):
            continue
        if moe and name.endswith("ffn_down.weight"):
            p = name[: -len("ffn_down.weight")]
            E = N_EXPERT
            w.add_tensor(p + "ffn_gate_inp.weight", normal(E, n_embd, gain=2.0))
            w.add_tensor(p + "exp_probs_b.bias",
                         (rng.standard_normal(E) * 0.5).astype(np.float32))
            w.add_tensor(p + "ffn_gate_exps.weight", normal(E, FF_EXP, n_embd).astype(np.float16))
            w.add_tensor(p + "ffn_up_exps.weight", normal(E, FF_EXP, n_embd).astype(np.float16))
            w.add_tensor(p + "ffn_down_exps.weight", normal(E, n_embd, FF_EXP).astype(np.float16))
            continue
        w.add_tensor(name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=BASE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write(args.out, args.base, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
