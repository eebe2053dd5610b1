"""Rotary position embedding on q and k together, as Hugging Face's `apply_rotary_pos_emb`.

    rotary(q, k, cos, sin) = (rope(q), rope(k)),   with R = cos.shape[-1], h = R / 2 and
    rope(x)[..., :h]  = x[..., :h] * cos[..., :h] - x[..., h:R] * sin[..., :h]
    rope(x)[..., h:R] = x[..., h:R] * cos[..., h:R] + x[..., :h] * sin[..., h:R]
    rope(x)[..., R:]  = x[..., R:]                          (partial rotary, R < D: passed through)

which is HF's `x * cos + rotate_half(x) * sin` on the first R columns (cos and sin unsqueezed
at dim 1). q: [B, H, T, D], k: [B, kv_heads, T, D] (any strides: they are transposes of the
projection outputs); cos, sin: [B or 1, T or 1, R], R even, R <= D; all four of one dtype.
Outputs are fresh contiguous tensors shaped like q and k.

    rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens) -> rope(q)
        k_cache[b, seq_lens[b] + t] = rope(k)[b, :, t];  v_cache[b, seq_lens[b] + t] = v[b, :, t]

is the same rotation with a decode step's KV-cache write folded in (passes/rotary_cache.py):
v: [B, kv_heads, T, D] like k; k_cache, v_cache: [B, S, kv_heads, D] contiguous, written in
place; seq_lens: [B] int64. One launch instead of rotary + two index_put kernels. Both ops run
one kernel (`WRITE_CACHE` selects where k goes and whether v is copied).

    rotary_cache_write(..., seq_lens, block_table)
        the paged cache (runtime/blocks.py): k_cache, v_cache: [num_blocks, PAGE, kv_heads, D]
        pools, block_table: [B, max_blocks] int32; slot j of row b is written at
        (block_table[b, j // PAGE], j % PAGE). The kernel drops slots >= max_blocks * PAGE; the
        reference writes them to the null block 0 (which no row reads as its own).

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
            (+ 2 * kv_heads * D * s for rotary_cache_write's copy of v)
    FLOPs = 3 * (H + kv_heads) * R
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.paged import paged_slots
from fuser.ops.pdl import pdl_launch, wait_for_inputs

# Heads of one tensor (q or k) that one program rotates: enough to load the token's cos/sin row
# once for several heads, few enough that a decode step (B*T of 1..16 tokens) still spreads
# over (H + kv_heads) / HEADS_PER_PROGRAM programs per token.
HEADS_PER_PROGRAM = 4


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, out_row, cos_row, sin_row,  # out_row: this token's output row; cos_row, sin_row: its [R] rows
    b, t, n_heads, head0,
    x_sb, x_sh, x_st, x_sd,            # x: [B, n_heads, T, D] strides
    o_sh,                              # out: stride between heads (columns contiguous)
    c_sr, s_sr,                        # cos, sin: stride of the last dim
    D: tl.constexpr, R: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    n_store,                           # heads stored: n_heads, or 0 for a cache slot past the end
):
    """Rotate heads head0 .. head0 + HEADS - 1 of x at token (b, t) into out_row + head * o_sh."""
    HALF: tl.constexpr = R // 2
    heads = head0 + tl.arange(0, HEADS)                 # [HEADS]
    cols = tl.arange(0, BLOCK_HALF)                      # [BLOCK_HALF] columns of one half
    head_ok = heads < n_heads
    col_ok = cols < HALF
    mask = head_ok[:, None] & col_ok[None, :]            # [HEADS, BLOCK_HALF]

    x_rows = x_ptr + b * x_sb + t * x_st + heads[:, None].to(tl.int64) * x_sh  # [HEADS, 1]
    out_rows = out_row + heads[:, None].to(tl.int64) * o_sh                     # [HEADS, 1]

    x1 = tl.load(x_rows + cols[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (cols[None, :] + HALF) * x_sd, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_row + cols * c_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + (cols + HALF) * c_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + cols * s_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + (cols + HALF) * s_sr, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    # rotate_half(x) = cat(-x2, x1): (-x2) * sin1 is exactly -(x2 * sin1).
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    dtype = out_row.dtype.element_ty
    # (a block mask, not `mask & flag`: Triton 3.9's interpreter refuses a scalar bool in a mask)
    mask = (heads < n_store)[:, None] & col_ok[None, :]
    tl.store(out_rows + cols[None, :], out1.to(dtype), mask=mask)
    tl.store(out_rows + cols[None, :] + HALF, out2.to(dtype), mask=mask)

    if R < D:  # partial rotary: columns R .. D - 1 are copied unchanged
        rest = R + tl.arange(0, BLOCK_PASS)
        rest_mask = head_ok[:, None] & (rest < D)[None, :]
        x_rest = tl.load(x_rows + rest[None, :] * x_sd, mask=rest_mask, other=0.0)
        tl.store(out_rows + rest[None, :], x_rest, mask=(heads < n_store)[:, None] & (rest < D)[None, :])


@triton.jit
def _copy_heads(
    x_ptr, out_row, b, t, n_heads, head0,
    x_sb, x_sh, x_st, x_sd,            # x: [B, n_heads, T, D] strides
    o_sh,                              # out: stride between heads (columns contiguous)
    D: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
    n_store,                           # heads stored: n_heads, or 0 for a cache slot past the end
):
    """Copy heads head0 .. head0 + HEADS - 1 of x at token (b, t) to out_row + head * o_sh."""
    heads = head0 + tl.arange(0, HEADS)[:, None].to(tl.int64)   # [HEADS, 1]
    cols = tl.arange(0, BLOCK_D)[None, :]                         # [1, BLOCK_D]
    x = tl.load(x_ptr + b * x_sb + t * x_st + heads * x_sh + cols * x_sd,
                mask=(heads < n_heads) & (cols < D))
    tl.store(out_row + heads * o_sh + cols, x, mask=(heads < n_store) & (cols < D))


@triton.jit
def _rotary_kernel(
    q_ptr,         # q: [B, H, T, D], strides q_s*
    k_ptr,         # k: [B, KH, T, D], strides k_s*
    v_ptr,         # v: [B, KH, T, D], strides v_s* (WRITE_CACHE only)
    cos_ptr,       # cos: [B, T, R] (broadcast dims have stride 0), strides c_s*
    sin_ptr,       # sin: like cos, strides s_s*
    q_out_ptr,     # q_out: [B, H, T, D], contiguous
    k_out_ptr,     # rotary: k_out [B, KH, T, D] contiguous; WRITE_CACHE: k_cache [B, S, KH, D]
    v_out_ptr,     # WRITE_CACHE: v_cache [B, S, KH, D] contiguous
    seq_lens_ptr,  # WRITE_CACHE: [B] int64, token t of row b goes to slot seq_lens[b] + t
    table_ptr,     # PAGE > 0: block table [B, max_blocks] int32 contiguous; the caches are pools
    T, H, KH, S,   # S: slots per row (max_blocks * PAGE when paged)
    max_blocks,    # PAGE > 0: the table's row stride
    q_sb, q_sh, q_st, q_sd,
    k_sb, k_sh, k_st, k_sd,
    v_sb, v_sh, v_st, v_sd,
    c_sb, c_st, c_sr,
    s_sb, s_st, s_sr,
    D: tl.constexpr, R: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with PDL: wait for the previous kernel (fuser/ops/pdl.py)
    PAGE: tl.constexpr = 0,     # WRITE_CACHE into a paged pool of PAGE-slot blocks; 0: contiguous
):
    wait_for_inputs(PDL)
    # Grid: (B * T tokens, cdiv(H, HEADS) + cdiv(KH, HEADS) [+ cdiv(KH, HEADS)] head blocks).
    # Axis 1 first covers the q heads, then the k heads, then (WRITE_CACHE) the v heads, so one
    # launch rotates q and k and, for a cache write, stores k and v into their cache slots.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    b = token // T
    t = token % T
    cos_row = cos_ptr + b * c_sb + t * c_st
    sin_row = sin_ptr + b * s_sb + t * s_st
    q_blocks = tl.cdiv(H, HEADS)
    kv_blocks = tl.cdiv(KH, HEADS)
    if WRITE_CACHE:
        slot = tl.load(seq_lens_ptr + b) + t
        if PAGE:
            # (the index is clamped so that a slot past the table reads an entry; it is dropped;
            # a slot before the row, an idle row's catch-up at seq_lens - 1 = -1, goes to the
            # null block)
            index = tl.minimum(tl.maximum(slot, 0) // PAGE, max_blocks - 1)
            pool_block = tl.load(table_ptr + b * max_blocks + index).to(tl.int64)
            pool_block = tl.where(slot >= 0, pool_block, 0)
            kv_row = (pool_block * PAGE + tl.maximum(slot, 0) % PAGE) * KH * D
        else:
            kv_row = (b * S + slot) * KH * D     # the cache row [KH, D] of this token
        kv_sh = D
        kv_store = tl.where(slot < S, KH, 0)  # a slot past the cache is dropped, never written
    else:
        kv_row = ((b * KH) * T + t) * D      # row t of a contiguous [B, KH, T, D]
        kv_sh = T * D
        kv_store = KH
    if block < q_blocks:
        _rotate_heads(q_ptr, q_out_ptr + ((b * H) * T + t) * D, cos_row, sin_row, b, t, H,
                      block * HEADS, q_sb, q_sh, q_st, q_sd, T * D, c_sr, s_sr,
                      D, R, HEADS, BLOCK_HALF, BLOCK_PASS, H)
    elif block < q_blocks + kv_blocks:
        _rotate_heads(k_ptr, k_out_ptr + kv_row, cos_row, sin_row, b, t, KH,
                      (block - q_blocks) * HEADS, k_sb, k_sh, k_st, k_sd, kv_sh, c_sr, s_sr,
                      D, R, HEADS, BLOCK_HALF, BLOCK_PASS, kv_store)
    elif WRITE_CACHE:
        _copy_heads(v_ptr, v_out_ptr + kv_row, b, t, KH, (block - q_blocks - kv_blocks) * HEADS,
                    v_sb, v_sh, v_st, v_sd, kv_sh, D, HEADS, BLOCK_D, kv_store)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _differs(a: object, b: object) -> bool:
    # Certainly different: ints compare as ints; a symbolic size (the fake implementation under
    # a dynamic T) is never guarded on, only refused where it cannot be equal.
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    # Imported here: symbolic_shapes imports sympy (seconds), and a symbolic size exists only
    # while a graph is traced, when it is loaded already; serving a loaded engine needs neither.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

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


def _check_cache(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 seq_lens: Tensor, block_table: Tensor | None = None) -> None:
    """Validate rotary_cache_write's cache arguments (q, k, cos, sin go through `_check`); with
    a block table the caches are pools [num_blocks, PAGE, kv_heads, D]."""
    B, _, T, D = q.shape
    KH = k.shape[1]
    if block_table is not None:
        if (block_table.dim() != 2 or _differs(block_table.shape[0], B)
                or block_table.dtype != torch.int32):
            raise ValueError(f"rotary_cache_write: block_table must be [B, max_blocks] int32, got "
                             f"{tuple(block_table.shape)} {block_table.dtype}")
    rows = B if block_table is None else k_cache.shape[0]  # a pool's blocks take the rows' place
    if v.dim() != 4 or any(_differs(a, b) for a, b in zip(v.shape, k.shape)):
        raise ValueError(f"rotary_cache_write: v {tuple(v.shape)} must be shaped like k {tuple(k.shape)}")
    if k_cache.dim() != 4 or any(_differs(a, b) for a, b in zip(k_cache.shape, v_cache.shape)):
        raise ValueError("rotary_cache_write: k_cache and v_cache must both be [B, S, kv_heads, D], "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if any(_differs(k_cache.shape[i], n) for i, n in ((0, rows), (2, KH), (3, D))):
        raise ValueError(f"rotary_cache_write: cache {tuple(k_cache.shape)} does not fit k "
                         f"{tuple(k.shape)} (need [B or num_blocks, S or PAGE, kv_heads, D])")
    if not q.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"rotary_cache_write: q, v and the caches must share a dtype, got "
                         f"{q.dtype}, {v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_cache_write: the caches must be contiguous")
    if seq_lens.dim() != 1 or _differs(seq_lens.shape[0], B) or seq_lens.dtype != torch.int64:
        raise ValueError(f"rotary_cache_write: seq_lens must be [B] int64, got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")


def _launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor,
            cache: tuple[Tensor, Tensor, Tensor] | None,
            block_table: Tensor | None = None) -> None:
    """Run `_rotary_kernel`: rope(q) into q_out and rope(k) into k_out ([B, KH, T, D]
    contiguous), or, with cache = (v, v_cache, seq_lens), rope(k) and v into the slots
    seq_lens[b] + t of k_out = k_cache and v_cache ([B, S, KH, D] contiguous; with a block
    table, the pools [num_blocks, PAGE, KH, D])."""
    R = cos.shape[-1]
    B, H, T, D = q.shape
    KH = k.shape[1]
    if B * T * (H + KH) == 0:  # D > 0: R <= D and R > 0
        return
    cos = cos.expand(B, T, R)  # broadcast batch/token dims become stride 0
    sin = sin.expand(B, T, R)
    v, v_out, seq_lens = cache if cache is not None else (k, k_out, k_out)  # unused without a cache
    page = 0 if block_table is None else k_out.shape[1]
    table = seq_lens if block_table is None else block_table.contiguous()  # unused when page = 0
    slots = k_out.shape[1] if cache is not None else T
    if page:
        slots = table.shape[1] * page
    heads = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(H, KH)))
    block_half = triton.next_power_of_2(R // 2)
    kv_blocks = triton.cdiv(KH, heads)
    grid = (B * T, triton.cdiv(H, heads) + kv_blocks * (2 if cache is not None else 1))
    pdl = pdl_launch(q.device, one_row=T == 1)
    _rotary_kernel[grid](
        q, k, v, cos, sin, q_out, k_out, v_out, seq_lens, table,
        T, H, KH, slots, table.shape[-1],
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(),
        D=D, R=R,
        HEADS=heads, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(D - R, 1)),
        BLOCK_D=triton.next_power_of_2(D),
        WRITE_CACHE=cache is not None,
        # About 8 elements of each half per thread (one 16-byte bf16 vector): 4 heads x 64
        # columns, a head dim of 128, is one warp. Tiles are small; 1..4 warps.
        num_warps=max(1, min(4, heads * block_half // 256)),
        # Keep mul, mul, add as three roundings (no FMA): fp32 stays bitwise equal to PyTorch.
        enable_fp_fusion=False, PDL=bool(pdl), PAGE=page, **pdl,
    )


def rotary_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [B, H, T, D], k: [B, KH, T, D], cos, sin: [B, T, R] -> (q_embed, k_embed), contiguous."""
    _check(q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, cos, sin, q_out, k_out, cache=None)
    return q_out, k_out


def rotary_cache_write_triton(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                              k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor,
                              block_table: Tensor | None = None) -> Tensor:
    """rope(q) -> q_embed [B, H, T, D] contiguous; rope(k) and v -> k_cache, v_cache
    [B, S, KH, D] at slots seq_lens[b] + t (in place; through block_table into the pools
    when given). One launch; slots >= S are dropped."""
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, cos, sin, q_out, k_cache, cache=(v, v_cache, seq_lens), block_table=block_table)
    return q_out


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


# rotary_cache_write: q's rotation is the only output; k and v go into the caches in place
# (the one mutation a step graph has, now inside the op instead of index_put + copy_).
@torch.library.custom_op("fuser::rotary_cache_write", mutates_args=("k_cache", "v_cache"))
def rotary_cache_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                       k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor,
                       block_table: Tensor | None = None) -> Tensor:
    """rope(q), and a step's KV-cache write with rope(k) in it. Contract:

    - returns rope(q): a fresh contiguous [B, H, T, D] (as `rotary`'s first output);
    - writes, for every row b and token t, k_cache[b, seq_lens[b] + t] = rope(k)[b, :, t] and
      v_cache[b, seq_lens[b] + t] = v[b, :, t] (v bit for bit), and no other slot; rope(k) is
      not returned;
    - q, k, v: [B, heads, T, D] of any strides; k_cache, v_cache: contiguous [B, S, kv_heads, D]
      (the engine's KVCache layout), one dtype with q; seq_lens: [B] int64 on q's device, read
      by the kernel (no host sync: a CUDA graph replays it with new lengths);
    - seq_lens[b] + T <= S (the engine guarantees it; the CPU reference raises otherwise, the
      kernel drops slots past S).
    - with block_table ([B, max_blocks] int32), k_cache and v_cache are paged pools
      [num_blocks, PAGE, kv_heads, D] and slot j of row b is (block_table[b, j // PAGE],
      j % PAGE) (module docstring).
    Numerics as `rotary` (module docstring). CPU: the reference; CUDA: one Triton launch.
    """
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    return rotary_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, seq_lens,
                                        block_table).contiguous()


@rotary_cache_write.register_fake
def _rotary_cache_write_fake(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                             k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor,
                             block_table: Tensor | None = None) -> Tensor:
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


rotary_cache_write.register_kernel("cuda")(rotary_cache_write_triton)


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


def rotary_cache_write_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                                 k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor,
                                 block_table: Tensor | None = None) -> Tensor:
    """What a decode graph did before the rotary_cache pass: rotary, then capture's two
    index_put_ writes (fuser/capture.py, `cache_attention`). Writes the caches, returns rope(q).
    Paged: the same writes at each slot's (block, offset) of the table (`paged_slots`)."""
    q_embed, k_embed = rotary_reference(q, k, cos, sin)
    B, _, T, _ = q.shape
    slots = seq_lens[:, None] + torch.arange(T, device=q.device)  # [B, T] slot of each new token
    if block_table is not None:
        rows, slots = paged_slots(block_table, k_cache.shape[1], slots)  # [B, T] block, offset
    else:
        rows = torch.arange(B, device=q.device)[:, None].expand(B, T)  # [B, T]
    k_cache.index_put_((rows, slots), k_embed.transpose(1, 2))  # [B, T, kv_heads, D]
    v_cache.index_put_((rows, slots), v.transpose(1, 2))
    return q_embed
