"""Rotary position embedding on q and k together, as Hugging Face's `apply_rotary_pos_emb`.

    rotary(q, k, cos, sin) = (rope(q), rope(k)),   with R = cos.shape[-1], h = R / 2 and
    rope(x)[..., :h]  = x[..., :h] * cos[..., :h] - x[..., h:R] * sin[..., :h]
    rope(x)[..., h:R] = x[..., h:R] * cos[..., h:R] + x[..., :h] * sin[..., h:R]
    rope(x)[..., R:]  = x[..., R:]                          (partial rotary, R < D: passed through)

which is HF's `x * cos + rotate_half(x) * sin` on the first R columns (cos and sin unsqueezed
at dim 1). q: [B, H, T, D], k: [B, kv_heads, T, D] (any strides: they are transposes of the
projection outputs); cos, sin: [B or 1, T or 1, R], R even, R <= D; all four of one dtype.
Outputs are fresh contiguous tensors shaped like q and k.

Numerics. The kernel multiplies and adds in fp32 and rounds once to the input dtype. In fp32
that is PyTorch's own sequence of roundings (mul, mul, add), so the result is bitwise equal to
the reference (fp contraction into FMA is switched off at launch so a GPU keeps that sequence).
In bf16/fp16 the products are exact in fp32, so the kernel's result is the exact x*cos ± y*sin
rounded once (plus one fp32 rounding of the sum); PyTorch rounds each product to the input
dtype and then the sum, so the two can differ by a rounding of each term and of each sum:
|out - ref| <= 1.5 eps * (|x * cos| + |y * sin|) (eps of the input dtype; u = eps / 2 for each
of the three roundings PyTorch makes, u for the kernel's one), which the tests hold it to.

Cost per token (s = element size in bytes, N = (H + kv_heads) * D):
    bytes = 2 * N * s  (+ 2 * R * s of cos/sin per program, mostly from L1/L2)
    FLOPs = 3 * (H + kv_heads) * R
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

# Heads of one tensor (q or k) that one program rotates: enough to load the token's cos/sin row
# once for several heads, few enough that a decode step (B*T of 1..16 tokens) still spreads
# over (H + kv_heads) / HEADS_PER_PROGRAM programs per token.
HEADS_PER_PROGRAM = 4


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos_row, sin_row,  # cos_row, sin_row: this token's [R] rows
    b, t, T, n_heads, head0,
    x_sb, x_sh, x_st, x_sd,            # x: [B, n_heads, T, D] strides
    c_sr, s_sr,                        # cos, sin: stride of the last dim
    D: tl.constexpr, R: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Rotate heads head0 .. head0 + HEADS - 1 of x at token (b, t) into out."""
    HALF: tl.constexpr = R // 2
    heads = head0 + tl.arange(0, HEADS)                 # [HEADS]
    cols = tl.arange(0, BLOCK_HALF)                      # [BLOCK_HALF] columns of one half
    head_ok = heads < n_heads
    col_ok = cols < HALF
    mask = head_ok[:, None] & col_ok[None, :]            # [HEADS, BLOCK_HALF]

    x_rows = x_ptr + b * x_sb + t * x_st + heads[:, None].to(tl.int64) * x_sh  # [HEADS, 1]
    out_rows = out_ptr + ((b * n_heads + heads[:, None].to(tl.int64)) * T + t) * D  # contiguous

    x1 = tl.load(x_rows + cols[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (cols[None, :] + HALF) * x_sd, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_row + cols * c_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + (cols + HALF) * c_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + cols * s_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + (cols + HALF) * s_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    # rotate_half(x) = cat(-x2, x1): (-x2) * sin1 is exactly -(x2 * sin1).
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    dtype = out_ptr.dtype.element_ty
    tl.store(out_rows + cols[None, :], out1.to(dtype), mask=mask)
    tl.store(out_rows + cols[None, :] + HALF, out2.to(dtype), mask=mask)

    if R < D:  # partial rotary: columns R .. D - 1 are copied unchanged
        rest = R + tl.arange(0, BLOCK_PASS)
        rest_mask = head_ok[:, None] & (rest < D)[None, :]
        x_rest = tl.load(x_rows + rest[None, :] * x_sd, mask=rest_mask, other=0.0)
        tl.store(out_rows + rest[None, :], x_rest, mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_ptr,         # q: [B, H, T, D], strides q_s*
    k_ptr,         # k: [B, KH, T, D], strides k_s*
    cos_ptr,       # cos: [B, T, R] (broadcast dims have stride 0), strides c_s*
    sin_ptr,       # sin: like cos, strides s_s*
    q_out_ptr,     # q_out: [B, H, T, D], contiguous
    k_out_ptr,     # k_out: [B, KH, T, D], contiguous
    T, H, KH,
    q_sb, q_sh, q_st, q_sd,
    k_sb, k_sh, k_st, k_sd,
    c_sb, c_st, c_sr,
    s_sb, s_st, s_sr,
    D: tl.constexpr, R: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # Grid: (B * T tokens, cdiv(H, HEADS) + cdiv(KH, HEADS) head blocks). Axis 1 first covers
    # the q heads, then the k heads, so q and k are rotated in one launch.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    b = token // T
    t = token % T
    cos_row = cos_ptr + b * c_sb + t * c_st
    sin_row = sin_ptr + b * s_sb + t * s_st
    q_blocks = tl.cdiv(H, HEADS)
    if block < q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, cos_row, sin_row, b, t, T, H, block * HEADS,
                      q_sb, q_sh, q_st, q_sd, c_sr, s_sr, D, R, HEADS, BLOCK_HALF, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr, k_out_ptr, cos_row, sin_row, b, t, T, KH, (block - q_blocks) * HEADS,
                      k_sb, k_sh, k_st, k_sd, c_sr, s_sr, D, R, HEADS, BLOCK_HALF, BLOCK_PASS)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _differs(a: object, b: object) -> bool:
    # Certainly different: ints compare as ints; a symbolic size (the fake implementation under
    # a dynamic T) is never guarded on, only refused where it cannot be equal.
    return bool(statically_known_true(a != b))


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> int:
    """Validate the arguments; returns R, the rotary width."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rotary: q and k must be [B, heads, T, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    B, _, T, D = q.shape
    if any(_differs(k.shape[i], q.shape[i]) for i in (0, 2, 3)):
        raise ValueError(f"rotary: k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    if cos.dim() != 3 or any(_differs(c, s) for c, s in zip(cos.shape, sin.shape)):
        raise ValueError("rotary: cos and sin must both be [B, T, R], got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    R = cos.shape[-1]
    bad_batch = _differs(cos.shape[0], 1) and _differs(cos.shape[0], B)
    bad_tokens = _differs(cos.shape[1], 1) and _differs(cos.shape[1], T)
    if R % 2 or not 0 < R <= D or bad_batch or bad_tokens:
        raise ValueError(f"rotary: cos {tuple(cos.shape)} does not fit q {tuple(q.shape)} "
                         "(need [B or 1, T or 1, R] with R even and R <= D)")
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"rotary: q, k, cos, sin must share a dtype, got "
                         f"{q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    return R


def rotary_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [B, H, T, D], k: [B, KH, T, D], cos, sin: [B, T, R] -> (q_embed, k_embed), contiguous."""
    R = _check(q, k, cos, sin)
    B, H, T, D = q.shape
    KH = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T * (H + KH) == 0:  # D > 0: R <= D and R > 0
        return q_out, k_out
    cos = cos.expand(B, T, R)  # broadcast batch/token dims become stride 0
    sin = sin.expand(B, T, R)
    heads = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(H, KH)))
    block_half = triton.next_power_of_2(R // 2)
    grid = (B * T, triton.cdiv(H, heads) + triton.cdiv(KH, heads))
    _rotary_kernel[grid](
        q, k, cos, sin, q_out, k_out,
        T, H, KH,
        *q.stride(), *k.stride(), *cos.stride(), *sin.stride(),
        D=D, R=R,
        HEADS=heads, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(D - R, 1)),
        # About 8 elements of each half per thread (one 16-byte bf16 vector): 4 heads x 64
        # columns, a head dim of 128, is one warp. Tiles are small; 1..4 warps.
        num_warps=max(1, min(4, heads * block_half // 256)),
        # Keep mul, mul, add as three roundings (no FMA): fp32 stays bitwise equal to PyTorch.
        enable_fp_fusion=False,
    )
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# Custom op: CPU (and any other device) runs the reference, CUDA runs the Triton kernel.
# Both return contiguous outputs, so one fake implementation describes both.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::rotary", mutates_args=())
def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    _check(q, k, cos, sin)
    q_embed, k_embed = rotary_reference(q, k, cos, sin)
    return q_embed.contiguous(), k_embed.contiguous()


@rotary.register_fake
def _rotary_fake(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    _check(q, k, cos, sin)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


rotary.register_kernel("cuda")(rotary_triton)


# ---------------------------------------------------------------------------------------------
# Reference (Hugging Face's apply_rotary_pos_emb, with the partial-rotary split of
# Phi-3/StableLM/GPT-NeoX); what the CPU path runs and what tests compare against.
# ---------------------------------------------------------------------------------------------


def rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos = cos.unsqueeze(1)  # [B, 1, T, R]
    sin = sin.unsqueeze(1)
    R = cos.shape[-1]

    def rope(x: Tensor) -> Tensor:
        rotated = x[..., :R] * cos + rotate_half(x[..., :R]) * sin  # in x's dtype, as HF
        return rotated if R == x.shape[-1] else torch.cat([rotated, x[..., R:]], dim=-1)

    return rope(q), rope(k)
