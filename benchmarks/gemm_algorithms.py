"""Could another GEMM kernel speed up the towers? Every algorithm cuBLASLt's heuristic offers, timed, against
what the towers call today (PyTorch's F.linear / addmm with a GELU epilogue), and inductor's max-autotune
(Triton templates against ATen) at 1024 rows. Shapes: MiniCPM-V's SigLIP layers and resampler.

cuBLASLt is called through ctypes (the library PyTorch already loaded): y = act(x @ W.T + b) in bf16 with
float32 accumulation, column-major as PyTorch sends it (W transposed). Each candidate runs 27 times over 27
weight copies inside one CUDA graph, as a tower reads its layers from HBM; µs per GEMM, median of 15 replays.

    python3 benchmarks/gemm_algorithms.py          # writes $OUT/gemm_probe.json and gemm_inductor.json
    INDUCTOR=0 python3 benchmarks/gemm_algorithms.py   # cuBLASLt only
"""
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.gpu.kernel_timing import graph_us as _graph_us  # noqa: E402

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, BIAS_DATA_TYPE = 3, 4, 7, 8, 26
OP_N, OP_T = 0, 1
EPI_DEFAULT, EPI_BIAS, EPI_GELU_BIAS = 1, 4, 36
PREF_MAX_WORKSPACE = 1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lib():
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.nn.functional.linear(torch.ones(8, 8, device="cuda", dtype=torch.bfloat16),
                               torch.ones(8, 8, device="cuda", dtype=torch.bfloat16),
                               torch.ones(8, device="cuda", dtype=torch.bfloat16))
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcublasLt" in ln})
    return ctypes.CDLL(paths[0]), paths[0]


LIB, LIB_PATH = None, None  # loaded on first use, after PyTorch has loaded it


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


class Plan:
    """One GEMM shape: x [M, K] bf16, W [N, K] bf16, optional bias [N]; out [M, N] bf16."""

    def __init__(self, M, N, K, epilogue, workspace_bytes=32 << 20):
        global LIB, LIB_PATH
        if LIB is None:
            LIB, LIB_PATH = _lib()
        self.M, self.N, self.K, self.epi = M, N, K, epilogue
        vp = ctypes.c_void_p
        self.handle = vp()
        check(LIB.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = vp()
        check(LIB.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, val in ((TRANSA, OP_T), (TRANSB, OP_N)):
            v = ctypes.c_int32(val)
            check(LIB.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "trans")
        e = ctypes.c_uint32(epilogue)
        check(LIB.cublasLtMatmulDescSetAttribute(self.desc, EPILOGUE, ctypes.byref(e), 4), "epi")
        if epilogue != EPI_DEFAULT:
            t = ctypes.c_int32(R_16BF)
            check(LIB.cublasLtMatmulDescSetAttribute(self.desc, BIAS_DATA_TYPE, ctypes.byref(t), 4), "bias type")
        self.a, self.b, self.c = vp(), vp(), vp()
        check(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), R_16BF, ctypes.c_uint64(K), ctypes.c_uint64(N),
                                          ctypes.c_int64(K)), "A")
        check(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), R_16BF, ctypes.c_uint64(K), ctypes.c_uint64(M),
                                          ctypes.c_int64(K)), "B")
        check(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), R_16BF, ctypes.c_uint64(N), ctypes.c_uint64(M),
                                          ctypes.c_int64(N)), "C")
        self.ws = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.pref = vp()
        check(LIB.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "pref")
        w = ctypes.c_uint64(workspace_bytes)
        check(LIB.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE, ctypes.byref(w), 8), "pref ws")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algos(self, n=64):
        res = (Heuristic * n)()
        got = ctypes.c_int(0)
        check(LIB.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, self.pref,
                                              n, res, ctypes.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def run(self, h: Heuristic, x, w, bias, out):
        if self.epi != EPI_DEFAULT:
            p = ctypes.c_void_p(bias.data_ptr())
            check(LIB.cublasLtMatmulDescSetAttribute(self.desc, BIAS_POINTER, ctypes.byref(p), 8), "bias ptr")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(LIB.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
                              ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta),
                              ctypes.c_void_p(out.data_ptr()), self.c, ctypes.c_void_p(out.data_ptr()), self.c,
                              ctypes.byref(h.algo), ctypes.c_void_p(self.ws.data_ptr()),
                              ctypes.c_size_t(self.ws.numel()), stream), "matmul")
        return out


OUT = os.environ.get("OUT", "/tmp")
BF = torch.bfloat16
L = 27  # layers: rotate weights as the tower reads them from HBM


def graph_us(fn):
    return _graph_us(fn, runs=15)


# name: (N, K, epilogue)
GEMMS = {
    "qkv": (3456, 1152, EPI_BIAS),
    "out": (1152, 1152, EPI_DEFAULT),
    "fc1_gelu": (4352, 1152, EPI_GELU_BIAS),
    "fc2": (1152, 4352, EPI_DEFAULT),
    "res_kv": (4096, 1152, EPI_DEFAULT),
    "res_inproj": (4096, 4096, EPI_BIAS),
}


def torch_call(name, x, w, b, out):
    if name == "fc1_gelu":
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    if EPI_BIAS == GEMMS[name][2]:
        return F.linear(x, w, b)
    return F.linear(x, w)


def probe(M, name, results):
    N, K, epi = GEMMS[name]
    layers = 1 if name.startswith("res_") and M > 1024 else L  # the resampler runs once per image
    xs = torch.randn(M, K, dtype=BF, device="cuda")
    ws = [torch.randn(N, K, dtype=BF, device="cuda") * 0.03 for _ in range(layers)]
    bs = [torch.randn(N, dtype=BF, device="cuda") for _ in range(layers)]
    out = torch.empty(M, N, dtype=BF, device="cuda")
    row = {"M": M, "gemm": name, "N": N, "K": K, "gflop": 2 * M * N * K / 1e9}
    ref = torch_call(name, xs, ws[0], bs[0], out).float()

    def loop(call):
        def f():
            for w, b in zip(ws, bs):
                call(xs, w, b)
        return f

    row["torch_us"] = graph_us(loop(lambda x, w, b: torch_call(name, x, w, b, None))) / layers
    if epi == EPI_DEFAULT:
        row["torch_zero_bias_us"] = graph_us(loop(lambda x, w, b: F.linear(x, w, torch.zeros_like(b)))) / layers
    plan = Plan(M, N, K, epi)
    cands = plan.algos(64)
    times = []
    for i, h in enumerate(cands):
        try:
            o = plan.run(h, xs, ws[0], bs[0], out).float()
            torch.cuda.synchronize()
            err = ((o - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                times.append((i, None, f"err {err:.2e}"))
                continue
            t = graph_us(loop(lambda x, w, b, h=h: plan.run(h, x, w, b, out))) / layers
            times.append((i, t, f"ws {h.workspace} waves {h.waves:.2f}"))
        except Exception as e:  # noqa: BLE001
            times.append((i, None, repr(e)[:80]))
    ok = [t for t in times if t[1] is not None]
    row["lt_algos"] = len(cands)
    row["lt_first_us"] = ok[0][1] if ok and ok[0][0] == 0 else None
    best = min(ok, key=lambda t: t[1]) if ok else None
    row["lt_best_us"], row["lt_best_index"] = (best[1], best[0]) if best else (None, None)
    row["lt_all"] = times
    base = row["torch_us"]
    row["best_vs_torch"] = round(base / row["lt_best_us"], 3) if best else None
    row["tflops_torch"] = round(row["gflop"] / base * 1e3, 1)
    print(f"M={M:5d} {name:10s} torch {base:7.2f} us ({row['tflops_torch']} TF/s)  "
          f"lt first {row['lt_first_us'] or float('nan'):7.2f}  lt best {row['lt_best_us'] or float('nan'):7.2f} "
          f"(#{row['lt_best_index']} of {len(cands)})  x{row['best_vs_torch']}", flush=True)
    results.append(row)


def inductor(M, results):
    import torch._inductor.config as icfg
    icfg.max_autotune = True
    icfg.max_autotune_gemm_backends = "ATEN,TRITON"
    for name in ("qkv", "out", "fc1_gelu", "fc2"):
        N, K, epi = GEMMS[name]
        xs = torch.randn(M, K, dtype=BF, device="cuda")
        ws = [torch.randn(N, K, dtype=BF, device="cuda") * 0.03 for _ in range(L)]
        bs = [torch.randn(N, dtype=BF, device="cuda") for _ in range(L)]
        if name == "fc1_gelu":
            def fn(x, w, b):
                return F.gelu(F.linear(x, w, b), approximate="tanh")
        elif epi == EPI_BIAS:
            def fn(x, w, b):
                return F.linear(x, w, b)
        else:
            def fn(x, w, b):
                return F.linear(x, w)
        t0 = time.time()
        cfn = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
        cfn(xs, ws[0], bs[0])
        torch.cuda.synchronize()
        compile_s = time.time() - t0

        def f(cfn=cfn, xs=xs, ws=ws, bs=bs):
            for w, b in zip(ws, bs):
                cfn(xs, w, b)
        t = graph_us(f) / L
        print(f"inductor M={M} {name}: {t:.2f} us (compile {compile_s:.0f} s)", flush=True)
        results.append({"M": M, "gemm": name, "inductor_us": t, "compile_s": compile_s})


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results = []
    for M in (1024, 784, 4096):
        for name in GEMMS:
            probe(M, name, results)
    print("lib", LIB_PATH)
    with open(f"{OUT}/gemm_probe.json", "w") as f:
        json.dump(results, f, indent=1)
    if os.environ.get("INDUCTOR", "1") == "1":
        ind = []
        try:
            inductor(1024, ind)
        except Exception as e:  # noqa: BLE001
            print("inductor failed", repr(e)[:400])
        with open(f"{OUT}/gemm_inductor.json", "w") as f:
            json.dump(ind, f, indent=1)


if __name__ == "__main__":
    main()
