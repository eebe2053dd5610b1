"""The prefill's attention as one Triton kernel: causal flash attention over the T new tokens
with each row's left padding, sliding window, softcap and grouped kv heads.

    flash_prefill(q, k, v, query_slots, starts, scale, window, softcap) -> [B, T, H, D]
    flash_prefill(q, k_pool, v_pool, query_slots, starts, ..., block_table=table)
        a chunk of T queries (at any slots, e.g. after a cached prefix) over a paged cache that
        already holds their keys: pools [num_blocks, PAGE, KV, D], table [B, max_blocks] int32,
        keys at every slot of the row (fuser/ops/paged.py). A prefix-cache hit's prefill.

The same visibility as `attention.masked_attention`: key j is visible to query i when
starts[b] <= j <= query_slots[b, i] (and i - j < window where window > 0). Per (query block,
batch row, head) one program walks the key blocks that can be visible to its queries (from the
row's start, or the window's first key, to the block's last query slot), keeping the running max
and sum of the softmax in fp32 (online softmax, as FlashAttention does): no [T, T] scores in
memory. Scores in fp32 (exp2 of the scores times scale * log2(e)); probabilities rounded to v's
dtype before P @ V, as the reference rounds them. A kv head serves its group of query heads by
index (h // (H / kv_heads)): no repeated k/v copies.

A small grid (a prefix hit's chunk: 128 queries, B = 1, 32 heads -> 32 programs on a 132-SM
GPU, each walking every key block in turn) splits the key range as flash-decoding does: a
third grid axis of `splits` programs per (query block, b, h), each running the online softmax
over an equal share of its query block's key blocks and writing fp32 partials (acc [T, D],
running max and sum [T]) to scratch; `_combine_splits_kernel` merges them (log-sum-exp
rescaling) into [B, T, H, D]. `prefill_splits` picks the count from the shapes alone (so a captured
graph holds for any slots): as many as fill one wave of the GPU's programs (SMS), with >=
MIN_SPLIT_BLOCKS key blocks a split; 1 is the single kernel as before. The count is a runtime
argument of one compiled split kernel, so a build that ran one count compiled them all.

Left-padding rows (query_slots < starts) see no key; their output is 0, where the reference
averages every value: no real row reads a padding row's output (its key is never visible to
one), and both are finite.

Why not torch SDPA: its flash kernel takes no mask, and with the boolean mask a padded batch
needs it picks the memory-efficient kernel: 363 us per layer at the 8B shape's 2048-token
prefill on the H200 (docs/performance-notes.md), ~4x the causal FLOPs' time.

Cost per (batch row, head), causal: FLOPs ~ 2 T^2 D (half of the 4 T^2 D of full attention);
bytes ~ T D (q, out) + (T / BLOCK_M) T D / 2 (k and v re-read per query block) in q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.paged import _cache_rows

LOG2E = math.log2(math.e)
MIN_BLOCK = 16  # tl.dot's smallest tile side
# The split rule's GPU: 132 SMs (H100 SXM, H200). At the D = 128 bf16 tiles (BLOCK_M 64,
# 4 warps) a program takes ~184 registers a thread for sm_90 (~200-215 at 128 rows and 8
# warps): an SM's 64K registers hold two programs (one at 8 warps). A grid's time is then
# about its waves times the longest program's key blocks, so the split fills ONE wave of the
# resident programs, not more (more splits of fewer blocks run in two waves and write twice
# the scratch). A grid of a wave or more is never split.
SMS = 132
MIN_SPLIT_BLOCKS = 2  # key blocks a split gets at least (of the most the shapes allow)
MAX_SPLITS = 16
COMBINE_ROWS = 16  # query rows per program of the combine on the GPU ([16, D] fp32 tiles)


@triton.jit
def _attend(acc, m_i, l_i, q, qi, start, n0, k_base, v_base, sk_t, sv_t, offs_d, T, qk_scale,
            softcap, table_row, MASKED: tl.constexpr, WINDOW: tl.constexpr,
            SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOTS: tl.constexpr,
            PAGE: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) into the running (acc, max, sum) of the online softmax.
    MASKED: apply the visibility mask (else every key of the block is visible to every row).
    T: the keys there are (slots 0..T-1); PAGE > 0: key j is pool row _cache_rows(j)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    keys = _cache_rows(offs_n, key_ok, table_row, PAGE)            # [BLOCK_N] rows of k, v
    if MASKED:
        k = tl.load(k_base + keys[:, None] * sk_t + offs_d[None, :], mask=key_ok[:, None],
                    other=0.0)
    else:
        k = tl.load(k_base + keys[:, None] * sk_t + offs_d[None, :])
    if FP32_DOTS:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))                                         # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        # softcap * tanh(x / softcap) = softcap * (1 - 2 / (exp(2x / softcap) + 1))
        x = s * (qk_scale / 1.4426950408889634) / softcap
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
    else:
        s = s * qk_scale
    if MASKED:
        visible = (offs_n[None, :] >= start) & (offs_n[None, :] <= qi[:, None]) & key_ok[None, :]
        if WINDOW > 0:
            visible = visible & (qi[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_base + keys[:, None] * sv_t + offs_d[None, :], mask=key_ok[:, None],
                    other=0.0)
    else:
        v = tl.load(v_base + keys[:, None] * sv_t + offs_d[None, :])
    p = p.to(v.dtype)  # the reference rounds the probabilities to v's dtype too
    if FP32_DOTS:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit(do_not_specialize=["splits"])
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,     # q [B, H, T, D], k/v [B, KV, T, D], out [B, T, H, D]
                                      # (PAGE > 0: k/v pools [num_blocks, PAGE, KV, D])
    slots_ptr, starts_ptr,            # query_slots [B, T] int64 (contiguous), starts [B] int64
    table_ptr,                        # PAGE > 0: block table [B, max_blocks] int32 (else unused)
    acc_ptr, ml_ptr,                  # SPLIT: fp32 scratch acc [B * H, splits, T, D] and
                                      # ml [B * H, splits, 2, T] (else unused)
    sq_b, sq_h, sq_t,                 # q strides (d stride 1)
    sk_b, sk_h, sk_t,                 # k strides (d stride 1)
    sv_b, sv_h, sv_t,                 # v strides (d stride 1)
    T, H, GROUP,                      # GROUP = H // KV: query heads per kv head
    N_KEYS,                           # keys at slots 0..N_KEYS-1: T, or max_blocks * PAGE
    max_blocks,                       # PAGE > 0: the table's row stride
    splits,                           # SPLIT: programs per (query block, b, h) (grid axis 2),
                                      # a runtime value: one compiled kernel for every count
    qk_scale,                         # scale * log2(e): scores in base 2
    softcap,                          # 0: none; else softcap * tanh(score / softcap)
    WINDOW: tl.constexpr,             # 0: none
    SOFTCAP: tl.constexpr,
    D: tl.constexpr,                  # head dim, a power of two >= 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOTS: tl.constexpr,          # fp32 operands, IEEE products (fp32 models; the
                                      # interpreter, whose bf16 dot is wrong)
    MASK_ALL: tl.constexpr,           # mask every key block (else only the blocks that need it)
    PAGE: tl.constexpr = 0,           # slots per block of a paged cache; 0: k, v as they are
    SPLIT: tl.constexpr = False,      # each program over its share of the key blocks, partials
                                      # to scratch; else the whole range, out directly
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    qi = tl.load(slots_ptr + b * T + offs_m, mask=row_ok, other=-1)      # [BLOCK_M] slots
    start = tl.load(starts_ptr + b)

    # Keys that any query of this block may see: [lo, hi).
    highest = tl.max(qi, axis=0)
    lowest = tl.min(tl.where(row_ok, qi, N_KEYS), axis=0)
    hi = tl.minimum(highest + 1, N_KEYS)
    lo = start
    if WINDOW > 0:
        lo = tl.maximum(lo, lowest - WINDOW + 1)
    lo = tl.maximum(lo, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    if SPLIT:
        # This split's share of the n key blocks of [lo, hi): blocks [split * n // splits,
        # (split + 1) * n // splits), so shares differ by one block at most (empty where
        # n < splits). The online softmax below runs over it alone.
        split = tl.program_id(2)
        n = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
        first = lo + (split * n // splits) * BLOCK_N
        hi = tl.minimum(lo + ((split + 1) * n // splits) * BLOCK_N, hi)
        lo = first

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if PAGE:  # the pools' rows hold KV * D elements: sk_t = sv_t = KV * D, sk_h = sv_h = D
        k_base = k_ptr + kvh * sk_h
        v_base = v_ptr + kvh * sv_h
    else:
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
    table_row = table_ptr + b * max_blocks
    if MASK_ALL:
        for n0 in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, qi, start, n0, k_base, v_base, sk_t, sv_t,
                                    offs_d, N_KEYS, qk_scale, softcap, table_row, True, WINDOW,
                                    SOFTCAP, BLOCK_N, FP32_DOTS, PAGE)
    else:
        # Blocks whose every key every row of this block sees: [full_lo, full_hi), block
        # aligned: past the start (and inside every row's window), up to the lowest row's slot.
        full_lo = tl.cdiv(start, BLOCK_N) * BLOCK_N
        if WINDOW > 0:
            full_lo = tl.maximum(full_lo, tl.cdiv(highest - WINDOW + 1, BLOCK_N) * BLOCK_N)
        full_hi = ((tl.minimum(lowest, N_KEYS - 1) + 1) // BLOCK_N) * BLOCK_N
        mid = tl.minimum(tl.maximum(full_lo, lo), hi)
        end = tl.maximum(tl.minimum(full_hi, hi), mid)
        for n0 in range(lo, mid, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, qi, start, n0, k_base, v_base, sk_t, sv_t,
                                    offs_d, N_KEYS, qk_scale, softcap, table_row, True, WINDOW,
                                    SOFTCAP, BLOCK_N, FP32_DOTS, PAGE)
        for n0 in range(mid, end, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, qi, start, n0, k_base, v_base, sk_t, sv_t,
                                    offs_d, N_KEYS, qk_scale, softcap, table_row, False, WINDOW,
                                    SOFTCAP, BLOCK_N, FP32_DOTS, PAGE)
        for n0 in range(end, hi, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, qi, start, n0, k_base, v_base, sk_t, sv_t,
                                    offs_d, N_KEYS, qk_scale, softcap, table_row, True, WINDOW,
                                    SOFTCAP, BLOCK_N, FP32_DOTS, PAGE)
    if SPLIT:
        part = bh.to(tl.int64) * splits + tl.program_id(2)              # [B * H, splits] slot
        tl.store(acc_ptr + (part * T + offs_m[:, None]) * D + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2 * T + offs_m, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 * T + T + offs_m, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = out_ptr + ((b * T + offs_m[:, None]) * H + h) * D + offs_d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["splits"])
def _combine_splits_kernel(
    acc_ptr, ml_ptr,                  # the split programs' scratch (see _flash_prefill_kernel)
    out_ptr,                          # [B, T, H, D] contiguous
    T, H,
    splits,                           # the split programs' count (runtime: one kernel for all)
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Per (block of BLOCK_T query rows, b * H + h): out = sum_s 2^(m_s - m) acc_s /
    sum_s 2^(m_s - m) l_s with m = max_s m_s (the scores are in base 2). A row no split saw a
    key for (m = -inf everywhere: left padding) gets 0, as the unsplit kernel writes."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    row_ok = offs_t < T
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    for s in range(splits):
        m_s = tl.load(ml_ptr + (bh * splits + s) * 2 * T + offs_t, mask=row_ok,
                      other=float("-inf"))
        m = tl.maximum(m, m_s)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key anywhere: every weight below is 0
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    l = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s in range(splits):
        part = bh * splits + s
        m_s = tl.load(ml_ptr + part * 2 * T + offs_t, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + part * 2 * T + T + offs_t, mask=row_ok, other=0.0)
        w = tl.math.exp2(m_s - m)                                        # empty split: 0
        acc_s = tl.load(acc_ptr + (part * T + offs_t[:, None]) * D + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
        acc += acc_s * w[:, None]
        l += l_s * w
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    out_rows = out_ptr + ((b * T + offs_t[:, None]) * H + h) * D + offs_d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def flash_prefill_supported(q: Tensor, k: Tensor) -> bool:
    """Head dims the kernel takes: a power of two from 16 to 256, q and k of one dtype, unit
    stride along it."""
    D = q.shape[-1]
    return (16 <= D <= 256 and D & (D - 1) == 0 and q.dtype == k.dtype
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.stride(-1) == 1 and k.stride(-1) == 1)


def _blocks(D: int, dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). On the GPU, for D <= 128 in 16-bit, 64
    query rows over 64 keys at 4 warps: on an H100 at the 8B shape it beat 128 rows at 8 warps
    in every case of benchmarks/flash_prefill.py, split or not (1.12x on a 2,048-token prompt,
    1.23x at 1,024, 1.18x on a 512-token chunk, 1.13x on a 128-token prefix hit split 4 ways;
    benchmarks/RESULTS.md). fp32 operands and D = 256 take smaller key tiles to fit shared
    memory; under the interpreter the smallest tiles, for speed."""
    if not on_gpu:
        return MIN_BLOCK, MIN_BLOCK, 1, 1
    if dtype == torch.float32 or D > 128:
        return 64, 32, 4, 2
    return 64, 64, 4, 3


def _tiles(D: int, dtype: torch.dtype, on_gpu: bool, block_m: int | None
           ) -> tuple[int, int, int, int]:
    """`_blocks`, with the block_m override (GPU only; 4 warps from 64 rows down, 8 above)."""
    if block_m is not None and (block_m < MIN_BLOCK or block_m & (block_m - 1)):
        raise ValueError(f"flash_prefill: block_m must be a power of two >= {MIN_BLOCK}, "
                         f"got {block_m}")
    BLOCK_M, BLOCK_N, warps, stages = _blocks(D, dtype, on_gpu)
    if block_m is not None and on_gpu and block_m != BLOCK_M:
        BLOCK_M, warps = block_m, 4 if block_m <= 64 else 8
    return BLOCK_M, BLOCK_N, warps, stages


def default_splits(B: int, H: int, T: int, n_keys: int, D: int, dtype: torch.dtype,
                   block_m: int | None = None) -> int:
    """The splits `flash_prefill` runs on the GPU by default for T queries over n_keys slots
    (`prefill_splits` of its grid; an SM holds one program of 8 warps, two of 4)."""
    BLOCK_M, BLOCK_N, warps, _ = _tiles(D, dtype, True, block_m)
    return prefill_splits(triton.cdiv(T, BLOCK_M) * B * H, triton.cdiv(n_keys, BLOCK_N),
                          SMS * max(1, 8 // warps))


def prefill_splits(programs: int, key_blocks: int, resident: int = SMS) -> int:
    """How many programs share each (query block, b, h)'s key blocks: as many as keep the
    grid within one wave of `resident` programs (1 where `programs` fill it already), with
    at least MIN_SPLIT_BLOCKS key blocks a split (of the `key_blocks` the shapes allow) and at
    most MAX_SPLITS. Depends on shapes only, so a CUDA graph captured once stays valid for any
    slots."""
    return max(1, min(resident // programs, key_blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


def flash_prefill(q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
                  scale: float, window: int, softcap: float, block_table: Tensor | None = None,
                  *, mask_all: bool = True, splits: int | None = None,
                  block_m: int | None = None) -> Tensor:
    """q [B, H, T, D], k/v [B, KV, T, D] (key t at slot t), query_slots [B, T], starts [B]
    -> [B, T, H, D] contiguous in q's dtype. See the module's docstring. With block_table
    [B, max_blocks] int32, k/v are pools [num_blocks, PAGE, KV, D] (contiguous) holding every
    key the queries see, query_slots where the queries sit (e.g. a cached prefix's length + t).

    mask_all=False masks only the key blocks that straddle a row's start, window edge or
    diagonal (the Triton fused-attention tutorial's split): the same result, less work per
    fully visible block. Not yet timed on a GPU, so not the default.

    splits: programs per (query block, b, h), each over an equal share of the key blocks its
    queries may see, combined by `_combine_splits_kernel` (flash-decoding); 1 runs the single
    kernel. None: on CUDA over a paged cache (a prefix hit's chunk) `default_splits`; else 1:
    the contiguous prefill, whose small grids are short prompts (and whose build warm-up,
    at T <= 32, never splits: a split there would compile at the first long enough prompt;
    a chunk's warm-up splits wherever a bucket's chunks can), and the interpreter.
    block_m: query rows per program on the GPU (a tuning override of `_blocks`' 64; 8 warps
    above 64 rows)."""
    B, H, T, D = q.shape
    if block_table is None:
        KV, n_keys, page, max_blocks = k.shape[1], T, 0, 1
        assert k.shape == v.shape == (B, KV, T, D), (q.shape, k.shape, v.shape)
        table = starts  # unused
    else:
        _, page, KV, _ = k.shape
        assert k.shape == v.shape and k.shape[3] == D, (q.shape, k.shape, v.shape)
        assert block_table.shape[0] == B and block_table.dtype == torch.int32, block_table.shape
        k, v, table = k.contiguous(), v.contiguous(), block_table.contiguous()
        max_blocks = table.shape[1]
        n_keys = max_blocks * page
    assert H % KV == 0, f"{H} query heads do not group over {KV} kv heads"
    if splits is not None and splits < 1:
        raise ValueError(f"flash_prefill: splits must be >= 1, got {splits}")
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if v.stride(-1) != 1:
        v = v.contiguous()
    if block_table is None:
        strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    else:
        strides = (0, D, KV * D, 0, D, KV * D)  # pool rows of KV * D; kv head h at h * D
    slots = query_slots.to(torch.int64).expand(B, T).contiguous()
    starts = starts.to(torch.int64).contiguous()
    BLOCK_M, BLOCK_N, warps, stages = _tiles(D, q.dtype, q.is_cuda, block_m)
    grid = (triton.cdiv(T, BLOCK_M), B * H)
    if splits is None:
        splits = default_splits(B, H, T, n_keys, D, q.dtype, block_m) \
            if q.is_cuda and block_table is not None else 1
    if splits > 1:
        acc = torch.empty(B * H, splits, T, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * H, splits, 2, T, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    _flash_prefill_kernel[grid + (splits,)](
        q, k, v, out, slots, starts, table, acc, ml,
        q.stride(0), q.stride(1), q.stride(2),
        *strides,
        T, H, H // KV, n_keys, max_blocks, splits, scale * LOG2E, float(softcap),
        WINDOW=int(window), SOFTCAP=bool(softcap), D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        FP32_DOTS=q.dtype == torch.float32 or not q.is_cuda, MASK_ALL=mask_all,
        num_warps=warps, num_stages=stages, PAGE=page, SPLIT=splits > 1,
    )
    if splits > 1:
        block_t = COMBINE_ROWS if q.is_cuda else MIN_BLOCK
        _combine_splits_kernel[(triton.cdiv(T, block_t), B * H)](
            acc, ml, out, T, H, splits, D=D, BLOCK_T=block_t, num_warps=4,
        )
    return out
