"""Two more ways one might speed up a SigLIP-so400m layer (MiniCPM-V, the Qwen3-VL-8B tower) at one
image's rows, measured against what the towers run: both lose on an H200 (benchmarks/RESULTS.md,
fifteenth session). Kept so the claim can be re-checked on another GPU or library version.

- `triton_gemms`: hand-written Triton GEMMs with the layer's epilogues (bias, GELU-tanh), loading
  tiles by pointer, by TMA descriptor, and persistent over TMA, over a sweep of tile configs, against
  the PyTorch calls the fused body makes (cuBLAS / cuBLASLt). cuBLAS's own algorithms and inductor's
  Triton templates are probed by benchmarks/gemm_algorithms.py.
- `row_split`: every op between one layer's attention and the next layer's qkv GEMM works row by
  row, so the rows could be cut into parts run on parallel streams, to fill the SMs a lone GEMM's
  last wave leaves idle. The layer's chain (out GEMM, add + LayerNorm, fc1 + GELU, fc2, add +
  LayerNorm, qkv GEMM, optionally cuDNN attention) on 1-4 row parts.
- `fc1_rows`: fc1 + GELU (cuBLASLt's epilogue) at the row counts of budgets and of real batches, the
  MLP width padded (4352) or not (4304, a view): cuBLASLt's heuristic picks its kernel per shape, and
  a budget graph runs the budget's rows where an eager batch runs its own.

Times are µs per GEMM or per layer, from CUDA graphs over distinct weights per layer (read from HBM,
as the tower reads them), median of the replays (app/gpu/kernel_timing.graph_us).

    python3 benchmarks/layer_probes.py [triton_gemms] [row_split] [fc1_rows]   # writes $OUT/layer_probes.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.gpu.kernel_timing import graph_us  # noqa: E402
from app.vision.kernels import add_bias_layernorm, linear_gelu_tanh, padded_width  # noqa: E402

DEV, BF = "cuda", torch.bfloat16
HIDDEN, MLP_WIDTH, HEADS = 1152, 4304, 16  # SigLIP-so400m
WIDTH = padded_width(MLP_WIDTH)  # the MLP width as the towers store it (kernels.pad_mlp)
LAYERS = 6  # distinct weights per timed graph
ROWS = (1024, 784, 4096)  # one 448^2 image for MiniCPM-V (patch 14) and the 8B tower (patch 16); 4 images
# name -> (N, K, bias, GELU): the layer's GEMMs as the fused body calls them
GEMMS = {"qkv": (3 * HIDDEN, HIDDEN, True, False), "out": (HIDDEN, HIDDEN, False, False),
         "fc1": (WIDTH, HIDDEN, True, True), "fc2": (HIDDEN, WIDTH, False, False)}
# (block M, block N, block K, stages, warps)
CONFIGS = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (128, 64, 64, 4, 4),
           (64, 128, 64, 4, 4), (64, 256, 64, 4, 8), (128, 128, 128, 3, 8), (64, 128, 128, 3, 4),
           (128, 64, 128, 3, 4), (64, 64, 64, 5, 4), (128, 128, 64, 5, 4), (256, 128, 64, 3, 8)]
RESULTS: dict = {}


def weights(n: int, k: int, bias: bool):
    ws = [torch.randn(n, k, device=DEV, dtype=BF) * 0.03 for _ in range(LAYERS)]
    return ws, ([torch.randn(n, device=DEV, dtype=BF) for _ in range(LAYERS)] if bias else [None] * LAYERS)


def per_call_us(fn, ws, bs) -> float:
    """µs of one fn(w, b), from a graph of one call per layer weight."""
    return round(graph_us(lambda: [fn(w, b) for w, b in zip(ws, bs)], runs=15) / LAYERS, 2)


def triton_gemms():
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def tile_coords(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
        """Tiles in groups of GROUP row blocks, so neighbouring programs share weight tiles in L2."""
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        first = tile // (GROUP * num_n) * GROUP
        size = min(num_m - first, GROUP)
        return first + tile % (GROUP * num_n) % size, tile % (GROUP * num_n) // size

    @triton.jit
    def epilogue(acc, b_ptr, cols, N, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GELU:  # 0.5 x (1 + tanh(y)) = x sigmoid(2y)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        return acc

    @triton.jit
    def by_pointer(a_ptr, w_ptr, b_ptr, c_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
        pm, pn = tile_coords(tl.program_id(0), M, N, BM, BN, 8)
        rows, cols, ks = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
        a = a_ptr + (rows % M)[:, None] * K + ks[None, :]  # wrapped rows: loads need no mask (K % BK == 0)
        w = w_ptr + (cols % N)[:, None] * K + ks[None, :]
        acc = tl.zeros((BM, BN), tl.float32)
        for _ in range(K // BK):
            acc = tl.dot(tl.load(a), tl.trans(tl.load(w)), acc)
            a += BK
            w += BK
        acc = epilogue(acc, b_ptr, cols, N, HAS_BIAS, GELU)
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def by_tma(a_desc, w_desc, b_ptr, c_desc, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, PROGRAMS: tl.constexpr):
        """One tile per program (PROGRAMS = 0), or persistent: PROGRAMS programs stride over the tiles."""
        tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        step = PROGRAMS if PROGRAMS > 0 else tiles
        for tile in tl.range(tl.program_id(0), tiles, step, flatten=True):
            pm, pn = tile_coords(tile, M, N, BM, BN, 8)
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(K // BK):
                acc = tl.dot(a_desc.load([pm * BM, k * BK]), w_desc.load([pn * BN, k * BK]).T, acc)
            acc = epilogue(acc, b_ptr, pn * BN + tl.arange(0, BN), N, HAS_BIAS, GELU)
            c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(kind, x, w, b, gelu, cfg, out):
        bm, bn, bk, stages, warps = cfg
        (m, k), n = x.shape, w.shape[0]
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        bias = b if b is not None else x
        if kind == "pointer":
            by_pointer[(tiles,)](x, w, bias, out, m, n, k, bm, bn, bk, b is not None, gelu, num_stages=stages,
                                 num_warps=warps)
            return out
        programs = min(sms, tiles) if kind == "tma_persistent" else 0
        by_tma[(programs or tiles,)](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                                     bias, TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k, bm, bn, bk,
                                     b is not None, gelu, programs, num_stages=stages, num_warps=warps)
        return out

    def probe(m: int, name: str) -> dict:
        n, k, has_bias, gelu = GEMMS[name]
        ws, bs = weights(n, k, has_bias)
        x = torch.randn(m, k, device=DEV, dtype=BF)
        zero = torch.zeros(n, device=DEV, dtype=BF)

        def torch_way(w, b):  # what the fused body calls (fc2's tuned way may also be the zero-bias one)
            return linear_gelu_tanh(x, w, b) if gelu else F.linear(x, w, b)

        row = {"rows": m, "gemm": name, "torch": per_call_us(torch_way, ws, bs)}
        if not has_bias:
            row["torch_lt_zero_bias"] = per_call_us(lambda w, b: F.linear(x, w, zero), ws, bs)
        want = torch_way(ws[0], bs[0]).float()
        out = torch.empty(m, n, device=DEV, dtype=BF)
        sweep = {}
        for kind in ("pointer", "tma", "tma_persistent"):
            for cfg in CONFIGS:
                key = f"{kind} {'/'.join(map(str, cfg))}"
                try:
                    err = (run(kind, x, ws[0], bs[0], gelu, cfg, out).float() - want).abs().max() / want.abs().max()
                    if err > 2e-2:
                        sweep[key] = f"wrong: relative error {err:.2g}"
                        continue
                    sweep[key] = per_call_us(lambda w, b, kind=kind, cfg=cfg: run(kind, x, w, b, gelu, cfg, out), ws, bs)
                except Exception as e:  # noqa: BLE001 - recorded (shared memory over the limit, say)
                    sweep[key] = f"fails: {str(e).splitlines()[0][:100]}"
        timed = {key: v for key, v in sweep.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        row.update(triton_best=best, triton_best_us=timed[best], tflops_torch=round(2 * m * n * k / row["torch"] / 1e6),
                   sweep=sweep)
        print(f"{m} rows {name}: torch {row['torch']} µs, best Triton {timed[best]} ({best})", flush=True)
        return row

    rows_out = [probe(m, name) for m in ROWS for name in GEMMS]
    RESULTS["triton_gemms"] = rows_out


def row_split():
    layers = []
    for _ in range(LAYERS):
        p = {f"w{name}": torch.randn(n, k, device=DEV, dtype=BF) * 0.03 for name, (n, k, _, _) in GEMMS.items()}
        p.update(b_qkv=torch.randn(3 * HIDDEN, device=DEV, dtype=BF), b_fc1=torch.randn(WIDTH, device=DEV, dtype=BF),
                 b_out=torch.randn(HIDDEN, device=DEV, dtype=BF), b_fc2=torch.randn(HIDDEN, device=DEV, dtype=BF),
                 ln_w=torch.ones(HIDDEN, device=DEV, dtype=BF), ln_b=torch.zeros(HIDDEN, device=DEV, dtype=BF))
        layers.append(p)
    zero = torch.zeros(HIDDEN, device=DEV, dtype=BF)
    streams = [torch.cuda.Stream() for _ in range(4)]

    def chain(p, x, attn):  # as the fused body runs it, from the attention's output to the next qkv
        x, h = add_bias_layernorm(x, F.linear(attn, p["wout"]), p["b_out"], p["ln_w"], p["ln_b"], 1e-6)
        u = linear_gelu_tanh(h, p["wfc1"], p["b_fc1"])
        x, h = add_bias_layernorm(x, F.linear(u, p["wfc2"], zero), p["b_fc2"], p["ln_w"], p["ln_b"], 1e-6)
        return x, F.linear(h, p["wqkv"], p["b_qkv"])

    def attention(qkv):
        n = qkv.shape[0]
        q, k, v = (t.view(1, n, HEADS, -1).transpose(1, 2) for t in qkv.view(n, 3, HEADS, -1).unbind(1))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, HIDDEN)

    def layers_fn(m, parts, with_attention):
        x = torch.randn(m, HIDDEN, device=DEV)  # the float32 residual stream
        attn = torch.randn(m, HIDDEN, device=DEV, dtype=BF)
        cut = [m * i // parts for i in range(parts + 1)]

        def go():
            xs = [x[a:b] for a, b in zip(cut, cut[1:])]
            ins = [attn[a:b] for a, b in zip(cut, cut[1:])]
            for p in layers:
                here = torch.cuda.current_stream()
                qkvs = []
                for i in range(parts):
                    s = streams[i] if parts > 1 else here
                    s.wait_stream(here)
                    with torch.cuda.stream(s):
                        xs[i], qkv = chain(p, xs[i], ins[i])
                    qkvs.append(qkv)
                for s in streams[:parts] if parts > 1 else []:
                    here.wait_stream(s)
                if with_attention:
                    a = attention(torch.cat(qkvs) if parts > 1 else qkvs[0])
                    ins = [a[lo:hi] for lo, hi in zip(cut, cut[1:])]
                else:
                    ins = [q[:, :HIDDEN] for q in qkvs]
        return go

    rows_out = []
    for m in ROWS:
        for with_attention in (False, True):
            row = {"rows": m, "attention": with_attention}
            for parts in (1, 2, 3, 4):
                row[f"{parts} part(s)"] = round(graph_us(layers_fn(m, parts, with_attention), runs=20) / LAYERS, 1)
            rows_out.append(row)
            print("row_split", row, flush=True)
    RESULTS["row_split"] = rows_out


def fc1_rows():
    n, k, _, _ = GEMMS["fc1"]
    ws, bs = weights(n, k, True)
    for w, b in zip(ws, bs):  # as kernels.pad_mlp stores them: zero units past the real width
        w[MLP_WIDTH:], b[MLP_WIDTH:] = 0, 0
    rows_out = []
    for m in (1024, 2048, 3072, 4096, 6144, 7108, 7168, 8192):
        x = torch.randn(m, k, device=DEV, dtype=BF)
        row = {"rows": m}
        for label, width in ((f"padded {n}", n), (f"unpadded {MLP_WIDTH}", MLP_WIDTH)):
            row[label] = per_call_us(lambda w, b, width=width, x=x: linear_gelu_tanh(x, w[:width], b[:width]), ws, bs)
        row["ns per row, padded"] = round(row[f"padded {n}"] / m * 1e3, 2)
        rows_out.append(row)
        print("fc1_rows", row, flush=True)
    RESULTS["fc1_rows"] = rows_out


def main():
    RESULTS["device"] = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    steps = {f.__name__: f for f in (triton_gemms, row_split, fc1_rows)}
    out = Path(os.environ.get("OUT", ".")) / "layer_probes.json"
    for step in [steps[a] for a in sys.argv[1:]] or list(steps.values()):
        step()
        out.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
