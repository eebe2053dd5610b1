"""fuser::cache_attention_read: the split-K Triton launcher and the custom op against the reference.

Without a GPU the launcher runs under TRITON_INTERPRET=1 (conftest.py); with one it runs for real.
Only queries with at least one visible key are compared: for a query that sees nothing the
reference averages all S slots and the kernel writes zeros (both finite; checked separately).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.ops import attention  # noqa: F401  (registers torch.ops.fuser.cache_attention_read)
from fuser.ops.attention import cache_attention_read_triton, cache_attention_reference

pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# |out - ref| <= rtol * (|ref| + max|v|), elementwise. The output is a convex combination of
# v's rows, so max|v| is the natural scale of an absolute error.
TOLERANCE = {
    # Same math in a different summation order (blocked dots, online softmax rescaling by
    # exp2(m_old - m_new), the split merge, tanh from exp): a few fp32 ulps of max|v|
    # (measured <= ~1e-6 relative).
    torch.float32: 1e-5,
    # The reference rounds each normalised prob to bf16 (<= 2^-9 relative each, so <= 2^-9 *
    # max|v| on the sum) and the kernel keeps p in fp32; each side then rounds its output to
    # bf16 once (2^-9 |ref| each); bf16 products in the reference's p @ v add less. 2^-7
    # covers the sum with margin, and is still ~8x below what one key masked wrongly moves
    # the output by at these lengths (>= 1/96 of a v difference).
    torch.bfloat16: 2.0**-7,
    # fp16 takes the MMA path under the interpreter too (bf16 cannot: TRITON_INTERPRET's bf16
    # dot is wrong), and rounds p to fp16 before p @ v: the bf16 argument with 2^-11 units.
    torch.float16: 2.0**-9,
}


def make_case(B, KV, rep, T, D, S, dtype, seed, left_pad=True, strided_q=True, dummy_row=False):
    g = torch.Generator().manual_seed(seed)
    H = KV * rep
    if strided_q:  # as the model produces it: [B, T, H, D] viewed as [B, H, T, D]
        q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, S, KV, D, generator=g).to(dtype)
    v = torch.randn(B, S, KV, D, generator=g).to(dtype)
    seq_lens = torch.randint(0, S - T + 1, (B,), generator=g)  # different per row
    if left_pad:  # starts > 0 on some rows (but <= seq_lens: the row's own token is visible)
        starts = (torch.rand(B, generator=g) * (seq_lens + 1).float()).long()
        starts[0] = min(int(seq_lens[0]), 3)
    else:
        starts = torch.zeros(B, dtype=torch.int64)
    if dummy_row:  # a padding row that sees nothing at all
        starts[-1] = S
    return q, k, v, seq_lens, starts


def visible_queries(seq_lens, starts, T, S, window):
    """[B, T] bool: the query has at least one visible key."""
    i = seq_lens[:, None] + torch.arange(T)  # [B, T]
    lo = starts[:, None].expand_as(i)
    if window:
        lo = torch.maximum(lo, i - window + 1)
    return (lo <= i) & (lo < S)


def check(out, ref, v, seen, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype, (out.shape, out.dtype, ref.dtype)
    assert out.is_contiguous()
    assert torch.isfinite(out).all()
    o, r = out.float()[seen], ref.float()[seen]  # [n, H, D] over queries with a visible key
    assert o.numel() > 0
    rtol = TOLERANCE[dtype]
    bound = rtol * (r.abs() + v.float().abs().max())
    err = (o - r).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, max excess {(err - bound).max().item():.3g}"


def run_case(B, KV, rep, T, D, S, dtype, window, softcap, seed, num_splits=None, block_n=64, **kw):
    q, k, v, seq_lens, starts = make_case(B, KV, rep, T, D, S, dtype, seed, **kw)
    scale = D**-0.5
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    out = cache_attention_read_triton(dev(q), dev(k), dev(v), dev(seq_lens), dev(starts), scale, window,
                                      softcap, num_splits=num_splits, block_n=block_n).cpu()
    ref = cache_attention_reference(q, k, v, seq_lens, starts, scale, window, softcap)
    seen = visible_queries(seq_lens, starts, T, S, window)
    check(out, ref, v, seen, dtype)
    return out, seen


FIXED = [
    # B, KV, rep, T, D, S, dtype, window, softcap, num_splits, block_n
    (3, 2, 1, 1, 64, 96, torch.float32, 0, 0.0, None, 64),         # decode, MHA
    (2, 2, 4, 5, 128, 80, torch.float32, 0, 0.0, 3, 16),           # GQA 4, splits > blocks/split
    (2, 1, 8, 16, 64, 96, torch.float32, 9, 0.0, 2, 16),           # verification, window
    (2, 2, 4, 5, 80, 72, torch.float32, 0, 30.0, None, 64),        # D = 80 (masked), softcap
    (3, 1, 4, 1, 64, 96, torch.bfloat16, 17, 20.0, 4, 16),         # bf16, window + softcap
    (2, 2, 8, 5, 128, 64, torch.bfloat16, 0, 0.0, None, 64),       # bf16, GQA 8, D 128
    (2, 2, 4, 1, 128, 96, torch.float16, 0, 0.0, None, 64),        # fp16 MMA path, decode
    (2, 1, 8, 16, 64, 80, torch.float16, 21, 30.0, 3, 16),         # fp16 MMA path, verify
]


@pytest.mark.parametrize("B,KV,rep,T,D,S,dtype,window,softcap,num_splits,block_n", FIXED)
def test_fixed_cases(B, KV, rep, T, D, S, dtype, window, softcap, num_splits, block_n):
    run_case(B, KV, rep, T, D, S, dtype, window, softcap, seed=B * 1000 + S,
             num_splits=num_splits, block_n=block_n)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 3),
    KV=st.integers(1, 2),
    rep=st.sampled_from([1, 4, 8]),
    T=st.sampled_from([1, 5, 16]),
    D=st.sampled_from([64, 128]),
    extra=st.integers(0, 80),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    window=st.sampled_from([0, 1, 4, 33]),
    softcap=st.sampled_from([0.0, 0.0, 15.0]),
    splits=st.sampled_from([None, 1, 2, 5]),
    block_n=st.sampled_from([16, 64]),
    left_pad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_cases(B, KV, rep, T, D, extra, dtype, window, softcap, splits, block_n, left_pad, seed):
    run_case(B, KV, rep, T, D, T + extra, dtype, window, softcap, seed,
             num_splits=splits, block_n=block_n, left_pad=left_pad)


def test_dummy_row_is_finite_and_zero():
    # Last row: starts = S, nothing visible. The kernel writes zeros (reference: the mean of v).
    out, seen = run_case(3, 2, 4, 5, 64, 48, torch.float32, 0, 0.0, seed=7, num_splits=3, block_n=16,
                         dummy_row=True)
    assert not seen[-1].any() and seen[:-1].all()
    assert (out[-1] == 0).all()


def test_contiguous_q_and_window_one():
    # window 1: each query sees only its own slot, so out = v at that slot (up to rounding).
    q, k, v, seq_lens, starts = make_case(2, 2, 4, 5, 64, 40, torch.float32, 3, strided_q=False)
    out = cache_attention_read_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seq_lens.to(DEVICE),
                                      starts.to(DEVICE), 0.125, 1, 0.0).cpu()
    slots = seq_lens[:, None] + torch.arange(5)
    expect = v[torch.arange(2)[:, None], slots]  # [B, T, KV, D]
    expect = expect.repeat_interleave(4, dim=2)  # [B, T, H, D], head h uses kv head h // rep
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


def test_custom_op_opcheck():
    q, k, v, seq_lens, starts = make_case(2, 2, 4, 5, 64, 24, torch.float32, 11)
    args = (q, k, v, seq_lens, starts, 0.125, 8, 30.0)
    torch.library.opcheck(torch.ops.fuser.cache_attention_read.default, args)
    out = torch.ops.fuser.cache_attention_read(*args)
    torch.testing.assert_close(out, cache_attention_reference(*args), rtol=0, atol=0)
    assert out.shape == (2, 5, 8, 64) and out.is_contiguous()


@needs_cuda
def test_gpu_long_cache_bf16():
    torch.manual_seed(0)
    B, KV, rep, T, D, S = 2, 8, 4, 5, 128, 4096
    q, k, v, _, _ = make_case(B, KV, rep, T, D, S, torch.bfloat16, 5)
    seq_lens = torch.tensor([S - T, 1234])
    starts = torch.tensor([0, 100])
    args = [x.cuda() for x in (q, k, v, seq_lens, starts)]
    for window, softcap in [(0, 0.0), (1024, 50.0)]:
        out = torch.ops.fuser.cache_attention_read(*args, D**-0.5, window, softcap)
        ref = cache_attention_reference(*args, D**-0.5, window, softcap)
        torch.cuda.synchronize()
        seen = visible_queries(seq_lens, starts, T, S, window)
        check(out.cpu(), ref.cpu(), v, seen, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("T", [1, 5, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_llama3_shapes_and_tuning_overrides(T, dtype):
    # Llama-3-8B's attention (32 heads over 8 kv heads, D 128) at contexts 1024 and 8192, with
    # tuning overrides of every kind (splits, block, warps, stages): the result must not move.
    for S, seq_len in [(1040, 1024), (8208, 8192), (8208, 333)]:
        q, k, v, _, _ = make_case(1, 8, 4, T, 128, S, dtype, seed=S + T)
        seq_lens, starts = torch.tensor([seq_len]), torch.tensor([0])
        ref = cache_attention_reference(q, k, v, seq_lens, starts, 128**-0.5, 0, 0.0)
        args = [x.cuda() for x in (q, k, v, seq_lens, starts)]
        seen = visible_queries(seq_lens, starts, T, S, 0)
        for kw in [{}, dict(block_n=32, target_programs=132, num_warps=4, num_stages=3),
                   dict(block_n=128, target_programs=528, num_warps=8, num_stages=2)]:
            out = cache_attention_read_triton(*args, 128**-0.5, 0, 0.0, **kw)
            check(out.cpu(), ref, v, seen, dtype)


# --- prefill: fuser::prefill_attention (SDPA on CUDA, masked_attention elsewhere) -------------


# Prefill shapes both CUDA kernels of fuser::prefill_attention are held to the reference over.
PREFILL_CASES = dict(
    B=st.integers(1, 3),
    T=st.integers(1, 40),
    heads=st.sampled_from([(4, 4), (4, 2), (8, 2)]),
    D=st.sampled_from([16, 32]),
    pad=st.integers(0, 5),
    window=st.sampled_from([0, 3, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)


def prefill_inputs(B: int, T: int, heads: tuple[int, int], D: int, pad: int,
                   dtype: torch.dtype, seed: int, q_scale: float = 1.0, strided_q: bool = False):
    """q [B, H, T, D] (a transposed [B, T, H, D] view when strided_q, as capture passes it),
    k, v [B, KV, T, D], slots [B, T], starts [B] of up to `pad` left-padding rows."""
    H, KV = heads
    g = torch.Generator().manual_seed(seed)
    if strided_q:
        q = (torch.randn(B, T, H, D, generator=g) * q_scale).to(dtype).transpose(1, 2)
    else:
        q = (torch.randn(B, H, T, D, generator=g) * q_scale).to(dtype)
    k = torch.randn(B, KV, T, D, generator=g).to(dtype)
    v = torch.randn(B, KV, T, D, generator=g).to(dtype)
    starts = torch.randint(0, min(pad, T - 1) + 1, (B,), generator=g)
    slots = torch.arange(T)[None].expand(B, T)
    return q, k, v, slots, starts


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**PREFILL_CASES)
def test_prefill_sdpa_equals_the_reference_on_real_rows(B, T, heads, D, pad, window, dtype,
                                                         seed):
    """The CUDA kernel of fuser::prefill_attention (run here on the CPU: SDPA exists there too)
    against the reference: equal on every row that sees a key; finite on the left-padding rows
    that see none (the reference averages every value there, SDPA attends to the diagonal)."""
    from fuser.ops.attention import prefill_attention_reference, prefill_attention_sdpa

    H = heads[0]
    q, k, v, slots, starts = prefill_inputs(B, T, heads, D, pad, dtype, seed)
    args = (q, k, v, slots, starts, D**-0.5, window, 0.0)
    out, ref = prefill_attention_sdpa(*args), prefill_attention_reference(*args)
    assert out.shape == ref.shape == (B, T, H, D) and out.dtype == dtype
    assert torch.isfinite(out).all()
    real = slots >= starts[:, None]                                   # [B, T]: sees a key
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[real].float(), ref[real].float(), rtol=tol, atol=tol)


def test_prefill_sdpa_keeps_the_reference_for_softcap():
    from fuser.ops.attention import prefill_attention_reference, prefill_attention_sdpa

    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    args = (q, k, v, torch.arange(5)[None], torch.zeros(1, dtype=torch.long), 0.25, 0, 30.0)
    assert torch.equal(prefill_attention_sdpa(*args), prefill_attention_reference(*args))


def test_prefill_attention_op_runs_the_reference_on_cpu():
    from fuser.ops.attention import prefill_attention_reference

    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    args = (q, k, v, torch.arange(6)[None].expand(2, 6), torch.tensor([0, 2]), 0.25, 0, 0.0)
    torch.library.opcheck(torch.ops.fuser.prefill_attention.default, args)
    assert torch.equal(torch.ops.fuser.prefill_attention(*args),
                       prefill_attention_reference(*args))


# --- prefill on CUDA: the Triton flash kernel (fuser/ops/flash_prefill.py) ---------------------


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**PREFILL_CASES, softcap=st.sampled_from([0.0, 0.0, 5.0]), mask_all=st.booleans())
def test_flash_prefill_equals_the_reference_on_real_rows(B, T, heads, D, pad, window, softcap,
                                                         dtype, mask_all, seed):
    """The flash kernel (interpreted here, 16 x 16 tiles: several key blocks, partial ones,
    whole blocks skipped for the padding and the window; every block masked, or only those
    that need it) against masked_attention: close on every row that sees a key, zeros on the
    left-padding rows that see none."""
    check_flash_prefill(B, T, heads, D, pad, window, softcap, dtype, mask_all, seed)


def check_flash_prefill(B, T, heads, D, pad, window, softcap, dtype, mask_all, seed,
                        splits: int | None = None) -> None:
    """flash_prefill (`splits` programs a query block, or the default) against
    masked_attention: close on every row that sees a key, zeros on the left-padding rows."""
    from fuser.ops.attention import prefill_attention_reference
    from fuser.ops.flash_prefill import flash_prefill

    H = heads[0]
    q, k, v, slots, starts = prefill_inputs(B, T, heads, D, pad, dtype, seed, q_scale=2.0,
                                            strided_q=True)
    args = (q, k, v, slots, starts, D**-0.5, window, softcap)
    out = flash_prefill(*args, mask_all=mask_all, splits=splits)
    ref = prefill_attention_reference(*args)
    assert out.shape == ref.shape == (B, T, H, D) and out.dtype == dtype and out.is_contiguous()
    real = slots >= starts[:, None]
    assert torch.isfinite(out).all() and (out[~real] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[real].float(), ref[real].float(), rtol=tol, atol=tol)


def test_flash_prefill_fails_the_check_when_padding_keys_leak():
    # The comparison above must see a kernel that ignores `starts`: with the starts dropped,
    # the real rows of a padded row attend to its padding keys and move.
    from fuser.ops.attention import prefill_attention_reference
    from fuser.ops.flash_prefill import flash_prefill

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    slots, starts = torch.arange(20)[None], torch.tensor([6])
    ref = prefill_attention_reference(q, k, v, slots, starts, 0.25, 0, 0.0)
    for mask_all, splits in ((True, 1), (False, 1), (True, 3)):
        leaky = flash_prefill(q, k, v, slots, torch.zeros(1, dtype=torch.long), 0.25, 0, 0.0,
                              mask_all=mask_all, splits=splits)
        assert not torch.allclose(leaky[0, 6:], ref[0, 6:], atol=1e-3)


def test_flash_prefill_unmasked_blocks_agree_with_masked_ones():
    # 64 rows of 16-row blocks: the later blocks see whole 16-key blocks unmasked when
    # mask_all=False; with a window of 20 only some of them. Same bits as masking every block
    # in fp32 (the same products and sums in the same order; a mask adds only -inf entries).
    from fuser.ops.flash_prefill import flash_prefill

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    slots, starts = torch.arange(64)[None].expand(2, 64), torch.tensor([0, 19])
    for window, splits in ((0, 1), (20, 1), (0, 3)):
        args = (q, k[:, :2], v[:, :2], slots, starts, 0.25, window, 0.0)
        assert torch.equal(flash_prefill(*args, mask_all=False, splits=splits),
                           flash_prefill(*args, splits=splits))


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**PREFILL_CASES, softcap=st.sampled_from([0.0, 0.0, 5.0]), mask_all=st.booleans(),
       splits=st.integers(2, 6))
def test_flash_prefill_split_keys_equal_the_reference_on_real_rows(B, T, heads, D, pad, window,
                                                                   softcap, dtype, mask_all,
                                                                   splits, seed):
    """The key range split over `splits` programs (fp32 partials, then the log-sum-exp
    combine; splits with no key block, rows with no key in a split) against masked_attention,
    as the unsplit kernel is held: close on every row that sees a key, zeros on the
    left-padding rows."""
    check_flash_prefill(B, T, heads, D, pad, window, softcap, dtype, mask_all, seed, splits)


def test_flash_prefill_splits_fill_a_small_grid_only():
    # The default rule: one wave of resident programs (132: one an SM), >= 2 key blocks a
    # split, at most MAX_SPLITS.
    from fuser.ops.flash_prefill import MAX_SPLITS, default_splits, prefill_splits

    assert prefill_splits(32, 18) == 4      # the 8B prefix hit: 128 queries x 1,152 keys
    assert prefill_splits(64, 18, 264) == 4  # ... in 64-row tiles, two programs an SM
    assert prefill_splits(4, 18) == 9       # a few programs: 2 key blocks a split
    assert prefill_splits(128, 32) == 1     # 512 queries over 2,048 keys: one wave already
    assert prefill_splits(512, 32) == 1     # a 2,048-token prefill: four waves
    assert prefill_splits(32, 3) == 1       # too few key blocks to share
    assert prefill_splits(1, 10_000) == MAX_SPLITS
    # ... as flash_prefill applies it to the 8B shape's GPU tiles (128 rows, 8 warps; 64, 4)
    bf16 = torch.bfloat16
    assert default_splits(1, 32, 128, 1152, 128, bf16) == 4
    assert default_splits(1, 32, 128, 1152, 128, bf16, block_m=64) == 4
    assert default_splits(1, 32, 2048, 2048, 128, bf16) == 1
    assert default_splits(8, 32, 128, 1152, 128, bf16) == 1     # 8 rows' chunks fill the GPU


def test_flash_prefill_rejects_bad_tuning_overrides():
    from fuser.ops.flash_prefill import flash_prefill

    q = torch.zeros(1, 2, 4, 16)
    args = (q, q, q, torch.arange(4)[None], torch.zeros(1, dtype=torch.long), 0.25, 0, 0.0)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        flash_prefill(*args, splits=0)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        flash_prefill(*args, block_m=48)


def test_flash_prefill_takes_power_of_two_head_dims_only():
    from fuser.ops.flash_prefill import flash_prefill_supported

    q = torch.zeros(1, 2, 4, 128, dtype=torch.bfloat16)
    assert flash_prefill_supported(q, q)
    assert not flash_prefill_supported(q[..., :96], q[..., :96])       # 96: SDPA takes it
    assert not flash_prefill_supported(q, q.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,pad", [(2048, 0), (777, 100)])
def test_gpu_flash_prefill_llama3_shape(T, pad):
    # The 8B shape's prefill attention (32 query heads over 8 kv heads, head dim 128) on the
    # GPU's tiles, against SDPA with its mask (and the reference on a slice of the rows).
    from fuser.ops.attention import prefill_attention_cuda, prefill_attention_sdpa

    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, T, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 8, T, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 8, T, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = torch.arange(T, device="cuda")[None]
    starts = torch.tensor([pad], device="cuda")
    args = (q, k, v, slots, starts, 128**-0.5, 0, 0.0)
    out, sdpa = prefill_attention_cuda(*args), prefill_attention_sdpa(*args)
    torch.testing.assert_close(out[0, pad:].float(), sdpa[0, pad:].float(), rtol=2e-2, atol=2e-2)
    assert (out[0, :pad] == 0).all()
    from fuser.ops.flash_prefill import flash_prefill

    fewer_masks = flash_prefill(*args, mask_all=False)
    torch.testing.assert_close(fewer_masks[0, pad:].float(), sdpa[0, pad:].float(), rtol=2e-2,
                               atol=2e-2)
    for mask_all in (True, False):  # the key range split over 3 programs (GPU tiles)
        split = flash_prefill(*args, mask_all=mask_all, splits=3)
        torch.testing.assert_close(split[0, pad:].float(), sdpa[0, pad:].float(), rtol=2e-2,
                                   atol=2e-2)
        assert (split[0, :pad] == 0).all()
