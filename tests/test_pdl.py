"""Programmatic dependent launch (fuser/ops/pdl.py): off where it cannot run, and on a Hopper GPU
the PDL-launched kernels give the ordinary launch's bits, alone and captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fuser.ops.fp8 import quantize_weight
from fuser.ops.linear import linear_triton
from fuser.ops.norm_linear import rms_norm_linear_triton
from fuser.ops.pdl import pdl_enabled, pdl_launch

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU with compute capability >= 9.0")


def test_pdl_is_off_on_cpu_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu"), one_row=True) == {}  # the interpreter never sees it
    monkeypatch.setenv("FUSER_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))  # decided before asking the device anything


def test_pdl_is_on_by_default_for_one_row_launches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy (fuser/ops/pdl.py): a supporting device launches one-row (decode) kernels with
    PDL unless FUSER_PDL=0, and several-row kernels (verify, catch-up, prefill) never."""
    from fuser.ops import pdl as pdl_module

    monkeypatch.setattr(pdl_module, "pdl_supported", lambda device: True)
    monkeypatch.delenv("FUSER_PDL", raising=False)
    cuda = torch.device("cuda")
    assert pdl_launch(cuda, one_row=True) == {"launch_pdl": True}
    assert pdl_launch(cuda, one_row=False) == {}
    monkeypatch.setenv("FUSER_PDL", "0")  # ... never with PDL off
    assert pdl_launch(cuda, one_row=True) == {}
    assert pdl_launch(cuda, one_row=False) == {}


def _cases() -> list[tuple]:
    # (rows, N, K, fp8, norm, activation, split_k): qkv and down_proj shapes at 8B width, the
    # norm prologue and the gated epilogue, split-K, several rows on the MMA path
    return [(1, 6144, 4096, False, True, None, None), (1, 6144, 4096, True, True, None, None),
            (1, 4096, 14336, True, False, None, 7), (1, 4096, 14336, False, False, None, 2),
            (1, 2 * 1024, 4096, True, True, "silu", None),
            (5, 6144, 4096, False, False, None, None),
            (5, 6144, 4096, True, False, None, None),
            (9, 2 * 1024, 4096, True, False, "silu", None)]


@needs_hopper
@pytest.mark.parametrize("case", _cases())
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gpu_pdl_launch_gives_the_ordinary_launchs_bits(case: tuple, prefetch: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    M, N, K, fp8, norm, activation, split_k = case
    gen = torch.Generator(device="cuda").manual_seed(M * N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    r = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.1 * torch.randn(K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w, scale = quantize_weight(w) if fp8 else (w, None)

    def run() -> torch.Tensor:
        kw = dict(weight_scale=scale, activation=activation, split_k=split_k, prefetch=prefetch)
        if norm:
            out, summed = rms_norm_linear_triton(x, r, g, 1e-5, w, **kw)
            return torch.cat([out.flatten(), summed.flatten()])
        return linear_triton(x, w, **kw).flatten()

    monkeypatch.setenv("FUSER_PDL", "0")
    expected = run()
    monkeypatch.setenv("FUSER_PDL", "1")
    assert pdl_enabled(x.device)
    torch.testing.assert_close(run(), expected, rtol=0, atol=0)
    # captured: three PDL launches in a row in one graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [run() for _ in range(3)]
    x.add_(0.5)  # new inputs: the replay must see them, not overlap the writes before it
    monkeypatch.setenv("FUSER_PDL", "0")
    expected = run()
    graph.replay()
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@needs_hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_gpu_dependent_pdl_launches_give_the_ordinary_launchs_bits(
        rows: int, fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain in which every GEMV reads the one before's output (as a decode step runs them,
    norm prologue and gated epilogue at one row), captured in one CUDA graph: the same bits with
    PDL on as off. The test above never makes a PDL kernel wait for data; this one does. At 5
    rows the launches are ordinary either way (several rows never take PDL)."""
    H, I = 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(rows + 10 * fp8)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        return quantize_weight(w) if fp8 else (w, None)

    layers = [(weight(H, H), weight(2 * I, H), weight(H, I)) for _ in range(4)]
    g = 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16, generator=gen)
    h0 = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    r0 = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=gen)

    def chain() -> torch.Tensor:
        h, r = h0, r0
        for (w1, s1), (w2, s2), (w3, s3) in layers:
            if rows == 1:
                x, r = rms_norm_linear_triton(h, r, g, 1e-5, w1, weight_scale=s1)
                act, r = rms_norm_linear_triton(x, r, g, 1e-5, w2, weight_scale=s2,
                                                activation="silu")
            else:
                x = linear_triton(h, w1, weight_scale=s1)
                act = linear_triton(x, w2, weight_scale=s2, activation="silu")
            h = linear_triton(act, w3, weight_scale=s3) * 0.25  # kept in range over the layers
        return torch.cat([h.flatten(), r.flatten()])

    def captured() -> torch.Tensor:
        chain()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        h0.mul_(-1)  # new data for the replay
        graph.replay()
        torch.cuda.synchronize()
        h0.mul_(-1)
        return out.clone()

    monkeypatch.setenv("FUSER_PDL", "0")
    expected = captured()
    monkeypatch.setenv("FUSER_PDL", "1")
    got = captured()
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@triton.jit
def _no_wait(PDL: tl.constexpr):
    pass


class _LaunchAsPdl(dict):
    """Launch options that ask for the kernel's PDL variant (truthy) and pass no option to the
    launch (empty): what the interpreter can run."""

    def __bool__(self) -> bool:
        return True


@pytest.mark.parametrize("fp8, norm, activation", [(False, False, None), (True, False, None),
                                                   (True, True, None), (False, True, "silu")])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_pdl_variant_sums_the_prefetched_tiles_as_the_loop_does(
        fp8: bool, norm: bool, activation: str | None, prefetch: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PDL-launched one-row program sums its first weight tiles (loaded before its wait)
    outside the K loop: it must sum them exactly as a loop step would, so that PDL changes no
    bit. On the interpreter: the kernel's PDL variant, its wait taken out, against the ordinary
    variant, through the norm prologue and the gated epilogue."""
    from fuser.ops import linear as linear_module

    if torch.cuda.is_available():
        pytest.skip("the interpreter's check (tests on the GPU launch the variants for real)")

    gen = torch.Generator().manual_seed(prefetch)
    N, K = 48, 256
    x, r = (torch.randn(1, K, generator=gen).to(torch.bfloat16) for _ in range(2))
    g = (1 + 0.1 * torch.randn(K, generator=gen)).to(torch.bfloat16)
    w = torch.randn(2 * N if activation else N, K, generator=gen) * 0.05
    w, scale = quantize_weight(w) if fp8 else (w.to(torch.bfloat16), None)
    kw = dict(weight_scale=scale, activation=activation, block_n=16, block_k=32,
              prefetch=prefetch)

    def run() -> torch.Tensor:
        if norm:
            out, summed = rms_norm_linear_triton(x, r, g, 1e-5, w, **kw)
            return torch.cat([out.flatten(), summed.flatten()])
        return linear_triton(x, w, **kw).flatten()

    expected = run()
    monkeypatch.setattr(linear_module, "wait_for_inputs", _no_wait)
    monkeypatch.setattr(linear_module, "pdl_launch", lambda device, one_row: _LaunchAsPdl())
    torch.testing.assert_close(run(), expected, rtol=0, atol=0)
