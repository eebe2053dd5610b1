"""FP8 weights on the tensor cores at few rows: candidate kernels against `_linear_kernel`.

    python3 benchmarks/fp8_mma_lab.py [--rows 1,5] [--out f.json]

The one-row FP8 GEMV (`_linear_kernel`, CUDA cores) streams at ~73% of the read bandwidth and
its several-row MMA path (weights widened to bf16, x as the MMA's A operand) at ~41%
(benchmarks/RESULTS.md). The candidates here put the weight tile in the MMA's A operand (swap
AB: acc[BLOCK_N, 16] += w[BLOCK_N, BLOCK_K] . x[16, BLOCK_K].T, x padded to 16 rows) so that
on sm_90 the weight can stay in shared memory for the wgmma (FP8 x FP8, "a8": x quantized per
row in the kernel, scale max|x| / 448, the prefill's recipe) or be widened in registers and fed
from there ("a16": e4m3fn -> bf16, exact; x stays bf16; the op's current semantics).

Each shape is timed as a chain of weight copies (more bytes than L2 holds) captured in one CUDA
graph; prints us per GEMV and the read bandwidth against the measured HBM read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import measure_read_bandwidth, replay_median_ms  # noqa: E402

from fuser.ops.fp8 import fp8_linear_reference, quantize_rows, quantize_weight  # noqa: E402
from fuser.ops.fp8_quant import _row_scale  # noqa: E402
from fuser.ops.linear import _sum_splits, linear_triton  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
          "o_proj": (4096, 4096), "lm_head": (128256, 4096)}


@triton.jit
def _swap_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                 stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, A8: tl.constexpr, FP32_DOTS: tl.constexpr,
                 HAS_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    k_lo = tl.multiple_of(tl.program_id(1) * (K // SPLIT_K), 16)
    k_hi = k_lo + K // SPLIT_K
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m[:, None] * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    if A8:  # the row's scale over all of K (every split the same), as quantize_rows
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        x_scale = _row_scale(tl.max(amax, axis=1))                     # [BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        if A8:
            q = tl.clamp(tl.math.div_rn(x.to(tl.float32), x_scale[:, None]), -448.0, 448.0)
            x = q.to(w.dtype)
        if FP32_DOTS:  # TRITON_INTERPRET: its low-precision dots are not exact
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif A8:
            acc = tl.dot(w, tl.trans(x), acc)
        elif HAS_SCALE:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if SPLIT_K > 1:
        acc, last = _sum_splits(acc, part_ptr, count_ptr, pid, BLOCK_N * BLOCK_M, SPLIT_K)
    if HAS_SCALE:
        acc *= tl.load(ws_ptr + n, mask=n_ok, other=0.0)[:, None]
    if A8:
        acc *= x_scale[None, :]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        ok = ok & (tl.zeros_like(ok.to(tl.int32)) + last.to(tl.int32) != 0)
    tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


class Swap:
    """One launch configuration of _swap_kernel with its buffers."""

    def __init__(self, N: int, K: int, block_n: int, block_k: int, split_k: int, stages: int,
                 warps: int, a8: bool, device: torch.device):
        assert K % (split_k * block_k) == 0
        self.cfg = (block_n, block_k, split_k, stages, warps, a8)
        grid_n = triton.cdiv(N, block_n)
        self.grid = (grid_n, split_k)
        self.part = torch.empty(grid_n * split_k * block_n * 16, device=device,
                                dtype=torch.float32)
        self.count = torch.zeros(grid_n, device=device, dtype=torch.int32)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        block_n, block_k, split_k, stages, warps, a8 = self.cfg
        M, K = x.shape
        _swap_kernel[self.grid](x, w, ws, out, self.part, self.count, M, w.shape[0], K,
                                x.stride(0), w.stride(0), out.stride(0), BLOCK_M=16,
                                BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, A8=a8,
                                FP32_DOTS=x.device.type != "cuda", HAS_SCALE=ws is not None,
                                num_warps=warps, num_stages=stages)
        return out


def a8_reference(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_rows(x)
    return ((xq.float() @ w.float().T) * xs[:, None] * ws[None, :]).to(x.dtype)


def time_chain(fn, copies: list, x: torch.Tensor, replays: int = 20) -> float:
    """Median us per GEMV over the chain of weight copies, captured in one CUDA graph."""
    outs = [torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
            for w, _ in copies]

    def run() -> torch.Tensor:
        for (w, ws), out in zip(copies, outs):
            fn(x, w, ws, out)
        return outs[-1]
    ms, _ = replay_median_ms(run, replays)
    return ms * 1000 / len(copies)


def candidates(N: int, K: int, w_size: int) -> list[tuple]:
    """(block_n, block_k, split_k, stages, warps) to try at this shape."""
    out = []
    for block_n in (64, 128):
        for block_k in ((64, 128, 256) if w_size == 1 else (64, 128)):
            programs = triton.cdiv(N, block_n)
            splits = [1] if programs >= 264 else [s for s in (2, 4) if K % (s * block_k) == 0]
            if programs >= 132 and programs < 264:
                splits = [1, 2]
            for split in splits:
                for stages in ((4, 6) if w_size == 1 else (3, 5)):
                    if stages * block_k * (block_n + 16) * w_size > 200 * 1024:
                        continue
                    out.append((block_n, block_k, split, stages, 4))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--skip-a8", action="store_true")
    parser.add_argument("--default-only", action="store_true",
                        help="time `_linear_kernel`'s defaults (and cuBLAS) only, no candidates")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = measure_read_bandwidth()
    print(f"HBM read bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for dtype, name in [(d, n) for d in args.dtypes.split(",") for n in args.shapes.split(",")]:
        fp8 = dtype == "fp8"
        N, K = SHAPES[name]
        n_copies = max(2, (400 * 2**20) // (N * K * (1 if fp8 else 2)))
        base = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        copies = []
        for i in range(n_copies):
            w = base.roll(i, dims=1) if i else base
            copies.append(quantize_weight(w) if fp8 else (w.clone(), None))
        for M in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w0, ws0 = copies[0]
            ref16 = fp8_linear_reference(x, w0, ws0) if fp8 else (x.float() @ w0.float().T).to(x.dtype)
            ref8 = a8_reference(x, w0, ws0) if fp8 else None
            nbytes = N * K * (1 if fp8 else 2)

            def report(label: str, us: float, err: float) -> None:
                tbs = nbytes / us / 1e6
                print(f"{dtype:4s} {name:8s} M={M:2d} {label:32s} {us:8.2f} us {tbs:5.2f} TB/s "
                      f"{100 * tbs * 1e12 / bandwidth:5.1f}%  err {err:.1e}", flush=True)
                results.append({"dtype": dtype, "shape": name, "M": M, "variant": label, "us": us,
                                "tbs": tbs, "err": err})

            def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
                return ((out.float() - ref.float()).norm() / ref.float().norm()).item()

            base_fn = lambda x, w, ws, out: out.copy_(linear_triton(x, w, weight_scale=ws))  # noqa: E731
            us = time_chain(lambda x, w, ws, out: linear_triton(x, w, weight_scale=ws), copies, x)
            report("_linear_kernel (default)", us, rel(base_fn(x, w0, ws0, torch.empty_like(ref16)), ref16))
            if not fp8:
                us = time_chain(lambda x, w, ws, out: torch.mm(x, w.T, out=out), copies, x)
                report("cuBLAS (torch.mm)", us, rel(x @ w0.T, ref16))
            best = {}
            for a8 in () if args.default_only else \
                    ((True, False) if fp8 and not args.skip_a8 else (False,)):
                for cfg in candidates(N, K, 1 if fp8 else 2):
                    try:
                        fn = Swap(N, K, *cfg, a8=a8, device=device)
                        out = fn(x, w0, ws0, torch.empty_like(ref16))
                        err = rel(out, ref8 if a8 else ref16)
                        us = time_chain(fn, copies, x)
                    except Exception as exc:  # noqa: BLE001 - a lab: report and go on
                        print(f"{name} M={M} {cfg} a8={a8}: {type(exc).__name__}: {exc}"[:200])
                        continue
                    label = f"swap {'a8' if a8 else 'a16'} {cfg[:4]}"
                    if us < best.get(a8, (1e9,))[0]:
                        best[a8] = (us, label, err)
                    results.append({"dtype": dtype, "shape": name, "M": M, "variant": label, "us": us,
                                    "tbs": nbytes / us / 1e6, "err": err})
            for a8, (us, label, err) in sorted(best.items()):
                report(label, us, err)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
