"""app/llm/skinny.py: one- and two-row linear layers as Triton matrix-vector products (llm.skinny_gemm).
The engine-level check (greedy answers equal transformers' with the option on, in graphs) is in
test_llm_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.llm import skinny


def test_off_the_gpu_or_past_two_rows_it_is_f_linear_exactly():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 40, generator=g)
        assert torch.equal(skinny.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(skinny.linear(x, w, None, enabled=False), F.linear(x, w))


def test_small_layers_get_narrower_tiles_so_they_still_spread_over_the_gpu():
    assert skinny._block_n(5120) == 8 and skinny._block_n(2048) == 8  # 640 and 256 programs
    assert skinny._block_n(768) == 4 and skinny._block_n(128) == 2  # the MoE router: 64 programs of 2 rows


def test_the_config_reaches_the_model(tiny_checkpoint):
    from app.llm.engine import Engine

    eng = Engine(str(tiny_checkpoint), max_model_len=256, num_kv_blocks=64, skinny_gemm=True)
    try:
        assert eng.model.skinny is True
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k,bias", [(5120, 2048, True), (2048, 4096, False), (128, 2048, False), (37, 300, True)])
def test_matrix_vector_kernel_equals_f_linear(rows, n, k, bias):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) if bias else None
    wide = torch.randn(rows, k + 8, generator=g, device="cuda").to(torch.bfloat16)
    for x in (wide[:, :k].contiguous(), wide[:, 8:]):  # contiguous, and a column slice (row stride k + 8)
        got = skinny.linear(x, w, b)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # float32 accumulation, rounded once to bf16: within one bf16 rounding of the exact product
        assert ((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()
    x32 = wide[:, :k].float()  # float32 in, float32 out: against a float64 product (F.linear may use TF32)
    exact = F.linear(x32.double(), w.double()).float()
    assert torch.allclose(skinny.linear(x32, w.float()), exact, rtol=1e-4, atol=1e-4)
