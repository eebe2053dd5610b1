"""fuser/ops/e4m3_pieces.py and linear.py's X2_PIECES: bf16 rows as two e4m3 pieces, made by the
several-row norm kernel (or split by a kernel of their own, for down_proj's long rows) and
multiplied by FP8 weights on the FP8 MMA. Without a GPU the kernels run under TRITON_INTERPRET=1
(conftest.py)."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.ops import e4m3_pieces
from fuser.ops import fp8_linear, norm_linear
from fuser.ops.e4m3_pieces import (add_rms_norm_pieces_triton, join_pieces, pieces_supported,
                                   split_pieces_reference, split_pieces_triton)
from fuser.ops.fp8 import fp8_linear_reference, quantize_weight
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.ops.linear import linear_pieces_triton
from fuser.ops.rmsnorm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_triton

pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def spread_rows(M: int, K: int, exponent: int, span: int, seed: int) -> torch.Tensor:
    """bf16 [M, K]: random signs, 8-bit mantissas, magnitudes 2^(exponent - span .. exponent)."""
    g = torch.Generator().manual_seed(seed)
    mantissa = 1 + torch.randint(0, 128, (M, K), generator=g) / 128
    sign = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
    power = torch.randint(-span, 1, (M, K), generator=g).double() + exponent
    return (sign * mantissa * torch.exp2(power)).to(torch.bfloat16)


@settings(max_examples=20, **SETTINGS)
@given(M=st.integers(1, 8), K=st.integers(1, 200), exponent=st.integers(-120, 120),
       span=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_split_is_exact_near_the_row_max_and_bounded_below(M, K, exponent, span, seed):
    """hi + lo is x exactly for values within 2^9 of their row's max |x| (below that each piece
    may round to e4m3's subnormal step, 2^-9: never off by more than 2^-9 inv_scale in all);
    every piece is an e4m3 value under 2^8, so no MMA input saturates."""
    x = spread_rows(M, K, exponent, span, seed)
    hi, lo, inv = split_pieces_reference(x)
    back = join_pieces(hi, lo, inv)
    x64 = x.double()
    near = x64.abs() >= x64.abs().amax(dim=1, keepdim=True) * 2.0**-9
    assert torch.equal(back[near], x64[near])
    assert ((back - x64).abs() <= 2.0**-9 * inv.double()[:, None]).all()
    assert (hi.float().abs() < 256).all() and (lo.float().abs() < 16).all()


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("M,K", [(1, 64), (5, 200), (16, 4096)])
def test_norm_kernel_writes_the_norms_value_as_pieces(M, K, residual):
    """The norm kernel's pieces are the split of what the norm kernel (fuser::add_rms_norm's,
    fuser::rms_norm's) writes, bit for bit, and summed is the residual add's."""
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, K, generator=g).to(torch.bfloat16) if residual else None
    w = (1 + 0.2 * torch.randn(K, generator=g)).to(torch.bfloat16)
    hi, lo, inv, summed = add_rms_norm_pieces_triton(
        x.to(DEVICE), r.to(DEVICE) if residual else None, w.to(DEVICE), EPS)
    if residual:
        normed, _ = add_rms_norm_triton(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), EPS)
        assert torch.equal(summed.cpu(), add_rms_norm_reference(x, r, w, EPS)[1])
    else:
        normed = rms_norm_triton(x.to(DEVICE), w.to(DEVICE), EPS)
        assert summed is None
    want = split_pieces_reference(normed.cpu())
    for got, ref in zip((hi, lo), want[:2]):
        assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(inv.cpu(), want[2])


@settings(max_examples=10, **SETTINGS)
@given(lead=st.sampled_from([(1,), (3,), (1, 5), (2, 3)]), K=st.integers(1, 300),
       exponent=st.integers(-120, 120), span=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_split_kernel_is_the_reference_split(lead, K, exponent, span, seed):
    """split_pieces_triton: split_pieces_reference's pieces and scales bit for bit, any row
    count, width and magnitude (rows over several of the kernel's steps included)."""
    x = spread_rows(math.prod(lead), K, exponent, span, seed).reshape(*lead, K)
    with mock.patch.object(e4m3_pieces, "SPLIT_BLOCK", 64):  # K > 64: more than one step
        got = split_pieces_triton(x.to(DEVICE))
    want = split_pieces_reference(x.reshape(-1, K))
    for a, b in zip(got[:2], want[:2]):
        assert a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(got[2].cpu(), want[2])


def test_split_kernel_refuses_other_dtypes_and_takes_empty_rows():
    with pytest.raises(ValueError, match="bf16 rows"):
        split_pieces_triton(torch.ones(2, 8, dtype=torch.float16))
    hi, lo, inv = split_pieces_triton(torch.ones(3, 0, dtype=torch.bfloat16, device=DEVICE))
    assert hi.shape == (3, 0) and inv.shape == (3,)


@pytest.mark.parametrize("M", [1, 5])
def test_fp8_linear_splits_its_rows_under_pieces(M):
    """fuser::fp8_linear's CUDA implementation at 2..16 bf16 rows longer than
    SPLIT_PIECES_MIN_K (down_proj) splits x and runs the GEMV on the pieces (spied), with the
    reference's values; one row and a short row never split."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(1, M, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    w, scale = (t.to(DEVICE) for t in quantize_weight(torch.randn(40, 96, generator=g)))
    spy = mock.Mock(wraps=split_pieces_triton)
    with mock.patch.object(fp8_linear, "split_pieces_triton", spy):
        with mock.patch.object(fp8_linear, "SPLIT_PIECES_MIN_K", 96):
            fp8_linear._fp8_linear_cuda(x, w, scale)  # rows of 96: too short to split
        assert spy.call_count == 0
        with mock.patch.object(fp8_linear, "SPLIT_PIECES_MIN_K", 64):
            got = fp8_linear._fp8_linear_cuda(x, w, scale)
        assert spy.call_count == (1 if M > 1 else 0)
    ref = fp8_linear_reference(x.cpu(), w.cpu(), scale.cpu())
    assert got.shape == ref.shape == (1, M, 40)
    tol = 2.0**-7
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def _reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               activation: str | None = None) -> torch.Tensor:
    """The FP8 GEMV's reference on x: the exact products of bf16's x, summed in fp32."""
    if activation is None:
        return fp8_linear_reference(x, w, scale)
    return fp8_linear.fp8_gated_linear_reference(x, w, scale, activation)


@settings(max_examples=12, **SETTINGS)
@given(M=st.integers(2, MAX_ROWS), N=st.integers(1, 70), blocks=st.integers(1, 3),
       split_k=st.sampled_from([1, 2]), activation=st.sampled_from([None, "silu"]),
       magnitude=st.sampled_from([2.0**-40, 1.0, 2.0**40]), seed=st.integers(0, 2**16))
def test_gemv_on_pieces_keeps_the_reference_values(M, N, blocks, split_k, activation,
                                                    magnitude, seed):
    """X2_PIECES: the FP8 MMA over x's pieces gives the reference's outputs (the same exact
    products, summed in another order, one rounding), at any magnitude."""
    K = 32 * blocks * split_k
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * magnitude).to(torch.bfloat16)
    w, scale = quantize_weight(torch.randn(2 * N if activation else N, K, generator=g))
    w, scale = w.to(DEVICE), scale.to(DEVICE)
    hi, lo, inv = (t.to(DEVICE) for t in split_pieces_reference(x))
    config = dict(activation=activation, block_n=16, block_k=32, split_k=split_k)
    out = linear_pieces_triton(hi, lo, inv, w, scale, **config)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    tol = 2.0**-7
    ref = _reference(x.to(DEVICE), w, scale, activation).float()
    torch.testing.assert_close(out.float(), ref, rtol=tol,
                               atol=tol * ref.abs().max().item() + 1e-37)


def test_pieces_carry_every_bit_through_an_identity_weight():
    """Through an identity weight (1.0 exact in e4m3, scale 1) the GEMV returns x bit for bit:
    fails if the lo piece is dropped or the rows' 2^-t is misapplied."""
    x = spread_rows(5, 64, 3, 9, seed=1)
    hi, lo, inv = (t.to(DEVICE) for t in split_pieces_reference(x))
    w = torch.eye(64).to(torch.float8_e4m3fn).to(DEVICE)
    out = linear_pieces_triton(hi, lo, inv, w, torch.ones(64, device=DEVICE),
                               block_n=16, block_k=32)
    assert torch.equal(out.cpu(), x)


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_norm_linear_ops_take_the_pieces_path(residual, activation):
    """The CUDA implementations of fuser::rms_norm_linear and fuser::add_rms_norm_linear at
    several bf16 rows and FP8 weights run the norm kernel with pieces, then the GEMV on them:
    their references' values, summed bit for bit; at one row the pieces kernel never runs."""
    g = torch.Generator().manual_seed(7)
    M, K, N = 5, 96, 40
    x, r = (torch.randn(1, M, K, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(torch.bfloat16).to(DEVICE)
    w, scale = quantize_weight(torch.randn(2 * N if activation else N, K, generator=g))
    w, scale = w.to(DEVICE), scale.to(DEVICE)
    args = (x, r, nw, EPS, w, scale, activation) if residual else \
        (x, nw, EPS, w, scale, activation)
    fn = norm_linear._add_rms_norm_linear_cuda if residual else \
        norm_linear._rms_norm_linear_cuda
    ref_fn = norm_linear.add_rms_norm_linear_reference if residual else \
        norm_linear.rms_norm_linear_reference
    spy = mock.Mock(wraps=add_rms_norm_pieces_triton)
    with mock.patch.object(norm_linear, "add_rms_norm_pieces_triton", spy):
        got = fn(*args)
        assert spy.call_count == 1
        fn(*(a[:, :1] if isinstance(a, torch.Tensor) and a.dim() == 3 else a for a in args))
        assert spy.call_count == 1  # one row: the norm inside the GEMV
    ref = ref_fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    if residual:
        (got, summed), (ref, summed_ref) = got, ref
        assert torch.equal(summed.cpu(), summed_ref)
    assert got.shape == ref.shape
    tol = 2.0**-7
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def test_bad_pieces_are_refused_with_a_message():
    w, scale = quantize_weight(torch.randn(16, 32))
    x = torch.randn(3, 32).to(torch.bfloat16)
    hi, lo, inv = split_pieces_reference(x)
    with pytest.raises(ValueError, match="pieces must be"):
        linear_pieces_triton(x, lo, inv, w, scale)                 # hi in bf16
    with pytest.raises(ValueError, match="pieces must be"):
        linear_pieces_triton(hi, lo, inv[:2], w, scale)            # a scale missing
    h1, l1, i1 = split_pieces_reference(x[:1])
    with pytest.raises(ValueError, match="2 to 16 rows"):
        linear_pieces_triton(h1, l1, i1, w, scale)                 # one row: not the MMA path
    assert not pieces_supported(x.half(), torch.ones(32).half(), None)
    with pytest.raises(ValueError, match="bf16 rows"):
        add_rms_norm_pieces_triton(x.half(), None, torch.ones(32).half(), EPS)


@needs_cuda
@pytest.mark.parametrize("N,activation", [(6144, None), (28672, "silu")])
def test_gpu_norm_pieces_at_llama3_shapes(N, activation):
    """The 8B qkv and gate/up GEMVs at five rows through the pieces path: finite, and the
    reference's values on the same normed rows."""
    K = 4096
    g = torch.Generator(device="cuda").manual_seed(N)
    x, r = (torch.randn(5, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    w, scale = quantize_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    out, summed = norm_linear._add_rms_norm_linear_cuda(x, r, nw, EPS, w, scale, activation)
    normed, summed_ref = add_rms_norm_reference(x, r, nw, EPS)
    assert torch.equal(summed, summed_ref)
    bf16 = _reference(normed, w, scale, activation)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), bf16.float(), rtol=2.0**-7,
                               atol=2.0**-7 * bf16.float().abs().max().item())


@needs_cuda
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336)])
def test_gpu_split_pieces_at_llama3_shapes(N, K):
    """The 8B o_proj and down_proj GEMVs at five rows split by split_pieces_triton: the split is
    the reference's bit for bit, the GEMV the reference's values on the same rows."""
    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(5, K, device="cuda", generator=g).to(torch.bfloat16)
    w, scale = quantize_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    pieces = split_pieces_triton(x)
    for a, b in zip(pieces, split_pieces_reference(x)):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
    with mock.patch.object(fp8_linear, "SPLIT_PIECES_MIN_K", 0):  # o_proj's rows too
        out = fp8_linear._fp8_linear_cuda(x, w, scale)
    bf16 = _reference(x, w, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), bf16.float(), rtol=2.0**-7,
                               atol=2.0**-7 * bf16.float().abs().max().item())


@needs_cuda
@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336)])
def test_gpu_small_tiles_on_pieces(N, K, block_n):
    """Tiles below 64 weight rows (mma.sync on the pieces widened to fp16) at 8B shapes, five
    rows: the reference's values."""
    g = torch.Generator(device="cuda").manual_seed(N + block_n)
    x = torch.randn(5, K, device="cuda", generator=g).to(torch.bfloat16)
    w, scale = quantize_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    out = linear_pieces_triton(*split_pieces_triton(x), w, scale, block_n=block_n,
                               block_k=256, split_k=2, num_stages=4, num_warps=4)
    bf16 = _reference(x, w, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), bf16.float(), rtol=2.0**-7,
                               atol=2.0**-7 * bf16.float().abs().max().item())
