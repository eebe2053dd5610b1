"""FP8 (issue #10): quantization helpers, fuser::fp8_linear, the fused norm/activation +
quantize ops and fuser::fp8_scaled_mm, against the emulated-FP8 references of fuser/ops/fp8.py.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (conftest.py); with one they run
for real, and the tests marked needs_cuda run too (Llama-3-8B shapes).

What "equal" means here:
- Quantization (codes and scales) is deterministic arithmetic: one IEEE division for the scale,
  one per element, a clamp and a round-to-nearest-even cast. A kernel that performs it on the
  same input values gives the same bits, so the fused kernels are held bit for bit to
  quantize_rows(<the unfused kernel's output>). Against quantize_rows(<the PyTorch reference>)
  they may differ where the unfused kernel already differs from its reference (rmsnorm's sum
  order, gated_act's exp: test_ops_rmsnorm.py / test_gated_mlp.py bound those); there codes
  may move by one step, and no further (assert_codes_near).
- GEMV/GEMM outputs sum K products in another order than the reference: held to the same
  elementwise bound as tests/test_ops_linear.py, against a float64 evaluation of the reference.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuser.ops import fp8_quant as _  # noqa: F401  (registers the fuser::*_quant ops)
from fuser.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_AMAX,
    dequantize,
    fp8_linear_reference,
    fp8_scaled_mm_reference,
    quantize_rows,
    quantize_weight,
)
from fuser.ops.fp8_quant import (
    add_rms_norm_quant_triton,
    gated_act_quant_triton,
    quantize_rows_triton,
    rms_norm_quant_triton,
    scaled_mm_rowwise,
)
from fuser.ops.gated_act import gated_act_reference, gated_act_triton
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.ops.linear import linear_triton
from fuser.ops.rmsnorm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALLEST_SCALE = FP8_MIN_AMAX / FP8_MAX  # 2^-126: the scale of an all-zero row
# opcheck's test_schema multiplies the inputs, which PyTorch does not implement for float8
# ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the others apply as usual.
OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu",
                                     "interpreter_rounds_fp8_like_gpu")


@pytest.fixture(scope="module")
def interpreter_rounds_fp8_like_gpu():
    """Make the Triton interpreter round fp32 -> float8 e4m3fn to nearest even, as GPUs do.

    Triton 3.9's interpreter converts fp32 -> fp8e4nv in _convert_float by truncating the
    mantissa and adding the first cut-off bit without carrying a mantissa overflow into the
    exponent: 31.44 becomes 16, not 32 (about 2% of random values land on such a wrong code).
    Compiled Triton emits cvt.rn.satfinite.e4m3x2.f32 (round to nearest even, saturating), which
    is what PyTorch's cast does for the values the kernels cast (already clamped to +-448). Only
    the interpreter's emulation of that cast is replaced; the kernels are unchanged. The
    fp8 -> fp32 direction is exact in the interpreter and left alone (checked below).
    """
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            codes = torch.from_numpy(src.data).to(FP8_DTYPE).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes, dst_type.scalar)
        return convert(self, src, dst_type, rounding_mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
        yield


# ---------------------------------------------------------------------------------------------
# Inputs and checks
# ---------------------------------------------------------------------------------------------


def outlier_matrix(rows: int, cols: int, dtype: torch.dtype, seed: int, *, magnitude: float = 1.0,
                   outlier: float = 0.0, zero_rows: int = 0, tiny_rows: int = 0) -> torch.Tensor:
    """[rows, cols] of N(0, magnitude^2), a few entries of size `outlier` (if nonzero), the first
    `zero_rows` rows all zero and the next `tiny_rows` rows scaled down to ~1e-30."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64) * magnitude
    if outlier and t.numel():
        idx = torch.randint(0, t.numel(), (max(1, t.numel() // 50),), generator=g)
        sign = torch.randint(0, 2, idx.shape, generator=g) * 2 - 1
        t.view(-1)[idx] = sign.double() * outlier
    t[:zero_rows] = 0
    t[zero_rows:zero_rows + tiny_rows] *= 1e-30 / magnitude
    return t.to(dtype)


def assert_valid_codes(q: torch.Tensor, scale: torch.Tensor) -> None:
    """No NaN code (0x7f / 0xff: e4m3fn has no infinity) and finite, positive, normal scales."""
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert not ((q.view(torch.uint8) & 0x7F) == 0x7F).any(), "NaN code"
    assert torch.isfinite(scale).all() and (scale >= SMALLEST_SCALE).all(), scale


def assert_round_trip(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Each element of dequantize(q, scale) is the input to e4m3 precision, in float64.

    A normal code is within half an ulp (2^-4 of the value), a subnormal one within 2^-10 of
    the scale; both are <= 2^-4 of the row's amax (the issue's bound), checked as well. The
    factor 1 + 2^-20 allows for the fp32 division and the dequantizing multiply (2^-24 each).
    """
    assert_valid_codes(q, scale)
    w64 = w.double()
    deq = q.double() * scale.double()[:, None]
    err = (deq - w64).abs()
    bound = torch.maximum(w64.abs() * 2**-4, scale.double()[:, None] * 2**-10) * (1 + 2**-20)
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.3g}x the e4m3 bound"
    amax = w64.abs().amax(dim=1, keepdim=True) if w.shape[1] else w64.new_zeros(w.shape[0], 1)
    assert (err <= amax * 2**-4 * (1 + 2**-20) + scale.double()[:, None] * 2**-10).all()
    # the scale maps the row's amax to 448 (one fp32 division), or is the floor
    expect = (amax.squeeze(1).clamp_min(FP8_MIN_AMAX) / FP8_MAX).float()
    assert torch.equal(scale, expect), (scale, expect)


# |out - ref| <= rtol * (|ref| + ||x_m|| ||w_n|| / sqrt(K)) per element (m, n), ref in float64
# from the same FP8 codes and scales: both sides sum K exact fp32 products in different orders
# (error ~ a few fp32 ulps of the larger partial sums, each <= ||x_m|| ||w_n||), and the kernel
# rounds once to x's dtype (half an ulp of |ref|). The second term is the size of a sum of K
# random products, so one dropped or doubled product, or a scale from the wrong channel, exceeds
# it (test_wrong_scale_fails_the_check).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def assert_linear_close(out: torch.Tensor, x: torch.Tensor, w_deq: torch.Tensor,
                        dtype: torch.dtype) -> None:
    """out [M, N] against x [M, K] @ w_deq [N, K].T evaluated in float64."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w_deq.double()
    ref = x64 @ w64.T
    out = out.reshape(ref.shape)
    assert torch.isfinite(out).all()
    K = x.shape[-1]
    size = x64.norm(dim=1)[:, None] * w64.norm(dim=1)[None, :] / max(K, 1) ** 0.5
    bound = TOLERANCE[dtype] * (ref.abs() + size)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound.clamp_min(1e-300)).max().item():.3g}x bound"


def codes_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.uint8) == b.view(torch.uint8)


def assert_quantized_equal(got: tuple[torch.Tensor, torch.Tensor],
                           want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (rq, rs) = got, want
    assert q.shape == rq.shape and s.shape == rs.shape, (q.shape, rq.shape, s.shape, rs.shape)
    assert_valid_codes(q, s)
    assert torch.equal(s, rs), f"scales differ at {(s != rs).nonzero()[:5].tolist()}"
    same = codes_equal(q.cpu(), rq.cpu())
    assert same.all(), f"{int((~same).sum())} of {same.numel()} codes differ"


def assert_codes_near(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                      rounded_to: torch.dtype, min_equal: float,
                      scale_ulps: float | torch.Tensor = 4) -> None:
    """Quantized activations of two computations that agree to ~2 ulps of `rounded_to`.

    Scales agree to 4 ulps of that dtype (amax moves by 2 ulps at most, one division); each
    value then moves by < 2^-7 of itself, far less than an e4m3 step (2^-3..2^-4 of it), so a
    code changes only if its value sat next to a rounding boundary, and by one step. `min_equal`
    of the codes must match exactly (the rest are those boundary cases).
    """
    (q, s), (rq, rs) = got, want
    assert_valid_codes(q, s)
    eps = torch.finfo(rounded_to).eps
    assert ((s.double() - rs.double()).abs() <= scale_ulps * eps * rs.double()).all()
    a, b = q.double(), rq.double()
    step = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-6) * 2**-3  # one e4m3 step at a, b
    assert ((a - b).abs() <= step).all(), "a code moved by more than one step"
    equal = codes_equal(q, rq).double().mean().item() if q.numel() else 1.0
    assert equal >= min_equal, f"only {equal:.3f} of codes equal, need {min_equal}"


# ---------------------------------------------------------------------------------------------
# Quantization helpers (plain PyTorch)
# ---------------------------------------------------------------------------------------------

# Largest outlier each dtype can hold, beyond +-448 by far.
OUTLIERS = {torch.float32: [1e4, 1e12, 1e30, 3e38], torch.bfloat16: [1e4, 1e20, 1e30, 3e38],
            torch.float16: [1e3, 6e4]}


@settings(max_examples=60, **SETTINGS)
@given(N=st.integers(1, 24), K=st.integers(1, 70), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), outlier_pick=st.integers(0, 4),
       zero_rows=st.integers(0, 2), tiny_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_quantize_weight_round_trip(N, K, dtype, magnitude, outlier_pick, zero_rows, tiny_rows,
                                    seed):
    choices = [0.0] + OUTLIERS[dtype]
    outlier = choices[outlier_pick % len(choices)]
    if dtype == torch.float16:
        tiny_rows = 0  # 1e-30 is 0 in fp16: that is a zero row, covered by zero_rows
    w = outlier_matrix(N, K, dtype, seed, magnitude=magnitude, outlier=outlier,
                       zero_rows=min(zero_rows, N), tiny_rows=tiny_rows)
    q, scale = quantize_weight(w)
    assert q.shape == (N, K) and scale.shape == (N,)
    assert_round_trip(w, q, scale)
    if zero_rows:
        assert (scale[:zero_rows] == SMALLEST_SCALE).all() and (q[:zero_rows].float() == 0).all()


def test_quantize_round_trip_check_catches_a_wrong_scale():
    # The check above must fail for codes made with another scale: here per input channel.
    w = outlier_matrix(16, 16, torch.float32, seed=1, outlier=1e4)
    q, scale = quantize_weight(w)
    wrong = (w / scale[None, :]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    with pytest.raises(AssertionError):
        assert_round_trip(w, wrong, scale)
    with pytest.raises(AssertionError):  # right codes, scale off by one fp32 ulp
        assert_round_trip(w, q, scale.nextafter(torch.full_like(scale, math.inf)))


def test_quantize_weight_codes_are_nearest():
    # Every e4m3fn value times a scale comes back exactly; midpoints round to even.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = codes[torch.isfinite(codes)]                       # 254 values, 448 included
    w = torch.stack([values, -values]) * 2.0**-5                # amax 448 * 2^-5 -> scale 2^-5
    q, scale = quantize_weight(w)
    assert torch.equal(scale, torch.full((2,), 2.0**-5))
    assert torch.equal(q.float(), w / 2.0**-5)
    mid = torch.tensor([[448.0, 1.0625, 1.1875, 0.5 * 2**-9]])  # between 1, 1.125 / 1.125, 1.25
    assert quantize_weight(mid)[0].float().tolist() == [[448.0, 1.0, 1.25, 0.0]]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_weight_refuses_non_finite(bad):
    w = torch.randn(4, 8)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=r"NaN or infinity.*\[2, 5\]"):
        quantize_weight(w)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(8))


@settings(max_examples=40, **SETTINGS)
@given(M=st.integers(1, 16), K=st.integers(1, 70), dtype=st.sampled_from(DTYPES),
       outlier_pick=st.integers(0, 4), zero_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_quantize_rows_round_trip(M, K, dtype, outlier_pick, zero_rows, seed):
    choices = [0.0] + OUTLIERS[dtype]
    x = outlier_matrix(M, K, dtype, seed, magnitude=2.0, outlier=choices[outlier_pick % len(choices)],
                       zero_rows=min(zero_rows, M))
    q, scale = quantize_rows(x)
    assert_round_trip(x, q, scale)


def test_quantize_empty():
    q, s = quantize_weight(torch.zeros(3, 0))
    assert q.shape == (3, 0) and torch.equal(s, torch.full((3,), SMALLEST_SCALE))
    q, s = quantize_rows(torch.zeros(0, 5))
    assert q.shape == (0, 5) and s.shape == (0,)


def test_references_dequantize_the_codes():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g)
    q, s = quantize_weight(w)
    torch.testing.assert_close(fp8_linear_reference(x, q, s), x @ dequantize(q, s).T,
                               rtol=1e-6, atol=1e-6)
    xq, xs = quantize_rows(x)
    torch.testing.assert_close(fp8_scaled_mm_reference(xq, xs, q, s, torch.float32),
                               dequantize(xq, xs) @ dequantize(q, s).T, rtol=1e-6, atol=1e-6)
    # and close to the unquantized product: the quantization error is e4m3's, not more
    rel = (fp8_linear_reference(x, q, s) - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < 2**-5


def test_interpreter_reads_every_fp8_code_exactly():
    # The fixture only corrects fp32 -> fp8; fp8 -> fp32 (every weight load) must be right as is.
    import triton
    import triton.language as tl

    @triton.jit
    def widen(q_ptr, out_ptr, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + cols, tl.load(q_ptr + cols).to(tl.float32))

    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    widen[(1,)](codes, out, BLOCK=256)
    finite = ((torch.arange(256) & 0x7F) != 0x7F).to(DEVICE)
    assert torch.equal(out[finite], codes.float()[finite])


# ---------------------------------------------------------------------------------------------
# fuser::fp8_linear: the decode GEMV over FP8 weights
# ---------------------------------------------------------------------------------------------


def run_fp8_linear(M, N, K, dtype, seed, lead=(), outlier=0.0, **config):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = outlier_matrix(N, K, torch.float32, seed + 1, outlier=outlier)
    q, s = quantize_weight(w)
    out = linear_triton(x.to(DEVICE), q.to(DEVICE), weight_scale=s.to(DEVICE), **config).cpu()
    assert out.shape == (*lead, M, N) and out.dtype == dtype
    return x, q, s, out


@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_rows_and_dtypes(M, dtype):
    # N, K off the block sizes: masked last column block and last K chunk.
    x, q, s, out = run_fp8_linear(M, 40, 200, dtype, seed=M, block_n=16, block_k=64)
    assert_linear_close(out, x, dequantize(q, s), dtype)


@settings(max_examples=20, **SETTINGS)
@given(M=st.integers(1, MAX_ROWS), N=st.integers(1, 80), K=st.integers(1, 300),
       dtype=st.sampled_from(DTYPES), outlier=st.sampled_from([0.0, 1e4, 1e30]),
       block_n=st.sampled_from([None, 16, 32]), block_k=st.sampled_from([None, 32, 128]),
       seed=st.integers(0, 2**16))
def test_fp8_linear_random_shapes(M, N, K, dtype, outlier, block_n, block_k, seed):
    if dtype == torch.float16:  # outputs must fit fp16 (65504): overflow there is not ours
        outlier = min(outlier, 1e3)
    x, q, s, out = run_fp8_linear(M, N, K, dtype, seed, outlier=outlier, block_n=block_n,
                                  block_k=block_k)
    assert_linear_close(out, x, dequantize(q, s), dtype)


def test_wrong_scale_fails_the_check():
    # The same kernel output held against references that apply the scale wrongly: per input
    # channel, or not at all. And the kernel fed a scale of the wrong channels fails too.
    x, q, s, out = run_fp8_linear(3, 48, 48, torch.float32, seed=7, block_n=16, block_k=32)
    assert_linear_close(out, x, dequantize(q, s), torch.float32)
    with pytest.raises(AssertionError):
        assert_linear_close(out, x, q.float() * s[None, :], torch.float32)
    with pytest.raises(AssertionError):
        assert_linear_close(out, x, q.float(), torch.float32)
    shuffled = linear_triton(x.to(DEVICE), q.to(DEVICE), weight_scale=s.flip(0).to(DEVICE),
                             block_n=16, block_k=32).cpu()
    with pytest.raises(AssertionError):
        assert_linear_close(shuffled, x, dequantize(q, s), torch.float32)


def test_fp8_linear_leading_dims_strided_x_and_outlier_activations():
    x, q, s, out = run_fp8_linear(5, 24, 96, torch.bfloat16, seed=3, lead=(1,), block_n=16,
                                  block_k=32)
    assert_linear_close(out, x, dequantize(q, s), torch.bfloat16)
    xt = torch.randn(64, 3).t()  # [3, 64], stride (1, 3)
    xt[0, 0] = 1e6               # an activation outlier: finite output, still within bound
    q, s = quantize_weight(torch.randn(20, 64))
    out = linear_triton(xt.to(DEVICE), q.to(DEVICE), weight_scale=s.to(DEVICE)).cpu()
    assert_linear_close(out, xt, dequantize(q, s), torch.float32)


def test_fp8_linear_op_on_cpu_is_the_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 3, 64, generator=g).bfloat16(), torch.randn(24, 64, generator=g)
    q, s = quantize_weight(w)
    torch.library.opcheck(torch.ops.fuser.fp8_linear.default, (x, q, s), test_utils=OPCHECK_TESTS)
    out = torch.ops.fuser.fp8_linear(x, q, s)
    assert out.shape == (1, 3, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_linear_reference(x, q, s))


# ---------------------------------------------------------------------------------------------
# Fused norm / activation + quantize
# ---------------------------------------------------------------------------------------------


def activations(rows: int, n: int, dtype: torch.dtype, seed: int, outlier: float = 0.0,
                zero_rows: int = 0) -> torch.Tensor:
    return outlier_matrix(rows, n, dtype, seed, magnitude=3.0, outlier=outlier,
                          zero_rows=zero_rows).to(DEVICE)


def norm_weight(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)


# Widths either side of the power-of-two blocks; one past the single-pass limit is below.
WIDTHS = [1, 7, 64, 65, 129, 300]


@settings(max_examples=25, **SETTINGS)
@given(rows=st.integers(1, 6), n=st.sampled_from(WIDTHS), dtype=st.sampled_from(DTYPES),
       weight_dtype=st.sampled_from(DTYPES), residual=st.booleans(),
       outlier=st.sampled_from([0.0, 1e3]), zero_rows=st.integers(0, 1),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_norm_quant_equals_quantized_norm_kernel(rows, n, dtype, weight_dtype, residual, outlier,
                                                 zero_rows, eps, seed):
    x = activations(rows, n, dtype, seed, outlier, zero_rows)
    w = norm_weight(n, weight_dtype, seed)
    if residual:
        r = activations(rows, n, dtype, seed + 1, zero_rows=zero_rows)
        q, s, summed = add_rms_norm_quant_triton(x, r, w, eps)
        normed, want_sum = add_rms_norm_triton(x, r, w, eps)
        assert torch.equal(summed, want_sum) and torch.equal(summed, x + r)
        ref_normed, _ = add_rms_norm_reference(x, r, w, eps)
    else:
        q, s = rms_norm_quant_triton(x, w, eps)
        normed = rms_norm_triton(x, w, eps)
        ref_normed = rms_norm_reference(x, w, eps)
    assert q.shape == x.shape and s.shape == (rows,)
    assert_quantized_equal((q, s), quantize_rows(normed))
    # against the PyTorch reference: rmsnorm's own kernel-vs-reference differences only
    assert_codes_near((q.cpu(), s.cpu()), quantize_rows(ref_normed.cpu()),
                      rounded_to=normed.dtype, min_equal=0.9)
    if zero_rows:  # an all-zero row: codes 0 and the smallest scale, no 0/0
        assert (s[0] == SMALLEST_SCALE).item() and (q[0].float() == 0).all()


@pytest.mark.parametrize("residual", [False, True])
def test_norm_quant_multi_pass(residual):
    # A row wider than one block: three passes over it. Forced with a small block, and at the
    # real limit (8193 > MAX_SINGLE_PASS) where rmsnorm.py's kernel also loops, in blocks of the
    # same size, so the two agree bit for bit.
    x, w = activations(3, 8193, torch.bfloat16, 1, outlier=1e3), norm_weight(8193, torch.bfloat16, 2)
    r = activations(3, 8193, torch.bfloat16, 3) if residual else None
    if residual:
        got = add_rms_norm_quant_triton(x, r, w, 1e-5)
        normed, summed = add_rms_norm_triton(x, r, w, 1e-5)
        assert torch.equal(got[2], summed)
    else:
        got = rms_norm_quant_triton(x, w, 1e-5)
        normed = rms_norm_triton(x, w, 1e-5)
    assert_quantized_equal(got[:2], quantize_rows(normed))
    x, w = activations(4, 300, torch.float32, 4), norm_weight(300, torch.bfloat16, 5)
    small = rms_norm_quant_triton(x, w, 1e-5, block=64)  # 5 blocks, the last one masked
    assert_codes_near((small[0].cpu(), small[1].cpu()),
                      quantize_rows(rms_norm_reference(x, w, 1e-5).cpu()), torch.float32, 0.98)


@settings(max_examples=20, derandomize=True, **SETTINGS)
@example(rows=1, I=1, dtype=torch.float32, activation="gelu_tanh", block=None, outlier=False,
         zero_rows=0, seed=4)  # act ~ 5e-7 at g ~ -4.6: 7 ulps off (activation_ulps)
@given(rows=st.integers(1, 6), I=st.sampled_from([1, 7, 64, 65, 300]),
       dtype=st.sampled_from(DTYPES), activation=st.sampled_from(["silu", "gelu_tanh"]),
       block=st.sampled_from([None, 32]), outlier=st.booleans(), zero_rows=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_gated_act_quant_equals_quantized_gated_act_kernel(rows, I, dtype, activation, block,
                                                           outlier, zero_rows, seed):
    big = 200.0 if dtype == torch.float16 else 1e6  # act(g) * u must fit the model dtype
    gate_up = activations(rows, 2 * I, dtype, seed, outlier=big if outlier else 0.0,
                          zero_rows=zero_rows)
    q, s = gated_act_quant_triton(gate_up, activation, block=block)
    assert q.shape == (rows, I) and s.shape == (rows,)
    assert_quantized_equal((q, s), quantize_rows(gated_act_triton(gate_up, activation)))
    exact = exact_gated_act(gate_up.cpu(), activation)
    assert_codes_near((q.cpu(), s.cpu()), quantize_rows(exact), rounded_to=dtype, min_equal=0.9,
                      scale_ulps=activation_ulps(gate_up.cpu(), exact, activation))


def activation_ulps(gate_up: torch.Tensor, exact: torch.Tensor, activation: str) -> torch.Tensor:
    """Per row, how many ulps the kernel's fp32 act(g) * u at the row's amax may be off: 4, plus
    |z| where act = g / (1 + exp(-z)) (z = g for silu, 2 sqrt(2/pi) (g + 0.044715 g^3) for
    gelu_tanh). z carries a rounding of ~|z| * eps, which exp turns into a relative error of
    the same size when exp(-z) >> 1: act ~ 1e-7 at g ~ -4.5 is accurate to ~|z| = 10 ulps only
    (hypothesis found 7 there)."""
    gate = gate_up.double().chunk(2, dim=-1)[0]
    z = gate if activation == "silu" else 2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    at = exact.double().abs().argmax(dim=-1, keepdim=True)  # [rows, 1], the amax element
    return 4 + z.gather(-1, at)[:, 0].abs().nan_to_num(0.0)


def exact_gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up with the activation in float64, rounded to the dtype, times up, rounded
    again: the kernel's contract (gated_act.py) with exact math. Not PyTorch's fp32 gelu_tanh:
    0.5 g (1 + tanh(y)) cancels below g ~ -3, where act is ~1e-9 and PyTorch's fp32 value is
    off by several percent (hypothesis found g*u ~ 1.1e-9 off by 6.7%); the kernel's
    g * sigmoid(2y) is not (tests/test_gated_mlp.py has the same note)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    return (act.to(gate_up.dtype).double() * up).to(gate_up.dtype)


@settings(max_examples=20, derandomize=True, **SETTINGS)
@given(rows=st.integers(1, 6), K=st.sampled_from([1, 7, 64, 65, 300]),
       dtype=st.sampled_from(DTYPES), block=st.sampled_from([None, 32]),
       outlier=st.sampled_from([0.0, 1e3, 6e4]), zero_rows=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_quantize_rows_kernel_equals_the_reference(rows, K, dtype, block, outlier, zero_rows,
                                                   seed):
    # fuser::quantize_rows' CUDA kernel (o_proj's input in an FP8 prefill) against fp8.py's
    # quantize_rows, bit for bit: one pass (block None) and two passes over 32-wide blocks;
    # outliers far beyond +-448 and all-zero rows (the scale's floor).
    x = activations(rows, K, dtype, seed, outlier=outlier, zero_rows=zero_rows)
    got = quantize_rows_triton(x, block=block)
    assert_quantized_equal(got, quantize_rows(x))


def test_quantize_rows_kernel_over_leading_dims_and_strides():
    # [B, T, K] with a row stride wider than K (a slice of a wider tensor), and no rows at all.
    wide = activations(6, 96, torch.bfloat16, 3, outlier=1e4)
    x = wide[:, :80].reshape(2, 3, 80)
    codes, scale = quantize_rows_triton(x)
    assert codes.shape == (2, 3, 80) and scale.shape == (2, 3)
    assert_quantized_equal((codes.reshape(6, 80), scale.reshape(6)), quantize_rows(wide[:, :80]))
    empty, floor = quantize_rows_triton(torch.empty(0, 16, device=DEVICE))
    assert empty.shape == (0, 16) and floor.shape == (0,)


def test_outlier_activations_stay_finite():
    # Far beyond +-448, up to what each dtype holds: codes and scales stay finite, no NaN code.
    for dtype, big in [(torch.float32, 1e30), (torch.bfloat16, 1e30), (torch.float16, 6e4)]:
        x = activations(4, 96, dtype, 0, outlier=big)
        w = norm_weight(96, dtype, 1)
        for got in (rms_norm_quant_triton(x, w, 1e-5), add_rms_norm_quant_triton(x, x, w, 1e-5)[:2]):
            assert_valid_codes(*got)
        q, s = quantize_rows(x.cpu().float())
        assert_valid_codes(q, s)
        assert (q.float().abs().amax(1) == FP8_MAX).all()  # the outlier itself maps to 448


def test_fused_quant_check_catches_a_wrong_order():
    # Quantizing the fp32 normalised row (before rounding it to bf16) gives other codes: the
    # exact comparison used above must notice.
    x, w = activations(8, 300, torch.bfloat16, 9), norm_weight(300, torch.bfloat16, 10)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    unrounded = quantize_rows(w.float() * h)
    with pytest.raises(AssertionError):
        assert_quantized_equal(rms_norm_quant_triton(x, w, 1e-5), unrounded)


def test_quant_ops_on_cpu_are_the_references():
    x, r = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    w = torch.rand(64).bfloat16() + 0.5
    for op, args in [(torch.ops.fuser.rms_norm_quant, (x, w, 1e-5)),
                     (torch.ops.fuser.add_rms_norm_quant, (x, r, w, 1e-6)),
                     (torch.ops.fuser.gated_act_quant, (x, "silu"))]:
        torch.library.opcheck(op.default, args, test_utils=OPCHECK_TESTS)
    q, s = torch.ops.fuser.rms_norm_quant(x, w, 1e-5)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3)
    want = quantize_rows(rms_norm_reference(x, w, 1e-5).reshape(6, 64))
    assert codes_equal(q.reshape(6, 64), want[0]).all() and torch.equal(s.reshape(6), want[1])
    q, s, summed = torch.ops.fuser.add_rms_norm_quant(x, r, w, 1e-6)
    assert torch.equal(summed, x + r) and s.shape == (2, 3)
    q, s = torch.ops.fuser.gated_act_quant(x, "gelu_tanh")
    want = quantize_rows(gated_act_reference(x, "gelu_tanh").reshape(6, 32))
    assert codes_equal(q.reshape(6, 32), want[0]).all() and torch.equal(s.reshape(6), want[1])
    with pytest.raises(ValueError, match="activation"):
        torch.ops.fuser.gated_act_quant(x, "relu")


# ---------------------------------------------------------------------------------------------
# fuser::fp8_scaled_mm
# ---------------------------------------------------------------------------------------------


def scaled_mm_inputs(M: int, N: int, K: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10)
    wq, ws = quantize_weight(outlier_matrix(N, K, torch.float32, seed + 1, outlier=30.0))
    return [t.to(device) for t in (xq, xs, wq, ws)]


def test_fp8_scaled_mm_op_on_cpu_is_the_reference():
    xq, xs, wq, ws = scaled_mm_inputs(6, 32, 48, seed=0)
    for out_dtype in DTYPES:
        torch.library.opcheck(torch.ops.fuser.fp8_scaled_mm.default, (xq, xs, wq, ws, out_dtype),
                              test_utils=OPCHECK_TESTS)
        out = torch.ops.fuser.fp8_scaled_mm(xq, xs, wq, ws, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(out, fp8_scaled_mm_reference(xq, xs, wq, ws, out_dtype))
    out = torch.ops.fuser.fp8_scaled_mm(xq.reshape(2, 3, 48), xs.reshape(2, 3), wq, ws,
                                        torch.bfloat16)
    assert out.shape == (2, 3, 32)


def test_scaled_mm_call_matches_the_reference():
    # The torch._scaled_mm call the CUDA path makes (operand layout, rowwise scale shapes) on
    # whatever device runs the tests: PyTorch has a CPU kernel for it too. Dequantized operands
    # held to the GEMV bound (fp32 sums in another order, one bf16 rounding).
    xq, xs, wq, ws = scaled_mm_inputs(20, 48, 64, seed=1, device=DEVICE)
    try:
        out = scaled_mm_rowwise(xq, xs, wq, ws, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:  # no FP8 GEMM on this device
        pytest.skip(f"torch._scaled_mm: {e}")
    assert out.shape == (20, 48) and out.dtype == torch.bfloat16
    assert_linear_close(out.cpu(), dequantize(xq, xs).cpu(), dequantize(wq, ws).cpu(),
                        torch.bfloat16)
    with pytest.raises(AssertionError):  # scales swapped to the wrong operands' channels
        wrong = scaled_mm_rowwise(xq, ws[:20], wq, torch.cat([xs, xs, xs])[:48], torch.bfloat16)
        assert_linear_close(wrong.cpu(), dequantize(xq, xs).cpu(), dequantize(wq, ws).cpu(),
                            torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# On a GPU: Llama-3-8B shapes
# ---------------------------------------------------------------------------------------------

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 9])
@pytest.mark.parametrize("N,K", LLAMA3_8B)
def test_gpu_fp8_linear_llama3_shapes(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q, s = quantize_weight(w)
    out = torch.ops.fuser.fp8_linear(x, q, s)
    assert_linear_close(out.cpu(), x.cpu(), dequantize(q, s).cpu(), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("N,K", LLAMA3_8B)
def test_gpu_fp8_scaled_mm_llama3_prefill(N, K):
    M = 2048
    xq, xs, wq, ws = scaled_mm_inputs(M, N, K, seed=N + K, device="cuda")
    out = torch.ops.fuser.fp8_scaled_mm(xq, xs, wq, ws, torch.bfloat16)
    ref = fp8_scaled_mm_reference(xq, xs, wq, ws, torch.float64)  # float64 on the GPU
    size = (xq.double() * xs.double()[:, None]).norm(dim=1)[:, None] * \
        (wq.double() * ws.double()[:, None]).norm(dim=1)[None, :] / K**0.5
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= TOLERANCE[torch.bfloat16] * (ref.abs() + size)).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fused_quant_llama3_prefill(dtype):
    x = torch.randn(2048, 4096, device="cuda", dtype=dtype) * 3
    r = torch.randn(2048, 4096, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(4096, device="cuda")).to(dtype)
    # The norms: bit-equal codes where the normalised row is rounded to 16 bits. In fp32 nothing
    # rounds it, and the fused kernel's sum of squares may take another order than rmsnorm.py's
    # (Triton lays the two kernels' reductions out by their loads and stores: fp8 stores here,
    # fp32 there), so a row's rstd, hence its values and scale, can move by an ulp; measured on
    # the H200: a few rows in 2048. There the codes must agree up to rounding-boundary cases.
    if dtype == torch.float32:
        def check(got, want):
            assert_codes_near(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want),
                              torch.float32, min_equal=0.999)
    else:
        check = assert_quantized_equal
    check(torch.ops.fuser.rms_norm_quant(x, w, 1e-5), quantize_rows(rms_norm_triton(x, w, 1e-5)))
    q, s, summed = torch.ops.fuser.add_rms_norm_quant(x, r, w, 1e-5)
    normed, want_sum = add_rms_norm_triton(x, r, w, 1e-5)
    assert torch.equal(summed, want_sum)
    check((q, s), quantize_rows(normed))
    gate_up = torch.randn(2048, 2 * 14336, device="cuda", dtype=dtype) * 2
    for act in ("silu", "gelu_tanh"):
        assert_quantized_equal(torch.ops.fuser.gated_act_quant(gate_up, act),
                               quantize_rows(gated_act_triton(gate_up, act)))
