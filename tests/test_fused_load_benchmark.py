"""benchmarks/fused_load.py on the CPU with the tiny model, so the GPU ceiling benchmark cannot rot
between GPU runs: every stage runs, and every request it times really generated its tokens."""

from __future__ import annotations

import json

from benchmarks.fused_load import kind_of, main


def test_every_stage_runs_and_every_request_generates_its_tokens(tmp_path, model_cache):
    out = tmp_path / "fused_load.json"
    res = main(["serve_config.yaml", "--image-size", "64", "--concurrency", "1", "3", "--requests", "6",
                "--distinct", "3", "--app-args", json.dumps({"cache_dir": model_cache}), "--out", str(out)])
    assert json.loads(out.read_text()) == res
    runs = [(r["stage"], r["concurrency"]) for r in res["runs"]]
    assert runs == [(s, c) for c in (1, 3) for s in ("tower", "llm", "fused")]
    for r in res["runs"]:
        assert r["requests"] == (6 if r["concurrency"] == 1 else 9) and r["req_s"] > 0
        if r["stage"] == "tower":
            assert r["completion_tokens"] == 0 and not r["ttft_ms"]
        else:  # 16 output tokens each (ignore_eos), and a first token before the last
            assert r["completion_tokens"] == 16 * r["requests"]
            assert 0 < r["ttft_ms"]["p50"] <= r["latency_ms"]["p50"]


def test_kernels_are_summed_by_the_right_kind():
    # names as torch's profiler reported them on the H200 (FlashAttention's carry cutlass templates)
    names = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
        "cutlass::bfloat16_t>>": "attention",
        "_varlen_fwd": "attention",
        "_paged_attention_kernel": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8": "gemm",
        "_add_rmsnorm_kernel": "norm",
        "Memcpy HtoD (Pageable -> Device)": "copy",
        "_silu_mul_kernel": "activation",
        "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<float>>": "other elementwise",
    }
    assert {n: kind_of(n) for n in names} == names
