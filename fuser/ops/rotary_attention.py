"""Rotary, KV-cache write and attention of a fixed-T step in one split-K kernel.

    rotary_cache_attention(q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts,
                           scale, window, softcap) -> out [B, T, H, D]
      = q_rot = rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens)
        cache_attention_read(q_rot, k_cache, v_cache, seq_lens, starts, scale, window, softcap)

the two ops a decode, verify or catch-up step ran per layer (passes/rotary_attention.py folds
them). Arguments are theirs: q: [B, H, T, D], k, v: [B, KV, T, D] un-rotated, any strides;
cos, sin: [B or 1, T or 1, R], R even, R <= D (partial rotary passes columns R.. through);
k_cache, v_cache: [B, S, KV, D] contiguous, written in place at slots seq_lens[b] + t with
rope(k) and v (slots >= S dropped, as rotary_cache_write's kernel does); seq_lens, starts: [B]
int64; one dtype throughout. With block_table [B, max_blocks] int32, k_cache and v_cache are
the paged pools [num_blocks, PAGE, KV, D] and every slot is read and written through the table
(runtime/blocks.py; fuser/ops/paged.py). Visibility, scores and softmax are cache_attention_read's
(fuser/ops/attention.py): key j is visible to query i = seq_lens[b] + t iff
starts[b] <= j <= i and (window == 0 or i - j < window).

Triton (one launch less per layer than the two ops: the rotary kernel is gone). Grid
(B * KV, num_splits), as attention's `_split_kernel`; program (b, kv head, split):
  - rotates its rep * T query rows in registers: rope(x)[c] = x[c] cos[c] -+ x[c +- R/2] sin[c]
    in fp32, no FMA, rounded once to the dtype (bit for bit what the rotary kernel stores);
  - walks its share of the cache slots [lo, seq_lens[b] - 1] (the slots written by earlier
    steps; loads stop before seq_lens[b], so no program reads a slot this launch writes);
  - the last split also takes the T new keys, rope(k) and v computed from the inputs (one
    more block of the online softmax), and writes them to the caches' slots seq_lens[b] + t:
    exactly one program per (b, kv head) writes, on every row, whether or not its queries see
    anything;
  - writes (acc, m, l) to scratch; attention's `_combine_kernel` merges the splits.

Numerics. The caches' new slots and the rotated q equal rotary_cache_write's kernel bit for
bit; the output is cache_attention_read's math over those values (the new keys are one block
of their own, a different summation order: the attention tests' tolerances hold).

Cost per (b, kv head), with L the visible cached slots, M = rep * T query rows, s the element
size: attention's 2 L D s + M D (s_q + s_out) + scratch, plus 2 T D s read (k, v) and 2 T D s
written (cache slots); the rotary kernel's separate round trip of rope(q) (2 M D s) is gone.
FLOPs as attention's, plus 3 (M + T) R for the rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.attention import (BLOCK_N, TARGET_PROGRAMS, _attend_block, _attend_cache,
                                 _combine_kernel, _store_partial, cache_attention_read_triton,
                                 cache_attention_reference, check_paged, split_scratch)
from fuser.ops.paged import _cache_rows
from fuser.ops.pdl import pdl_launch, wait_for_inputs
from fuser.ops.rope import (_check, _check_cache, rotary_cache_write_reference,
                            rotary_cache_write_triton)

# New tokens one fused launch takes: the fixed T of decode, catch-up and verification (gamma
# <= 15). Larger T (never a fixed step today) runs the two kernels.
MAX_FUSED_TOKENS = 16


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rope_rows(
    x_rows,            # [ROWS, 1] pointers to each row's column 0
    x_sd,              # stride between columns
    cos_rows, sin_rows,  # [ROWS, 1] pointers to each row's cos/sin column 0
    c_sr, s_sr,        # cos, sin: stride of the last dim
    row_ok,            # [ROWS] which rows exist
    D, R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """rope of ROWS rows of x, in x's dtype: [ROWS, BLOCK_D] (zeros past D and on missing rows).

        rope(x)[c] = x[c] cos[c] - x[c + R/2] sin[c]    c < R/2
        rope(x)[c] = x[c] cos[c] + x[c - R/2] sin[c]    R/2 <= c < R
        rope(x)[c] = x[c]                               c >= R
    Products and sum in fp32, rounded once: fuser/ops/rope.py's `_rotate_heads`, term by term
    (the launch switches FMA contraction off, as rope's does)."""
    HALF: tl.constexpr = R // 2
    cols = tl.arange(0, BLOCK_D)
    rotated = cols < R
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    mask = row_ok[:, None] & (cols < D)[None, :]
    rot_mask = row_ok[:, None] & rotated[None, :]
    x = tl.load(x_rows + cols[None, :] * x_sd, mask=mask, other=0.0)
    y = tl.load(x_rows + partner[None, :] * x_sd, mask=rot_mask, other=0.0).to(tl.float32)
    c = tl.load(cos_rows + cols[None, :] * c_sr, mask=rot_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_rows + cols[None, :] * s_sr, mask=rot_mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    out = tl.where((cols < HALF)[None, :], xf * c - y * s, xf * c + y * s)
    return tl.where(rotated[None, :], out.to(x.dtype), x)


@triton.jit
def _rotary_split_kernel(
    q_ptr,             # q: [B, H, T, D] un-rotated, strides sq_*
    k_ptr, v_ptr,      # k, v: [B, KV, T, D] un-rotated / as written, strides sk_*, sv_*
    cos_ptr, sin_ptr,  # [B, T, R] (broadcast dims stride 0), strides c_*, s_*
    k_cache_ptr, v_cache_ptr,  # [B, S, KV, D] contiguous: read below seq_lens, written at seq_lens + t
                               # (PAGE > 0: the pools [num_blocks, PAGE, KV, D], through the table)
    seq_lens_ptr, starts_ptr,  # [B] int64
    table_ptr,         # PAGE > 0: block table [B, max_blocks] int32 contiguous (else unused)
    acc_ptr, ml_ptr,   # scratch, as attention's `_split_kernel`
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_t, sk_d,
    sv_b, sv_h, sv_t, sv_d,
    c_sb, c_st, c_sr,
    s_sb, s_st, s_sr,
    S, KV, T, D, M,    # M = rep * T query rows per kv head
    scale_log2e, softcap, window,
    max_blocks,        # PAGE > 0: the table's row stride
    R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,        # power of two >= max(16, M)
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,        # power of two >= max(16, T): the new keys as one dot operand
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32_DOTS: tl.constexpr,
    PDL: tl.constexpr = False,
    PAGE: tl.constexpr = 0,       # slots per block of a paged cache; 0: contiguous
):
    wait_for_inputs(PDL)
    bk = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = bk // KV
    kvh = bk % KV
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.load(starts_ptr + b)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D

    # Query rows r = (head within the group) * T + t, head h = kvh * rep + r // T, rotated here.
    rows = tl.arange(0, BLOCK_M)
    t = rows % T
    h = kvh * (M // T) + rows // T
    q = _rope_rows(q_ptr + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t, sq_d,
                   cos_ptr + b * c_sb + t[:, None] * c_st, sin_ptr + b * s_sb + t[:, None] * s_st,
                   c_sr, s_sr, rows < M, D, R, BLOCK_D)
    if FP32_DOTS:
        q = q.to(tl.float32)
    slot_i = seq_len + t                                   # [BLOCK_M] slot of each query

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Slots written by earlier steps: [.., seq_len - 1]; never load seq_len.. (written below).
    old = tl.minimum(seq_len, S)
    kv_row = kvh * D if PAGE else b * S * KV * D + kvh * D
    table_row = table_ptr + b * max_blocks
    m_i, l_i, acc = _attend_cache(
        q, k_cache_ptr, v_cache_ptr, kv_row, table_row, slot_i, start, seq_len, window, split,
        old, old - 1, m_i, l_i, acc, scale_log2e, softcap, KV, D,
        NUM_SPLITS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, FP32_DOTS, PAGE)

    if split == NUM_SPLITS - 1:
        # The T new keys: rope(k) and v from the inputs, attended as one more block and written
        # to their cache slots (this program is the only writer of them).
        tt = tl.arange(0, BLOCK_T)
        t_ok = tt < T
        k_new = _rope_rows(k_ptr + b * sk_b + kvh * sk_h + tt[:, None] * sk_t, sk_d,
                           cos_ptr + b * c_sb + tt[:, None] * c_st,
                           sin_ptr + b * s_sb + tt[:, None] * s_st,
                           c_sr, s_sr, t_ok, D, R, BLOCK_D)          # [BLOCK_T, BLOCK_D]
        new_mask = t_ok[:, None] & col_ok[None, :]
        v_new = tl.load(v_ptr + b * sv_b + kvh * sv_h + tt[:, None] * sv_t + cols[None, :] * sv_d,
                        mask=new_mask, other=0.0)
        j = seq_len + tt                                   # [BLOCK_T] their slots
        j_ok = t_ok & (j < S)
        m_i, l_i, acc = _attend_block(q, k_new, v_new, j, j_ok, slot_i, start, m_i, l_i, acc,
                                      scale_log2e, softcap, window,
                                      HAS_WINDOW, HAS_SOFTCAP, FP32_DOTS)
        rows_new = _cache_rows(j, j_ok, table_row, PAGE)   # [BLOCK_T] cache rows of the new slots
        slot_offs = kv_row + rows_new[:, None] * (KV * D) + cols[None, :]
        write = j_ok[:, None] & col_ok[None, :]          # a slot past the cache is dropped
        tl.store(k_cache_ptr + slot_offs, k_new, mask=write)
        tl.store(v_cache_ptr + slot_offs, v_new, mask=write)

    _store_partial(acc_ptr, ml_ptr, bk * NUM_SPLITS + split, rows, acc, m_i, l_i, M, D,
                   BLOCK_M, BLOCK_D)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _check_attention(q: Tensor, k: Tensor, seq_lens: Tensor, starts: Tensor) -> None:
    """What attention needs beyond rotary_cache_write's checks: whole GQA groups, starts [B]."""
    H, KV = q.shape[1], k.shape[1]
    if H % KV:
        raise ValueError(f"rotary_cache_attention: {H} query heads do not group over {KV} kv heads")
    if starts.shape != seq_lens.shape or starts.dtype != torch.int64:
        raise ValueError(f"rotary_cache_attention: starts must be [B] int64 like seq_lens, got "
                         f"{tuple(starts.shape)} {starts.dtype}")


def fused_supported(q: Tensor) -> bool:
    """Whether one launch takes the call (else the two kernels run): T <= MAX_FUSED_TOKENS."""
    return q.shape[2] <= MAX_FUSED_TOKENS


def rotary_cache_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    seq_lens: Tensor, starts: Tensor, scale: float, window: int, softcap: float,
    block_table: Tensor | None = None, *, num_splits: int | None = None, block_n: int = BLOCK_N,
    target_programs: int = TARGET_PROGRAMS, num_warps: int | None = None, num_stages: int = 2,
) -> Tensor:
    """See the module docstring. Keyword-only arguments: attention's tuning overrides."""
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    _check_attention(q, k, seq_lens, starts)
    if not fused_supported(q):
        q_rot = rotary_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, seq_lens,
                                          block_table)
        return cache_attention_read_triton(q_rot, k_cache, v_cache, seq_lens, starts, scale,
                                           window, softcap, block_table)
    B, H, T, D = q.shape
    KV = k_cache.shape[2]
    S = check_paged(q, k_cache, v_cache, block_table, "rotary_cache_attention")
    page = 0 if block_table is None else k_cache.shape[1]
    table = seq_lens if block_table is None else block_table.contiguous()  # unused when page = 0
    R = cos.shape[-1]
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    cos, sin = cos.expand(B, T, R), sin.expand(B, T, R)  # broadcast dims become stride 0
    M, programs, splits, acc, ml, fp32_dots = split_scratch(q, k_cache, num_splits, block_n,
                                                            target_programs, S)
    block_d = max(16, triton.next_power_of_2(D))
    log2e = 1.4426950408889634
    pdl = pdl_launch(q.device, one_row=T == 1)  # several rows: measured slower with it
    _rotary_split_kernel[(programs, splits)](
        q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts, table, acc, ml,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(),
        S, KV, T, D, M,
        scale if softcap else scale * log2e, float(softcap), int(window), table.shape[-1],
        R=R, NUM_SPLITS=splits, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
        BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_D=block_d,
        HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap), FP32_DOTS=fp32_dots,
        num_warps=num_warps or 4, num_stages=num_stages,
        # mul, mul, add as three roundings: the rotation stays bit-equal to the rotary kernel's.
        enable_fp_fusion=False, PDL=bool(pdl), PAGE=page, **pdl,
    )
    _combine_kernel[(B * H * T,)](
        acc, ml, out, H, KV, T, D, M,
        NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2, PDL=bool(pdl), **pdl,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Custom op: CPU (and any other device) runs the reference, CUDA runs the Triton kernels.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::rotary_cache_attention", mutates_args=("k_cache", "v_cache"))
def rotary_cache_attention(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    seq_lens: Tensor, starts: Tensor, scale: float, window: int, softcap: float,
    block_table: Tensor | None = None,
) -> Tensor:
    """rotary_cache_write then cache_attention_read (module docstring): writes rope(k) and v at
    the caches' slots seq_lens[b] + t, returns attention's [B, T, H, D] (contiguous, q's dtype).
    CPU: the two references; CUDA: one split-K launch and the combine."""
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    _check_attention(q, k, seq_lens, starts)
    return rotary_cache_attention_reference(q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts,
                                            scale, window, softcap, block_table)


@rotary_cache_attention.register_fake
def _rotary_cache_attention_fake(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    seq_lens: Tensor, starts: Tensor, scale: float, window: int, softcap: float,
    block_table: Tensor | None = None,
) -> Tensor:
    _check(q, k, cos, sin)
    _check_cache(q, k, v, k_cache, v_cache, seq_lens, block_table)
    _check_attention(q, k, seq_lens, starts)
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D))


rotary_cache_attention.register_kernel("cuda")(rotary_cache_attention_triton)


def rotary_cache_attention_split(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    seq_lens: Tensor, starts: Tensor, scale: float, window: int, softcap: float,
    block_table: Tensor | None = None,
) -> Tensor:
    """The same call as the two ops it fuses (what a CPU compile runs: fuser/compile_cpu.py
    inlines cache_attention_read's reference into its C++ kernels)."""
    q_rot = torch.ops.fuser.rotary_cache_write.default(q, k, v, cos, sin, k_cache, v_cache,
                                                     seq_lens, block_table)
    return torch.ops.fuser.cache_attention_read.default(q_rot, k_cache, v_cache, seq_lens, starts,
                                                        scale, window, softcap, block_table)


# ---------------------------------------------------------------------------------------------
# Reference: the two ops' references, one after the other (same roundings: rope(q) in q's dtype).
# ---------------------------------------------------------------------------------------------


def rotary_cache_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
    seq_lens: Tensor, starts: Tensor, scale: float, window: int, softcap: float,
    block_table: Tensor | None = None,
) -> Tensor:
    q_rot = rotary_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, seq_lens,
                                         block_table)
    return cache_attention_reference(q_rot, k_cache, v_cache, seq_lens, starts, scale, window,
                                     softcap, block_table)
