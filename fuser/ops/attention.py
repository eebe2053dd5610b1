"""Attention of T new queries over the engine's KV cache (decode T = 1, verification T <= 16).

    cache_attention_read(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap)
        q: [B, H, T, D] (any strides); k_cache, v_cache: [B, S, KV, D] contiguous, already holding
        this step's k/v at slots seq_lens[b] + t; seq_lens, starts: [B] int64.
        -> [B, T, H, D] contiguous, in q's dtype.
    cache_attention_read(..., block_table)
        the paged cache (runtime/blocks.py): k_cache, v_cache: [num_blocks, PAGE, KV, D] pools
        contiguous; block_table: [B, max_blocks] int32; row b's slot j lives in block
        block_table[b, j // PAGE] at offset j % PAGE (S = max_blocks * PAGE slots per row).
        Same math: `paged_view` gathers a row's blocks into the contiguous layout.

Query t of row b sits at slot i = seq_lens[b] + t; key slot j is visible iff
starts[b] <= j <= i and (window == 0 or i - j < window). Scores s = (q . k) * scale in fp32,
s = tanh(s / softcap) * softcap when softcap != 0, softmax in fp32 over visible keys, probs cast to
v's dtype, out = probs @ v: the non-prefill branch of fuser/capture.py's `cache_attention`
(`cache_attention_reference` below is that math, standalone).

The prefill branch (the cache was empty: the T new tokens attend among themselves) is
`fuser::prefill_attention`, the same visibility: its reference is `masked_attention` (fp32
scores for all T x T pairs, what CPU runs and inlines), and on CUDA a causal flash kernel in
Triton (fuser/ops/flash_prefill.py; torch's scaled_dot_product_attention with a boolean mask,
`prefill_attention_sdpa`, where that kernel does not apply): one fused kernel without the
T x T scores in memory (at T = 2048 on a 32-head model those are 512 MB of fp32 per layer).

A query that sees no key (only dummy rows can: starts[b] > seq_lens[b] + t, or the window past
everything) is undefined in the model. The reference gives the uniform average of v over all S
slots (its mask value is finfo.min, not -inf); the Triton kernel gives zeros. Both are finite.

Triton implementation (split-K / flash-decoding):
  kernel 1, grid (B * KV, num_splits): one program takes the rep * T query rows of one kv head
    (rep = H // KV) as one [BLOCK_M >= 16, BLOCK_D] tile, walks its share of the BLOCK_N-slot
    blocks between the first visible slot (starts, window) and the last (seq_lens + T - 1),
    keeping the online-softmax state (running max m, sum l, accumulator acc; fp32), and writes
    (acc, m, l) to fp32 scratch.
  kernel 2, grid (B * H * T,): merges the splits of one query row by log-sum-exp and writes it.
  Paged (PAGE > 0, a constexpr: the contiguous build is unchanged): each BLOCK_N-slot load
  gathers its slots' rows through the block table (`_cache_rows`), an int32 read per slot
  (cached: the BLOCK_N slots share one or two table entries when PAGE >= BLOCK_N).

Cost per (b, kv head), with L = visible slots (seq_lens + T - starts, or ~window + T), s = element
size of the cache, M = rep * T query rows:
    bytes  = 2 * L * D * s  (K and V, each read once for the whole GQA group)
           + M * D * (s_q + s_out) + scratch 2 * num_splits * M * (D + 2) * 4
    FLOPs ~= 4 * M * L * D  (q.k^T and p.v) + ~5 * M * L (scale, mask, exp, max/sum)
Decode (T = 1) is memory bound on K/V; at rep * T = 128 (rep 8, T 16) the two dots dominate.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.flash_prefill import flash_prefill, flash_prefill_supported
from fuser.ops.paged import _cache_rows, paged_view
from fuser.ops.pdl import pdl_launch, wait_for_inputs

BLOCK_N = 64          # key slots per inner-loop step
TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): latency of one hides behind the other
MAX_SPLITS = 128


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp (libdevice is not available under TRITON_INTERPRET).

    Absolute error ~1e-7 (the rounding of e); tanh is odd, so use exp(-2|x|) <= 1: no overflow.
    """
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_block(
    q, k, v,           # q: [BLOCK_M, BLOCK_D] (MMA dtype or fp32); k, v: [BLOCK_N, BLOCK_D] keys, values
    j, j_ok,           # [BLOCK_N] slots of the keys; which of them exist (loaded, not padding)
    slot_i, start,     # [BLOCK_M] slot of each query; the row's first real slot
    m_i, l_i, acc,     # online-softmax state: running max (log2 units), sum, unnormalised p @ v
    scale_log2e, softcap, window,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32_DOTS: tl.constexpr,
):
    """One step of the online softmax over the keys j: with s = scores in log2 units, masked
    to -inf where key j is invisible to query i (j < start, j > i, i - j >= window, missing),
        m' = max(m, max_j s),  p = 2^(s - m'),  l' = l 2^(m - m') + sum_j p,
        acc' = acc 2^(m - m') + p @ v.          Returns (m', l', acc')."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if FP32_DOTS:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))                      # bf16/fp16 MMA, fp32 accumulate
    # s: [BLOCK_M, BLOCK_N] fp32
    if HAS_SOFTCAP:
        s = _tanh(s * scale_log2e / softcap) * (softcap * LOG2E)
    else:
        s = s * scale_log2e                              # log2 units: exp2 below
    visible = (j[None, :] >= start) & (j[None, :] <= slot_i[:, None]) & j_ok[None, :]
    if HAS_WINDOW:
        visible = visible & (slot_i[:, None] - j[None, :] < window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 there so that
    # exp2(-inf - -inf) = NaN never appears (p and alpha are then exactly 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # The reference rounds the normalised probs to v's dtype; the MMA path rounds the
    # unnormalised p (in [0, 1]) instead: a rounding of the same size, which the bf16/fp16
    # tolerance of the tests covers. The fp32 path does not round.
    if FP32_DOTS:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_cache(
    q, k_ptr, v_ptr,   # q: [BLOCK_M, BLOCK_D]; k_cache, v_cache: [B, S, KV, D] contiguous
                       # (or the [num_blocks, PAGE, KV, D] pools when PAGE > 0)
    kv_row,            # offset of (b, slot 0, kv head) in the caches (int64); of kv head (PAGE)
    table_row,         # PAGE > 0: this row's block table [max_blocks] int32
    slot_i, start, seq_len, window,
    split, limit,      # this program's split; slots >= limit are never loaded (S, or the new slots)
    hi,                # last slot any query of the group may see
    m_i, l_i, acc,
    scale_log2e, softcap,
    KV, D,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32_DOTS: tl.constexpr,
    PAGE: tl.constexpr,
):
    """The split `split` of the cache walk: visible slots of the whole group are [lo, hi]; the
    BLOCK_N-slot blocks holding them (aligned: whole-block loads) are shared out over the
    NUM_SPLITS programs, and each block goes through `_attend_block`. Returns (m, l, acc)."""
    lo = tl.maximum(start, 0)
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window + 1)          # first slot the earliest query sees
    base = (lo // BLOCK_N) * BLOCK_N
    n_blocks = tl.maximum(tl.cdiv(hi + 1 - base, BLOCK_N), 0)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, n_blocks)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    offs_n = tl.arange(0, BLOCK_N)
    for blk in range(first, last):
        j = base + blk * BLOCK_N + offs_n                   # [BLOCK_N] key slots
        j_ok = (j >= 0) & (j < limit)
        kv_offs = kv_row + _cache_rows(j, j_ok, table_row, PAGE)[:, None] * (KV * D) + cols[None, :]
        kv_mask = j_ok[:, None] & col_ok[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, j, j_ok, slot_i, start, m_i, l_i, acc,
                                      scale_log2e, softcap, window,
                                      HAS_WINDOW, HAS_SOFTCAP, FP32_DOTS)
    return m_i, l_i, acc


@triton.jit
def _store_partial(
    acc_ptr, ml_ptr, part, rows, acc, m_i, l_i, M, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Write one program's (acc, m, l) to the scratch slot `part` = (b * KV + kv head) * splits
    + split, for `_combine_kernel`."""
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_D)
    acc_ptrs = acc_ptr + (part * M + rows[:, None]) * D + cols[None, :]
    tl.store(acc_ptrs, acc, mask=row_ok[:, None] & (cols < D)[None, :])
    tl.store(ml_ptr + part * 2 * M + rows, m_i, mask=row_ok)
    tl.store(ml_ptr + part * 2 * M + M + rows, l_i, mask=row_ok)


@triton.jit
def _split_kernel(
    q_ptr,             # q: [B, H, T, D], strides sq_b, sq_h, sq_t, sq_d
    k_ptr, v_ptr,      # k_cache, v_cache: [B, S, KV, D] contiguous, or pools (PAGE > 0)
    seq_lens_ptr,      # [B] int64
    starts_ptr,        # [B] int64
    table_ptr,         # PAGE > 0: block table [B, max_blocks] int32 contiguous (else unused)
    acc_ptr,           # scratch [B * KV, NUM_SPLITS, M, D] fp32: unnormalised p @ v
    ml_ptr,            # scratch [B * KV, NUM_SPLITS, 2, M] fp32: running max (log2 units), sum
    sq_b, sq_h, sq_t, sq_d,
    S, KV, T, D, M,    # M = rep * T query rows per kv head; S slots per row (max_blocks * PAGE)
    scale_log2e,       # scale * log2(e) (no softcap) or scale (softcap: tanh comes first)
    softcap,
    window,
    max_blocks,        # PAGE > 0: the table's row stride
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,        # power of two >= max(16, M): tl.dot needs M, N, K >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,        # power of two >= max(16, D); D = 80 runs masked in 128
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32_DOTS: tl.constexpr,      # fp32 operands, IEEE products (fp32 caches; bf16 interpreted)
    PDL: tl.constexpr = False,    # launched with PDL: wait for the previous kernel (fuser/ops/pdl.py)
    PAGE: tl.constexpr = 0,       # slots per block of a paged cache; 0: contiguous [B, S, KV, D]
):
    wait_for_inputs(PDL)
    bk = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = bk // KV
    kvh = bk % KV
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.load(starts_ptr + b)

    # Query rows r = (head within the group) * T + t, for head h = kvh * rep + r // T.
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    col_ok = cols < D
    t = rows % T
    h = kvh * (M // T) + rows // T
    q_ptrs = q_ptr + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + cols[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if FP32_DOTS:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)                    # the cache's dtype: one MMA type
    slot_i = seq_len + t                                   # [BLOCK_M] slot of each query

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Visible slots of the whole group end at the last query's slot (seq_lens + T - 1).
    hi = tl.minimum(seq_len + T - 1, S - 1)
    kv_row = kvh * D if PAGE else b * S * KV * D + kvh * D
    m_i, l_i, acc = _attend_cache(
        q, k_ptr, v_ptr, kv_row, table_ptr + b * max_blocks, slot_i, start, seq_len, window,
        split, S, hi, m_i, l_i, acc, scale_log2e, softcap, KV, D,
        NUM_SPLITS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, FP32_DOTS, PAGE)
    _store_partial(acc_ptr, ml_ptr, bk * NUM_SPLITS + split, rows, acc, m_i, l_i, M, D,
                   BLOCK_M, BLOCK_D)


@triton.jit
def _combine_kernel(
    acc_ptr, ml_ptr,   # scratch from _split_kernel
    out_ptr,           # [B, T, H, D] contiguous
    H, KV, T, D, M,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,      # next power of two >= NUM_SPLITS
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # One program per output row (b, h, t): out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
    pid = tl.program_id(0).to(tl.int64)
    t = pid % T
    h = (pid // T) % H
    b = pid // (T * H)
    rep = H // KV
    bk = b * KV + h // rep
    r = (h % rep) * T + t
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    part = bk * NUM_SPLITS + splits
    m = tl.load(ml_ptr + part * 2 * M + r, mask=split_ok, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 * M + M + r, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + (part[:, None] * M + r) * D + cols[None, :],
                  mask=split_ok[:, None] & col_ok[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # no visible key anywhere: all w = 0
    w = tl.exp2(m - m_max)                                  # empty splits: exp2(-inf) = 0
    denom = tl.sum(w * l, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)              # ... and the output is 0, not NaN
    o = tl.sum(acc * w[:, None], axis=0) / denom
    out_row = out_ptr + ((b * T + t) * H + h) * D
    tl.store(out_row + cols, o.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _num_splits(programs: int, s: int, block_n: int, target_programs: int) -> int:
    # Decode has few (b, kv head) pairs (B * KV is often 8..64) against ~132 SMs, and one
    # program per pair would leave most SMs idle while each walks the whole cache. Split the
    # slots so B * KV * num_splits ~ target_programs, but never more splits than there are
    # blocks of the cache (a split with no block only costs a scratch write). Depends only on
    # shapes, never on seq_lens, so a CUDA graph captured once stays valid.
    n_blocks = triton.cdiv(s, block_n)
    return max(1, min(triton.cdiv(target_programs, programs), n_blocks, MAX_SPLITS))


def split_scratch(q: Tensor, k_cache: Tensor, num_splits: int | None, block_n: int,
                  target_programs: int, slots: int | None = None
                  ) -> tuple[int, int, int, Tensor, Tensor, bool]:
    """What a split-K launch over q [B, H, T, D] and k_cache [B, S, KV, D] (a paged pool: S =
    `slots`, the slots per row of its table) needs:
    (M = rep * T query rows per kv head, programs = B * KV, splits, the fp32 scratch
    acc [programs, splits, M, D] and ml [programs, splits, 2, M], fp32_dots). The MMA runs in
    the cache's dtype (fp32 accumulate) for bf16/fp16; IEEE fp32 for fp32 caches, and for bf16
    under TRITON_INTERPRET, whose bf16 dot is wrong (fp16 there takes the MMA path, so the CPU
    tests cover it)."""
    B, H, T, D = q.shape
    _, S, KV, _ = k_cache.shape
    S = S if slots is None else slots
    M = (H // KV) * T
    programs = B * KV
    splits = num_splits or _num_splits(programs, S, block_n, target_programs)
    acc = torch.empty((programs, splits, M, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((programs, splits, 2, M), dtype=torch.float32, device=q.device)
    fp32_dots = k_cache.dtype == torch.float32 or (
        q.device.type != "cuda" and k_cache.dtype == torch.bfloat16)
    return M, programs, splits, acc, ml, fp32_dots


def check_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor | None,
                op: str) -> int:
    """Validate a cache argument pair against q [B, H, T, D]: the contiguous [B, S, KV, D], or
    with a block table [B, max_blocks] int32 the pools [num_blocks, PAGE, KV, D]. Returns the
    slots per row (S, or max_blocks * PAGE)."""
    B, D = q.shape[0], q.shape[3]
    if k_cache.dim() != 4 or tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.shape[3] != D:
        raise ValueError(f"{op}: k_cache and v_cache must both be [B or num_blocks, S or PAGE, "
                         f"kv_heads, {D}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"{op}: the cache {tuple(k_cache.shape)} has not the {B} rows of q")
        return k_cache.shape[1]
    if (block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32
            or block_table.device != q.device):
        raise ValueError(f"{op}: block_table must be [{B}, max_blocks] int32 on {q.device}, got "
                         f"{tuple(block_table.shape)} {block_table.dtype} on {block_table.device}")
    return block_table.shape[1] * k_cache.shape[1]


def cache_attention_read_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
    *, num_splits: int | None = None, block_n: int = BLOCK_N,
    target_programs: int = TARGET_PROGRAMS, num_warps: int | None = None, num_stages: int = 2,
) -> Tensor:
    """See the module docstring. The keyword-only arguments are tuning overrides (tests); the
    defaults are what the engine runs."""
    B, H, T, D = q.shape
    KV = k_cache.shape[2]
    S = check_paged(q, k_cache, v_cache, block_table, "cache_attention_read")
    assert H % KV == 0, f"{H} query heads do not group over {KV} kv heads"
    assert seq_lens.shape == starts.shape == (B,)
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    starts = starts.to(torch.int64).contiguous()
    page = 0 if block_table is None else k_cache.shape[1]
    table = seq_lens if block_table is None else block_table.contiguous()  # unused when page = 0
    M, programs, splits, acc, ml, fp32_dots = split_scratch(q, k_cache, num_splits, block_n,
                                                            target_programs, S)
    block_m = max(16, triton.next_power_of_2(M))
    block_d = max(16, triton.next_power_of_2(D))
    log2e = 1.4426950408889634
    pdl = pdl_launch(q.device, one_row=T == 1)  # several rows: measured slower with it
    _split_kernel[(programs, splits)](
        q, k_cache, v_cache, seq_lens, starts, table, acc, ml,
        *q.stride(), S, KV, T, D, M,
        scale if softcap else scale * log2e, float(softcap), int(window), table.shape[-1],
        NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap), FP32_DOTS=fp32_dots,
        # 4 warps: measured as fast or faster than 8 at every Llama-3-8B case on an H200, up to
        # 2x at T = 9, ctx 8192 (docs/performance-notes.md).
        num_warps=num_warps or 4, num_stages=num_stages, PDL=bool(pdl), PAGE=page, **pdl,
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


@torch.library.custom_op("fuser::cache_attention_read", mutates_args=())
def cache_attention_read(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    return cache_attention_reference(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap,
                                     block_table)


@cache_attention_read.register_fake
def _cache_attention_read_fake(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D))


cache_attention_read.register_kernel("cuda")(cache_attention_read_triton)


@torch.library.custom_op("fuser::cache_attention", mutates_args=())
def cache_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    """What capture emits for a fixed-T step's attention over the cache: the reference math on
    every device. passes/attention.py turns it into `fuser::cache_attention_read` (the split-K
    kernel; the same schema, paged cache included) where the config asks for fused attention."""
    return cache_attention_reference(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap,
                                     block_table)


cache_attention.register_fake(_cache_attention_read_fake)

# Above this many queries a paged `fuser::cache_attention` (a chunk step's: no pass rewrites
# a step of dynamic T) runs the flash kernel's paged mode on CUDA; the fixed-T steps (at most
# 16 tokens) keep the reference there when fused attention is off.
CHUNK_FLASH_MIN_TOKENS = 16


def cache_attention_cuda(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    """fuser::cache_attention on CUDA: a paged chunk of many queries (a prefix-cache hit's
    prefill) through `flash_prefill` over the pools, the queries at slots seq_lens + t; the
    rest by the reference."""
    T = q.shape[2]
    if block_table is not None and T > CHUNK_FLASH_MIN_TOKENS and \
            flash_prefill_supported(q, k_cache):
        slots = seq_lens[:, None] + torch.arange(T, device=q.device)  # [B, T]
        return flash_prefill(q, k_cache, v_cache, slots, starts, scale, window, softcap,
                             block_table)
    return cache_attention_reference(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap,
                                     block_table)


cache_attention.register_kernel("cuda")(cache_attention_cuda)


# ---------------------------------------------------------------------------------------------
# Reference: fuser/capture.py cache_attention, non-prefill branch, after the cache write.
# ---------------------------------------------------------------------------------------------


def masked_attention(
    q: Tensor, keys: Tensor, values: Tensor, query_slots: Tensor, key_slots: Tensor,
    starts: Tensor, scale: float, window: int, softcap: float,
) -> Tensor:
    """Attention of q over keys/values by slot: the math every fuser attention path shares.

    q: [B, H, T, D]; keys, values: [B, kv_heads, S, D]; query_slots: [B, T]; key_slots: [S].
    Key j is visible to query i when starts <= j <= i (and i - j < window where window > 0).
    Scores and softmax in fp32; a query that sees nothing gets uniform weights (finfo.min, not
    -inf: a NaN there would leak through 0 * NaN into later layers). Returns [B, T, H, D].
    """
    B, H, T, D = q.shape
    kv_heads = keys.shape[1]
    # GQA: query heads grouped by their kv head, keys broadcast over the group (no copies; and
    # merging dims of an expanded view would make torch 2.11 export guard on a symbolic T).
    rep = H // kv_heads
    qg = q.float().unflatten(1, (kv_heads, rep))  # [B, kv_heads, rep, T, D]
    keys = keys.float()[:, :, None]  # [B, kv_heads, 1, S, D]
    values = values[:, :, None]  # [B, kv_heads, 1, S, D]
    scores = (qg @ keys.transpose(-1, -2)) * scale  # [B, kv_heads, rep, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    j = key_slots[None, None, :]  # [1, 1, S]
    i = query_slots[:, :, None]  # [B, T, 1]
    visible = (j >= starts[:, None, None]) & (j <= i)  # [B, T, S]
    if window:
        visible = visible & (i - j < window)
    scores = torch.where(visible[:, None, None], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = (probs @ values).flatten(1, 2)  # [B, H, T, D]
    return out.transpose(1, 2).to(q.dtype).contiguous()


@torch.library.custom_op("fuser::prefill_attention", mutates_args=())
def prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float,
) -> Tensor:
    """Attention among a prefill's T new tokens (the cache was empty): what capture emits for
    a prefill step's attention.

    q: [B, H, T, D]; k, v: [B, kv_heads, T, D], token t at slot t; query_slots: [B, T]; starts:
    [B]. Key j is visible to query i when starts <= j <= query_slots[i] (and within the window).
    -> [B, T, H, D] contiguous, q's dtype. CPU (and any device but CUDA) runs `masked_attention`
    (fp32 scores for every pair: the reference); CUDA runs `prefill_attention_cuda` (the
    Triton flash kernel of flash_prefill.py, or SDPA).
    """
    return prefill_attention_reference(q, k, v, query_slots, starts, scale, window, softcap)


@prefill_attention.register_fake
def _prefill_attention_fake(
    q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float,
) -> Tensor:
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D))


def prefill_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float,
) -> Tensor:
    """`masked_attention` over the T new keys at slots 0..T-1."""
    key_slots = torch.arange(k.shape[2], device=k.device)
    return masked_attention(q, k, v, query_slots, key_slots, starts, scale, window, softcap)


def prefill_attention_sdpa(
    q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float,
) -> Tensor:
    """The prefill's attention by torch's scaled_dot_product_attention with a boolean mask: a
    fused kernel (memory-efficient attention on CUDA), no [T, T] fp32 scores in memory.

    The same visibility as the reference, plus the diagonal: a query that sees no key (a left
    padding row, query_slots < starts) attends to its own key, where the reference averages
    every value; both are finite, and no real row reads a padding row's output (its key is
    never visible to one). Real rows see their own key anyway, so the diagonal changes nothing
    for them. Scores and softmax in fp32 inside the kernel. Kv heads are repeated to the query
    heads (head h reads kv head h // rep, as the reference groups them) so that the
    memory-efficient kernel takes the call. Softcap (tanh on the scores) is not an SDPA
    option: the reference runs then.
    """
    if softcap:
        return prefill_attention_reference(q, k, v, query_slots, starts, scale, window, softcap)
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    j = torch.arange(k.shape[2], device=q.device)                       # key slots [S]
    i = query_slots[:, :, None]                                         # [B, T, 1]
    visible = (j >= starts[:, None, None]) & (j <= i)                   # [B, T, S]
    if window:
        visible = visible & (i - j < window)
    visible = visible | (j[None, :] == torch.arange(T, device=q.device)[:, None])  # diagonal
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2).contiguous()


def prefill_attention_cuda(
    q: Tensor, k: Tensor, v: Tensor, query_slots: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float,
) -> Tensor:
    """fuser::prefill_attention on CUDA: the Triton flash kernel (fuser/ops/flash_prefill.py)
    where it takes the head dim and dtypes, else torch SDPA with a boolean mask."""
    if flash_prefill_supported(q, k):
        return flash_prefill(q, k, v, query_slots, starts, scale, window, softcap)
    return prefill_attention_sdpa(q, k, v, query_slots, starts, scale, window, softcap)


prefill_attention.register_kernel("cuda")(prefill_attention_cuda)


def cache_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    """T new queries over every slot of the cache (the new k/v already written); a paged cache
    is read through its block table (`paged_view`)."""
    if block_table is not None:
        k_cache, v_cache = paged_view(k_cache, block_table), paged_view(v_cache, block_table)
    T = q.shape[2]
    slots = seq_lens[:, None] + torch.arange(T, device=q.device)  # [B, T]
    key_slots = torch.arange(k_cache.shape[1], device=q.device)  # [S]
    return masked_attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots,
                            key_slots, starts, scale, window, softcap)


def cache_attention_grouped(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, starts: Tensor,
    scale: float, window: int, softcap: float, block_table: Tensor | None = None,
) -> Tensor:
    """`cache_attention_reference`'s math with each GQA group's rep * T queries as the rows of
    one matrix: the two products are batched GEMMs [rep * T, D] x [D, S] and [rep * T, S] x
    [S, D] per (b, kv head). What Inductor compiles on CPU (fuser.ops.CPU_INLINE): with
    rep * T > 1 it calls its GEMM kernel on materialized q and probabilities, where a
    one-row product would become a reduction that recomputes its inlined producers (rotary,
    softmax) for every key slot. Same values as the reference (fp32 scores and softmax).

    q: [B, H, T, D]; k_cache, v_cache: [B, S, KV, D] (or pools and their block table: read
    through `paged_view`). Returns [B, T, H, D] contiguous.
    """
    if block_table is not None:
        k_cache, v_cache = paged_view(k_cache, block_table), paged_view(v_cache, block_table)
    B, H, T, D = q.shape
    S, kv_heads = k_cache.shape[1], k_cache.shape[2]
    rep = H // kv_heads
    qg = q.float().reshape(B, kv_heads, rep * T, D)  # rows (r, t) of each group
    keys = k_cache.float().permute(0, 2, 3, 1)  # [B, KV, D, S]
    scores = (qg @ keys) * scale  # [B, KV, rep * T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = (seq_lens[:, None] + torch.arange(T, device=q.device))[:, :, None]  # [B, T, 1] query slots
    j = torch.arange(S, device=q.device)[None, None]  # [1, 1, S] key slots
    visible = (j >= starts[:, None, None]) & (j <= i)  # [B, T, S]
    if window:
        visible = visible & (i - j < window)
    visible = visible[:, None, None].expand(B, 1, rep, T, S).reshape(B, 1, rep * T, S)
    scores = torch.where(visible, scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    out = probs @ v_cache.permute(0, 2, 1, 3)  # [B, KV, rep * T, D]
    return out.reshape(B, H, T, D).transpose(1, 2).to(q.dtype).contiguous()
