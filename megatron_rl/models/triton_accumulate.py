"""One Triton kernel: add an [E, N, K] gradient (bf16 or fp32) into E fp32 rows of a flat buffer at
arbitrary offsets (megatron-core DDP's `main_grad`s of one expert projection, wherever the buffer
lays them out: reversed, padded, split over buckets). Imported only where triton is (CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _accumulate_rows(main_ptr, grad_ptr, offsets_ptr, NK, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < NK
    g = tl.load(grad_ptr + e * NK + cols, mask=mask, other=0.0).to(tl.float32)
    dst = main_ptr + tl.load(offsets_ptr + e) + cols
    tl.store(dst, tl.load(dst, mask=mask, other=0.0) + g, mask=mask)


def accumulate_rows(flat: torch.Tensor, offsets: torch.Tensor, grad_ENK: torch.Tensor) -> None:
    """flat[offsets[e] : offsets[e] + N·K] += grad_ENK[e] for every e (flat fp32, contiguous;
    offsets int64 on flat's device; grad_ENK contiguous)."""
    E, NK = grad_ENK.shape[0], grad_ENK[0].numel()
    _accumulate_rows[(E, triton.cdiv(NK, BLOCK))](flat, grad_ENK, offsets, NK, BLOCK=BLOCK, num_warps=8)
