#!/usr/bin/env python3
"""llama.cpp's logits at every position of the public texts, for a tiny test model: the
reference files `tests/data/<model>.logits.npz` that the model tests compare kvshare against.

    python scripts/make_reference_logits.py --llama-cpp PATH/TO/llama.cpp \\
        --model tests/data/models/tiny-qwen3moe.gguf \\
        --texts tests/data/tiny-qwen35.public.texts.json \\
        --out tests/data/tiny-qwen3moe.logits.npz --max-tokens tools_long=2048

llama.cpp side: a small tool (`LOGITS_CPP`, compiled with g++ against a llama.cpp build's
shared libraries, e.g. the llama.cpp that `llama-cpp-python`'s sdist vendors, built with
`cmake -B build -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
--target llama`) tokenizes each text (BOS added, special tokens parsed), decodes it in batches
of 512 with every position's logits requested (f16 KV cache, flash attention off, 2 threads),
then takes `--greedy` argmax steps one token at a time.

The file holds per case `tokens`, the logits quantized per position as uint16 over [min, max]
(`logits_u16`, `lo`, `range`: value = lo + q / 65535 * range, storage error <= 0.0008% of the
range), `top1` (argmax of the f32 logits) and `greedy`. kvshare's tokenizer is checked to give
the same tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

LOGITS_CPP = r"""
// usage: lc_logits MODEL TEXTFILE OUTPREFIX THREADS KV(f16|f32) MAXTOK NGREEDY
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void write(const std::string & path, const void * data, size_t n) {
    FILE * f = fopen(path.c_str(), "wb");
    fwrite(data, 1, n, f);
    fclose(f);
}

int main(int argc, char ** argv) {
    if (argc < 8) { fprintf(stderr, "usage: lc_logits MODEL TEXT OUT THREADS KV MAXTOK NGREEDY\n"); return 1; }
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::string text = ss.str();
    std::string out = argv[3];
    int maxtok = atoi(argv[6]), ngreedy = atoi(argv[7]);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> toks(text.size() + 16);
    int n = llama_tokenize(vocab, text.c_str(), text.size(), toks.data(), toks.size(), true, true);
    if (n < 0) return 1;
    toks.resize(n);
    if (maxtok > 0 && n > maxtok) { toks.resize(maxtok); n = maxtok; }
    auto cp = llama_context_default_params();
    cp.n_ctx = n + ngreedy + 16;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = strcmp(argv[5], "f16") == 0 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    std::vector<float> logits((size_t) n * n_vocab);
    llama_batch b = llama_batch_init(512, 0, 1);
    for (int s = 0; s < n; s += 512) {
        int m = std::min(512, n - s);
        b.n_tokens = m;
        for (int i = 0; i < m; i++) {
            b.token[i] = toks[s + i]; b.pos[i] = s + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
        for (int i = 0; i < m; i++)
            memcpy(&logits[(size_t) (s + i) * n_vocab], llama_get_logits_ith(ctx, i), n_vocab * sizeof(float));
    }
    std::vector<int32_t> greedy;
    const float * last = &logits[(size_t) (n - 1) * n_vocab];
    std::vector<float> cur(last, last + n_vocab);
    for (int g = 0; g < ngreedy; g++) {
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (cur[v] > cur[best]) best = v;
        greedy.push_back(best);
        b.n_tokens = 1;
        b.token[0] = best; b.pos[0] = n + g; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0; b.logits[0] = 1;
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
        const float * l = llama_get_logits_ith(ctx, 0);
        cur.assign(l, l + n_vocab);
    }
    std::vector<int32_t> t32(toks.begin(), toks.end());
    write(out + ".tokens", t32.data(), t32.size() * 4);
    write(out + ".logits", logits.data(), logits.size() * 4);
    write(out + ".greedy", greedy.data(), greedy.size() * 4);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


def build_tool(llama_cpp: Path, work: Path) -> Path:
    exe = work / "lc_logits"
    src = work / "lc_logits.cpp"
    src.write_text(LOGITS_CPP)
    lib = llama_cpp / "build" / "bin"
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", str(llama_cpp / "include"), "-I",
                    str(llama_cpp / "ggml" / "include"), str(src), "-o", str(exe), "-L", str(lib),
                    "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


def quantize_rows(logits: np.ndarray) -> dict[str, np.ndarray]:
    """Per position uint16 over [min, max] of that row."""
    lo = logits.min(1).astype(np.float64)
    rng = logits.max(1).astype(np.float64) - lo
    q = np.rint((logits - lo[:, None]) / np.where(rng > 0, rng, 1.0)[:, None] * 65535.0)
    return dict(logits_u16=q.astype(np.uint16), lo=lo, range=rng)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--texts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-tokens", nargs="*", default=[],
                    help="CASE=N: keep the first N tokens of that case")
    ap.add_argument("--greedy", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="f16", choices=("f16", "f32"))
    args = ap.parse_args(argv)
    limits = {k: int(v) for k, v in (s.split("=") for s in args.max_tokens)}
    texts = json.loads(args.texts.read_text())
    from kvshare.model.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_gguf(args.model)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = build_tool(args.llama_cpp.resolve(), work)
        for case, text in texts.items():
            (work / "text").write_bytes(text.encode())
            subprocess.run([str(exe), str(args.model), str(work / "text"), str(work / case),
                            str(args.threads), args.kv, str(limits.get(case, 0)),
                            str(args.greedy)], check=True, capture_output=True)
            toks = np.fromfile(work / f"{case}.tokens", np.int32)
            logits = np.fromfile(work / f"{case}.logits", np.float32).reshape(len(toks), -1)
            ours = tok.encode(text)[: len(toks)]
            if ours != toks.tolist():
                raise SystemExit(f"{case}: kvshare's tokens differ from llama.cpp's")
            out[f"{case}/tokens"] = toks
            for k, v in quantize_rows(logits).items():
                out[f"{case}/{k}"] = v
            out[f"{case}/top1"] = logits.argmax(1).astype(np.int16)
            out[f"{case}/greedy"] = np.fromfile(work / f"{case}.greedy", np.int32)
            print(f"{case}: {len(toks)} tokens, greedy {out[f'{case}/greedy'][:8].tolist()}...")
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
