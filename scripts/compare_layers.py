"""Compare kvshare's forward pass with llama.cpp's, tensor by tensor (llama-style attention
layers; written for Gemma 3 and its GGUF's tensor names). docs/model.md ("Agreement with
llama.cpp") has what it found.

llama.cpp side: a dump directory written by a small tool (`DUMP_CPP`, compiled with g++ against
a llama.cpp build's shared libraries): every f32/f16 tensor of one `llama_decode` of the ids,
all logits requested, as raw f32 (`index.tsv` + `NNNNN.f32`, `tokens.txt`).
`llama-eval-callback` prints the same tensors but only 3 values per axis at 4 decimals.

kvshare side: `DecoderModel.forward` on the same ids, with the ops that `kvshare.model.base`
imports wrapped (in this process only) to record their outputs under llama.cpp's names, and
optionally to apply llama.cpp's CPU roundings (`--emulate`): `q8` 8-bit activations before
each product with a quantized weight (Q8_K blocks of 256 for K-quants, Q8_0 blocks of 32
for the others, per the GGUF's tensor types), `gelu` GELU read from an f16 table, `attn` its
non-flash attention over f16 K/V (q and the softmax weights rounded to f16).

Reports:
1. end to end: per layer and tensor, max |ours - theirs| / max |theirs| per position, at
   position 0 and the worst of positions >= 1 (position 0 attends only to itself: rope is the
   identity and the softmax weight is 1, so what differs only at positions >= 1 comes from
   rope or attention), and the logits' differences over llama.cpp's top-40 tokens;
2. op by op: llama.cpp's own inputs through our rope and attention against its outputs, and
   its q.k scores, softmax and P.V against float64 recomputations from its own inputs.

usage (from the repository root; llama.cpp built with shared libraries, e.g.
`cmake -B build -DBUILD_SHARED_LIBS=ON && cmake --build build --target llama`):
  python scripts/compare_layers.py --llama-cpp ~/llama.cpp --case chat --n 16 [--fa 1]
  python scripts/compare_layers.py --dump DIR [--kv f16] [--emulate q8,gelu,attn]
  python scripts/compare_layers.py --dump DIR --against DIR2   # two llama.cpp runs
The first form writes its dump under $TMPDIR/kvshare_compare_layers/. A dump holds every
tensor, logits included (~120 MB for 16 tokens of Gemma 3 270M): keep prompts to tens of tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

DUMP_CPP = r"""
// Dump every f32/f16 tensor of one llama_decode (all rows' logits requested) as raw f32.
// usage: dump MODEL OUTDIR FA(0/1) THREADS KV(f16|f32) TOKEN...
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::string g_out;
static FILE * g_idx = nullptr;
static int g_n = 0;
static std::vector<uint8_t> g_buf;

static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) return true;
    const uint8_t * data;
    if (ggml_backend_buffer_is_host(t->buffer)) {
        data = (const uint8_t *) t->data;
    } else {
        g_buf.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, g_buf.data(), 0, ggml_nbytes(t));
        data = g_buf.data();
    }
    std::vector<float> v;
    v.reserve(ggml_nelements(t));
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
        size_t off = i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1] + i0 * t->nb[0];
        v.push_back(t->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(*(const ggml_fp16_t *)(data + off))
                                             : *(const float *)(data + off));
    }
    char fn[64];
    snprintf(fn, sizeof fn, "%05d.f32", g_n);
    FILE * f = fopen((g_out + "/" + fn).c_str(), "wb");
    fwrite(v.data(), sizeof(float), v.size(), f);
    fclose(f);
    fprintf(g_idx, "%d\t%s\t%s\t%s\t%lld\t%lld\t%lld\t%lld\n", g_n, t->name, ggml_type_name(t->type),
            ggml_op_desc(t), (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
            (long long) t->ne[3]);
    g_n++;
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 7) { fprintf(stderr, "usage: dump MODEL OUTDIR FA THREADS KV TOKEN...\n"); return 1; }
    g_out = argv[2];
    std::vector<llama_token> toks;
    for (int i = 6; i < argc; i++) toks.push_back(atoi(argv[i]));
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    auto cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 1024;
    cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    cp.flash_attn_type = atoi(argv[3]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = strcmp(argv[5], "f16") == 0 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    cp.cb_eval = cb;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    g_idx = fopen((g_out + "/index.tsv").c_str(), "w");
    llama_batch b = llama_batch_init(toks.size(), 0, 1);
    b.n_tokens = toks.size();
    for (size_t i = 0; i < toks.size(); i++) {
        b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    int rc = llama_decode(ctx, b);
    fclose(g_idx);
    if (rc) { fprintf(stderr, "decode rc %d\n", rc); return 1; }
    fprintf(stderr, "dumped %d tensors\n", g_n);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


def build_dump_tool(llama_cpp: Path, work: Path) -> Path:
    exe = work / "lc_dump"
    if exe.exists():
        return exe
    src = work / "lc_dump.cpp"
    src.write_text(DUMP_CPP)
    lib = llama_cpp / "build" / "bin"
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", str(llama_cpp / "include"), "-I",
                    str(llama_cpp / "ggml" / "include"), str(src), "-o", str(exe), "-L", str(lib),
                    "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


class Dump:
    """llama.cpp's tensors by name (a name may repeat: `get(name, op)` picks by op too)."""

    def __init__(self, d: Path):
        self.d = d
        self.rows = []
        for line in (d / "index.tsv").read_text().splitlines():
            i, name, typ, op, *ne = line.split("\t")
            self.rows.append((int(i), name, typ, op, tuple(int(x) for x in ne)))

    def get(self, name: str, op: str | None = None, nth: int = -1) -> np.ndarray | None:
        hits = [r for r in self.rows if r[1] == name and (op is None or r[3] == op)]
        if not hits:
            return None
        i, _, _, _, ne = hits[nth]
        return self._load(i, ne)

    def _load(self, i: int, ne: tuple) -> np.ndarray:
        a = np.fromfile(self.d / f"{i:05d}.f32", np.float32).reshape(ne[::-1])
        while a.ndim > 2 and a.shape[0] == 1:
            a = a[0]
        return a

    def after(self, name: str, op: str) -> np.ndarray | None:
        """The first tensor computed by `op` after the last tensor called `name`."""
        idx = max(r[0] for r in self.rows if r[1] == name)
        for r in self.rows:
            if r[0] > idx and r[3] == op:
                return self._load(r[0], r[4])
        return None


# ---- llama.cpp's CPU arithmetic, emulated (for `--emulate`) ---------------------------------

def q8_0_round(x: np.ndarray) -> np.ndarray:
    """x [N, in] as ggml's quantize_row_q8_0 leaves it (blocks of 32, f16 scale), dequantized:
    the activations of a product with a Q4_0/Q5_0/Q8_0 weight."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d16 = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (np.rint(b * idv) * d16).reshape(n, k).astype(np.float32)


def q8_k_round(x: np.ndarray) -> np.ndarray:
    """x [N, in] as quantize_row_q8_K_ref leaves it (blocks of 256, f32 scale), dequantized:
    the activations of a product with a K-quant weight."""
    n, k = x.shape
    b = x.reshape(n, k // 256, 256).astype(np.float32)
    i = np.abs(b).argmax(-1)[..., None]
    mx = np.take_along_axis(b, i, -1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(b * iscale), 127)
    return (q * d).reshape(n, k).astype(np.float32)


_K_QUANTS = {10, 11, 12, 13, 14, 15}  # Q2_K .. Q8_K: ggml's vec_dot_type is Q8_K
_Q8_0_DOT = {2, 3, 6, 7, 8, 9}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1: Q8_0 / Q8_1 (same values)


def act_round(qtype: int):
    """How ggml's CPU rounds the activations of a product with a weight of GGML type `qtype`."""
    if qtype in _K_QUANTS:
        return q8_k_round
    if qtype in _Q8_0_DOT:
        return q8_0_round
    if qtype == 1:  # F16 weights: activations converted to f16
        return _f16_round
    return _no_round


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _no_round(x: np.ndarray) -> np.ndarray:
    return x


def weight_parts(path: Path, cfg) -> dict:
    """(kind, layer) -> [(first output column, GGML type)] for each part of kvshare's fused
    weights, from the GGUF's tensor types."""
    from kvshare.model.gguf_file import GGUFFile

    t = GGUFFile(path).tensors
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim

    def ty(name):
        return int(t[name].qtype)

    out = {("output", -1): [(0, ty("output.weight" if "output.weight" in t
                                    else "token_embd.weight"))]}
    for il in range(cfg.n_layers):
        p = f"blk.{il}."
        if p + "attn_q.weight" not in t:
            continue
        out[("wqkv", il)] = [(0, ty(p + "attn_q.weight")), (H * D, ty(p + "attn_k.weight")),
                             ((H + K) * D, ty(p + "attn_v.weight"))]
        out[("wo", il)] = [(0, ty(p + "attn_output.weight"))]
        out[("w_gate_up", il)] = [(0, ty(p + "ffn_gate.weight")),
                                  (cfg.n_ff, ty(p + "ffn_up.weight"))]
        out[("w_down", il)] = [(0, ty(p + "ffn_down.weight"))]
    return out


def _gelu_table() -> np.ndarray:
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        g = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))
    return g.astype(np.float16).astype(np.float32)


def geglu_f16_table(gate: np.ndarray, up: np.ndarray, out=None, **_) -> np.ndarray:
    """ggml_vec_geglu_f32 with GGML_GELU_FP16: GELU read from an f16 table at f16(x)."""
    t = _gelu_table()[gate.astype(np.float16).view(np.uint16)]
    t = np.where(gate <= -10, np.float32(0), np.where(gate >= 10, gate, t)).astype(np.float32)
    y = t * up
    if out is not None:
        out[...] = y
        return out
    return y


def attention_ggml(q, k, v, scale: float, window: int) -> np.ndarray:
    """Attention of one sequence at positions 0..n-1 as ggml's CPU mul_mat path does it with
    an f16 KV cache (flash attention off): q*scale rounded to f16 for the f16 K.q product,
    softmax in f32 (exp, times the f32 reciprocal of their float64 sum), its probabilities rounded to f16 for the product with f16 V."""
    n, H, D = q.shape
    K = k.shape[1]
    g = H // K
    qs = (q * np.float32(scale)).astype(np.float16).astype(np.float64)
    k16 = k.astype(np.float16).astype(np.float64)
    v16 = v.astype(np.float16).astype(np.float64)
    out = np.empty((n, H, v.shape[2]), np.float32)
    pos = np.arange(n)
    bad = pos[None, :] > pos[:, None]
    if window:
        bad |= (pos[:, None] - pos[None, :]) >= window
    for h in range(H):
        s = (qs[:, h] @ k16[:, h // g].T).astype(np.float32)
        s[bad] = -np.inf
        s -= s.max(-1, keepdims=True)
        p = np.exp(s)
        p *= (1.0 / p.sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)
        out[:, h] = (p.astype(np.float16).astype(np.float64) @ v16[:, h // g]).astype(np.float32)
    return out


def run_ours(model, tokens: np.ndarray, kv_dtype: str, emulate: set = frozenset(),
             qtypes: dict | None = None) -> dict:
    """kvshare's forward on `tokens` (one chunk, all logits), recording per layer the tensors
    llama.cpp names (`attn_norm-3`, `Qcur-3`, ...) as float32 arrays [n, ...]."""
    import kvshare.model.base as base
    from kvshare.model.batch import SeqChunk

    rec: dict[str, np.ndarray] = {}
    names = {}  # id(weight) -> (kind, layer)
    for L in model.layers:
        for kind in ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm",
                     "post_ffn_norm", "wqkv", "wo", "w_gate_up", "w_down"):
            names[id(getattr(L, kind))] = (kind, L.index)
    names[id(model.output_norm)] = ("output_norm", -1)
    state = {"layer": 0, "rope": 0}
    orig = {k: getattr(base, k) for k in ("rms_norm", "linear", "apply_rope", "paged_attention",
                                 "write_kv", "glu")}
    cfg = model.config
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim

    def rms_norm(x, w, eps, **kw):
        kind, il = names.get(id(w), ("?", -2))
        if kind == "attn_norm":
            if il > 0:
                rec[f"l_out-{il - 1}"] = np.array(x)
            state["layer"], state["rope"] = il, 0
        elif kind == "ffn_norm":
            rec[f"sa_out-{il}"] = np.array(x)
        elif kind == "output_norm":
            rec[f"l_out-{len(model.layers) - 1}"] = np.array(x)
        y = orig["rms_norm"](x, w, eps, **kw)
        tag = {"attn_norm": "attn_norm", "q_norm": "Qcur_normed", "k_norm": "Kcur_normed",
               "post_attn_norm": "attn_post_norm", "ffn_norm": "ffn_norm",
               "post_ffn_norm": "ffn_post_norm", "output_norm": "result_norm"}[kind]
        rec[tag if il < 0 else f"{tag}-{il}"] = np.array(y)
        return y

    def linear(x, w, bias=None, **kw):
        kind, il = names.get(id(w), ("output", -1))
        if "q8" in emulate:  # each part of a fused weight with its own activation rounding
            parts = qtypes[(kind, il)]
            y = orig["linear"](act_round(parts[0][1])(np.asarray(x)), w, bias)
            for j, (c0, qt) in enumerate(parts[1:], 1):
                if act_round(qt) is not act_round(parts[0][1]):
                    c1 = parts[j + 1][0] if j + 1 < len(parts) else None
                    y[:, c0:c1] = orig["linear"](act_round(qt)(np.asarray(x)), w, bias)[:, c0:c1]
        else:
            y = orig["linear"](x, w, bias, **kw)
        if kind == "wqkv":
            rec[f"Qcur_mm-{il}"] = np.array(y[:, : H * D])
            rec[f"Kcur_mm-{il}"] = np.array(y[:, H * D : (H + K) * D])
            rec[f"Vcur-{il}"] = np.array(y[:, (H + K) * D :])
        elif kind == "wo":
            rec[f"attn_out-{il}"] = np.array(y)
        elif kind == "w_gate_up":
            ff = y.shape[1] // 2
            rec[f"ffn_gate-{il}"] = np.array(y[:, :ff])
            rec[f"ffn_up-{il}"] = np.array(y[:, ff:])
        elif kind == "w_down":
            rec[f"ffn_out-{il}"] = np.array(y)
        else:
            rec["result_output"] = np.array(y)
        return y

    def apply_rope(x, cos, sin, style, **kw):
        y = orig["apply_rope"](x, cos, sin, style, **kw)
        rec[f"{'QK'[state['rope']]}cur-{state['layer']}"] = np.array(y)
        state["rope"] += 1
        return y

    def write_kv(kc, vc, slots, k, v, **kw):
        state["k"], state["v"] = np.array(k), np.array(v)
        return orig["write_kv"](kc, vc, slots, k, v, **kw)

    def paged_attention(q, *a, **kw):
        if "attn" in emulate:
            y = attention_ggml(q, state["k"], state["v"], kw["scale"], kw["window"])
        else:
            y = orig["paged_attention"](q, *a, **kw)
        rec[f"kqv_out-{state['layer']}"] = np.array(y).reshape(len(y), -1)
        return y

    def glu(gu, kind, **kw):
        if "gelu" in emulate:
            ff = gu.shape[1] // 2
            y = geglu_f16_table(gu[:, :ff], gu[:, ff:], out=gu[:, :ff])
        else:
            y = orig["glu"](gu, kind, **kw)
        rec[f"ffn_geglu-{state['layer']}"] = np.array(y)
        return y

    threads = base.CPU_THREADS

    class OnePart:  # the token-wise work in one piece, so each wrapper sees whole tensors
        def __getattr__(self, name):
            return getattr(threads, name)

        def for_tokens(self, n_tokens, row_parallel=False):
            return threads.for_tokens(n_tokens, row_parallel=False)

    n = len(tokens)
    nb = -(-n // 16) + 1
    try:
        for k, f in (("rms_norm", rms_norm), ("linear", linear), ("apply_rope", apply_rope),
                     ("paged_attention", paged_attention), ("write_kv", write_kv),
                     ("glu", glu), ("CPU_THREADS", OnePart())):
            setattr(base, k, f)
        cache = model.new_cache(nb, 16, kv_dtype=kv_dtype)
        (lg,) = model.forward([SeqChunk(np.asarray(tokens, np.int32), 0, np.arange(nb),
                                        logits="all")], cache)
    finally:
        for k, f in orig.items():
            setattr(base, k, f)
        base.CPU_THREADS = threads
    rec["result_output"] = lg
    return rec


KINDS = ["attn_norm", "Qcur_mm", "Kcur_mm", "Vcur", "Qcur_normed", "Kcur_normed", "Qcur", "Kcur",
         "kqv_out", "attn_out", "attn_post_norm", "sa_out", "ffn_norm", "ffn_gate", "ffn_up",
         "ffn_geglu", "ffn_out", "ffn_post_norm", "l_out"]


def theirs_of(dump: Dump, kind: str, il: int, n: int) -> np.ndarray | None:
    t = None
    if kind == "Qcur_mm":
        t = dump.get(f"Qcur-{il}", "MUL_MAT")
    elif kind == "Kcur_mm":
        t = dump.get(f"Kcur-{il}", "MUL_MAT")
    elif kind == "Vcur":
        t = dump.get(f"Vcur-{il}", "MUL_MAT")
    elif kind in ("Qcur", "Kcur"):
        t = dump.get(f"{kind}-{il}", "ROPE")
    elif kind == "kqv_out":
        t = dump.get(f"kqv_out-{il}")
    elif kind == "attn_out":
        t = dump.after(f"kqv_out-{il}", "MUL_MAT")
    else:
        t = dump.get(f"{kind}-{il}")
    return None if t is None else t.reshape(n, -1)


def rel_by_pos(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float, float, float]:
    """(max |d| at position 0, at positions >= 1, each relative to max |theirs| of the rows)."""
    d = np.abs(ours.astype(np.float64) - theirs).reshape(len(theirs), -1)
    m = np.abs(theirs).reshape(len(theirs), -1).max(-1)
    return (d[0].max(), d[1:].max(), d[0].max() / m[0], (d[1:].max(-1) / m[1:]).max())


def report_end_to_end(rec: dict, dump: Dump, n: int, layers: list[int]) -> None:
    print("\n== end to end: max|ours - llama.cpp| / max|llama.cpp| per row; pos 0 | pos >= 1 ==")
    print(f"{'tensor':>15} " + " ".join(f"{'L' + str(il):>15}" for il in layers))
    for kind in KINDS:
        cells = []
        for il in layers:
            t = theirs_of(dump, kind, il, n)
            o = rec.get(f"{kind}-{il}")
            if t is None or o is None:
                cells.append(f"{'-':>15}")
                continue
            _, _, r0, r1 = rel_by_pos(o.reshape(n, -1), t)
            cells.append(f"{r0:7.1e}|{r1:7.1e}")
        print(f"{kind:>15} " + " ".join(cells))
    t = dump.get("result_output").reshape(n, -1)
    d = np.abs(rec["result_output"].reshape(n, -1) - t)
    top = np.argsort(-t, -1)[:, :40]
    print("logits, max |delta| per position, all tokens: "
          + " ".join(f"{x:.3f}" for x in d.max(-1)))
    d40 = np.take_along_axis(d, top, -1).max(-1)
    print("                    llama.cpp's top-40 tokens: " + " ".join(f"{x:.3f}" for x in d40))
    if n > 1:
        print(f"top-40 max |delta|: position 0 {d40[0]:.3f}; positions >= 1 median "
              f"{np.median(d40[1:]):.3f}, max {d40[1:].max():.3f}")


def report_ops(model, dump: Dump, n: int, layers: list[int], fa: bool) -> None:
    """llama.cpp's inputs through our rope / attention against its outputs."""
    from kvshare.ops.attention import paged_attention, write_kv
    from kvshare.ops.rope import apply_rope, rope_cos_sin

    cfg = model.config
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    pos = np.arange(n)
    print("\n== op by op: llama.cpp's inputs through our op (max |d| / max |llama.cpp out|); "
          "pos 0 | pos >= 1 ==")
    print(f"{'op':>26} " + " ".join(f"{'L' + str(il):>15}" for il in layers))
    rows: dict[str, list[str]] = {}
    for il in layers:
        L = model.layers[il]
        cos, sin = rope_cos_sin(pos, cfg.n_rot, L.rope_base, L.rope_scale)
        for qk, nh in (("Q", H), ("K", K)):
            x = dump.get(f"{qk}cur_normed-{il}").reshape(n, nh, D).copy()
            apply_rope(x, cos, sin, cfg.rope_style)
            t = dump.get(f"{qk}cur-{il}", "ROPE").reshape(n, nh, D)
            _, _, r0, r1 = rel_by_pos(x, t)
            rows.setdefault(f"rope {qk}", []).append(f"{r0:7.1e}|{r1:7.1e}")
        # float64 rope of llama's input: how far each is from exact
        c64 = np.cos(pos[:, None] * (L.rope_base ** (-np.arange(0, D, 2) / D))[None])
        s64 = np.sin(pos[:, None] * (L.rope_base ** (-np.arange(0, D, 2) / D))[None])
        x = dump.get(f"Qcur_normed-{il}").reshape(n, H, D).astype(np.float64)
        a, b = x[..., : D // 2], x[..., D // 2 :]
        ex = np.concatenate([a * c64[:, None] - b * s64[:, None],
                             b * c64[:, None] + a * s64[:, None]], -1)
        t = dump.get(f"Qcur-{il}", "ROPE").reshape(n, H, D)
        _, _, r0, r1 = rel_by_pos(t, ex)
        rows.setdefault("llama rope Q vs f64", []).append(f"{r0:7.1e}|{r1:7.1e}")
        q = dump.get(f"Qcur-{il}", "ROPE").reshape(n, H, D)
        k = dump.get(f"Kcur-{il}", "ROPE").reshape(n, K, D)
        v = dump.get(f"Vcur-{il}", "MUL_MAT").reshape(n, K, D)
        t = dump.get(f"kqv_out-{il}").reshape(n, H * D)
        exact = None
        for kvd in ("f32", "f16", "f64"):
            dt = {"f32": np.float32, "f16": np.float16, "f64": np.float64}[kvd]
            if kvd == "f64":
                from kvshare.ops.attention import attention_reference
                o = attention_reference(q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64), pos, pos, scale=cfg.q_scale,
                                        window=L.window).reshape(n, -1)
                exact = o
            else:
                nb = n // 16 + 1
                kc = np.zeros((nb, 16, K, D), dt)
                vc = np.zeros((nb, 16, K, D), dt)
                write_kv(kc, vc, pos, k, v)
                o = paged_attention(q.copy(), kc, vc, np.arange(nb, dtype=np.int32)[None],
                                    np.array([0, n]), np.array([0]), scale=cfg.q_scale,
                                    window=L.window).reshape(n, -1)
            _, _, r0, r1 = rel_by_pos(o, t)
            rows.setdefault(f"attention ours {kvd} KV", []).append(f"{r0:7.1e}|{r1:7.1e}")
        # llama.cpp's attention against float64 attention of f16-rounded K/V (its cache)
        o16 = attention_reference(q.astype(np.float64), k.astype(np.float16).astype(np.float64),
                                  v.astype(np.float16).astype(np.float64), pos, pos,
                                  scale=cfg.q_scale, window=L.window).reshape(n, -1)
        _, _, r0, r1 = rel_by_pos(t, o16)
        rows.setdefault("llama attn vs f64(f16 KV)", []).append(f"{r0:7.1e}|{r1:7.1e}")
        _, _, r0, r1 = rel_by_pos(t, exact)
        rows.setdefault("llama attn vs f64", []).append(f"{r0:7.1e}|{r1:7.1e}")
        if not fa:
            kq = dump.get(f"kq-{il}")  # [H, n, n_kv_padded]
            qs = dump.after(f"Qcur-{il}", "SCALE").reshape(n, H, D).astype(np.float64)
            kk = k.astype(np.float16).astype(np.float64)
            ref = np.einsum("qhd,kd->hqk", qs, kk[:, 0])
            d = np.abs(kq[:, :, :n] - ref)
            causal = np.tril(np.ones((n, n), bool))
            dd = np.where(causal[None], d, 0)
            rows.setdefault("llama kq vs f64 (pos>=1)", []).append(
                f"{dd[:, 1:].max():15.2e}")
            qs16 = qs.astype(np.float16).astype(np.float64)
            ref16 = np.einsum("qhd,kd->hqk", qs16, kk[:, 0])
            dd = np.where(causal[None], np.abs(kq[:, :, :n] - ref16), 0)
            rows.setdefault("llama kq vs f64(f16 q)", []).append(f"{dd[:, 1:].max():15.2e}")
            # its softmax, and its P.V with P rounded to f16, from its own kq / softmax
            sm = dump.get(f"kq_soft_max-{il}")[:, :, :n]
            s_ = np.where(causal[None], kq[:, :, :n], -np.inf).astype(np.float64)
            p_ = np.exp(s_ - s_.max(-1, keepdims=True))
            p_ /= p_.sum(-1, keepdims=True)
            rows.setdefault("llama softmax vs f64", []).append(
                f"{np.abs(sm - p_)[:, 1:].max():15.2e}")
            v16 = v.astype(np.float16).astype(np.float64)[:, 0]
            o = np.einsum("hqk,kd->qhd", sm.astype(np.float16).astype(np.float64), v16)
            _, _, r0, r1 = rel_by_pos(t, o.reshape(n, -1))
            rows.setdefault("llama kqv vs f64(f16 P)", []).append(f"{r0:7.1e}|{r1:7.1e}")
    for k_, cells in rows.items():
        print(f"{k_:>26} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source dir with build/bin")
    ap.add_argument("--dump", type=Path, help="an existing dump directory (skips running "
                    "llama.cpp; its tokens.txt gives the ids)")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", default="2,818,5279,529,7001,563",
                    help="comma-separated ids (default: the test's `short` text)")
    ap.add_argument("--case", help="take the ids from this text of tests/data/gemma-3-270m-"
                    "q4_k_m.public.npz (short, chat, unicode, code, tools_long)")
    ap.add_argument("--n", type=int, default=32, help="with --case: its first n ids")
    ap.add_argument("--fa", type=int, default=0)
    ap.add_argument("--llama-kv", default="f16")
    ap.add_argument("--kv", default="f32", help="kvshare's KV dtype")
    ap.add_argument("--against", type=Path, help="compare this second llama.cpp dump (e.g. "
                    "flash attention on) with --dump instead of running kvshare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="0,1,2,5,11,17")
    ap.add_argument("--emulate", default="", help="comma list of llama.cpp CPU roundings to "
                    "apply on our side: q8 (8-bit activations before each quantized product), "
                    "gelu (f16 GELU table), attn (f16 q and softmax weights, f16 K/V)")
    args = ap.parse_args()
    from kvshare.model.loader import default_model_path, load_model

    model_path = args.model or default_model_path()
    if args.case:
        ref = np.load(Path(__file__).resolve().parents[1] / "tests" / "data"
                      / "gemma-3-270m-q4_k_m.public.npz")
        tokens = ref[f"{args.case}/tokens"][: args.n].astype(np.int32)
    elif args.dump is not None and (args.dump / "tokens.txt").exists():
        tokens = np.array((args.dump / "tokens.txt").read_text().split(), np.int32)
    else:
        tokens = np.array([int(t) for t in args.tokens.split(",")], np.int32)
    if args.dump is None:
        work = Path(tempfile.gettempdir()) / "kvshare_compare_layers"
        work.mkdir(exist_ok=True)
        exe = build_dump_tool(args.llama_cpp.resolve(), work)
        args.dump = work / f"dump_fa{args.fa}_{args.llama_kv}"
        args.dump.mkdir(exist_ok=True)
        for f in args.dump.iterdir():
            f.unlink()
        subprocess.run([str(exe), str(model_path), str(args.dump), str(args.fa),
                        str(args.threads), args.llama_kv, *map(str, tokens)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (args.dump / "tokens.txt").write_text(" ".join(map(str, tokens)))
    dump = Dump(args.dump)
    n = len(tokens)
    layers = [int(x) for x in args.layers.split(",")]
    if args.against is not None:
        other = Dump(args.against)
        rec = {f"{k}-{il}": theirs_of(other, k, il, n) for k in KINDS for il in layers}
        rec = {k: v for k, v in rec.items() if v is not None}
        rec["result_output"] = other.get("result_output")
        print(f"{n} tokens; llama.cpp {args.against} against {args.dump}")
        report_end_to_end(rec, dump, n, layers)
        return
    model = load_model(model_path)
    emulate = set(filter(None, args.emulate.split(",")))
    print(f"{n} tokens; llama.cpp fa={args.fa} KV {args.llama_kv}; ours KV {args.kv}, "
          f"emulating {sorted(emulate) or 'nothing'}")
    rec = run_ours(model, tokens, args.kv, emulate, weight_parts(model_path, model.config))
    report_end_to_end(rec, dump, n, layers)
    report_ops(model, dump, n, layers, bool(args.fa))


if __name__ == "__main__":
    main()
