"""The decode GEMV over FP8 weights: fuser::fp8_linear and fuser::fp8_gated_linear.

    fp8_linear(x, w_fp8, w_scale) = (x @ w_fp8.T) * w_scale
        x: [..., K] (bf16/fp16/fp32), w_fp8: [N, K] e4m3fn, w_scale: [N] fp32 -> [..., N], x's dtype

FuserConfig(precision="fp8"): fuser/ops/linear.py's kernel reads the e4m3fn weight (half the
bytes) with one fp32 scale per output channel (fuser/ops/fp8.py). Each weight tile is
dequantized in registers (exactly: to fp32 on the CUDA-core path, to x's bf16/fp16 for the
MMA), the sum runs in fp32, and the scale multiplies each output once after the K loop, before
the one rounding to x's dtype. The activations are not quantized on this path. Its tiles are
fuser/ops/gemv_tables.py's _default_fp8_config.

Several bf16 rows (verification): the MMA runs in fp16 with x scaled by a running power of two
per row (fuser/ops/gemv_rows.py _f16_step: bf16's x exact, the products the bf16 MMA's), or, for
rows longer than SPLIT_PIECES_MIN_K, on the FP8 MMA over x split exactly into two e4m3 pieces
by a kernel of their own (fuser/ops/e4m3_pieces.py). The GEMVs after a norm get their pieces
from the norm kernel (fuser/ops/norm_linear.py).

Gated (fuser::fp8_gated_linear): as fuser::gated_linear (fuser/ops/linear.py) over a merged
e4m3fn gate/up weight [2I, K] and its one scale vector.

Cost: as fuser::linear with s_w = 1, plus 4N bytes of scales and M * N scale multiplies.
"""

import torch
from torch import Tensor

from fuser.ops.e4m3_pieces import split_pieces_triton
from fuser.ops.fp8 import fp8_linear_reference
from fuser.ops.gated_act import gated_act_reference
from fuser.ops.gemv_tables import MAX_ROWS, _row_count
from fuser.ops.linear import check_gated, linear_pieces_triton, linear_triton


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU (and any other device) runs the reference, CUDA runs the Triton kernel.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    """x [..., K] (bf16/fp16/fp32), w_fp8 [N, K] e4m3fn, w_scale [N] fp32 -> [..., N], x's dtype."""
    return fp8_linear_reference(x, w_fp8, w_scale)


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], w_fp8.shape[0]))


# fuser::fp8_linear splits several bf16 rows longer than this (down_proj's 14336 at the 8B
# shape) into e4m3 pieces before its GEMV. On an H200 at 5 rows the split kernel and the pieces
# GEMV took down_proj 23.96 us against 25.42 on the fp16 MMA, o_proj (K = 4096) 11.51 against
# 11.45: the split kernel's ~2 us launch eats a short row's gain.
SPLIT_PIECES_MIN_K = 8192


def _split_pieces_take(x: Tensor) -> bool:
    """Whether fuser::fp8_linear splits its rows into e4m3 pieces before the GEMV: 2..16
    bf16 rows of more than SPLIT_PIECES_MIN_K values."""
    rows = _row_count(x)
    return (x.dtype == torch.bfloat16 and 1 < rows <= MAX_ROWS
            and x.shape[-1] > SPLIT_PIECES_MIN_K)


def _fp8_linear_cuda(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    # Above MAX_ROWS this is not a decode shape; prefill quantizes its activations and calls
    # fuser::fp8_scaled_mm instead (fuser/ops/fp8_quant.py), so this fallback is the
    # reference's fp32 GEMM: correct, not fast.
    if _row_count(x) > MAX_ROWS:
        return fp8_linear_reference(x, w_fp8, w_scale)
    if _split_pieces_take(x):
        out = linear_pieces_triton(*split_pieces_triton(x), w_fp8, w_scale, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return linear_triton(x, w_fp8, weight_scale=w_scale)


fp8_linear.register_kernel("cuda")(_fp8_linear_cuda)


@torch.library.custom_op("fuser::fp8_gated_linear", mutates_args=())
def fp8_gated_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    """x [..., K], w_fp8 [2I, K] e4m3fn (gate rows, then up rows), w_scale [2I] fp32
    -> act(gate) * up [..., I] in x's dtype."""
    return fp8_gated_linear_reference(x, w_fp8, w_scale, activation)


@fp8_gated_linear.register_fake
def _fp8_gated_linear_fake(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    check_gated(w_fp8, activation)
    return x.new_empty((*x.shape[:-1], w_fp8.shape[0] // 2))


def _fp8_gated_linear_cuda(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    if _row_count(x) > MAX_ROWS:  # not a decode shape: see _fp8_linear_cuda
        return fp8_gated_linear_reference(x, w_fp8, w_scale, activation)
    return linear_triton(x, w_fp8, weight_scale=w_scale, activation=activation)


fp8_gated_linear.register_kernel("cuda")(_fp8_gated_linear_cuda)


# ---------------------------------------------------------------------------------------------
# Reference (fuser::fp8_linear's is fuser/ops/fp8.py's fp8_linear_reference)
# ---------------------------------------------------------------------------------------------


def fp8_gated_linear_reference(x: Tensor, w_fp8: Tensor, w_scale: Tensor,
                               activation: str) -> Tensor:
    """gated_act(fp8_linear(x, w_fp8, w_scale)): each half's scale applied to its own rows
    (the one per-channel scale vector of the merged matrix), rounded to x's dtype, then
    act(gate) * up."""
    check_gated(w_fp8, activation)
    return gated_act_reference(fp8_linear_reference(x, w_fp8, w_scale), activation).contiguous()
