"""Which scaled-dot-product-attention kernels the tower and the LLM let PyTorch choose from.

cuDNN's attention is the fastest on Hopper at these head sizes, but it builds a slow execution plan
for every new shape (benchmarks/results/2026-11-21-serving-under-load-graphs-on-off.md). A CUDA
graph's shape is fixed, so its plan is built once, at capture. Uncaptured forwards (the tower's eager
batches) see new shapes all the time, so they leave cuDNN out. (The LLM engine calls no SDPA: it runs
its own paged-attention kernel.)
"""

from __future__ import annotations

from torch.nn.attention import SDPBackend

CAPTURED = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
UNCAPTURED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
