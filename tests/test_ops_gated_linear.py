"""fuser::gated_linear and fuser::fp8_gated_linear: the decode GEMV over a merged gate/up weight
with act(gate) * up in its epilogue, against plain PyTorch.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); with one it runs for real,
and the tests with "gpu" in their name run too (Llama-3-8B's gate/up shape).

Two references:
- float64: gate and up from x and the (dequantized) weight in float64, act(gate) * up in float64.
  The kernel may differ from it by the GEMV's own error (tests/test_ops_linear.py's bound, for
  each of gate and up), carried through act and the product, plus the roundings of act and of
  the output. That bound fails for swapped halves, a scale from the wrong channel or a dropped
  product (test_check_fails_for_wrong_halves_and_scales).
- the unfused kernels with the same blocking (fuser::linear's then fuser::gated_act's): the
  fused epilogue rounds gate and up to the dtype as the GEMV's output, then act, then the
  product, as they do; in bf16/fp16 nearly every element must match bit for bit (a missing
  rounding would break that on about half of them). Elsewhere only the order of the K sums can
  differ (the reduction's layout follows the tile's width), moving a result by an ulp.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*gated_linear)
from fuser.ops.fp8 import dequantize, fp8_linear_reference, quantize_weight
from fuser.ops.fp8_linear import fp8_gated_linear_reference
from fuser.ops.gated_act import ACTIVATIONS, gated_act_reference, gated_act_triton
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.ops.linear import gated_linear_reference, linear_reference, linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# opcheck's test_schema multiplies the inputs, which PyTorch does not implement for float8
# (as in tests/test_ops_fp8.py); the other checks apply.
FP8_OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

pytestmark = [
    pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu"),
    # exp(-z) overflows to inf in the activations' tails: act -> -0, as intended
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

# Per dtype: (the GEMV's rtol, as tests/test_ops_linear.py: K fp32 products summed in another
# order, then one rounding to the dtype; the rounding of act and of the product, half an ulp
# each in bf16, one ulp in fp16 as there, a few ulps of fp32's exp and division in fp32).
GEMV_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
ROUND_RTOL = {torch.float32: 4 * torch.finfo(torch.float32).eps, torch.bfloat16: 2.0**-8,
              torch.float16: 2.0**-10}
# Fraction of elements equal bit for bit to the unfused kernels (bf16/fp16; none in fp32).
MIN_EQUAL = {torch.float32: 0.0, torch.bfloat16: 0.97, torch.float16: 0.97}
# act' is at most ~1.1 (silu) and ~1.13 (gelu_tanh) in magnitude: an error in gate moves act by
# at most this much of it.
ACT_SLOPE = 1.2


def act64(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh")


def assert_gated_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, activation: str,
                       dtype: torch.dtype) -> None:
    """out [..., I] against act(x @ w[:I].T) * (x @ w[I:].T) in float64, w [2I, K] (already
    dequantized for FP8), elementwise:

        |out - ref| <= |u| (ACT_SLOPE dg + r |a|) + |a| du + dg du + r |ref| (+ tiny)

    with dg, du the GEMV bound of gate and up (rtol (|v| + ||x_m|| ||w_n|| / sqrt(K))), r the
    rounding of act and of the output, a = act(gate), and tiny the dtype's smallest normal
    where a product underflows.
    """
    K = x.shape[-1]
    x64 = x.double().reshape(-1, K)
    w64 = w.double()
    I = w64.shape[0] // 2
    gu = x64 @ w64.T                                                  # [M, 2I]
    g, u = gu[:, :I], gu[:, I:]
    a = act64(g, activation)
    ref = a * u
    out = out.reshape(ref.shape).double()
    assert torch.isfinite(out).all()
    size = x64.norm(dim=1)[:, None] * w64.norm(dim=1)[None, :] / max(K, 1) ** 0.5
    slack = GEMV_RTOL[dtype] * (gu.abs() + size)
    dg, du = slack[:, :I], slack[:, I:]
    r = ROUND_RTOL[dtype]
    tiny = torch.finfo(dtype).smallest_normal
    bound = (u.abs() * (ACT_SLOPE * dg + r * a.abs()) + a.abs() * du + ACT_SLOPE * dg * du
             + r * ref.abs() + tiny * (1 + u.abs()))
    err = (out - ref).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"worst {worst:.3g}x the {dtype} {activation} bound"


def assert_mostly_equal(out: torch.Tensor, unfused: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == unfused.shape and out.dtype == unfused.dtype
    equal = (out == unfused).double().mean().item() if out.numel() else 1.0
    assert equal >= MIN_EQUAL[dtype], f"only {equal:.3f} of elements equal to the unfused kernels"


def inputs(M: int, I: int, K: int, dtype: torch.dtype, seed: int, lead: tuple = (),
           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(*lead, M, K, generator=g)).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) / max(K, 1) ** 0.5 * 3).to(dtype)  # gate ~ N(0, 9)
    return x, w


def unfused(x: torch.Tensor, w: torch.Tensor, activation: str, weight_scale=None,
            block_n=None, block_k=None) -> torch.Tensor:
    """fuser::linear's kernel then fuser::gated_act's, with the fused call's blocking."""
    gate_up = linear_triton(x, w, weight_scale=weight_scale, block_n=block_n, block_k=block_k)
    return gated_act_triton(gate_up, activation)


def run(M: int, I: int, K: int, dtype: torch.dtype, activation: str, seed: int, lead: tuple = (),
        scale: float = 1.0, **config) -> torch.Tensor:
    x, w = inputs(M, I, K, dtype, seed, lead, scale)
    xd, wd = x.to(DEVICE), w.to(DEVICE)
    out = linear_triton(xd, wd, activation=activation, **config).cpu()
    assert out.shape == (*lead, M, I) and out.dtype == dtype
    assert_gated_close(out, x, w, activation, dtype)
    # the unfused pair with the same blocking: block_n counts merged-weight rows in both, and
    # both look their defaults up at the merged weight's shape
    same = dict(block_n=config.get("block_n"), block_k=config.get("block_k"))
    assert_mostly_equal(out, unfused(xd, wd, activation, **same).cpu(), dtype)
    return out


# --- the bf16/fp16/fp32 kernel ------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 2, 5, 9, 16])
def test_rows_dtypes_activations(M: int, dtype: torch.dtype, activation: str) -> None:
    # I, K off the block sizes: a masked last column block (20 of 32 columns in the second
    # program) and a masked last K chunk.
    run(M, 52, 200, dtype, activation, seed=M, block_n=64, block_k=64)


@settings(max_examples=25, derandomize=True, **SETTINGS)
@given(
    M=st.integers(1, MAX_ROWS),
    I=st.integers(1, 80),
    K=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from(ACTIVATIONS),
    block_n=st.sampled_from([None, 16, 32, 64]),   # merged-weight rows per program
    block_k=st.sampled_from([None, 32, 128]),
    scale=st.sampled_from([1e-2, 1.0, 4.0]),       # 4: gate deep in both activation tails
    seed=st.integers(0, 2**16),
)
def test_random_shapes(M, I, K, dtype, activation, block_n, block_k, scale, seed) -> None:
    run(M, I, K, dtype, activation, seed, scale=scale, block_n=block_n, block_k=block_k)


def test_leading_dims_strided_x_and_tuned_blocks() -> None:
    # [B, T, K] activations as the graph has them; a transposed x; the tuned tables' blocks.
    run(5, 40, 96, torch.float32, "silu", seed=3, lead=(1,), block_n=32, block_k=32)
    x = torch.randn(64, 3).t()  # [3, 64], stride (1, 3)
    w = torch.randn(2 * 20, 64)
    out = linear_triton(x.to(DEVICE), w.to(DEVICE), activation="gelu_tanh").cpu()
    assert_gated_close(out, x, w, "gelu_tanh", torch.float32)
    run(1, 300, 512, torch.bfloat16, "silu", seed=4)    # M = 1: block_n 8 rows: 4 + 4
    run(7, 300, 512, torch.bfloat16, "silu", seed=5)    # MMA path: 32 rows: 16 + 16


def test_block_n_counts_merged_weight_rows() -> None:
    # block_n is weight rows per program, half gate and half up: 2 + 2 at one row, and 16
    # (8 + 8) is enough for the MMA path, as for the plain kernel.
    run(1, 30, 100, torch.bfloat16, "silu", seed=6, block_n=4, block_k=32)
    run(3, 30, 100, torch.float16, "gelu_tanh", seed=7, block_n=16, block_k=32)
    x, w = torch.randn(2, 32).to(DEVICE), torch.randn(40, 32).to(DEVICE)
    with pytest.raises(ValueError, match="block_n"):
        linear_triton(x, w, activation="silu", block_n=8)
    with pytest.raises(ValueError, match="block_n"):
        linear_triton(x[:1], w, activation="silu", block_n=1)
    with pytest.raises(ValueError, match="activation"):
        linear_triton(x, w, activation="relu")
    with pytest.raises(ValueError, match="2I"):
        linear_triton(x, w[:39], activation="silu")


def test_check_fails_for_wrong_halves_and_scales() -> None:
    # The float64 bound must reject what a wrong kernel would produce.
    x, w = inputs(3, 24, 64, torch.float32, seed=7)
    good = gated_linear_reference(x, w, "silu")
    assert_gated_close(good, x, w, "silu", torch.float32)
    swapped = torch.cat([w[24:], w[:24]])
    with pytest.raises(AssertionError):
        assert_gated_close(gated_linear_reference(x, swapped, "silu"), x, w, "silu", torch.float32)
    dropped = x.clone()
    dropped[..., 5] = 0  # one product of every sum missing
    with pytest.raises(AssertionError):
        assert_gated_close(gated_linear_reference(dropped, w, "silu"), x, w, "silu", torch.float32)
    q, s = quantize_weight(w)
    shifted = torch.cat([s[24:], s[:24]])  # up's scales on gate's rows and vice versa
    with pytest.raises(AssertionError):
        assert_gated_close(fp8_gated_linear_reference(x, q, shifted, "silu"), x,
                           dequantize(q, s), "silu", torch.float32)


# --- the FP8 kernel (HAS_SCALE): e4m3fn weights, one scale per row of the merged matrix ---------


def outlier_weight(rows: int, K: int, seed: int, outlier: float) -> torch.Tensor:
    """[rows, K] of N(0, 1 / K) with about 2% of entries +-outlier (if nonzero) and row 0 zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, K, generator=g, dtype=torch.float64) / max(K, 1) ** 0.5
    if outlier and w.numel():
        idx = torch.randint(0, w.numel(), (max(1, w.numel() // 50),), generator=g)
        w.view(-1)[idx] = (torch.randint(0, 2, idx.shape, generator=g) * 2 - 1).double() * outlier
    w[0] = 0
    return w.float()


def run_fp8(M: int, I: int, K: int, dtype: torch.dtype, activation: str, seed: int,
            outlier: float = 0.0, lead: tuple = (), **config) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    q, s = quantize_weight(outlier_weight(2 * I, K, seed + 1, outlier))
    xd, qd, sd = x.to(DEVICE), q.to(DEVICE), s.to(DEVICE)
    out = linear_triton(xd, qd, weight_scale=sd, activation=activation, **config).cpu()
    assert out.shape == (*lead, M, I) and out.dtype == dtype
    # against the emulated-FP8 reference (fuser/ops/fp8.py): the dequantized weight, in float64
    assert_gated_close(out, x, dequantize(q, s), activation, dtype)
    same = dict(block_n=config.get("block_n"), block_k=config.get("block_k"))
    assert_mostly_equal(out, unfused(xd, qd, activation, weight_scale=sd, **same).cpu(), dtype)
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_fp8_rows_dtypes_activations(M: int, dtype: torch.dtype, activation: str) -> None:
    run_fp8(M, 52, 200, dtype, activation, seed=M, outlier=10.0, block_n=64, block_k=64)


# Outliers far beyond e4m3's +-448 before scaling; act(gate) * up must fit the dtype (fp16:
# 65504), so fp16 takes the small ones only.
OUTLIERS = {torch.float32: [0.0, 1e4, 1e12], torch.bfloat16: [0.0, 1e4, 1e12],
            torch.float16: [0.0, 3.0, 30.0]}


@settings(max_examples=25, derandomize=True, **SETTINGS)
@given(
    M=st.integers(1, MAX_ROWS),
    I=st.integers(1, 80),
    K=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from(ACTIVATIONS),
    outlier_pick=st.integers(0, 2),
    block_n=st.sampled_from([None, 16, 32, 64]),
    block_k=st.sampled_from([None, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_fp8_random_shapes_with_outliers(M, I, K, dtype, activation, outlier_pick, block_n,
                                         block_k, seed) -> None:
    run_fp8(M, I, K, dtype, activation, seed, outlier=OUTLIERS[dtype][outlier_pick],
            block_n=block_n, block_k=block_k)


def test_fp8_kernel_fed_the_wrong_scales_fails_the_check() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=g)
    w = outlier_weight(48, 64, 10, outlier=100.0)
    q, s = quantize_weight(w)
    for wrong in (torch.cat([s[24:], s[:24]]), s.flip(0)):
        out = linear_triton(x.to(DEVICE), q.to(DEVICE), weight_scale=wrong.to(DEVICE),
                            activation="silu", block_n=32, block_k=32).cpu()
        with pytest.raises(AssertionError):
            assert_gated_close(out, x, dequantize(q, s), "silu", torch.float32)


# --- the custom ops -----------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_ops_on_cpu_are_the_unfused_references(activation: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 64, generator=g).bfloat16()
    w = torch.randn(2 * 40, 64, generator=g).bfloat16()
    out = torch.ops.fuser.gated_linear(x, w, activation)
    assert out.shape == (1, 3, 40) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, gated_act_reference(linear_reference(x, w), activation))
    gate, up = torch.nn.functional.linear(x, w[:40]), torch.nn.functional.linear(x, w[40:])
    assert torch.equal(out, act64(gate, activation) * up)  # Hugging Face's eager MLP
    q, s = quantize_weight(w.float())
    out = torch.ops.fuser.fp8_gated_linear(x, q, s, activation)
    assert out.shape == (1, 3, 40) and out.dtype == torch.bfloat16
    assert torch.equal(out, gated_act_reference(fp8_linear_reference(x, q, s), activation))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_and_fake(activation: str) -> None:
    x, w = torch.randn(1, 3, 64), torch.randn(48, 64)
    torch.library.opcheck(torch.ops.fuser.gated_linear.default, (x, w, activation))
    q, s = quantize_weight(w)
    torch.library.opcheck(torch.ops.fuser.fp8_gated_linear.default, (x.bfloat16(), q, s, activation),
                          test_utils=FP8_OPCHECK_TESTS)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.fuser.gated_linear(torch.empty(2, 5, 64, dtype=torch.float16),
                                           torch.empty(144, 64, dtype=torch.float16), activation)
    assert out.shape == (2, 5, 72) and out.dtype == torch.float16


def test_ops_refuse_what_they_cannot_compute() -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="activation"):
        torch.ops.fuser.gated_linear(x, torch.randn(8, 16), "relu")
    with pytest.raises(ValueError, match="2I"):
        torch.ops.fuser.gated_linear(x, torch.randn(7, 16), "silu")
    q, s = quantize_weight(torch.randn(7, 16))
    with pytest.raises(ValueError, match="2I"):
        torch.ops.fuser.fp8_gated_linear(x, q, s, "silu")


# --- compiled for Hopper without a GPU (Triton's front end and ptxas) -----------------------------

# Compiles _linear_kernel for sm_90 at Llama-3-8B's gate/up shape (the tuned blocks), plain and
# gated, and prints the weight loads each issues per K step: vectorized global loads (one row)
# and cp.async copies (the MMA path's pipelined tiles). A subprocess, because this process runs
# the kernels under TRITON_INTERPRET=1, where @triton.jit gives interpreted functions.
COMPILE_FOR_SM90 = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fuser.ops.gemv_tables import _default_config, _default_fp8_config, _default_swap
from fuser.ops.linear import _linear_kernel

NAMES = [param.name for param in _linear_kernel.params]
out = {}
for fp8, M in [(False, 1), (True, 16), (True, 1)]:
    for act, norm, pdl in (("", False, 0), ("silu", False, 0), ("silu", True, 0),
                           ("", False, 1), ("silu", True, 1)):
        bn, bk, warps, stages = (_default_fp8_config if fp8 else _default_config)(M, 28672, 4096)
        types = dict(w_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32", part_ptr="*fp32",
                     count_ptr="*i32", lo_ptr="*fp8e4nv", inv_ptr="*fp32", eps="fp32")
        sig = {param.name: "constexpr" if param.is_constexpr else types.get(
                   param.name, "*bf16" if param.name.endswith("_ptr") else "i32")
               for param in _linear_kernel.params}
        consts = dict(BLOCK_M=1 if M == 1 else 16, BLOCK_N=bn, BLOCK_K=bk, NORM_K=bk,
                      FP32_DOTS=False, HAS_SCALE=fp8, ACTIVATION=act, NORM=norm,
                      HAS_RESIDUAL=norm, SPLIT_K=1, PDL=bool(pdl), PREFETCH=pdl,
                      SWAP=_default_swap(M, 28672, 4096, fp8), F16_MMA=False,
                      X2_PIECES=False, RSTD_LAST=norm and M == 1,
                      ROW_VEC=(16 if fp8 else 8) if M == 1 else 0, EPI_RESIDUAL=False,
                      STATS_BLOCK=0, STAT_COLS=16, NORM_AFTER=False)
        aligned = [n for n in NAMES if n.endswith("_ptr") or n.startswith("stride")] + ["N", "K"]
        attrs = {(NAMES.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(_linear_kernel, sig, {(NAMES.index(k),): v for k, v in consts.items()},
                        attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
        out[f"{'fp8' if fp8 else 'bf16'} M{M} {act or 'plain'}{' norm' if norm else ''}"
            f"{' pdl' if pdl else ''}"] = [
            ptx.count("ld.global.v4"), ptx.count("cp.async.cg"), ptx.count("cp.async.ca"),
            ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")]
print(json.dumps(out))
"""


def test_gated_kernel_compiles_for_sm90_with_the_plain_kernels_loads() -> None:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True,
                          text=True, timeout=600)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this Triton installation")
    assert done.returncode == 0, done.stderr[-3000:]
    loads = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("bf16 M1", "fp8 M16"):
        plain, gated = loads[f"{case} plain"], loads[f"{case} silu"]
        assert sum(plain) > 0, (case, plain)  # the count sees the weight loads at all
        assert gated == plain, (case, plain, gated)
        # the norm prologue (fuser::add_rms_norm_linear) compiles for sm_90 too; it adds the
        # loads of x, the residual and the norm weight, never fewer weight loads
        normed = loads[f"{case} silu norm"]
        assert all(n >= p for n, p in zip(normed, plain)), (case, plain, normed)
        # PDL (fuser/ops/pdl.py): one wait and one trigger, and the prefetched first weight tile
        # adds loads to the pipelined loop's, never removes the pipelining
        assert plain[3:] == [0, 0] and normed[3:] == [0, 0], (case, plain, normed)
        for name, without in (("plain", plain), ("silu norm", normed)):
            with_pdl = loads[f"{case} {name} pdl"]
            assert with_pdl[3:] == [1, 1], (case, name, with_pdl)
            assert sum(with_pdl[:3]) > sum(without[:3]) and with_pdl[1:3] >= without[1:3] \
                or with_pdl[:3] == without[:3], (case, name, without, with_pdl)


# --- on a GPU: Llama-3-8B's gate/up (I = 14336, K = 4096) -----------------------------------------


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M", [1, 5, 9, 16])
def test_gpu_llama3_gate_up_bf16(M: int, activation: str) -> None:
    run(M, 14336, 4096, torch.bfloat16, activation, seed=M)


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gpu_llama3_gate_up_fp8(M: int, activation: str) -> None:
    run_fp8(M, 14336, 4096, torch.bfloat16, activation, seed=M, outlier=1e4)


@needs_cuda
def test_gpu_ops_run_the_kernel_and_fall_back_above_max_rows() -> None:
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 384, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(torch.ops.fuser.gated_linear(x, w, "silu"),
                       linear_triton(x, w, activation="silu"))
    q, s = quantize_weight(w)
    assert torch.equal(torch.ops.fuser.fp8_gated_linear(x, q, s, "silu"),
                       linear_triton(x, q, weight_scale=s, activation="silu"))
    big = torch.randn(MAX_ROWS + 1, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(torch.ops.fuser.gated_linear(big, w, "gelu_tanh"),
                       gated_linear_reference(big, w, "gelu_tanh"))
    assert torch.equal(torch.ops.fuser.fp8_gated_linear(big, q, s, "gelu_tanh"),
                       fp8_gated_linear_reference(big, q, s, "gelu_tanh"))
