"""The stream GEMV (fuser/ops/gemv_stream.py): one row, one program per SM over a run of
output columns, against the references and against _linear_kernel's one-row path.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (conftest.py) with a stand-in of 4 SMs
(or what a test asks); with one, the tests with "gpu" in their name run the 8B shapes for real.

What must hold, for every plan (rows per program, tile, prefetched tiles):
- summed (x + residual, program 0) equals add_rms_norm's sum bit for bit;
- out is within the GEMV tests' float64 bounds (test_ops_linear.check, or
  test_ops_gated_linear.assert_gated_close) around the reference's normed rows and weights;
- in bf16/fp16 nearly every output equals _linear_kernel's bit for bit (only the summation
  order differs), so a dropped or doubled K step or row cannot hide inside the bound.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops import gemv_stream
from fuser.ops.fp8 import quantize_weight
from fuser.ops.gemv_stream import StreamConfig, stream_gemv, stream_plan
from fuser.ops.linear import linear_triton
from fuser.ops.norm_linear import rms_norm_linear_triton
from test_ops_gated_linear import SETTINGS, assert_gated_close, assert_mostly_equal
from test_ops_linear import check as assert_linear_close
from test_ops_norm_linear import EPS, after_norm, inputs, norm_after, reference_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

pytestmark = [
    pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


def run(K: int, N: int, dtype: torch.dtype, norm: bool, residual: bool, activation: str | None,
        seed: int, config: StreamConfig, sms: int) -> None:
    rows_w = 2 * N if activation else N
    x, r, norm_weight, w = inputs(1, K, rows_w, dtype, seed, residual)
    r = r if norm else None
    plan = stream_plan(N, K, w.element_size(), activation is not None, config, sms)
    assert plan is not None
    assert plan.programs <= sms * config.programs_per_sm  # one wave
    to = (lambda t: None if t is None else t.to(DEVICE))
    xd, rd, gd, wd = (to(t) for t in (x, r, norm_weight, w))
    out = torch.full((1, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: all written?
    summed = torch.full_like(xd, float("nan")) if r is not None else None
    stream_gemv(xd, wd, out, plan, config, activation=activation, residual=rd,
                norm_weight=gd if norm else None, eps=EPS, summed=summed)
    out = out.cpu()
    if norm:
        normed, summed_ref = reference_norm(x, r, norm_weight)
        if r is not None:
            assert torch.equal(summed.cpu(), summed_ref)
        if norm_after(1, r is not None, False, activation, N):  # linear.ONE_ROW_NORM_AFTER
            normed = after_norm(x, r, norm_weight)
        # _linear_kernel's one row (explicit blocks: never the stream kernel)
        other, _ = rms_norm_linear_triton(xd, rd, gd, EPS, wd, activation=activation,
                                          block_n=16, block_k=64)
    else:
        normed = x
        other = linear_triton(xd, wd, activation=activation, block_n=16, block_k=64)
    if activation is None:
        assert_linear_close(normed, w, out, dtype)
    else:
        assert_gated_close(out, normed, w, activation, dtype)
    assert_mostly_equal(out, other.cpu(), dtype)


CONFIGS = [StreamConfig(tile_bytes=2048, depth=1), StreamConfig(tile_bytes=4096, depth=3),
           StreamConfig(programs_per_sm=2, tile_bytes=1024, depth=2),
           StreamConfig(tile_bytes=4096, depth=4), gemv_stream.DEFAULT.wide]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"p{c.programs_per_sm}t{c.tile_bytes}"
                         f"d{c.depth}")
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("norm, residual", [(False, False), (True, False), (True, True)],
                         ids=["plain", "norm", "add_norm"])
def test_plans_norms_gated(norm, residual, activation, config) -> None:
    # N, K off every block size: a short last program, a masked last K step and rows past N
    # inside the last program's tile.
    run(200, 37, torch.bfloat16, norm, residual, activation, seed=7, config=config, sms=4)


@settings(max_examples=12, derandomize=True, **SETTINGS)
@given(
    K=st.integers(8, 400),
    N=st.integers(1, 90),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    norm_residual=st.sampled_from([(False, False), (True, False), (True, True)]),
    activation=st.sampled_from([None, "silu", "gelu_tanh"]),
    sms=st.integers(1, 8),
    config=st.sampled_from(CONFIGS),
    seed=st.integers(0, 2**16),
)
def test_any_shape(K, N, dtype, norm_residual, activation, sms, config, seed) -> None:
    norm, residual = norm_residual
    if stream_plan(N, K, dtype.itemsize, activation is not None, config, sms) is None:
        return  # too many rows a program for the tile: linear.py keeps _linear_kernel
    run(K, N, dtype, norm, residual, activation, seed, config, sms)


def test_fp8_weights_and_several_rows_are_refused() -> None:
    """FP8 weights and 2..16 rows stay on _linear_kernel (every stream configuration measured
    slower there): no plan for FP8, and the launcher refuses both."""
    config = StreamConfig()
    assert stream_plan(37, 200, 1, False, config, 4) is None
    plan = stream_plan(37, 200, 2, False, config, 4)
    w = torch.randn(37, 200).to(torch.bfloat16)
    out = torch.empty(2, 37, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        stream_gemv(torch.randn(2, 200).to(torch.bfloat16), w, out, plan, config)
    with pytest.raises(ValueError, match="one row"):
        stream_gemv(torch.randn(1, 200).to(torch.bfloat16), quantize_weight(w.float())[0],
                    out[:1], plan, config)


def test_plan_is_one_wave_of_equal_runs() -> None:
    config = StreamConfig()
    # Llama-3-8B at one row on an H200 (132 SMs): qkv, o_proj, gate/up (merged), down_proj
    for N, K, gated, w_bytes, rows, block_r in [(6144, 4096, False, 2, 47, 64),
                                                (4096, 4096, False, 2, 32, 32),
                                                (14336, 4096, True, 2, 109, 256),
                                                (4096, 14336, False, 4, 32, 32)]:
        plan = stream_plan(N, K, w_bytes, gated, config, 132)
        assert plan is not None and (plan.rows, plan.block_r) == (rows, block_r)
        assert plan.programs <= 132 and plan.block_r * plan.block_k * w_bytes <= config.tile_bytes
        assert plan.block_k * w_bytes >= gemv_stream.MIN_RUN_BYTES
    # the LM head's 972 rows a program leave 16-byte runs: not this kernel's shape
    assert stream_plan(128256, 4096, 1, False, config, 132) is None


@pytest.mark.parametrize("gpu, shapes", [
    ("8B", [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False)]),
    ("1B", [(3072, 2048, False), (2048, 2048, False), (8192, 2048, True), (2048, 8192, False)])])
def test_default_takes_its_wide_tile_where_rows_are_read_64_bytes_a_step(gpu, shapes) -> None:
    """gemv_stream.choose: the 8B gate/up (110 rows of a 128-row 8 KB tile, 64 bytes of each a
    step) on DEFAULT.wide's 16 KB tiles, the 8B down_proj (K = 14336) on DEFAULT.long_k's 16
    warps, every other Llama-3 shape on DEFAULT; a configuration without them keeps its own."""
    default = gemv_stream.DEFAULT
    for N, K, gated in shapes:
        config, plan = gemv_stream.choose(N, K, 2, gated, default, 132)
        wide, long_k = gpu == "8B" and gated, K > 8192  # the 8B gate/up; the 8B down_proj
        assert config is (default.wide if wide else default.long_k if long_k else default), (
            N, K, gated)
        assert plan.block_k * 2 >= 128, plan  # a row's run a step: 128 bytes or more
        assert plan.programs <= 2 * 132
        plain = StreamConfig(programs_per_sm=2, tile_bytes=8192, depth=4)
        assert gemv_stream.choose(N, K, 2, gated, plain, 132)[0] is plain
    assert gemv_stream.choose(14336, 4096, 1, True, default, 132) is None  # FP8: _linear_kernel


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        StreamConfig(depth=5)
    with pytest.raises(ValueError, match="stream configuration"):
        StreamConfig(programs_per_sm=0)


@needs_cuda
@pytest.mark.parametrize("config", [StreamConfig(), gemv_stream.DEFAULT],
                         ids=["d3", "default"])
@pytest.mark.parametrize("shape", ["qkv", "o_proj", "gate_up", "down"])
def test_gpu_8b_shapes_through_linear(shape, config, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear.py dispatches one row to the stream kernel when CONFIG is set: the 8B shapes."""
    K, N, norm, activation = {"qkv": (4096, 6144, True, None), "o_proj": (4096, 4096, False, None),
                              "gate_up": (4096, 14336, True, "silu"),
                              "down": (14336, 4096, False, None)}[shape]
    monkeypatch.setattr(gemv_stream, "CONFIG", config)
    run(K, N, torch.bfloat16, norm, norm, activation, seed=3, config=config,
        sms=gemv_stream.num_sms(torch.device("cuda")))
    x, r, g, w = (t.cuda() if t is not None else None
                  for t in inputs(1, K, 2 * N if activation else N, torch.bfloat16, 5, True))
    if norm:
        out, _ = rms_norm_linear_triton(x, r, g, EPS, w, activation=activation)
        ref, _ = rms_norm_linear_triton(x, r, g, EPS, w, activation=activation, block_n=16,
                                        block_k=512)
    else:
        out = linear_triton(x, w, activation=activation)
        ref = linear_triton(x, w, activation=activation, block_n=16, block_k=512)
    assert_mostly_equal(out, ref, torch.bfloat16)


def test_default_config_leaves_fp8_weights_to_linear_kernel() -> None:
    default = gemv_stream.DEFAULT
    assert stream_plan(6144, 4096, 2, False, default, 132) is not None  # bf16 qkv
    assert stream_plan(6144, 4096, 1, False, default, 132) is None      # FP8: measured slower


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with compute capability >= 9.0 (PDL)")
def test_gpu_pdl_chain_gives_the_ordinary_launchs_bits() -> None:
    """Two layers of the 8B decode GEMVs (norm + qkv, o_proj, norm + gate/up, down), each
    reading what the one before wrote, in a CUDA graph: with PDL (the default's) the bits of
    ordinary launches. A kernel that read its input before `griddepcontrol.wait` would read the
    previous replay's values and differ."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * std

    layers = [dict(qkv=randn(6144, 4096, std=0.02), o=randn(4096, 4096, std=0.02),
                   gate_up=randn(2 * 14336, 4096, std=0.02), down=randn(4096, 14336, std=0.02),
                   g1=1 + randn(4096, std=0.1), g2=1 + randn(4096, std=0.1)) for _ in range(2)]
    h0, r0 = randn(1, 4096), randn(1, 4096)

    def chain(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            qkv, r = rms_norm_linear_triton(h, r, layer["g1"], EPS, layer["qkv"])
            o = linear_triton(qkv[:, :4096], layer["o"])
            act, r = rms_norm_linear_triton(o, r, layer["g2"], EPS, layer["gate_up"],
                                            activation="silu")
            h = linear_triton(act, layer["down"])
        return torch.cat([h, r], dim=1)

    def replayed(config: StreamConfig) -> torch.Tensor:
        previous = gemv_stream.CONFIG
        gemv_stream.CONFIG = config
        try:
            h, r = h0.clone(), r0.clone()
            chain(h, r)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(h, r)
            for scale in (3.0, 1.0):  # a replay after new inputs: stale reads would show
                h.copy_(h0 * scale)
                graph.replay()
            torch.cuda.synchronize()
            return out.clone()
        finally:
            gemv_stream.CONFIG = previous

    with_pdl = replayed(gemv_stream.DEFAULT)
    default = gemv_stream.DEFAULT  # its wide and long-K configurations too: PDL off in all
    without = replayed(dataclasses.replace(
        default, pdl=False, wide=dataclasses.replace(default.wide, pdl=False),
        long_k=dataclasses.replace(default.long_k, pdl=False)))
    assert torch.isfinite(with_pdl).all()
    assert torch.equal(with_pdl, without)
