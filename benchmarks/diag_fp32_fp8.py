"""Diagnostic (twenty-third session): fp32 x, FP8 weights, several rows: which of
linear_triton and linear_residual_triton is off (tests/test_ops_norm_stats.py on the GPU)."""
import torch

from fuser.ops.fp8 import dequantize, quantize_weight
from fuser.ops.linear import linear_triton
from fuser.ops.norm_stats import linear_residual_triton

for M in (2, 5):
    for blocks in ({}, dict(block_n=64, block_k=32)):
        g = torch.Generator().manual_seed(M)
        a = torch.randn(1, M, 96, generator=g)
        r = torch.randn(1, M, 200, generator=g)
        nw = 1 + 0.2 * torch.randn(200, generator=g)
        q, s = quantize_weight(torch.randn(200, 96, generator=g).float() / 96 ** 0.5 * 3)
        ref = (a.double() @ dequantize(q, s).double().T)
        d = [t.cuda() for t in (a, r, nw, q, s)]
        y = linear_triton(d[0], d[3], weight_scale=d[4], **blocks).cpu()
        summed, gh, sq = linear_residual_triton(d[0], d[3], d[1], d[2], weight_scale=d[4],
                                                **blocks)
        s_ref = (ref + r.double())
        print(M, blocks, "linear err", (y.double() - ref).abs().max().item(),
              "residual err", (summed.cpu().double() - s_ref).abs().max().item())
