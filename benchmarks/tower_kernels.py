"""Kernel probe at the 8B tower's shapes: where the per-layer time can and cannot go.

- attention back-ends by head size (cuDNN, FlashAttention-2 through SDPA), dense and varlen as the
  graphs run it (33 sequence slots, `max_seqlen` = the budget);
- cuDNN's ragged (varlen) attention: correct, but can it be captured in a CUDA graph?
- our Triton varlen attention (app/vision/attention.py: the 72-wide head as 64 + 16), config sweep;
- the GEMMs at 784 / 896 / 1024 / 3136 / 4096 tokens, with the MLP width 4304 or padded to 4352;
- the four patch mergers (main + 3 deepstack) one by one vs grouped into batched GEMMs;
- every tower's bias-free GEMMs (proj, fc2 / down) through cuBLAS or cuBLASLt, MLP width padded or not;
- optional Hopper kernels written in the CuTe DSL, where their packages are installed:
  FlashAttention-4's forward (`flash_attn.cute`, SM90 path) and QuACK's GEMMs (`quack`);
- FlashAttention-3's prebuilt forward (the `fa3-fwd` wheel, put on PYTHONPATH: `fa3_attention`).

Times are per call, from a CUDA graph of `inner` back-to-back calls (no launch gaps), median of 30
replays. Writes $OUT/kernels.json (or ./kernels.json).

    python benchmarks/tower_kernels.py [sdpa_by_head_dim attention_cases gemms mergers residual_gemms fa4_attention quack_gemms
                                  fa3_attention]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.gpu import kernel_timing as timing  # noqa: E402
from app.vision import attention  # noqa: E402

# The 8B tower's heads (16 x 72) unless KERNELS_HEAD_DIM says otherwise (64: the 2B tower).
DEV, BF, HEADS, HD = "cuda", torch.bfloat16, 16, int(os.environ.get("KERNELS_HEAD_DIM", 72))
RESULTS: dict = {}


def graph_us(fn, inner: int = 20, runs: int = 30) -> float:
    return round(timing.graph_us(fn, inner, runs), 1)


def per_sequence_reference(q, k, v, seqs):
    outs, s0 = [], 0
    for n in seqs:
        outs.append(F.scaled_dot_product_attention(*(t[s0:s0 + n].transpose(0, 1).float() for t in (q, k, v)))
                    .transpose(0, 1))
        s0 += n
    return torch.cat(outs)


def rel(a, b) -> str:
    return f"{((a.float() - b).abs().max() / b.abs().max()).item():.1e}"


def sdpa_by_head_dim():
    rows = []
    for b, length in [(1, 784), (4, 196), (4, 784), (1, 4096)]:
        for d in (64, 72, 80, 96, 128):
            q, k, v = (torch.randn(b, HEADS, length, d, device=DEV, dtype=BF) for _ in range(3))
            row = {"batch": b, "length": length, "head_dim": d}
            for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
                with sdpa_kernel(be):
                    row[name] = graph_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
            rows.append(row)
            print("sdpa", row, flush=True)
    RESULTS["sdpa_by_head_dim"] = rows


# (sequence lengths, slots as a graph pads them): real batches, and the same inside a budget graph
CASES = {"1x448": ([784], 1), "1x448 in budget 896": ([784, 112], 33), "video 4x196": ([196] * 4, 4),
         "video in budget 896": ([196] * 4 + [112], 33), "4x448": ([784] * 4, 4),
         "4x448 in budget 3584": ([784] * 4 + [448], 33), "1x1024": ([4096], 1), "2x1024": ([4096] * 2, 2),
         "MiniCPM-V 1x448 (1024)": ([1024], 1),
         "mixed 2744 in budget 3072": ([784, 196, 196, 196, 196, 784, 196, 196, 328], 33)}


def case_inputs(seqs: list[int], slots: int):
    """q, k, v [N, H, D] (views into one [N, 3, H, D] tensor), the fp32 per-sequence reference,
    `cu_seqlens` padded to `slots` sequences, and `max_seqlen` as the graphs pass it (the budget when
    slots are padded)."""
    n = sum(seqs)
    q, k, v = torch.randn(n, 3, HEADS, HD, device=DEV, dtype=BF).unbind(1)
    cu = torch.tensor(list(itertools.accumulate([0] + seqs)) + [n] * (slots - len(seqs)), device=DEV,
                      dtype=torch.int32)
    return q, k, v, per_sequence_reference(q, k, v, seqs), cu, n if slots > len(seqs) else max(seqs)


def attempt(fn, *args, prefix: str = "fails"):
    """fn(*args), or where it raises, the first line of why (what the probe records), the GPU synchronised."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded: this is what the probe asks
        torch.cuda.synchronize()
        return f"{prefix}: {(str(e).splitlines() or [type(e).__name__])[0][:120]}"


def err_after(fn, ref, out=None) -> str:
    """Run `fn` once; the error of its result (or of `out`, where it writes into a given buffer) vs `ref`."""
    res = fn()
    return rel(res if out is None else out, ref)


def cudnn_ragged(q, k, v, cu, maxlen):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, maxlen, maxlen, False, 0.0, False, False)[0]


def attention_cases():
    rows = []
    for name, (seqs, slots) in CASES.items():
        q, k, v, ref, cu, maxlen = case_inputs(seqs, slots)
        row = {"case": name, "fa2_varlen_us": graph_us(partial(varlen_attn, q, k, v, cu, cu, maxlen, maxlen))}
        if slots == len(seqs) and len(set(seqs)) == 1:
            qb, kb, vb = (t.reshape(len(seqs), seqs[0], HEADS, HD).transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["cudnn_dense_us"] = graph_us(partial(F.scaled_dot_product_attention, qb, kb, vb))
        row["cudnn_ragged_err"] = rel(cudnn_ragged(q, k, v, cu, maxlen), ref)
        row["cudnn_ragged_us"] = attempt(graph_us, partial(cudnn_ragged, q, k, v, cu, maxlen), prefix="capture fails")
        row.update(triton_split_head(q, k, v, seqs, slots, ref))
        rows.append(row)
        print("attention", row, flush=True)
    RESULTS["attention"] = rows


def triton_split_head(q, k, v, seqs, slots, ref) -> dict:
    """Our kernel (app/vision/attention.py) over a small config sweep: (block_m, block_n, warps, stages)."""
    if not attention.available(HD, q.device):
        return {}
    rows = {}
    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 2), (128, 64, 4, 2),
                                  (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)]:
        tab = attention.block_table(seqs, attention.table_rows(sum(seqs), slots, bm), bm).to(DEV)
        rows[f"{bm}/{bn}/{warps}/{stages}"] = graph_us(partial(attention.varlen_attention, q, k, v, tab, bm,
                                                               (bn, warps, stages)))
    bm = attention.block_m_for(seqs[0] if len(set(seqs)) == 1 else None)
    default = "/".join(map(str, (bm, *attention.CONFIGS[bm])))
    return {"triton_us": rows[default], "triton_best": min(rows.items(), key=lambda kv: kv[1]),
            "triton_err": rel(attention.varlen_attention(q, k, v, attention.block_table(seqs, block_m=bm).to(DEV), bm), ref),
            "triton_sweep": rows}


def gemms():
    """Per-layer GEMMs, with torch's preferred BLAS library set to cuBLAS (the default) and cuBLASLt."""
    rows = []
    d, qkv_n = 1152, 3456
    for m, lib in itertools.product((784, 896, 1024, 3136, 4096), ("cublas", "cublaslt")):
        torch.backends.cuda.preferred_blas_library(lib)
        x, a = torch.randn(m, d, device=DEV, dtype=BF), torch.randn(m, d, device=DEV, dtype=BF)
        wq, bq, wp = (torch.randn(qkv_n, d, device=DEV, dtype=BF), torch.randn(qkv_n, device=DEV, dtype=BF),
                      torch.randn(d, d, device=DEV, dtype=BF))
        row = {"tokens": m, "blas": lib, "qkv_us": graph_us(partial(F.linear, x, wq, bq)),
               "proj_us": graph_us(partial(F.linear, a, wp))}
        for width in (4304, 4352):
            w1, b1 = torch.randn(width, d, device=DEV, dtype=BF) * 0.02, torch.randn(width, device=DEV, dtype=BF)
            w2, u = torch.randn(d, width, device=DEV, dtype=BF) * 0.02, torch.randn(m, width, device=DEV, dtype=BF)
            row[f"fc1_gelu_{width}_us"] = graph_us(partial(torch._addmm_activation, b1, x, w1.t(), use_gelu=True))
            row[f"fc2_{width}_us"] = graph_us(partial(F.linear, u, w2))
        flops = 2 * m * d * (qkv_n + d + 2 * 4304)
        total = row["qkv_us"] + row["proj_us"] + row["fc1_gelu_4304_us"] + row["fc2_4304_us"]
        row["layer_gemm_us"], row["layer_tflops"] = round(total, 1), round(flops / total / 1e6)
        rows.append(row)
        print("gemm", row, flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    RESULTS["gemms"] = rows


# (tower, hidden, MLP width): the towers' bias-free GEMMs, i.e. the ones whose bias the residual add applies
RESIDUAL_SHAPES = [("qwen3-vl-8b / minicpm-v siglip", 1152, 4304), ("qwen3-vl-2b", 1024, 4096),
                   ("qwen2.5-vl-7b", 1280, 3420)]


def residual_gemms():
    """The towers' proj and fc2 / down GEMMs, whose bias the fused add+norm applies: cuBLAS (no bias) or
    cuBLASLt (a zero bias, which PyTorch sends to cuBLASLt's bias epilogue), at the MLP's width and at
    the width padded to a multiple of 64 (the ways app/vision/down_projection.py chooses between)."""
    from app.vision.kernels import padded_width

    rows = []
    for (name, d, width), m in itertools.product(RESIDUAL_SHAPES, (256, 512, 784, 1024, 1536, 2048, 3136, 4096, 8192)):
        zero = torch.zeros(d, device=DEV, dtype=BF)
        row = {"tower": name, "tokens": m}
        a, wp = torch.randn(m, d, device=DEV, dtype=BF), torch.randn(d, d, device=DEV, dtype=BF)
        row["proj_cublas_us"] = graph_us(partial(F.linear, a, wp))
        row["proj_lt_us"] = graph_us(partial(F.linear, a, wp, zero))
        for w in sorted({width, padded_width(width)}):
            u, w2 = torch.randn(m, w, device=DEV, dtype=BF), torch.randn(d, w, device=DEV, dtype=BF) * 0.02
            row[f"fc2_{w}_cublas_us"] = graph_us(partial(F.linear, u, w2))
            row[f"fc2_{w}_lt_us"] = graph_us(partial(F.linear, u, w2, zero))
        rows.append(row)
        print("residual_gemm", row, flush=True)
    RESULTS["residual_gemms"] = rows


def mergers():
    """Main + 3 deepstack mergers at the 8B shape: each module in turn vs all four grouped into two
    batched GEMMs over stacked weights (measured; not adopted, see RESULTS.md)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

    from app.checkpoints.model_builder import load_preset

    cfg = AutoConfig.for_model(**load_preset("qwen3-vl-8b")).vision_config
    mods = [Qwen3VLVisionPatchMerger(cfg, use_postshuffle_norm=i > 0).to(DEV, BF)
            for i in range(1 + len(cfg.deepstack_visual_indexes))]
    w1, b1, w2, b2 = (torch.stack([getattr(getattr(m, lin), p) for m in mods])
                      for lin, p in itertools.product(("linear_fc1", "linear_fc2"), ("weight", "bias")))

    def grouped(xs):
        h = torch.stack([m.norm(x.view(-1, m.hidden_size) if m.use_postshuffle_norm else x).view(-1, m.hidden_size)
                         for m, x in zip(mods, xs)])
        u = mods[0].act_fn(torch.baddbmm(b1.unsqueeze(1), h, w1.transpose(1, 2)))
        return torch.baddbmm(b2.unsqueeze(1), u, w2.transpose(1, 2))

    rows = []
    for tokens in (784, 3136, 4096):
        xs = [torch.randn(tokens, cfg.hidden_size, device=DEV, dtype=BF) for _ in mods]
        with torch.inference_mode():
            err = rel(grouped(xs), torch.stack([m(x) for m, x in zip(mods, xs)]))
            row = {"tokens": tokens, "err": err,
                   "one_by_one_us": graph_us(lambda xs=xs: [m(x) for m, x in zip(mods, xs)], inner=5),
                   "grouped_us": graph_us(partial(grouped, xs), inner=5)}
        rows.append(row)
        print("mergers", row, flush=True)
    RESULTS["mergers"] = rows


def record_missing(key: str, e: Exception) -> None:
    """An optional package's probe that could not run: why, in the results."""
    RESULTS[key] = f"not importable: {e}"
    print(key, RESULTS[key], flush=True)


def cudnn_dense_us(qb, kb, vb) -> float:
    """cuDNN's dense attention over [B, L, H, D] inputs, the baseline the optional kernels must beat."""
    qd, kd, vd = (t.transpose(1, 2) for t in (qb, kb, vb))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return graph_us(partial(F.scaled_dot_product_attention, qd, kd, vd))


def triton_varlen_us(q, k, v, seqs, slots) -> float:
    """Our Triton varlen kernel with the block size the tower picks, padded to `slots` as in graphs."""
    bm = attention.block_m_for(seqs[0] if len(set(seqs)) == 1 else None)
    tab = attention.block_table(seqs, attention.table_rows(sum(seqs), slots, bm), bm).to(DEV)
    return graph_us(partial(attention.varlen_attention, q, k, v, tab, bm))


def fa4_attention():
    """FlashAttention-4 (CuTe DSL) at the attention cases: varlen as the graphs would call it, and dense
    (batch, length) for equal lengths; error against per-sequence fp32 attention; can it be captured?"""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - recorded: the package is optional
        return record_missing("fa4", e)
    rows = []
    for name, (seqs, slots) in CASES.items():
        q, k, v, ref, cu, maxlen = case_inputs(seqs, slots)
        q, k, v = (t.contiguous() for t in (q, k, v))  # the tower's q and k are contiguous (rotary output)
        row = {"case": name}

        def varlen(q=q, k=k, v=v, cu=cu, maxlen=maxlen):
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen,
                                          max_seqlen_k=maxlen)[0]

        qkv = torch.stack((q, k, v), 1)  # v as the tower has it: a strided view into the qkv rows
        for label, fn in [("varlen", varlen), ("varlen_strided_v", partial(varlen, q, k, qkv[:, 2]))]:
            t0 = time.perf_counter()  # the first call compiles (once per kernel variant)
            row[f"{label}_err"] = attempt(err_after, fn, ref)
            row[f"{label}_first_s"] = round(time.perf_counter() - t0, 2)
            row[f"{label}_us"] = attempt(graph_us, fn)
        if slots == len(seqs) and len(set(seqs)) == 1:
            qb, kb, vb = (t.reshape(len(seqs), seqs[0], HEADS, HD) for t in (q, k, v))
            dense = partial(lambda a, b, c: flash_attn_func(a, b, c)[0].reshape(-1, HEADS, HD), qb, kb, vb)
            t0 = time.perf_counter()
            row["dense_err"] = attempt(err_after, dense, ref)
            row["dense_first_s"] = round(time.perf_counter() - t0, 2)
            row["dense_us"] = attempt(graph_us, dense)
            vs = qkv[:, 2].reshape(len(seqs), seqs[0], HEADS, HD)  # v strided, as the tower's dense path passes it
            row["dense_strided_v_us"] = attempt(graph_us, partial(lambda a, b, c: flash_attn_func(a, b, c)[0], qb, kb, vs))
            row["cudnn_dense_us"] = attempt(cudnn_dense_us, qb, kb, vb)
        row["triton_us"] = attempt(triton_varlen_us, q, k, v, seqs, slots)
        rows.append(row)
        print("fa4", row, flush=True)
    RESULTS["fa4"] = rows


def fa3_call(q, k, v, cu=None, maxlen=None):
    """FlashAttention-3's forward (the `fa3-fwd` wheel's op, called directly: its Python wrapper reads a
    config module under another name), dense [B, L, H, D] or varlen [N, H, D] with `cu`."""
    out = torch.ops.fa3_fwd.fwd(q, k, v, None, None, None, None, cu, cu, None, None, None, maxlen, maxlen,
                                None, None, None, None, None, None, None, None, None, q.shape[-1] ** -0.5,
                                False, -1, -1, 0, 0.0, True, None, 1, None, 0)
    return out[0]


def fa3_attention():
    """FlashAttention-3's Hopper forward (a prebuilt forward-only wheel, `fa3-fwd`) at the attention cases,
    as fa4_attention: varlen and dense, error against per-sequence fp32 attention, time from graphs."""
    try:
        import fa3_fwd._C  # noqa: F401 - registers torch.ops.fa3_fwd
    except Exception as e:  # noqa: BLE001 - recorded: the package is optional
        return record_missing("fa3", e)
    rows = []
    for name, (seqs, slots) in CASES.items():
        q, k, v, ref, cu, maxlen = case_inputs(seqs, slots)
        row = {"case": name}
        qkv_v = v  # a strided view into the qkv rows, as the tower passes it
        q, k, v = (t.contiguous() for t in (q, k, v))
        for label, vv in [("varlen", v), ("varlen_strided_v", qkv_v)]:
            fn = partial(fa3_call, q, k, vv, cu, maxlen)
            row[f"{label}_err"] = attempt(err_after, fn, ref)
            row[f"{label}_us"] = attempt(graph_us, fn)
        if slots == len(seqs) and len(set(seqs)) == 1:
            qb, kb, vb = (t.reshape(len(seqs), seqs[0], HEADS, HD) for t in (q, k, v))
            dense = partial(lambda a, b, c: fa3_call(a, b, c).reshape(-1, HEADS, HD), qb, kb, vb)
            row["dense_err"] = attempt(err_after, dense, ref)
            row["dense_us"] = attempt(graph_us, dense)
            row["cudnn_dense_us"] = attempt(cudnn_dense_us, qb, kb, vb)
        row["triton_us"] = attempt(triton_varlen_us, q, k, v, seqs, slots)
        row["fa2_varlen_us"] = attempt(graph_us, partial(varlen_attn, q, k, v, cu, cu, maxlen, maxlen))
        rows.append(row)
        print("fa3", row, flush=True)
    RESULTS["fa3"] = rows


def quack_gemms():
    """QuACK's SM90 GEMMs (CuTe DSL) at the layer's four GEMMs, a few tile configs, against cuBLAS."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_act, gemm_tuned
        gemm_pinned = gemm_tuned.fn  # the function under the autotuner: runs the config it is given
    except Exception as e:  # noqa: BLE001 - recorded: the package is optional
        return record_missing("quack", e)
    configs = {"128x128 pp c1x2": GemmConfig(128, 128, pingpong=True, is_dynamic_persistent=False, cluster_m=1,
                                            cluster_n=2),
               "128x192 pp c2x1": GemmConfig(128, 192, pingpong=True, is_dynamic_persistent=False, cluster_m=2),
               "192x128 pp c2x1": GemmConfig(192, 128, pingpong=True, is_dynamic_persistent=False, cluster_m=2),
               "256x128 coop c2x1": GemmConfig(256, 128, pingpong=False, is_dynamic_persistent=False, cluster_m=2)}
    d, rows = 1152, []
    for m in (784, 3136, 4096):
        x = torch.randn(m, d, device=DEV, dtype=BF)
        u = torch.randn(m, 4304, device=DEV, dtype=BF)
        shapes = {"qkv": (x, torch.randn(3456, d, device=DEV, dtype=BF) * 0.03, torch.randn(3456, device=DEV, dtype=BF)),
                  "proj": (x, torch.randn(d, d, device=DEV, dtype=BF) * 0.03, None),
                  "fc1_gelu": (x, torch.randn(4304, d, device=DEV, dtype=BF) * 0.03,
                               torch.randn(4304, device=DEV, dtype=BF)),
                  "fc2": (u, torch.randn(d, 4304, device=DEV, dtype=BF) * 0.02, None)}
        for gname, (a, w, b) in shapes.items():
            row = {"tokens": m, "gemm": gname}
            if gname == "fc1_gelu":
                ref_fn = partial(torch._addmm_activation, b, a, w.t(), use_gelu=True)
            else:
                ref_fn = partial(F.linear, a, w, b)
            ref = ref_fn()
            row["cublas_us"] = graph_us(ref_fn)
            out = torch.empty(m, w.shape[0], device=DEV, dtype=BF)
            for cname, cfg in configs.items():
                if gname == "fc1_gelu":
                    fn = partial(gemm_act, a, w.t(), bias=b, activation="gelu_tanh_approx", postact_out=out,
                                 store_preact=False, config=cfg)
                else:
                    fn = partial(gemm_pinned, a, w.t(), out, bias=b, config=cfg)
                row[f"{cname}_err"] = attempt(err_after, fn, ref.float(), out)
                row[f"{cname}_us"] = attempt(graph_us, fn)
            rows.append(row)
            print("quack", row, flush=True)
    RESULTS["quack"] = rows


def main():
    RESULTS["device"] = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    RESULTS["heads"] = [HEADS, HD]
    print(RESULTS["device"], flush=True)
    steps = {f.__name__: f for f in (sdpa_by_head_dim, attention_cases, gemms, mergers, residual_gemms, fa4_attention,
                                      quack_gemms, fa3_attention)}
    out = Path(os.environ.get("OUT", ".")) / ("kernels.json" if HD == 72 else f"kernels_hd{HD}.json")
    for step in [steps[a] for a in sys.argv[1:]] or list(steps.values())[:5]:
        step()
        out.write_text(json.dumps(RESULTS, indent=1))  # after each step: a later one may run out of time


if __name__ == "__main__":
    main()
