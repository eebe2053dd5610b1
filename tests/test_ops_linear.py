"""fuser::linear: the decode GEMV kernel and the custom op against the reference.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); with one it runs for real.
Both paths of the kernel are covered: one row (CUDA-core products and sums) and 2..16 rows (the
MMA path; fp16 takes it under the interpreter too, bf16 there falls back to fp32 dots).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.ops import linear as _  # noqa: F401  (registers torch.ops.fuser.linear)
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.ops.linear import linear_reference, linear_triton

pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# |out - ref| <= rtol * (|ref| + sqrt(K) * rms(x) * rms(w)) elementwise: both sides sum K exact
# products in fp32 in different orders (error ~ K * 2^-24 of the sum of |products|), then round
# to the output dtype once (half an ulp of |ref| each). The second term is the scale of a sum of
# K random products, so an error of one dropped or doubled product (~ one product, i.e. the
# scale / sqrt(K)) still exceeds the bound at these K for fp32, and a dropped K-block always does.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
          dtype: torch.dtype | None = None) -> None:
    """out against x @ w.T in float64, within the GEMV bound of out's dtype (x's unless given:
    x may be a float64 input the kernel computed in another dtype)."""
    dtype = dtype or x.dtype
    ref = linear_reference(x.double(), w.double())
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    K = x.shape[-1]
    scale = K**0.5 * x.double().pow(2).mean().sqrt() * w.double().pow(2).mean().sqrt()
    bound = TOLERANCE[dtype] * (ref.abs() + scale)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, bound {bound.min().item():.3g}"


def run(M: int, N: int, K: int, dtype: torch.dtype, seed: int, lead: tuple = (), **config):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    out = linear_triton(x.to(DEVICE), w.to(DEVICE), **config).cpu()
    check(x, w, out)
    return out


@pytest.mark.parametrize("M", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_and_dtypes(M, dtype):
    # N, K off the block sizes: masked last column block and last K chunk.
    run(M, 40, 200, dtype, seed=M, block_n=16, block_k=64)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, MAX_ROWS),
    N=st.integers(1, 100),
    K=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    block_n=st.sampled_from([None, 16, 32]),
    block_k=st.sampled_from([None, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(M, N, K, dtype, block_n, block_k, seed):
    run(M, N, K, dtype, seed, block_n=block_n, block_k=block_k)


def test_leading_dims_and_strided_x():
    # [B, T, K] activations as the graph has them, and a non-contiguous (transposed) x.
    run(5, 48, 96, torch.float32, seed=3, lead=(1,), block_n=16, block_k=32)
    x = torch.randn(64, 3).t()  # [3, 64], stride (1, 3)
    w = torch.randn(20, 64)
    check(x, w, linear_triton(x.to(DEVICE), w.to(DEVICE)).cpu())


def test_one_row_uses_cuda_cores_with_small_block_n():
    run(1, 30, 100, torch.bfloat16, seed=4, block_n=8, block_k=32)
    with pytest.raises(ValueError, match="block_n"):
        linear_triton(torch.randn(2, 32).to(DEVICE), torch.randn(8, 32).to(DEVICE), block_n=8)


class _LaunchSpy:
    """Stands in for linear._linear_kernel: records each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(N=st.integers(1, 40), K=st.integers(1, 300),
       block=st.sampled_from([(4, 16), (8, 32), (2, 64), (16, 128)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       fp8=st.booleans(), seed=st.integers(0, 2**16))
def test_one_row_partials_sum_the_same_products(N, K, block, dtype, fp8, seed, monkeypatch):
    """One row: each thread's partial per 16-byte run of columns, added across threads after
    the K loop (ROW_VEC): the GEMV's sum within its bound, FP8 weights too, at tiles narrower
    than a 16-byte run (fp32: 4 columns; block_k 16 of FP8: the whole step one run)."""
    from fuser.ops import linear
    from fuser.ops.fp8 import dequantize, quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    scale = None
    if fp8 and dtype != torch.float32:
        w, scale = quantize_weight(w)
    spy = _LaunchSpy(linear._linear_kernel)
    monkeypatch.setattr(linear, "_linear_kernel", spy)
    out = linear_triton(x.to(DEVICE), w.to(DEVICE), weight_scale=None if scale is None else
                        scale.to(DEVICE), block_n=block[0], block_k=block[1]).cpu()
    check(x, w if scale is None else dequantize(w, scale), out)
    assert spy.launches[-1]["ROW_VEC"] == min(16 // w.element_size(), block[1])


def _norm_linear_case(M: int, N: int, K: int, dtype: torch.dtype, fp8: bool,
                      activation: str | None, seed: int) -> tuple:
    """(x, residual, norm gain, weight, FP8 scale or None): x and the residual [M, K], the
    weight [N, K] or, gated, [2N, K] (FP8: quantized per row), on DEVICE."""
    from fuser.ops.fp8 import quantize_weight

    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(M, K, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    gain = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(DEVICE)
    w = (torch.randn(2 * N if activation else N, K, generator=g) * 0.1).to(dtype).to(DEVICE)
    scale = None
    if fp8:
        w, scale = quantize_weight(w)
    return x, r, gain, w, scale


def _run_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, gain: torch.Tensor,
                     w: torch.Tensor, **config) -> torch.Tensor:
    """linear_triton(x, w), or with a residual rms_norm_linear_triton's output and summed
    residual, flattened into one tensor."""
    from fuser.ops.norm_linear import rms_norm_linear_triton

    if residual is None:
        return linear_triton(x, w, **config).flatten()
    out, summed = rms_norm_linear_triton(x, residual, gain, 1e-5, w, **config)
    return torch.cat([out.flatten(), summed.flatten()])


def test_custom_op_opcheck_and_reference_on_cpu():
    x, w = torch.randn(1, 3, 64), torch.randn(24, 64)
    torch.library.opcheck(torch.ops.fuser.linear.default, (x, w))
    torch.testing.assert_close(torch.ops.fuser.linear(x, w), x @ w.T, rtol=0, atol=0)
    assert torch.ops.fuser.linear(x, w).shape == (1, 3, 24)


@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 9])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_llama3_shapes(M, N, K):
    run(M, N, K, torch.bfloat16, seed=N + K + M)


@needs_cuda
def test_gpu_op_falls_back_above_max_rows():
    x = torch.randn(MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.fuser.linear(x, w), x @ w.T)


def test_cublas_keeps_the_shapes_it_measured_faster_on():
    from fuser.ops.gemv_tables import prefers_cublas

    assert prefers_cublas(5, 28672, 4096)  # gate_up, verification rows
    for M, N, K in [(1, 6144, 4096), (1, 4096, 4096), (1, 28672, 4096), (1, 128256, 4096),
                    (1, 4096, 14336),  # down_proj, one row: split-K beats cuBLAS
                    (5, 4096, 14336), (9, 6144, 4096), (5, 128256, 4096)]:
        assert not prefers_cublas(M, N, K), (M, N, K)


def test_tiles_fit_shared_memory_and_tuned_configs_stay():
    """fp32 weights at the MMA path's tuned tiles asked an H200 for 288 KB of shared memory
    (OutOfResources in every fp32 CUDA engine); the launcher trims stages, then block_k. The
    tuned bf16 and FP8 tables stay as measured."""
    from fuser.ops.gemv_tables import (SHARED_MEMORY_BUDGET, _default_config,
                                       _default_fp8_config, _fit_shared_memory)

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (96, 64)]
    for M in (1, 2, 5, 9, 16):
        block_m = 1 if M == 1 else 16
        for N, K in shapes:
            bn, bk, _, stages = _default_config(M, N, K)
            assert _fit_shared_memory(block_m, bn, bk, stages, 2, 2) == (stages, bk)
            bn8, bk8, _, stages8 = _default_fp8_config(M, N, K)
            assert _fit_shared_memory(block_m, bn8, bk8, stages8, 1, 2) == (stages8, bk8)
            fit_stages, fit_k = _fit_shared_memory(block_m, bn, bk, stages, 4, 4)
            assert fit_stages * fit_k * (bn * 4 + block_m * 4) <= SHARED_MEMORY_BUDGET
            assert fit_stages >= 2 and fit_k >= 32


# --- split-K: SPLIT_K programs per column block, summed by the last one in the same launch ------


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.sampled_from([1, 3, 16]),
    N=st.integers(1, 70),
    blocks_per_split=st.integers(1, 3),
    split_k=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8=st.booleans(),
    activation=st.sampled_from([None, "silu"]),
    seed=st.integers(0, 2**16),
)
def test_split_k_equals_the_unsplit_sum_and_leaves_counters_at_zero(
        M, N, blocks_per_split, split_k, dtype, fp8, activation, seed):
    from fuser.ops.fp8 import quantize_weight
    from fuser.ops.counters import split_counters

    block_k = 32
    K = block_k * blocks_per_split * split_k
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * N if activation else N, K, generator=g) * 0.1).to(dtype).to(DEVICE)
    scale = None
    if fp8:
        w, scale = quantize_weight(w)
    config = dict(weight_scale=scale, activation=activation, block_n=16, block_k=block_k)
    split = linear_triton(x, w, split_k=split_k, **config)
    again = linear_triton(x, w, split_k=split_k, **config)  # the counters were reset
    whole = linear_triton(x, w, split_k=1, **config)
    assert torch.equal(split, again)
    assert not split_counters(x.device, 1).any()
    assert split.shape == whole.shape and torch.isfinite(split).all()
    # the same products, summed in split order: equal up to the fp32 order of the sum (and one
    # rounding of the result to the dtype)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(split.float(), whole.float(), rtol=tol, atol=tol * (
        whole.float().abs().max().item() + 1e-6))
    if activation is None and not fp8:
        check(x.cpu(), w.cpu(), split.cpu())


def test_split_k_refuses_a_split_that_does_not_divide_k():
    x = torch.randn(1, 96, device=DEVICE)
    w = torch.randn(8, 96, device=DEVICE)
    with pytest.raises(ValueError, match="split_k"):
        linear_triton(x, w, split_k=2, block_k=64)


def test_default_split_k_is_where_it_measured_faster():
    from fuser.ops.gemv_tables import _default_split_k

    assert _default_split_k(1, 4096, 14336, False) == 2      # down_proj, bf16
    assert _default_split_k(1, 4096, 14336, True) == 1       # down_proj, fp8 (wide tiles)
    assert _default_split_k(1, 4096, 4096, False) == 2       # o_proj, bf16
    assert _default_split_k(1, 4096, 4096, True) == 1
    assert _default_split_k(1, 6144, 4096, False) == 1       # qkv
    # several rows, the swapped MMA's 64-row tiles (measured at M = 5)
    assert _default_split_k(5, 4096, 14336, False) == 4      # down_proj
    assert _default_split_k(5, 4096, 4096, False) == 2       # o_proj
    assert _default_split_k(5, 6144, 4096, False) == 1       # qkv
    assert _default_split_k(5, 6144, 4096, True) == 4
    assert _default_split_k(5, 28672, 4096, True) == 1       # gate_up


def test_small_weights_take_the_small_tile_at_several_rows():
    """The bundled pair's weights (at most SMALL_WEIGHT elements) at several rows: 16-column
    tiles, unsplit (measured faster on an H200); one row and the 8B shapes keep their tables."""
    from fuser.ops.gemv_tables import (SMALL_ROWS_TILE, _default_config, _default_split_k,
                                       small_weight)

    bundled = [(640, 384), (384, 384), (1920, 384), (384, 960), (4096, 384),  # target
               (320, 192), (192, 192), (1024, 192), (192, 512), (4096, 192)]  # draft
    for N, K in bundled:
        assert small_weight(N, K)
        for M in (2, 3, 5, 16):
            assert _default_config(M, N, K) == SMALL_ROWS_TILE
            assert _default_split_k(M, N, K, False) == 1
        assert _default_config(1, N, K) != SMALL_ROWS_TILE
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048)):
        assert not small_weight(N, K)
        assert _default_config(5, N, K) != SMALL_ROWS_TILE
    assert _default_split_k(5, 4096, 4096, False) == 2       # o_proj (8B) as before


@pytest.mark.parametrize("activation", [None, "silu"])
def test_small_tile_sums_the_same_products(activation):
    """At several rows the small tile's outputs equal the 8B-shape tile's: the same K order,
    only the columns per program differ (bit-equal on the H200 too)."""
    from fuser.ops.gemv_tables import SMALL_ROWS_TILE

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(192 if activation else 96, 384, generator=g) * 0.1).to(torch.bfloat16
                                                                              ).to(DEVICE)
    bn, bk, warps, stages = SMALL_ROWS_TILE
    small = linear_triton(x, w, activation=activation, block_n=bn, block_k=bk, split_k=1)
    wide = linear_triton(x, w, activation=activation, block_n=64, block_k=bk, split_k=1)
    assert torch.equal(small, wide)
    if activation is None:
        check(x.cpu(), w.cpu(), small.cpu())


def test_default_swap_is_where_it_measured_faster():
    from fuser.ops.gemv_tables import _default_swap

    assert not _default_swap(1, 28672, 4096, True)           # one row: the CUDA cores
    for N, K in ((4096, 14336), (4096, 4096), (28672, 4096)):  # down, o_proj, gate_up
        assert _default_swap(5, N, K, False) and _default_swap(5, N, K, True)
    assert not _default_swap(5, 6144, 4096, False)           # qkv, bf16
    assert not _default_swap(5, 128256, 4096, False)         # the LM head, bf16
    assert _default_swap(5, 6144, 4096, True) and _default_swap(5, 128256, 4096, True)


def test_split_counters_persist_and_grow():
    from fuser.ops.counters import SPLIT_COUNTERS, split_counters

    device = torch.device(DEVICE)
    counters = split_counters(device, 1)
    assert counters.dtype == torch.int32 and counters.numel() >= SPLIT_COUNTERS
    assert not counters.any()
    assert split_counters(device, counters.numel()) is counters  # the same buffer every call
    grown = split_counters(device, counters.numel() + 1)
    assert grown.numel() > counters.numel() and not grown.any()
    assert split_counters(device, 1) is grown


# --- several rows: the weight tile as the MMA's A operand (linear._default_swap) ----------------


# Several rows of x, a weight of N rows and K = 32 * blocks * split_k columns
SEVERAL_ROWS = dict(M=st.integers(2, MAX_ROWS), N=st.integers(1, 70), blocks=st.integers(1, 3),
                    split_k=st.sampled_from([1, 2]))


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    **SEVERAL_ROWS,
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    activation=st.sampled_from([None, "silu"]),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_swapped_mma_sums_the_same_products(M, N, blocks, split_k, dtype, fp8, activation, norm,
                                            seed):
    """_mma_swapped (acc[BLOCK_N, BLOCK_M] += w . x.T, transposed once after the K loop) against
    _mma (acc[BLOCK_M, BLOCK_N] += x . w.T): the same products in fp32, summed in another order,
    through split-K, the gated epilogue, the FP8 scale and the norm prologue; and against the
    reference where there is one."""
    from unittest import mock

    from fuser.ops import linear as linear_module

    K = 32 * blocks * split_k
    x, r, gain, w, scale = _norm_linear_case(M, N, K, dtype, fp8, activation, seed)
    config = dict(weight_scale=scale, activation=activation, block_n=16, block_k=32,
                  split_k=split_k)

    def run_once(swap: bool) -> torch.Tensor:
        with mock.patch.object(linear_module, "_default_swap", lambda *_: swap):
            return _run_norm_linear(x, r if norm else None, gain, w, **config)

    swapped, plain = run_once(True), run_once(False)
    assert swapped.shape == plain.shape and torch.isfinite(swapped).all()
    tol = 1e-5 if dtype == torch.float32 else (2.0**-7 if dtype == torch.bfloat16 else 2.0**-9)
    torch.testing.assert_close(swapped.float(), plain.float(), rtol=tol, atol=tol * (
        plain.float().abs().max().item() + 1e-6))
    if not (activation or fp8 or norm):
        check(x.cpu(), w.cpu(), swapped.reshape(M, -1).cpu())


def _run_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, **config) -> torch.Tensor:
    """linear_triton over FP8 weights on the swapped MMA: for bf16 x the fp16 MMA (_f16_step)."""
    from unittest import mock

    from fuser.ops import linear as linear_module

    with mock.patch.object(linear_module, "_default_swap", lambda *_: True):
        return linear_triton(x, w, weight_scale=scale, **config)


def _fp8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                   activation: str | None) -> torch.Tensor:
    from fuser.ops.fp8 import fp8_linear_reference
    from fuser.ops.fp8_linear import fp8_gated_linear_reference

    if activation is None:
        return fp8_linear_reference(x, w, scale).float()
    return fp8_gated_linear_reference(x, w, scale, activation).float()


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    **SEVERAL_ROWS,
    activation=st.sampled_from([None, "silu"]),
    magnitude=st.sampled_from([2.0**-40, 2.0**-8, 1.0, 2.0**40]),
    seed=st.integers(0, 2**16),
)
def test_fp8_weights_on_the_fp16_mma_keep_the_reference_values(M, N, blocks, split_k,
                                                                activation, magnitude, seed):
    """Several bf16 rows against FP8 weights: _f16_step puts x into the fp16 MMA scaled per row
    by a power of two that follows its running max |x|, so bf16's x is exact there at any
    magnitude and the products are exact in fp32: the outputs match the reference up to the
    fp32 order of the sum and one rounding, far outside fp16's range too."""
    from fuser.ops.fp8 import quantize_weight

    K = 32 * blocks * split_k
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * magnitude).to(torch.bfloat16).to(DEVICE)
    w, scale = quantize_weight((torch.randn(2 * N if activation else N, K, generator=g)))
    w, scale = w.to(DEVICE), scale.to(DEVICE)
    out = _run_fp8(x, w, scale, activation=activation, block_n=16, block_k=32, split_k=split_k)
    assert torch.isfinite(out).all()
    ref = _fp8_reference(x, w, scale, activation)
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7,
                               atol=2.0**-7 * ref.abs().max().item() + 1e-37)


@needs_cuda
@pytest.mark.parametrize("magnitude", [1.0, 2.0**37])
@pytest.mark.parametrize("N,K,activation", [(6144, 4096, None), (4096, 4096, None),
                                             (28672, 4096, "silu"), (4096, 14336, None)])
def test_gpu_fp16_mma_at_llama3_shapes(N, K, activation, magnitude):
    """The fp16 MMA at the 8B shapes, five rows, the default tiles and split-K, x a strided view
    as the qkv output's slice is, at ordinary and large magnitudes: finite, and the reference's
    values."""
    from fuser.ops.fp8 import quantize_weight

    g = torch.Generator(device="cuda").manual_seed(N + K)
    wide = torch.randn(5, K + 64, device="cuda", generator=g) * magnitude
    x = wide.to(torch.bfloat16)[:, :K]
    w, scale = quantize_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    f16 = _run_fp8(x, w, scale, activation=activation)
    bad = ~torch.isfinite(f16)
    assert not bad.any(), (f"{int(bad.sum())} of {f16.numel()} outputs non-finite, rows "
                           f"{bad.any(1).nonzero().flatten().tolist()}, first columns "
                           f"{bad.any(0).nonzero().flatten()[:8].tolist()}")
    ref = _fp8_reference(x, w, scale, activation)
    torch.testing.assert_close(f16.float(), ref, rtol=2.0**-7,
                               atol=2.0**-7 * ref.abs().max().item())


def test_fp16_mma_rescales_when_a_row_grows_by_far_more_than_fp16_holds():
    """A row whose first K tiles are ~2^-80 and whose last is ~2^60 (2^140 apart: beyond fp16's
    range, and a rescale of the sums clamped at 2^-126): finite, and the large tile's products
    decide the output as in the reference; the large values first need no rescale at all."""
    from fuser.ops.fp8 import fp8_linear_reference, quantize_weight

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128, generator=g) * 2.0**-80
    x[:, 96:] = torch.randn(3, 32, generator=g) * 2.0**60
    x[2] = x[2].flip(0)  # the large values first: no rescale after them
    x = x.to(torch.bfloat16).to(DEVICE)
    w, scale = quantize_weight(torch.randn(24, 128, generator=g))
    w, scale = w.to(DEVICE), scale.to(DEVICE)
    out = _run_fp8(x, w, scale, block_n=16, block_k=32)
    ref = fp8_linear_reference(x, w, scale).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=2.0**-7 * ref.abs().max())
