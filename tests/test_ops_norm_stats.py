"""fuser::linear_residual and fuser::stats_rms_norm_linear (fuser/ops/norm_stats.py): the
several-row norm moved into the GEMVs around it.

Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py); with one, for real, and
the "gpu" tests run too (Llama-3-8B's o_proj -> gate/up and down_proj -> qkv at 5 rows).

What must hold:
- linear_residual's summed equals the GEMV (same blocks, split-K included) plus the residual as
  fuser::add_rms_norm adds them, bit for bit; gh = g * summed bit for bit; its squares are
  summed's group sums of squares (fp32, another order: to a few ulps);
- the norm's GEMV (normed_linear_triton on gh and the squares) is the GEMV of its normed rows
  gh * rsqrt(mean(h^2) + eps) (float64) within the GEMV tests' float64 bounds, and closer to
  the GEMV of the *exact* norm g * h * rsqrt(...) than the norm kernel then the GEMV (one
  rounding of the normed values where the norm rounds twice);
- on CPU the ops are their references: the same bits as the ops they replace.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops import CPU_INLINE
from fuser.ops.fp8 import dequantize, quantize_weight
from fuser.ops.gated_act import ACTIVATIONS
from fuser.ops.gemv_tables import MAX_ROWS, STAT_COLS
from fuser.ops.linear import linear_triton
from fuser.ops.norm_stats import (
    group_squares_reference,
    linear_residual_triton,
    normed_linear_triton,
)
from fuser.ops.rmsnorm import rms_norm_reference
from test_ops_gated_linear import FP8_OPCHECK_TESTS, SETTINGS, assert_gated_close
from test_ops_linear import check as assert_linear_close
from test_ops_norm_linear import DEVICE, EPS, needs_cuda, pytestmark  # noqa: F401


def _weight(rows: int, K: int, dtype: torch.dtype, fp8: bool, g: torch.Generator):
    w = (torch.randn(rows, K, generator=g) / max(K, 1) ** 0.5 * 3).to(dtype)
    if not fp8:
        return w, None, w
    q, s = quantize_weight(w.float())
    return q, s, dequantize(q, s)


def exact_norm(h: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """g * h * rsqrt(mean(h^2) + eps) in float64."""
    h = h.double()
    return norm_weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


def run(M: int, K: int, H: int, N: int, dtype: torch.dtype, fp8: bool, activation: str | None,
        seed: int, producer: dict | None = None, consumer: dict | None = None) -> None:
    """a [1, M, K] -> summed [1, M, H] (a GEMV [H, K] plus the residual) -> the norm and a GEMV
    [N (2N gated), H]; checked as the module docstring says."""
    producer, consumer = producer or {}, consumer or {}
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, M, K, generator=g).to(dtype)
    r = torch.randn(1, M, H, generator=g).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    w_p, s_p, _ = _weight(H, K, dtype, fp8, g)
    w_c, s_c, w_c_values = _weight(2 * N if activation else N, H, dtype, fp8, g)
    to = (lambda t: None if t is None else t.to(DEVICE))
    a_d, r_d, g_d, w_p_d, s_p_d, w_c_d, s_c_d = map(to, (a, r, norm_weight, w_p, s_p, w_c, s_c))

    summed, gh, squares = linear_residual_triton(a_d, w_p_d, r_d, g_d, weight_scale=s_p_d,
                                                 **producer)
    y = linear_triton(a_d, w_p_d, weight_scale=s_p_d, **producer)
    assert summed.shape == gh.shape == r.shape and summed.dtype == gh.dtype == dtype
    assert torch.equal(summed, (y.reshape(r.shape) + r_d))
    assert torch.equal(gh, g_d * summed)
    assert squares.shape == (M, -(-H // STAT_COLS)) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.cpu(), group_squares_reference(summed.cpu()),
                               rtol=1e-5, atol=1e-6)

    out = normed_linear_triton(gh, squares, EPS, w_c_d, weight_scale=s_c_d,
                               activation=activation, **consumer)
    assert out.shape == (1, M, N) and out.dtype == dtype
    # What the kernel computes from its inputs: the GEMV of gh times rstd, in float64.
    h = summed.cpu().double()
    normed = gh.cpu().double() * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    if activation is None:
        assert_linear_close(normed, w_c_values, out.cpu(), dtype)
    else:
        assert_gated_close(out.cpu(), normed, w_c_values, activation, dtype)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [2, 5, MAX_ROWS])
def test_rows_dtypes_gated_fp8(M, dtype, activation, fp8) -> None:
    # H = 200: a last column block and a last group of squares cut short (200 = 12 * 16 + 8)
    run(M, 96, 200, 40, dtype, fp8, activation, seed=M,
        producer=dict(block_n=64, block_k=32), consumer=dict(block_n=32, block_k=64))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_producer_stores_once(split_k: int) -> None:
    run(5, 192, 64, 32, torch.bfloat16, False, None, seed=split_k,
        producer=dict(block_n=32, block_k=32, split_k=split_k), consumer=dict(split_k=2,
                                                                              block_k=16))


@settings(max_examples=12, derandomize=True, **SETTINGS)
@given(
    M=st.integers(2, MAX_ROWS),
    K=st.integers(1, 160),
    H=st.integers(1, 160),
    N=st.integers(1, 48),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    activation=st.sampled_from([None, *ACTIVATIONS]),
    fp8=st.booleans(),
    block_n=st.sampled_from([None, 16, 32]),
    block_k=st.sampled_from([None, 32, 64]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(M, K, H, N, dtype, activation, fp8, block_n, block_k, seed) -> None:
    blocks = dict(block_n=block_n, block_k=block_k)
    run(M, K, H, N, dtype, fp8, activation, seed, producer=blocks, consumer=blocks)


def test_closer_to_the_exact_norm_than_the_norm_kernel_then_the_gemv() -> None:
    """5 rows, bf16, K = 1024: the norm kernel rounds each normed value twice ((h * rstd), then
    times g: relative 2^-9 each), which adds up over K in the GEMV after it; here g * h is
    rounded once and rstd multiplies the fp32 sums. Against the float64 GEMV of the exact norm
    the error must be smaller."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(5, 1024, generator=g).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(1024, generator=g)).to(torch.bfloat16)
    w = (torch.randn(256, 1024, generator=g) / 32 * 3).to(torch.bfloat16)
    exact = exact_norm(h, norm_weight) @ w.double().T
    to = (lambda t: t.to(DEVICE))
    ours = normed_linear_triton(to(norm_weight * h), to(group_squares_reference(h)), EPS, to(w))
    theirs = linear_triton(to(rms_norm_reference(h, norm_weight, EPS)), to(w))

    def err(out):
        return ((out.cpu().double() - exact).norm() / exact.norm()).item()

    assert err(ours) < 0.85 * err(theirs), (err(ours), err(theirs))


def test_launcher_refuses_what_it_cannot_compute() -> None:
    x, w, g = torch.randn(1, 32), torch.randn(16, 32), torch.ones(16)
    with pytest.raises(ValueError, match="2 to 16 rows"):
        linear_residual_triton(x, w, torch.randn(1, 16), g)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="does not match the linear's output"):
        linear_residual_triton(x, w, torch.randn(3, 8), g)
    with pytest.raises(ValueError, match="norm weight"):
        linear_residual_triton(x, w, torch.randn(3, 16), torch.ones(8))
    with pytest.raises(ValueError, match="sums of squares"):
        normed_linear_triton(x, torch.zeros(3, 5), EPS, w)


def op_cases(dtype: torch.dtype = torch.bfloat16, rows: int = 3, device: str = "cpu"):
    """(linear_residual args, stats_rms_norm_linear args) for plain and FP8 weights, plain and
    gated consumers."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(rows, 40, generator=g).to(dtype).to(device)
    r = torch.randn(1, rows, 48, generator=g).to(dtype).to(device)
    norm_weight = (1 + 0.2 * torch.randn(48, generator=g)).to(dtype).to(device)
    cases = []
    for fp8 in (False, True):
        w_p, s_p, _ = (t.to(device) if t is not None else None
                       for t in _weight(48, 40, dtype, fp8, g))
        for activation in (None, "silu"):
            w_c, s_c, _ = (t.to(device) if t is not None else None
                           for t in _weight(64, 48, dtype, fp8, g))
            cases.append(((a, w_p, s_p, r), (norm_weight, EPS, w_c, s_c, activation)))
    return cases


def test_ops_on_cpu_are_the_ops_they_replace_and_inline_the_same() -> None:
    for (a, w_p, s_p, r), (norm_weight, eps, w_c, s_c, activation) in op_cases():
        y = torch.ops.fuser.linear(a, w_p) if s_p is None else \
            torch.ops.fuser.fp8_linear(a, w_p, s_p)
        want_out, want_summed = torch.ops.fuser.add_rms_norm_linear(
            y.reshape(r.shape), r, norm_weight, eps, w_c, s_c, activation)
        for lin, norm in ((torch.ops.fuser.linear_residual, torch.ops.fuser.stats_rms_norm_linear),
                          (CPU_INLINE[torch.ops.fuser.linear_residual.default],
                           CPU_INLINE[torch.ops.fuser.stats_rms_norm_linear.default])):
            summed, gh, squares = lin(a, w_p, s_p, r, norm_weight)
            assert torch.equal(summed, want_summed) and summed.is_contiguous()
            assert torch.equal(gh, norm_weight * summed) and gh.is_contiguous()
            assert torch.equal(squares, group_squares_reference(summed))
            out = norm(summed, gh, squares, norm_weight, eps, w_c, s_c, activation)
            assert torch.equal(out, want_out) and out.is_contiguous()


def test_opcheck_and_fake() -> None:
    for (a, w_p, s_p, r), tail in op_cases(torch.float32):
        norm_weight = tail[0]
        summed, gh, squares = torch.ops.fuser.linear_residual(a, w_p, s_p, r, norm_weight)
        for op, args, fp8 in ((torch.ops.fuser.linear_residual.default,
                               (a, w_p, s_p, r, norm_weight), s_p is not None),
                              (torch.ops.fuser.stats_rms_norm_linear.default,
                               (summed, gh, squares, *tail), tail[3] is not None)):
            torch.library.opcheck(op, args, test_utils=FP8_OPCHECK_TESTS if fp8 else
                                  ("test_schema", *FP8_OPCHECK_TESTS))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, w = torch.empty(5, 64, dtype=torch.float16), torch.empty(40, 64, dtype=torch.float16)
        g = torch.empty(40, dtype=torch.float16)
        summed, gh, squares = torch.ops.fuser.linear_residual(
            a, w, None, torch.empty(1, 5, 40, dtype=torch.float16), g)
        out = torch.ops.fuser.stats_rms_norm_linear(
            summed, gh, squares, g, EPS, torch.empty(144, 40, dtype=torch.float16), None, "silu")
    assert summed.shape == gh.shape == (1, 5, 40) and squares.shape == (5, 3)
    assert squares.dtype == torch.float32 and out.shape == (1, 5, 72)


# --- on a GPU: Llama-3-8B's o_proj -> gate/up and down_proj -> qkv, 5 rows --------------------


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
def test_gpu_llama3_shapes(fp8: bool) -> None:
    run(5, 4096, 4096, 14336, torch.bfloat16, fp8, "silu", seed=1)
    run(5, 14336, 4096, 6144, torch.bfloat16, fp8, None, seed=2)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS + 1])
def test_gpu_ops_compute_what_they_replace(rows: int) -> None:
    """The ops on CUDA: the kernels at 2..16 rows (summed bit-equal to the GEMV plus residual,
    the norm's GEMV within the GEMV bounds of the exact norm), the plain ops outside them
    (fuser::add_rms_norm_linear's bits)."""
    for (a, w_p, s_p, r), (norm_weight, eps, w_c, s_c, activation) in op_cases(rows=rows,
                                                                             device="cuda"):
        y = torch.ops.fuser.linear(a, w_p) if s_p is None else \
            torch.ops.fuser.fp8_linear(a, w_p, s_p)
        want_out, want_summed = torch.ops.fuser.add_rms_norm_linear(
            y.reshape(r.shape), r, norm_weight, eps, w_c, s_c, activation)
        summed, gh, squares = torch.ops.fuser.linear_residual(a, w_p, s_p, r, norm_weight)
        assert torch.equal(summed, want_summed) and torch.equal(gh, norm_weight * summed)
        out = torch.ops.fuser.stats_rms_norm_linear(summed, gh, squares, norm_weight, eps, w_c,
                                                    s_c, activation)
        if rows == 1 or rows > MAX_ROWS:
            assert torch.equal(out, want_out)
            continue
        h = summed.cpu().double()
        normed = gh.cpu().double() * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        values = w_c.cpu() if s_c is None else dequantize(w_c.cpu(), s_c.cpu())
        if activation is None:
            assert_linear_close(normed, values, out.cpu(), torch.bfloat16)
        else:
            assert_gated_close(out.cpu(), normed, values, activation, torch.bfloat16)


# --- one row in the same arithmetic (gemv_tables.ONE_ROW_NORM_AFTER) ----------------------------


@pytest.fixture
def one_row_norm_after():
    """gemv_tables.ONE_ROW_NORM_AFTER pinned on for the test (the default, as passes/norm_stats.py)."""
    from fuser.ops import gemv_tables

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv_tables, "ONE_ROW_NORM_AFTER", True)
        yield


@pytest.mark.usefixtures("one_row_norm_after")
@pytest.mark.parametrize("stream", [False, True], ids=["linear_kernel", "stream_kernel"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_one_row_norm_after_is_the_several_row_arithmetic(stream: bool,
                                                          activation: str | None) -> None:
    """Each row of a verify step's norm GEMV (normed_linear_triton over 4 rows) against the same
    row through the one-row add + norm GEMV (the decode step's), both kernels that take it:
    the one-row result within the GEMV bounds of rstd * (g * h @ W.T) in float64, and nearly
    every output bit-equal to the several-row one (only the summation order differs)."""
    from fuser.ops import gemv_stream
    from fuser.ops.norm_linear import rms_norm_linear_triton

    g = torch.Generator().manual_seed(21)
    M, K, N = 4, 256, 48
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, K, generator=g).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(K, generator=g)).to(torch.bfloat16)
    w = (torch.randn(2 * N if activation else N, K, generator=g) / 16 * 3).to(torch.bfloat16)
    h = x + r
    to = (lambda t: t.to(DEVICE))
    several = normed_linear_triton(to(norm_weight * h), to(group_squares_reference(h)), EPS,
                                   to(w), activation=activation).cpu()
    rows = []
    for i in range(M):
        xi, ri = to(x[i:i + 1]), to(r[i:i + 1])
        if stream:
            config = gemv_stream.DEFAULT
            plan = gemv_stream.stream_plan(N * (2 if activation else 1), K, 2,
                                           activation is not None, config, 4)
            out = torch.empty(1, N, dtype=torch.bfloat16, device=DEVICE)
            gemv_stream.stream_gemv(xi, to(w), out, plan, config, activation=activation,
                                    residual=ri, norm_weight=to(norm_weight), eps=EPS,
                                    summed=torch.empty_like(xi))
        else:
            out, _ = rms_norm_linear_triton(xi, ri, to(norm_weight), EPS, to(w),
                                            activation=activation, block_n=16, block_k=64)
        rows.append(out.cpu())
    one = torch.cat(rows)
    normed = (norm_weight * h).double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True)
                                                      + EPS)
    if activation is None:
        assert_linear_close(normed, w, one, torch.bfloat16)
    else:
        assert_gated_close(one, normed, w, activation, torch.bfloat16)
    from test_ops_gated_linear import assert_mostly_equal

    assert_mostly_equal(one, several, torch.bfloat16)


@pytest.mark.parametrize("M", [2, 5])
def test_fp8_producer_on_pieces(M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_residual over x's e4m3 pieces (down_proj's long rows, as fuser::fp8_linear splits
    them): summed is the pieces GEMV (linear_pieces_triton, same blocks) plus the residual, bit
    for bit; gh and the squares as on the other paths; and the op takes that path on its own
    for rows longer than SPLIT_PIECES_MIN_K."""
    from fuser.ops import fp8_linear
    from fuser.ops.e4m3_pieces import split_pieces_triton
    from fuser.ops.linear import linear_pieces_triton

    g = torch.Generator().manual_seed(M)
    K, H = 256, 80
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, H, generator=g).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16)
    w, s, _ = _weight(H, K, torch.bfloat16, True, g)
    a, r, norm_weight, w, s = (t.to(DEVICE) for t in (a, r, norm_weight, w, s))
    blocks = dict(block_n=32, block_k=64)
    pieces = split_pieces_triton(a)
    summed, gh, squares = linear_residual_triton(a, w, r, norm_weight, weight_scale=s,
                                                 pieces=pieces, **blocks)
    y = linear_pieces_triton(*pieces, w, s, out_dtype=a.dtype, **blocks)
    assert torch.equal(summed, y + r)
    assert torch.equal(gh, norm_weight * summed)
    torch.testing.assert_close(squares.cpu(), group_squares_reference(summed.cpu()), rtol=1e-5,
                               atol=1e-6)
    # the op splits rows longer than SPLIT_PIECES_MIN_K by itself (here: all of them)
    monkeypatch.setattr(fp8_linear, "SPLIT_PIECES_MIN_K", K - 1)
    from fuser.ops import norm_stats

    taken = []
    monkeypatch.setattr(norm_stats, "split_pieces_triton",
                        lambda x: taken.append(x.shape) or split_pieces_triton(x))
    monkeypatch.setattr(norm_stats, "_takes", lambda *args: True)
    norm_stats._linear_residual_cuda(a, w, s, r, norm_weight)
    assert taken == [a.shape]


_PTX_CHECK = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from fuser.ops.gemv_rows import _scale_product

@triton.jit
def product_then_add(a_ptr, s_ptr, r_ptr, o_ptr, MUL_RN: tl.constexpr):
    i = tl.arange(0, 64)[:, None] * 16 + tl.arange(0, 16)[None, :]
    y = _scale_product(tl.load(a_ptr + i), tl.load(s_ptr + tl.arange(0, 64))[:, None], MUL_RN)
    tl.store(o_ptr + i, y + tl.load(r_ptr + i))

for mul_rn in (False, True):
    source = triton.compiler.ASTSource(
        fn=product_then_add, constexprs={"MUL_RN": mul_rn},
        signature={"a_ptr": "*fp32", "s_ptr": "*fp32", "r_ptr": "*fp32", "o_ptr": "*fp32",
                   "MUL_RN": "constexpr"})
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except Exception as error:  # a Triton without its CUDA backend tools
        print("SKIP", type(error).__name__, error)
        sys.exit(0)
    print(mul_rn, ptx.count("fma.rn.f32"), ptx.count("mul.rn.f32"))
"""


def test_fp32_scale_product_is_not_fused_with_the_residual_add(tmp_path) -> None:
    """fp32 x, FP8 weights, the residual epilogue: y = acc * scale must be rounded before
    y + r (as the plain GEMV stores y and fuser::add_rms_norm adds r). Compiled for sm_90 (PTX,
    no GPU needed; in a process without TRITON_INTERPRET), the plain product contracts with the
    add into an FMA, which made summed differ from the GEMV plus r in the last bit on the H200;
    MUL_RN's explicitly rounded multiply must not."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "ptx_check.py"  # a file: triton.jit reads its kernel's source
    script.write_text(_PTX_CHECK)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    if lines[0].startswith("SKIP"):
        pytest.skip(f"cannot compile for sm_90 here: {lines[0]}")
    (plain_fma, _), (fixed_fma, fixed_mul) = (map(int, line.split()[1:]) for line in lines[:2])
    assert plain_fma > 0  # what the fix is for: the compiler does contract them
    assert fixed_fma == 0 and fixed_mul > 0
