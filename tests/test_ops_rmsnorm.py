"""fuser::rms_norm and fuser::add_rms_norm: Triton launchers and custom ops against the reference.

Without a GPU the launchers run under TRITON_INTERPRET=1 (set in conftest.py before any kernel
is defined); with one they run for real.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Widths either side of the power-of-two blocks, and one past the single-pass limit (8192).
WIDTHS = [1, 7, 63, 64, 65, 127, 128, 129, 1000, 4096, 8193]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Elementwise tolerance, relative to |ref| (floored at the smallest normal of the output dtype),
# keyed by the dtype the normalised row is rounded to (x's dtype, or x + residual's), with the
# fraction of elements that must match bit for bit.
TOLERANCE = {
    # Our sum of squares runs in a different order from torch's and rsqrt may differ in the
    # last bit; that enters every element as one relative factor through the shared rstd
    # (measured at most 3 ulps). 1e-6 is about 8 fp32 ulps. Most elements differ by an ulp, so
    # no bitwise fraction is required.
    torch.float32: (1e-6, 0.0),
    # A last-bit difference in the fp32 rstd can move h to the neighbouring bf16/fp16 value
    # (<= 1 ulp, relative <= eps) and the product with the weight is rounded once more (<= 1
    # ulp): 2 eps. That happens only when h lands within ~1e-7 of a rounding boundary, so
    # nearly all elements must match exactly; a wrong rounding order (h not rounded to x's
    # dtype before the weight) would break that on about half of them while staying within 2 eps.
    torch.bfloat16: (2 * torch.finfo(torch.bfloat16).eps, 0.99),
    torch.float16: (2 * torch.finfo(torch.float16).eps, 0.99),
}


# The interpreter must round fp32 -> bf16 like a GPU (see the fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")


def assert_close(out: torch.Tensor, ref: torch.Tensor, rounded_to: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    rtol, min_equal = TOLERANCE[rounded_to]
    floor = torch.finfo(ref.dtype).smallest_normal
    err = (out.double() - ref.double()).abs()
    bound = rtol * ref.double().abs().clamp_min(floor)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {worst:.2f}x the {rounded_to} tolerance"
    equal = (out == ref).double().mean().item()
    assert equal >= min_equal, f"only {equal:.4f} of elements bitwise equal, need {min_equal}"


def make_inputs(rows_shape, n, dtype, weight_dtype, layout, seed, scale=3.0):
    """x, residual: [*rows_shape, n] in the given layout; weight: [n]. Never all zero."""
    g = torch.Generator().manual_seed(seed)

    def act():
        if layout == "contiguous":
            t = torch.randn(*rows_shape, n, generator=g)
        elif layout == "strided_rows":  # every other row of a larger tensor
            t = torch.randn(*rows_shape[:-1], 2 * rows_shape[-1], n, generator=g)[..., ::2, :]
        else:  # "transposed": leading dims swapped; 3-D only, rows not collapsible to one stride
            t = torch.randn(rows_shape[1], rows_shape[0], n, generator=g).transpose(0, 1)
        return (scale * t).to(dtype).to(DEVICE)

    x, residual = act(), act()
    weight = (1 + 0.5 * torch.randn(n, generator=g)).to(weight_dtype).to(DEVICE)
    assert x.abs().sum() > 0 and residual.abs().sum() > 0
    return x, residual, weight


def check_launchers(x, residual, weight, eps):
    inputs = [t.clone() for t in (x, residual, weight)]
    # Kernels first, so nothing the reference frees can be picked up by the outputs' torch.empty.
    out = rms_norm_triton(x, weight, eps)
    normed, summed = add_rms_norm_triton(x, residual, weight, eps)

    for t in (out, normed, summed):  # fresh tensors; inputs untouched
        assert all(t.data_ptr() != i.data_ptr() for i in (x, residual, weight))
    for before, after in zip(inputs, (x, residual, weight)):
        assert torch.equal(before, after)

    assert_close(out, rms_norm_reference(x, weight, eps), rounded_to=x.dtype)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, eps)
    assert torch.equal(summed, ref_summed) and summed.dtype == ref_summed.dtype  # same single add
    assert_close(normed, ref_normed, rounded_to=ref_summed.dtype)


# --- launchers --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", WIDTHS)
def test_launchers_at_block_boundaries(n, dtype):
    rows = 2 if n > 8192 else 3
    x, residual, weight = make_inputs((rows,), n, dtype, dtype, "contiguous", seed=n)
    check_launchers(x, residual, weight, eps=1e-6)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    weight_fp32=st.booleans(),  # HF keeps some norms' weights in fp32 next to bf16 activations
    n=st.one_of(st.sampled_from(WIDTHS), st.integers(1, 2100)),
    rows_shape=st.sampled_from([(1,), (2,), (5,), (1, 1), (1, 3), (2, 2), (5, 1)]),
    layout=st.sampled_from(["contiguous", "strided_rows", "transposed"]),
    eps=st.sampled_from([1e-5, 1e-6]),
    scale=st.sampled_from([1e-3, 3.0]),  # at 1e-3 the mean square is comparable to eps
    seed=st.integers(0, 2**16),
)
def test_launchers_match_reference(dtype, weight_fp32, n, rows_shape, layout, eps, scale, seed):
    if n > 8192:
        rows_shape = rows_shape[:-1] + (min(rows_shape[-1], 2),)  # interpret mode stays fast
    if layout == "transposed" and len(rows_shape) == 1:
        layout = "strided_rows"
    weight_dtype = torch.float32 if weight_fp32 else dtype
    x, residual, weight = make_inputs(rows_shape, n, dtype, weight_dtype, layout, seed, scale)
    check_launchers(x, residual, weight, eps)


def test_launchers_residual_dtype_promotes():
    # bf16 x + fp32 residual: the sum is fp32 (torch promotion), normalised and weighted in fp32.
    x, _, weight = make_inputs((3,), 129, torch.bfloat16, torch.bfloat16, "contiguous", seed=1)
    _, residual, _ = make_inputs((3,), 129, torch.float32, torch.float32, "contiguous", seed=2)
    normed, summed = add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed) and summed.dtype == torch.float32
    assert_close(normed, ref_normed, rounded_to=torch.float32)


# --- custom ops (CPU: the reference) ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_ops_cpu_equal_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 3, 257, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(257, generator=g).to(dtype)
    out = torch.ops.fuser.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, rms_norm_reference(x, weight, 1e-6))
    normed, summed = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)


def _opcheck_samples():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return [
        (r(4, 64), r(4, 64), r(64), 1e-6),
        (r(2, 3, 65, dtype=torch.bfloat16), r(2, 3, 65, dtype=torch.bfloat16), r(65, dtype=torch.bfloat16), 1e-5),
        # mixed dtypes: outputs promote (normed fp32; summed fp32 for an fp32 residual)
        (r(3, 33, dtype=torch.bfloat16), r(3, 33), r(33, dtype=torch.bfloat16), 1e-5),
        (r(3, 33, dtype=torch.float16), r(3, 33, dtype=torch.float16), r(33), 1e-5),
        # non-contiguous leading dims
        (r(4, 2, 16).transpose(0, 1), r(2, 4, 16), r(16), 1e-6),
    ]


@pytest.mark.parametrize("sample", range(5))
def test_opcheck(sample):
    x, residual, weight, eps = _opcheck_samples()[sample]
    torch.library.opcheck(torch.ops.fuser.rms_norm.default, (x, weight, eps))
    torch.library.opcheck(torch.ops.fuser.add_rms_norm.default, (x, residual, weight, eps))


def test_fake_tensor_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 128, dtype=torch.bfloat16)
        residual = torch.empty(2, 5, 128, dtype=torch.float32)
        weight = torch.empty(128, dtype=torch.bfloat16)
        out = torch.ops.fuser.rms_norm(x, weight, 1e-6)
        normed, summed = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-6)
    assert out.shape == (2, 5, 128) and out.dtype == torch.bfloat16
    assert normed.shape == (2, 5, 128) and normed.dtype == torch.float32
    assert summed.shape == (2, 5, 128) and summed.dtype == torch.float32


# --- GPU --------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("n", [64, 4096, 5120, 8192, 16384])
def test_custom_ops_cuda_bf16(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x, residual = (3 * torch.randn(4, 7, n, device="cuda", generator=g)).bfloat16().unbind(0)[:2]
    weight = (1 + 0.5 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    out = torch.ops.fuser.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, rms_norm_triton(x, weight, 1e-5))  # the CUDA kernel is the Triton one
    assert_close(out, rms_norm_reference(x, weight, 1e-5), rounded_to=torch.bfloat16)
    normed, summed = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert_close(normed, ref_normed, rounded_to=torch.bfloat16)
