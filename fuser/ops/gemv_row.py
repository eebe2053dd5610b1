"""The decode GEMV's K step at one row, and what every row count shares: the weight tile's
load, the input tile (the norm prologue's normalised x), the split-K sum in one launch.

Pieces of fuser/ops/linear.py's _linear_kernel (Triton functions, inlined where they are
called); the several-row MMA steps are in fuser/ops/gemv_rows.py.
"""

import triton
import triton.language as tl

from fuser.ops.rmsnorm import _load_block, _normalise


@triton.jit
def _norm_x_tile(x_ptrs, r_ptrs, g_ptr, k, mask, k_ok, rstd, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """The GEMV's input tile at columns k, in x's dtype. x_ptrs / r_ptrs: row starts (broadcast
    against k), mask: rows and columns in bounds, k_ok: columns in bounds (k's shape).

    Without NORM that is x. With NORM it is the value fuser::rms_norm / add_rms_norm writes,
    g * (h * rstd).to(dtype) rounded once, h = x (+ r) rounded to x's dtype, computed by
    rmsnorm.py's own helpers (_load_block, _normalise) in the same order: the same bits for the
    same rstd.
    """
    if NORM:
        h = _load_block(x_ptrs, r_ptrs, x_ptrs, k, mask, HAS_RESIDUAL, False)
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
        return _normalise(h, rstd, g, x_ptrs.dtype.element_ty).to(x_ptrs.dtype.element_ty)
    return tl.load(x_ptrs + k, mask=mask, other=0.0)


@triton.jit
def _k_ok(k, k_hi, EVEN_K: tl.constexpr):
    """k < k_hi, or a constant True where the launcher knows every K step is whole (EVEN_K):
    the masks then fold away (on sm_90 a 5-row FP8 GEMV's K loop at 128 x 128 tiles drops from
    197 to 178 instructions, the predicate logic gone)."""
    if EVEN_K:
        return tl.full(k.shape, 1, tl.int1)
    return k < k_hi


@triton.jit
def _w_tile(w_rows, col_ok, k, k_hi, EVEN_K: tl.constexpr = False):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k (masked past k_hi: a predicated-off load
    moves no bytes)."""
    return tl.load(w_rows + k[None, :], mask=col_ok[:, None] & _k_ok(k, k_hi, EVEN_K)[None, :],
                   other=0.0)


@triton.jit
def _row_step(acc, squares, w, x_row, r_row, g_ptr, sum_ptr, k, k_hi, rstd, NORM: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, RSTD_LAST: tl.constexpr, STORE_SUM):
    """One K step of the one-row GEMV: (acc [BLOCK_N] + w [BLOCK_N, BLOCK_K] . x[k] in fp32,
    squares). With acc [BLOCK_N, BLOCK_K // ROW_VEC] (the kernel's ROW_VEC) each run of ROW_VEC
    columns, the run a thread loads as one 16-byte vector, adds its products to its own partial:
    sums inside each thread, no reduction across threads until the loop ends: compiled for sm_90
    the FP8 K loop drops from 525 to 461 instructions at gate/up's 128 x 256 tiles, from 351 to
    298 at qkv's 8 x 1024 and from 299 to 247 at down_proj's; the sum's order changes, not its
    terms. (x loaded in w's tile shape instead, which drops the sm_90 code's shared-memory
    broadcast of x between two barriers per step, measured slower on the H200; so did the K loop
    as `tl.range(..., num_stages=3 or 4)`, its loads software-pipelined through shared memory:
    docs/performance-notes.md.)

    NORM with RSTD_LAST: x[k] is g * h (fp32, h = x (+ r) rounded to x's dtype), squares
    [BLOCK_K] gathers h * h for the rstd that multiplies acc after the loop (_rstd_last), and
    STORE_SUM (program 0) writes h to summed."""
    k_ok = k < k_hi
    if NORM and RSTD_LAST:
        h = _load_block(x_row, r_row, sum_ptr, k, k_ok, HAS_RESIDUAL, False)
        if HAS_RESIDUAL:  # one writer (a predicated store: no branch in the loop)
            tl.store(sum_ptr + k, h.to(sum_ptr.dtype.element_ty),
                     mask=k < tl.where(STORE_SUM, k_hi, 0))
        squares += h * h
        x = h * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x = _norm_x_tile(x_row, r_row, g_ptr, k, k_ok, k_ok, rstd, NORM, HAS_RESIDUAL)
    prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
    runs: tl.constexpr = acc.shape[1]  # acc [BLOCK_N, BLOCK_K // ROW_VEC]: one partial per run
    acc += tl.sum(tl.reshape(prod, [acc.shape[0], runs, prod.shape[1] // runs]), axis=2)
    return acc, squares


@triton.jit
def _rstd_last(acc, squares, K, eps):
    """The one-row GEMV's sum times the norm's rstd = rsqrt(sum(h^2) / K + eps) (fp32, as
    rmsnorm.py), from the squares its K loop gathered: rstd is one number per row, so
    sum_k w[n, k] g[k] h[k] rstd = rstd * sum_k w[n, k] (g[k] h[k])."""
    return acc * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _sum_splits(acc, part_ptr, count_ptr, pid, SIZE: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split-K in one launch: (sum of the SPLIT_K partial accumulators of column block `pid`,
    whether this program is the one that summed them).

    Every program of the block stores its fp32 partial, then increments the block's counter
    (acq_rel, GPU scope; the barrier first, so that all of this program's warps have stored).
    The program that sees SPLIT_K - 1 arrived last: every other partial is visible to it. It
    reads them with L2-only loads (.cg: an L1 line of this SM could hold a previous call's
    partial), adds them in split order, the same order whichever program is last, so the result
    is deterministic, and resets the counter to zero for the next call or graph replay. The
    others return zeros and store nothing.
    """
    idx = tl.arange(0, SIZE)
    parts = part_ptr + pid.to(tl.int64) * (SPLIT_K * SIZE)
    tl.store(parts + tl.program_id(1) * SIZE + idx, tl.reshape(acc, [SIZE]))
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros([SIZE], dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(parts + s * SIZE + idx, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0)
    return tl.reshape(total, acc.shape), last
