"""fuser::rms_norm_linear and fuser::add_rms_norm_linear: the decode GEMV with the RMSNorm (and
residual add) in its prologue, against the norm's reference then the GEMV's.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); with one it runs for real,
and the tests with "gpu" in their name run too (Llama-3-8B's qkv and gate/up shapes).

What must hold:
- summed (x + residual, written by program 0) equals add_rms_norm's sum bit for bit;
- out is the GEMV of the norm's output: within the GEMV tests' float64 bounds
  (tests/test_ops_linear.py `check`, tests/test_ops_gated_linear.py `assert_gated_close`)
  around the GEMV of the *reference* normed rows. The kernel's normed values equal those except
  where its fp32 sum of squares (another order) moves rstd by an ulp;
- in bf16/fp16, nearly every output equals the unfused kernels' (the norm kernel, then the GEMV
  with the same blocking) bit for bit: a missing rounding of the normed tile would break that.

One row with rstd after the sum (linear.rstd_last_for: the decode step's FP8 qkv launch)
computes the norm differently: rstd multiplies the GEMV's fp32 sums of w * (g * h) after the
loop, with none of the norm's own roundings (g * (h * rstd).to(dtype), rounded again). The
rstd_after_the_sum fixture takes that form for every one-row shape, so that the tests cover it
in bf16, gated and fp32 too. There out is held to the float64 GEMV of the
*exact* normed rows g * h * rstd (h = x (+ r) rounded to x's dtype, as summed is) by the same
bounds, and, at a size where the roundings add up, its error against that must be smaller than
the unfused kernels' (test_rstd_last_is_closer_to_the_exact_norm_than_the_unfused_kernels).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops import CPU_INLINE
from fuser.ops.fp8 import dequantize, quantize_weight
from fuser.ops.gated_act import ACTIVATIONS
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.ops.linear import linear_triton
from fuser.ops.norm_linear import (add_rms_norm_linear_reference, rms_norm_linear_reference,
                                   rms_norm_linear_triton)
from fuser.ops.rmsnorm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, \
    rms_norm_triton
from test_ops_gated_linear import FP8_OPCHECK_TESTS, SETTINGS, assert_gated_close, \
    assert_mostly_equal
from test_ops_linear import check as assert_linear_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5

pytestmark = [
    pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


def inputs(M: int, K: int, rows_w: int, dtype: torch.dtype, seed: int, residual: bool,
           lead: tuple = ()) -> tuple:
    """x, residual (or None), norm weight [K] around 1, weight [rows_w, K] (gate ~ N(0, 9))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    r = torch.randn(*lead, M, K, generator=g).to(dtype) if residual else None
    norm_weight = (1 + 0.2 * torch.randn(K, generator=g)).to(dtype)
    w = (torch.randn(rows_w, K, generator=g) / max(K, 1) ** 0.5 * 3).to(dtype)
    return x, r, norm_weight, w


def reference_norm(x, r, norm_weight):
    """(normed, summed or None): the norm ops' references."""
    if r is None:
        return rms_norm_reference(x, norm_weight, EPS), None
    return add_rms_norm_reference(x, r, norm_weight, EPS)


def exact_norm(x, r, norm_weight):
    """g * h * rsqrt(mean(h^2) + eps) in float64, h = x (+ r) rounded to x's dtype."""
    h = (x if r is None else (x + r)).double()
    return norm_weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.fixture
def rstd_after_the_sum():
    """Every one-row GEMV with the norm multiplies by rstd after its K loop for the test (by
    default only FP8 qkv does: gemv_tables.rstd_last_for, as linear.py's launcher reads it)."""
    from unittest import mock

    from fuser.ops import linear as linear_module

    with mock.patch.object(linear_module, "rstd_last_for", lambda fp8, gated, n: True):
        yield


def rstd_last(rows: int, fp8: bool, activation: str | None, n: int) -> bool:
    """Whether the kernel multiplies by rstd after its loop (one row, linear.rstd_last_for)."""
    from fuser.ops import linear as linear_module

    return rows == 1 and linear_module.rstd_last_for(fp8, activation is not None, n)


def norm_after(rows: int, residual: bool, fp8: bool, activation: str | None, n: int) -> bool:
    """Whether the kernel runs gemv_tables.ONE_ROW_NORM_AFTER's arithmetic (on by default)."""
    from fuser.ops import gemv_tables

    return gemv_tables.norm_after_for(rows, residual, fp8, rstd_last(rows, fp8, activation, n))


def after_norm(x, r, norm_weight):
    """ONE_ROW_NORM_AFTER's normed rows in float64: (g * h, rounded once) * rsqrt(mean(h^2) +
    eps), h = x + r rounded to x's dtype."""
    h = x + r
    return (norm_weight * h).double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True)
                                                    + EPS)


def unfused_kernels(x, r, norm_weight, w, scale, activation, **blocks):
    normed = rms_norm_triton(x, norm_weight, EPS) if r is None else \
        add_rms_norm_triton(x, r, norm_weight, EPS)[0]
    return linear_triton(normed, w, weight_scale=scale, activation=activation, **blocks)


def run(M: int, K: int, N: int, dtype: torch.dtype, residual: bool, activation: str | None,
        fp8: bool, seed: int, lead: tuple = (), **blocks) -> torch.Tensor:
    rows_w = 2 * N if activation else N
    x, r, norm_weight, w = inputs(M, K, rows_w, dtype, seed, residual, lead)
    scale = None
    if fp8:
        w, scale = quantize_weight(w.float())
    to = (lambda t: None if t is None else t.to(DEVICE))
    args = [to(t) for t in (x, r, norm_weight, w, scale)]
    xd, rd, gd, wd, sd = args
    out, summed = rms_norm_linear_triton(xd, rd, gd, EPS, wd, weight_scale=sd,
                                         activation=activation, **blocks)
    out = out.cpu()
    normed, summed_ref = reference_norm(x, r, norm_weight)
    if residual:
        assert summed.shape == x.shape and torch.equal(summed.cpu(), summed_ref)
    else:
        assert summed is None
    assert out.shape == (*lead, M, N) and out.dtype == dtype
    w_values = dequantize(w, scale) if fp8 else w
    rows = x.numel() // max(K, 1)
    after = rstd_last(rows, fp8, activation, N)
    if after:  # the float64 GEMV of the exact normed rows (the module docstring)
        normed = exact_norm(x, r, norm_weight)
    elif norm_after(rows, residual, fp8, activation, N):  # g * h rounded once, rstd after
        normed, after = after_norm(x, r, norm_weight), True
    if activation is None:
        assert_linear_close(normed, w_values, out, dtype)
    else:
        assert_gated_close(out, normed, w_values, activation, dtype)
    if not after:
        assert_mostly_equal(out, unfused_kernels(xd, rd, gd, wd, sd, activation,
                                                 **blocks).cpu(), dtype)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_rows_dtypes_residual_gated_fp8(M, dtype, residual, activation, fp8) -> None:
    # N, K off the block sizes: a masked last column block and a masked last K chunk, in the
    # norm's pass over K as in the GEMV's.
    run(M, 200, 40, dtype, residual, activation, fp8, seed=M, block_n=32, block_k=64)


@settings(max_examples=15, derandomize=True, **SETTINGS)
@given(
    M=st.integers(1, MAX_ROWS),
    K=st.integers(1, 300),
    N=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    residual=st.booleans(),
    activation=st.sampled_from([None, *ACTIVATIONS]),
    fp8=st.booleans(),
    block_n=st.sampled_from([None, 16, 32]),
    block_k=st.sampled_from([None, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(M, K, N, dtype, residual, activation, fp8, block_n, block_k, seed) -> None:
    run(M, K, N, dtype, residual, activation, fp8, seed, block_n=block_n, block_k=block_k)


@pytest.mark.parametrize("norm_k", [16, 64, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_one_row_prologue_at_other_widths(norm_k: int, residual: bool) -> None:
    """gemv_tables.ONE_ROW_NORM_K (as linear.py's launcher reads it): one row's norm prologue
    stepping 16, 64 or all of K's columns (against BLOCK_K = 32) still gives the norm's value, summed and the GEMV (K off every
    width: a masked last step)."""
    from unittest import mock

    from fuser.ops import linear as linear_module

    with mock.patch.object(linear_module, "ONE_ROW_NORM_K", norm_k):
        for fp8, activation in ((False, None), (True, "silu")):
            run(1, 200, 24, torch.bfloat16, residual, activation, fp8, seed=norm_k,
                block_n=8, block_k=32)


@pytest.mark.usefixtures("rstd_after_the_sum")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_row_with_rstd_after_the_sum(dtype, residual, activation, fp8) -> None:
    """rstd after the sum: summed bit for bit, out within the GEMV bounds around the exact
    norm (run() switches to those when the flag is on), at a masked last block and K step."""
    run(1, 200, 40, dtype, residual, activation, fp8, seed=12, block_n=8, block_k=64)


@pytest.mark.usefixtures("rstd_after_the_sum")
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_rstd_last_is_closer_to_the_exact_norm_than_the_unfused_kernels(residual: bool) -> None:
    """One row, bf16, K = 1024: the norm's two roundings of each normed value (relative 2^-9
    each) add up over K in the unfused GEMV; rstd after the sum has none of them, so its error
    against the float64 GEMV of the exact norm is the output's rounding alone, smaller.
    Measured under the interpreter: 0.0017 against 0.0027 relative (with the residual)."""
    x, r, g, w = inputs(1, 1024, 256, torch.bfloat16, seed=11, residual=residual)
    exact = exact_norm(x, r, g) @ w.double().T
    to = (lambda t: None if t is None else t.to(DEVICE))
    fused, _ = rms_norm_linear_triton(to(x), to(r), to(g), EPS, to(w), block_n=16, block_k=512)
    unfused = unfused_kernels(to(x), to(r), to(g), to(w), None, None)

    def err(out):
        return ((out.cpu().double() - exact).norm() / exact.norm()).item()

    assert err(fused) < 0.85 * err(unfused), (err(fused), err(unfused))


def test_leading_dims_strided_inputs_and_tuned_blocks() -> None:
    run(5, 96, 40, torch.bfloat16, True, None, False, seed=3, lead=(1,), block_n=32, block_k=32)
    run(1, 512, 300, torch.bfloat16, True, "silu", False, seed=4)    # the tuned tables' blocks
    run(7, 512, 300, torch.bfloat16, False, None, True, seed=5)
    # transposed x and residual: [3, 64] with stride (1, 3)
    x, r, g = torch.randn(64, 3).t(), torch.randn(64, 3).t(), 1 + torch.randn(64) / 4
    w = torch.randn(24, 64)
    out, summed = rms_norm_linear_triton(*(t.to(DEVICE) for t in (x, r, g)), EPS, w.to(DEVICE))
    normed, summed_ref = add_rms_norm_reference(x, r, g, EPS)
    assert torch.equal(summed.cpu(), summed_ref)
    assert_linear_close(normed, w, out.cpu())


def test_the_check_fails_without_the_norm_or_the_residual() -> None:
    x, r, g, w = inputs(3, 128, 40, torch.float32, seed=6, residual=True)
    normed, _ = reference_norm(x, r, g)
    for wrong in (linear_triton(x, w),                                  # no norm at all
                  rms_norm_linear_triton(x, None, g, EPS, w)[0],        # the residual dropped
                  rms_norm_linear_triton(x, r, torch.ones_like(g), EPS, w)[0]):  # no weight
        with pytest.raises(AssertionError):
            assert_linear_close(normed, w, wrong)


def test_launcher_refuses_mixed_dtypes_and_shapes() -> None:
    x, r, g, w = inputs(2, 32, 16, torch.bfloat16, seed=7, residual=True)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_linear_triton(x, r, g.float(), EPS, w)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_linear_triton(x, r, g[:-1], EPS, w)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_linear_triton(x, r[:1], g, EPS, w)


# --- the custom ops -----------------------------------------------------------------------------


def unfused_ops(x, r, g, weight, scale, activation):
    """The separate ops the fused ones replace: fuser::rms_norm / add_rms_norm, then the GEMV."""
    normed, summed = (torch.ops.fuser.rms_norm(x, g, EPS), None) if r is None else \
        torch.ops.fuser.add_rms_norm(x, r, g, EPS)
    if scale is None:
        out = torch.ops.fuser.linear(normed, weight) if activation is None else \
            torch.ops.fuser.gated_linear(normed, weight, activation)
    else:
        out = torch.ops.fuser.fp8_linear(normed, weight, scale) if activation is None else \
            torch.ops.fuser.fp8_gated_linear(normed, weight, scale, activation)
    return out if r is None else (out, summed)


def op_cases(dtype: torch.dtype = torch.bfloat16, rows: int = 3, device: str = "cpu"):
    """(op, args, what the separate ops give) for both ops x the four weight kinds."""
    x, r, g, w = (t.to(device) for t in inputs(rows, 64, 48, dtype, seed=8, residual=True,
                                               lead=(1,)))
    q, s = quantize_weight(w.float())
    cases = []
    for weight, scale in ((w, None), (q, s)):
        for activation in (None, "silu"):
            tail = (EPS, weight, scale, activation)
            cases.append((torch.ops.fuser.rms_norm_linear.default, (x, g, *tail),
                          unfused_ops(x, None, g, *tail[1:])))
            cases.append((torch.ops.fuser.add_rms_norm_linear.default, (x, r, g, *tail),
                          unfused_ops(x, r, g, *tail[1:])))
    return cases


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def test_ops_on_cpu_are_the_unfused_ops_and_inline_the_same() -> None:
    for op, args, unfused in op_cases():
        want = _outputs(unfused)
        for got in (_outputs(op(*args)), _outputs(CPU_INLINE[op](*args))):
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert torch.equal(a, b) and a.is_contiguous(), op
    x, r, g, w = inputs(2, 32, 16, torch.float32, seed=9, residual=True)
    out, summed = add_rms_norm_linear_reference(x, r, g, EPS, w, None, None)
    assert torch.equal(rms_norm_linear_reference(summed, g, EPS, w, None, None), out)


def test_opcheck_and_fake() -> None:
    for op, args, _ in op_cases(torch.float32):
        fp8 = args[-2] is not None
        torch.library.opcheck(op, args, test_utils=FP8_OPCHECK_TESTS if fp8 else
                              ("test_schema", *FP8_OPCHECK_TESTS))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.float16)
        g, w = torch.empty(64, dtype=torch.float16), torch.empty(144, 64, dtype=torch.float16)
        out, summed = torch.ops.fuser.add_rms_norm_linear(x, x, g, EPS, w, None, "silu")
        plain = torch.ops.fuser.rms_norm_linear(x, g, EPS, w, None, None)
    assert out.shape == (2, 5, 72) and out.dtype == torch.float16 and summed.shape == x.shape
    assert plain.shape == (2, 5, 144)


# --- on a GPU: Llama-3-8B's qkv (N = 6144) and gate/up (I = 14336), K = 4096 ----------------------


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("M", [1, 5])
def test_gpu_llama3_qkv_and_gate_up(M: int, residual: bool, fp8: bool) -> None:
    run(M, 4096, 6144, torch.bfloat16, residual, None, fp8, seed=M)
    run(M, 4096, 14336, torch.bfloat16, residual, "silu", fp8, seed=M + 1)


@needs_cuda
@pytest.mark.parametrize("rows", [5, MAX_ROWS + 1])
def test_gpu_ops_run_the_kernel_and_fall_back_above_max_rows(rows: int) -> None:
    from fuser.ops import norm_linear

    for op, args, unfused in op_cases(rows=rows, device="cuda"):
        got = _outputs(op(*args))
        if rows > MAX_ROWS:  # the separate kernels, exactly
            want = _outputs(unfused)
        else:
            x, r, g = (args[0], None, args[1]) if len(args) == 6 else args[:3]
            weight, scale, activation = args[-3:]
            if norm_linear._norm_pieces_take(x, r, g, scale):  # FP8 rows on e4m3 pieces
                out, summed = norm_linear._norm_pieces_linear(x, r, g, EPS, weight, scale,
                                                                activation)
            else:
                out, summed = rms_norm_linear_triton(x, r, g, EPS, weight, weight_scale=scale,
                                                     activation=activation)
            want = (out,) if r is None else (out, summed)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), op


def test_rstd_after_the_sum_is_chosen_for_fp8_qkv_only() -> None:
    """The defaults: rstd after the sum for one-row FP8 GEMVs without the gated activation and
    under 2^16 outputs (qkv), the prologue pass for the LM head, gate/up and bf16 weights."""
    from fuser.ops.gemv_tables import rstd_last_for

    assert rstd_last_for(True, False, 6144)
    assert not rstd_last_for(True, False, 128256)   # the LM head
    assert not rstd_last_for(True, True, 14336)     # gate/up
    assert not rstd_last_for(False, False, 6144)    # bf16
