"""RMSNorm and residual-add + RMSNorm, as in Hugging Face's LlamaRMSNorm.

    rms_norm(x, w, eps)             = w * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)
    add_rms_norm(x, r, w, eps)      = rms_norm(s, w, eps), s       with s = x + r

The normalisation runs in fp32; the normalised row is rounded to the input dtype before the
weight multiplies it in promote(weight.dtype, x.dtype), the same rounding order as the reference.

Cost per row of width N (s_* = element size in bytes; weight counted once per row, although
across rows it mostly comes from L2):
    rms_norm:      bytes = N * (s_x + s_w + s_out)                    FLOPs ~ 4N (+ one rsqrt)
    add_rms_norm:  bytes = N * (s_x + s_r + s_w + s_sum + s_out)      FLOPs ~ 5N (+ one rsqrt)
For N > MAX_SINGLE_PASS the row does not stay in registers and is read twice: add N * s_x
(rms_norm) or N * (s_x + s_r) (add_rms_norm) to the bytes.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# Widest row held in registers in one pass; wider rows loop over blocks of this size, twice.
MAX_SINGLE_PASS = 8192


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_block(x_row, residual_row, summed_row, cols, mask,
                HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """One block of the row to normalise, in fp32, already rounded to its own dtype.

    With a residual that row is s = x + r, rounded to summed's dtype before any upcast
    (the reference adds in the input dtype); STORE_SUM writes s out.
    """
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_row + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(summed_row.dtype.element_ty)
        if STORE_SUM:
            tl.store(summed_row + cols, s, mask=mask)
        x = s
    return x.to(tl.float32)


@triton.jit
def _normalise(h, rstd, w, in_dtype: tl.constexpr):
    """weight * (h * rstd).to(in_dtype) in fp32, for the caller to round once to the output
    dtype. Shared with the decode GEMV's norm prologue (fuser/ops/linear.py): same bits.

    The product of two bf16/fp16 values is exact in fp32, so rounding it to the output dtype
    equals a correctly rounded multiply in that dtype (what PyTorch does).
    """
    return (h * rstd).to(in_dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _store_block(h, rstd, weight_ptr, out_row, cols, mask, in_dtype: tl.constexpr):
    """out = weight * (h * rstd).to(in_dtype), multiplied in fp32 and rounded once."""
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = _normalise(h, rstd, w, in_dtype)
    tl.store(out_row + cols, y.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,            # x: [rows, N], row stride x_row_stride, column stride 1
    residual_ptr,     # residual: [rows, N] like x (unused unless HAS_RESIDUAL)
    weight_ptr,       # weight: [N], contiguous
    out_ptr,          # out: [rows, N], contiguous, dtype promote(weight, in_dtype)
    summed_ptr,       # summed: [rows, N], contiguous, dtype promote(x, residual) (HAS_RESIDUAL)
    x_row_stride,
    residual_row_stride,
    N,
    eps,
    BLOCK: tl.constexpr,          # power of two; >= N when SINGLE_PASS
    SINGLE_PASS: tl.constexpr,    # whole row in registers, else two passes over blocks
    HAS_RESIDUAL: tl.constexpr,
):
    # One program per row.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    out_row = out_ptr + row * N
    summed_row = summed_ptr + row * N
    if HAS_RESIDUAL:
        in_dtype = summed_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)  # fp32, as torch.rsqrt(var + eps)
        _store_block(h, rstd, weight_ptr, out_row, cols, mask, in_dtype)
    else:
        # Pass 1: sum of squares (and s written out). Pass 2 reloads the inputs and recomputes
        # s rather than reading back `summed`: same bits, and no store-then-load ordering to
        # reason about inside the program.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, True)
            acc += h * h
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            h = _load_block(x_row, residual_row, summed_row, cols, mask, HAS_RESIDUAL, False)
            _store_block(h, rstd, weight_ptr, out_row, cols, mask, in_dtype)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _num_warps(block: int) -> int:
    # About 8 elements per thread: one 16-byte vector load of bf16 per thread, and enough
    # threads on a wide row for memory-level parallelism (decode has one row per sequence, so a
    # single program must pull its row at full speed). 1..16 warps.
    return max(1, min(16, block // (32 * 8)))


def _rows(t: Tensor, n: int) -> Tensor:
    """t: [..., N] -> [rows, N] with unit column stride (a view when the layout allows)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    n = x.shape[-1]
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} does not match width {n}"
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        in_dtype = summed.dtype
    else:
        summed = None
        in_dtype = x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    if out.numel() == 0:
        return out, summed

    x2 = _rows(x, n)                                        # [rows, N]
    r2 = _rows(residual, n) if residual is not None else x2  # [rows, N]
    block = min(triton.next_power_of_2(n), MAX_SINGLE_PASS)
    grid = (x2.shape[0],)
    _rms_norm_kernel[grid](
        x2, r2, weight.contiguous(), out, summed if summed is not None else out,
        x2.stride(0), r2.stride(0), n, eps,
        BLOCK=block,
        SINGLE_PASS=n <= MAX_SINGLE_PASS,
        HAS_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
    )
    return out, summed


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., N], weight: [N] -> [..., N] in promote(weight.dtype, x.dtype)."""
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual: [..., N], weight: [N] -> (rms_norm(x + residual), x + residual)."""
    out, summed = _launch(x, residual, weight, eps)
    return out, summed


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU (and any other device) runs the reference, CUDA runs the Triton kernel.
# Outputs are contiguous on every device (the kernel writes row-major [rows, N]; the reference
# would follow a strided input's layout), so one fake implementation describes both.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_reference(x, weight, eps).contiguous()


@rms_norm.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


rms_norm.register_kernel("cuda")(rms_norm_triton)


@torch.library.custom_op("fuser::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    normed, summed = add_rms_norm_reference(x, residual, weight, eps)
    return normed.contiguous(), summed.contiguous()


@add_rms_norm.register_fake
def _add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, summed_dtype), device=x.device)
    summed = torch.empty(x.shape, dtype=summed_dtype, device=x.device)
    return normed, summed


add_rms_norm.register_kernel("cuda")(add_rms_norm_triton)


# ---------------------------------------------------------------------------------------------
# Reference (Hugging Face LlamaRMSNorm); what the CPU path runs and what tests compare against.
# ---------------------------------------------------------------------------------------------


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + residual  # in the input dtype: bf16 rounding happens here, as in HF
    return rms_norm_reference(s, weight, eps), s
