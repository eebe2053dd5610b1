"""FP8 prefill: activation quantization fused into the op that produces the activation, and the
FP8 x FP8 GEMM that consumes it.

    rms_norm_quant(x, w, eps)          = quantize_rows(rms_norm(x, w, eps))
    add_rms_norm_quant(x, r, w, eps)   = (*quantize_rows(rms_norm(s, w, eps)), s)     s = x + r
    gated_act_quant(gate_up, act)      = quantize_rows(gated_act(gate_up, act))
    quantize_rows(x)                   = fp8.quantize_rows over the last dimension
    fp8_scaled_mm(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
        = ((x_fp8 @ w_fp8.T) in fp32 * x_scale[:, None] * w_scale[None, :]).to(out_dtype)

quantize_rows (fuser/ops/fp8.py) is dynamic per-token quantization to float8 e4m3fn: one fp32
scale per row, max(amax, FP8_MIN_AMAX) / 448, and codes clamp(v / scale, +-448) rounded to
nearest even. Prefill runs many rows (M = B * T tokens); where an RMSNorm (q/k/v and gate/up
inputs) or the gated activation (down_proj's input) feeds an FP8 linear, quantizing in the same
pass saves writing the bf16 activation and reading it back, and the GEMM then runs on the FP8
tensor cores with rowwise scales (torch._scaled_mm).

The activation is first computed exactly as the unquantized op's kernel does (rmsnorm.py,
gated_act.py: fp32 math, rounded to the model dtype where those round), then quantized from that
model-dtype value, so each fused op gives the same bits as the unfused op followed by
quantize_rows. Divisions in the quantization are IEEE (div_rn), as PyTorch's are.

Triton implementation: one program per row (the scale needs the row's amax before any code is
written). A row up to MAX_SINGLE_PASS wide (MAX_SINGLE_PASS_AMAX for the gated act and
quantize_rows) stays in registers; a wider one is walked in blocks
and recomputed per pass (norm: sum of squares, amax, quantize; gated act: amax, quantize), which
reads it again instead of keeping an extra copy in memory.

Cost per row of width N (I for gated_act; s_* = element size in bytes, codes 1 byte, scale 4):
    rms_norm_quant:      bytes = N * (s_x + s_w + 1) + 4                 FLOPs ~ 6N (+ rsqrt)
    add_rms_norm_quant:  bytes = N * (s_x + s_r + s_w + s_sum + 1) + 4   FLOPs ~ 7N (+ rsqrt)
    gated_act_quant:     bytes = I * (2 s + 1) + 4                       FLOPs ~ 8I (one exp each)
  (a row wider than the single-pass limit is read 3 times by the norms, twice by the gated act)
    fp8_scaled_mm:       bytes = M K + N K + (M + N) 4 + M N s_out       FLOPs = 2 M N K
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_AMAX,
    fp8_scaled_mm_reference,
    quantize_rows,
)
from fuser.ops.gated_act import _check, act_times_up, gated_act_reference
from fuser.ops.rmsnorm import (
    MAX_SINGLE_PASS,
    _load_block,
    _num_warps,
    _rows,
    add_rms_norm_reference,
    rms_norm_reference,
)

# fp8.py's FP8_MAX (448.0) and FP8_MIN_AMAX (448 * 2^-126) appear in the kernels as literals,
# both exact in fp32: a global constexpr gives the kernels that read it a cache key that differs
# from process to process under Triton 3.6 (tests/test_engine_load_compiles_nothing.py checks
# that no kernel reads one; tests/test_ops_fp8.py holds the kernels to fp8.py).
# The widest row that gated_act_quant and quantize_rows keep in registers (one read of the row
# instead of two): 16384 covers Llama-3-8B's intermediate size (14336), whose FP8 prefill spent
# ~84 us per layer in two passes. An amax does not depend on the block order, so any block gives
# the same bits; the norms keep rmsnorm.py's MAX_SINGLE_PASS, which fixes their sums' order.
MAX_SINGLE_PASS_AMAX = 16384
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_scale(amax):
    """max(amax, FP8_MIN_AMAX) / FP8_MAX in fp32, correctly rounded (fp8.py's _row_scale)."""
    return tl.math.div_rn(tl.maximum(amax, 5.266214691683848e-36), 448.0)


@triton.jit
def _store_codes(y, scale, q_row, cols, mask):
    """Codes e4m3fn(clamp(y / scale, +-448)) of one block y (fp32) into q_row + cols."""
    v = tl.math.div_rn(y, scale)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_row + cols, v.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _normed_block(x_row, residual_row, summed_row, weight_ptr, rstd, cols, mask,
                  HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr,
                  in_dtype: tl.constexpr, out_dtype: tl.constexpr):
    """One block of rms_norm's output, rounded to out_dtype, in fp32 (0 where masked).

    The same operations as rmsnorm.py's kernel (_load_block, then _store_block's product):
    the normalised row rounded to in_dtype, times the weight in fp32, rounded to out_dtype.
    """
    h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, STORE_SUM)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (h * rstd).to(in_dtype).to(tl.float32) * w.to(tl.float32)
    return y.to(out_dtype).to(tl.float32)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,            # x: [rows, N], row stride x_row_stride, column stride 1
    residual_ptr,     # residual: [rows, N] like x (unused unless HAS_RESIDUAL)
    weight_ptr,       # weight: [N], contiguous
    q_ptr,            # codes: [rows, N] e4m3fn, contiguous
    scale_ptr,        # scale: [rows] fp32
    summed_ptr,       # summed: [rows, N], contiguous, promote(x, residual) (HAS_RESIDUAL)
    x_row_stride,
    residual_row_stride,
    N,
    eps,
    OUT_DTYPE: tl.constexpr,      # the norm's output dtype, promote(weight, in_dtype)
    BLOCK: tl.constexpr,          # power of two; >= N when SINGLE_PASS
    SINGLE_PASS: tl.constexpr,    # whole row in registers, else three passes over blocks
    HAS_RESIDUAL: tl.constexpr,
):
    # One program per row.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    q_row = q_ptr + row * N
    summed_row = summed_ptr + row * N
    if HAS_RESIDUAL:
        in_dtype = summed_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)  # as rmsnorm.py
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        y = ((h * rstd).to(in_dtype).to(tl.float32) * w.to(tl.float32)).to(OUT_DTYPE)
        y = y.to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(y), axis=0))
        _store_codes(y, scale, q_row, cols, mask)
    else:
        # Pass 1: sum of squares (and s written out); pass 2: amax of the normalised row;
        # pass 3: codes. Passes 2 and 3 recompute from the inputs (same bits as pass 1).
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, True)
            acc += h * h
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            y = _normed_block(x_row, residual_row, summed_row, weight_ptr, rstd, cols, mask,
                              HAS_RESIDUAL, False, in_dtype, OUT_DTYPE)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _row_scale(tl.max(amax, axis=0))
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            y = _normed_block(x_row, residual_row, summed_row, weight_ptr, rstd, cols, mask,
                              HAS_RESIDUAL, False, in_dtype, OUT_DTYPE)
            _store_codes(y, scale, q_row, cols, mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _gated_block(gate_row, cols, mask, I, ACTIVATION: tl.constexpr, out_dtype: tl.constexpr):
    """One block of act(gate) * up, rounded as gated_act.py's kernel rounds it, in fp32; with
    ACTIVATION "" the row's own values (quantize_rows)."""
    if ACTIVATION == "":
        return tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    return act_times_up(g, u, ACTIVATION, out_dtype).to(out_dtype).to(tl.float32)


@triton.jit
def _gated_act_quant_kernel(
    gate_up_ptr,      # gate_up: [rows, 2I] (x: [rows, I] when ACTIVATION is ""), row stride
                      # row_stride, column stride 1
    q_ptr,            # codes: [rows, I] e4m3fn, contiguous
    scale_ptr,        # scale: [rows] fp32
    row_stride,
    I,
    ACTIVATION: tl.constexpr,     # one of gated_act.ACTIVATIONS, or "": quantize the rows as
                                  # they are (fuser::quantize_rows)
    BLOCK: tl.constexpr,          # power of two; >= I when SINGLE_PASS
    SINGLE_PASS: tl.constexpr,    # whole row in registers, else two passes over blocks
):
    # One program per row: amax, then the codes.
    row = tl.program_id(0).to(tl.int64)
    gate_row = gate_up_ptr + row * row_stride
    q_row = q_ptr + row * I
    out_dtype = gate_up_ptr.dtype.element_ty
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        y = _gated_block(gate_row, cols, mask, I, ACTIVATION, out_dtype)
        scale = _row_scale(tl.max(tl.abs(y), axis=0))
        _store_codes(y, scale, q_row, cols, mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, I, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < I
            amax = tl.maximum(amax, tl.abs(_gated_block(gate_row, cols, mask, I, ACTIVATION,
                                                        out_dtype)))
        scale = _row_scale(tl.max(amax, axis=0))
        for start in range(0, I, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < I
            y = _gated_block(gate_row, cols, mask, I, ACTIVATION, out_dtype)
            _store_codes(y, scale, q_row, cols, mask)
    tl.store(scale_ptr + row, scale)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _launch_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                 block: int | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """-> (codes [..., N] e4m3fn, scale [...] fp32, x + residual or None)."""
    n = x.shape[-1]
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} does not match width {n}"
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                             device=x.device)
        in_dtype = summed.dtype
    else:
        summed, in_dtype = None, x.dtype
    out_dtype = torch.promote_types(weight.dtype, in_dtype)
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if codes.numel() == 0:  # no rows, or empty rows (scale of an empty row: the floor)
        scale.fill_(FP8_MIN_AMAX / FP8_MAX)
        if summed is not None:
            torch.add(x, residual, out=summed)
        return codes, scale, summed

    x2 = _rows(x, n)                                           # [rows, N]
    r2 = _rows(residual, n) if residual is not None else x2    # [rows, N]
    block = block or min(triton.next_power_of_2(n), MAX_SINGLE_PASS)
    _rms_norm_quant_kernel[(x2.shape[0],)](
        x2, r2, weight.contiguous(), codes, scale, summed if summed is not None else codes,
        x2.stride(0), r2.stride(0), n, eps,
        OUT_DTYPE=_TL_DTYPE[out_dtype], BLOCK=block, SINGLE_PASS=n <= block,
        HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
    )
    return codes, scale, summed


def rms_norm_quant_triton(x: Tensor, weight: Tensor, eps: float, *,
                          block: int | None = None) -> tuple[Tensor, Tensor]:
    """x: [..., N], weight: [N] -> (codes [..., N] e4m3fn, scale [...] fp32).

    block (a power of two) overrides the row block; narrower than N it forces the multi-pass
    path (tests)."""
    codes, scale, _ = _launch_norm(x, None, weight, eps, block)
    return codes, scale


def add_rms_norm_quant_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *,
                              block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [..., N], weight: [N] -> (codes, scale [...], x + residual [..., N])."""
    codes, scale, summed = _launch_norm(x, residual, weight, eps, block)
    return codes, scale, summed


def gated_act_quant_triton(gate_up: Tensor, activation: str, *,
                           block: int | None = None) -> tuple[Tensor, Tensor]:
    """gate_up: [..., 2I] -> (codes [..., I] e4m3fn, scale [...] fp32)."""
    _check(gate_up, activation)
    two_i = gate_up.shape[-1]
    I = two_i // 2
    codes = torch.empty((*gate_up.shape[:-1], I), dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=gate_up.device)
    if codes.numel() == 0:
        scale.fill_(FP8_MIN_AMAX / FP8_MAX)
        return codes, scale
    rows = _rows(gate_up, two_i)                                # [rows, 2I]
    block = block or min(triton.next_power_of_2(I), MAX_SINGLE_PASS_AMAX)
    _gated_act_quant_kernel[(rows.shape[0],)](
        rows, codes, scale, rows.stride(0), I,
        ACTIVATION=activation, BLOCK=block, SINGLE_PASS=I <= block,
        num_warps=_num_warps(block),
    )
    return codes, scale


def quantize_rows_triton(x: Tensor, *, block: int | None = None) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (codes [..., K] e4m3fn, scale [...] fp32): fp8.py's quantize_rows over the
    last dimension in one kernel (gated_act_quant's, with no activation), the same bits."""
    K = x.shape[-1]
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if codes.numel() == 0:
        scale.fill_(FP8_MIN_AMAX / FP8_MAX)
        return codes, scale
    rows = _rows(x, K)                                          # [rows, K]
    block = block or min(triton.next_power_of_2(K), MAX_SINGLE_PASS_AMAX)
    _gated_act_quant_kernel[(rows.shape[0],)](
        rows, codes, scale, rows.stride(0), K,
        ACTIVATION="", BLOCK=block, SINGLE_PASS=K <= block, num_warps=_num_warps(block),
    )
    return codes, scale


def scaled_mm_rowwise(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                      out_dtype: torch.dtype) -> Tensor:
    """torch._scaled_mm with rowwise scales: x_fp8 [M, K] row-major, w_fp8 [N, K] row-major (so
    w_fp8.t() is the column-major [K, N] operand it wants), x_scale [M], w_scale [N] fp32.

    aten::_scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
    use_fast_accum=False), keywords as in torch 2.4 through 2.13 (rowwise: scale_a [M, 1],
    scale_b [1, N], fp32). Callers check the shape rules (K and N multiples of 16).
    """
    return torch._scaled_mm(
        x_fp8.contiguous(), w_fp8.contiguous().t(),
        scale_a=x_scale.reshape(-1, 1).contiguous(),     # [M, 1]
        scale_b=w_scale.reshape(1, -1).contiguous(),     # [1, N]
        out_dtype=out_dtype,
    )


def _scaled_mm_supported(x_fp8: Tensor, w_fp8: Tensor, out_dtype: torch.dtype) -> bool:
    """Where torch._scaled_mm's rowwise path applies: CUDA capability >= 9.0 (Hopper), K and N
    multiples of 16, bf16 output (the only one rowwise scaling accepts in torch 2.4-2.11)."""
    K, N = x_fp8.shape[-1], w_fp8.shape[0]
    return (x_fp8.is_cuda and torch.cuda.get_device_capability(x_fp8.device) >= (9, 0)
            and K % 16 == 0 and N % 16 == 0 and K > 0 and N > 0
            and out_dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU (and any other device) runs the reference, CUDA runs the Triton kernels (and
# cuBLAS's FP8 GEMM). Outputs are contiguous on every device, so one fake describes both.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [..., N], weight [N] -> (codes [..., N] e4m3fn, scale [...] fp32)."""
    return rms_norm_quant_reference(x, weight, eps)


@rms_norm_quant.register_fake
def _rms_norm_quant_fake(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


rms_norm_quant.register_kernel("cuda")(rms_norm_quant_triton)


@torch.library.custom_op("fuser::add_rms_norm_quant", mutates_args=())
def add_rms_norm_quant(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual [..., N], weight [N] -> (codes [..., N] e4m3fn, scale [...] fp32, x + residual)."""
    return add_rms_norm_quant_reference(x, residual, weight, eps)


@add_rms_norm_quant.register_fake
def _add_rms_norm_quant_fake(x: Tensor, residual: Tensor, weight: Tensor,
                             eps: float) -> tuple[Tensor, Tensor, Tensor]:
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device),
            torch.empty(x.shape, dtype=summed_dtype, device=x.device))


add_rms_norm_quant.register_kernel("cuda")(add_rms_norm_quant_triton)


@torch.library.custom_op("fuser::gated_act_quant", mutates_args=())
def gated_act_quant(gate_up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """gate_up [..., 2I] -> (codes [..., I] e4m3fn, scale [...] fp32)."""
    return gated_act_quant_reference(gate_up, activation)


@gated_act_quant.register_fake
def _gated_act_quant_fake(gate_up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    _check(gate_up, activation)
    return (torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=FP8_DTYPE,
                        device=gate_up.device),
            torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=gate_up.device))


gated_act_quant.register_kernel("cuda")(gated_act_quant_triton)


@torch.library.custom_op("fuser::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                  out_dtype: torch.dtype) -> Tensor:
    """x_fp8 [..., K] e4m3fn, x_scale [...] fp32, w_fp8 [N, K] e4m3fn, w_scale [N] fp32
    -> [..., N] in out_dtype (the schema's ScalarType argument)."""
    return fp8_scaled_mm_reference_nd(x_fp8, x_scale, w_fp8, w_scale, out_dtype)


@fp8_scaled_mm.register_fake
def _fp8_scaled_mm_fake(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                        out_dtype: torch.dtype) -> Tensor:
    return torch.empty((*x_fp8.shape[:-1], w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)


def _fp8_scaled_mm_cuda(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                        out_dtype: torch.dtype) -> Tensor:
    if not _scaled_mm_supported(x_fp8, w_fp8, out_dtype) or x_fp8.numel() == 0:
        return fp8_scaled_mm_reference_nd(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    *lead, K = x_fp8.shape
    out = scaled_mm_rowwise(x_fp8.reshape(-1, K), x_scale.reshape(-1), w_fp8, w_scale, out_dtype)
    return out.reshape(*lead, w_fp8.shape[0])


fp8_scaled_mm.register_kernel("cuda")(_fp8_scaled_mm_cuda)


# ---------------------------------------------------------------------------------------------
# References: the unquantized op's reference, then quantize_rows. What the CPU path runs.
# ---------------------------------------------------------------------------------------------


def _quantize_nd(y: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows over the last dimension of y [..., C] -> ([..., C], [...])."""
    codes, scale = quantize_rows(y.reshape(-1, y.shape[-1]))
    return codes.reshape(y.shape), scale.reshape(y.shape[:-1])


def rms_norm_quant_reference(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _quantize_nd(rms_norm_reference(x, weight, eps))


def add_rms_norm_quant_reference(x: Tensor, residual: Tensor, weight: Tensor,
                                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    normed, summed = add_rms_norm_reference(x, residual, weight, eps)
    return (*_quantize_nd(normed), summed.contiguous())


def gated_act_quant_reference(gate_up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    return _quantize_nd(gated_act_reference(gate_up, activation))


def fp8_scaled_mm_reference_nd(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                               out_dtype: torch.dtype) -> Tensor:
    """fp8.fp8_scaled_mm_reference over leading dims: x_fp8 [..., K], x_scale [...]."""
    *lead, K = x_fp8.shape
    out = fp8_scaled_mm_reference(x_fp8.reshape(-1, K), x_scale.reshape(-1), w_fp8, w_scale,
                                  out_dtype)
    return out.reshape(*lead, w_fp8.shape[0])


@torch.library.custom_op("fuser::quantize_rows", mutates_args=())
def quantize_rows_op(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (codes [..., K] e4m3fn, scale [...] fp32): per-token quantization of an
    activation that no fusable kernel produces (o_proj's input, the attention output). Plain
    PyTorch on the CPU; one Triton kernel on CUDA (quantize_rows_triton: at the 8B shape's
    2048-token prefill, 128 us in PyTorch's six kernels)."""
    return _quantize_nd(x)


@quantize_rows_op.register_fake
def _quantize_rows_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


quantize_rows_op.register_kernel("cuda")(quantize_rows_triton)
