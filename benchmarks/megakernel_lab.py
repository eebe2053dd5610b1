"""Is one persistent kernel per decode step worth building for small models (issue #12)?

The bundled pair's steps are launch-bound: a target-only iteration is ~0.12 ms for 6 layers of
hidden 384, each extra draft position ~0.05 ms for 2 layers of hidden 192, about 3.5 us per
kernel (benchmarks/RESULTS.md). This lab times a chain of GEMVs with the shapes of those layers
(qkv, o_proj, gate/up, down_proj per layer; each GEMV's input is the previous one's output, so
nothing can overlap) three ways, the weights L2-resident as they are step after step:

  launches     one fuser::linear launch per GEMV, captured in a CUDA graph (what the engine does)
  persistent   one kernel of P programs that runs every GEMV of the chain, each split over the
               programs by output rows, a grid barrier (an atomic counter) between two GEMVs
  one program  one program runs the whole chain: what a single SM streams from L2

and prints us per GEMV for each, after checking each chain's output against PyTorch's.

    python benchmarks/megakernel_lab.py [--out lab.json]

The persistent kernel needs its P programs resident at once (P <= the SM count, tiny tiles): a
grid barrier with programs waiting for unscheduled ones would never end. Under
TRITON_INTERPRET=1 (programs run one after another) only the one-program form can run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (hidden, intermediate, q heads, kv heads, head dim, layers): the bundled draft and target
MODELS = {
    "draft": (192, 512, 3, 1, 64, 2),
    "target": (384, 960, 6, 2, 64, 6),
}


def chain_shapes(hidden: int, inter: int, heads: int, kv: int, dim: int,
                 layers: int) -> list[tuple[int, int]]:
    """(N, K) of each GEMV of a decode step's layers: qkv, o_proj, gate/up, down_proj."""
    qkv = (heads + 2 * kv) * dim
    return [(qkv, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)] * layers


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program arrives once (one atomic per program), then waits until `target` programs
    have arrived in all: the counter only grows within a launch."""
    tl.debug_barrier()  # this program's stores of the phase are done
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _chain_kernel(w_ptr, meta_ptr, buf_ptr, counter_ptr, phases, buf_stride,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y_p = W_p @ y_{p-1}[:K_p] for p in 0..phases-1, buffers ping-ponged (row 0 holds x);
    meta [phases, 3] int64 = (N, K, weight offset). Program i takes rows i*BLOCK_N, then every
    P*BLOCK_N after."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for phase in range(phases):
        n = tl.load(meta_ptr + phase * 3)
        k = tl.load(meta_ptr + phase * 3 + 1)
        w_off = tl.load(meta_ptr + phase * 3 + 2)
        x_ptr = buf_ptr + (phase % 2) * buf_stride
        y_ptr = buf_ptr + ((phase + 1) % 2) * buf_stride
        for start in range(pid * BLOCK_N, n, programs * BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + w_off + rows[:, None] * k + cols[None, :],
                            mask=(rows[:, None] < n) & (cols[None, :] < k), other=0.0)
                acc += w.to(tl.float32) * x[None, :]
            y = tl.sum(acc, axis=1)
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < n)
        _grid_barrier(counter_ptr, (phase + 1) * programs)


class Chain:
    """A chain's weights in one flat buffer, its meta table and its two activation buffers."""

    def __init__(self, shapes: list[tuple[int, int]], device: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
                        for n, k in shapes]
        offsets, total = [], 0
        for n, k in shapes:
            offsets.append(total)
            total += n * k
        self.flat = torch.cat([w.reshape(-1) for w in self.weights])
        self.meta = torch.tensor([[n, k, o] for (n, k), o in zip(shapes, offsets)],
                                 dtype=torch.int64, device=device)
        width = max(max(n, k) for n, k in shapes)
        self.buf = torch.zeros(2, width, dtype=torch.bfloat16, device=device)
        self.x = torch.randn(width, generator=gen).to(torch.bfloat16).to(device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)

    def reference(self) -> torch.Tensor:
        """The chain in PyTorch, rounded to bf16 after each GEMV as the kernels do."""
        y = self.x.float()
        for w in self.weights:
            y = (w.float() @ y[:w.shape[1]]).to(torch.bfloat16).float()
        return y[:self.shapes[-1][0]]

    def output(self) -> torch.Tensor:
        return self.buf[len(self.shapes) % 2, :self.shapes[-1][0]].float()

    def persistent(self, programs: int, block_n: int, block_k: int, warps: int) -> None:
        """One launch: the counter zeroed, then the chain's kernel (x copied in first)."""
        self.counter.zero_()
        self.buf[0].copy_(self.x)
        _chain_kernel[(programs,)](self.flat, self.meta, self.buf, self.counter, len(self.shapes),
                                   self.buf.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                   num_warps=warps)

    def launches(self) -> torch.Tensor:
        """One fuser::linear per GEMV (the engine's decode GEMV)."""
        y = self.x[None]
        for w in self.weights:
            y = torch.ops.fuser.linear(y[:, :w.shape[1]].contiguous(), w)
        return y[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import fuser.ops  # noqa: F401, PLC0415  (registers fuser::linear)
    from timing import time_us  # noqa: PLC0415

    device = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, config in MODELS.items():
        chain = Chain(chain_shapes(*config), device)
        want = chain.reference()
        gemvs = len(chain.shapes)
        mb = chain.flat.numel() * 2 / 1e6

        def row(form: str, fn, check) -> None:
            try:
                fn()
                torch.cuda.synchronize()
                err = ((check() - want).abs().max() / want.abs().max()).item()
                t = time_us(fn)
                results.append(dict(model=name, form=form, gemvs=gemvs, us=t.us,
                                    us_per_gemv=t.us / gemvs, rel_err=err, method=t.method))
                print(f"{name:6s} {form:34s} {t.us:8.1f} us  {t.us / gemvs:6.2f} us/GEMV  "
                      f"rel err {err:.1e}  ({t.method})", flush=True)
            except Exception as error:  # noqa: BLE001  (a lab: report and go on)
                print(f"{name:6s} {form:34s} failed: {type(error).__name__}: {error}"[:300],
                      flush=True)

        print(f"{name}: {gemvs} GEMVs, {mb:.2f} MB of weights, {sms} SMs", flush=True)
        out = {}
        row("launches (fuser::linear each)", lambda: out.__setitem__("y", chain.launches()),
            lambda: out["y"][:want.numel()].float())
        for warps, block_k in ((4, 256), (8, 256), (16, 512)):
            row(f"one program w{warps} k{block_k}",
                lambda: chain.persistent(1, 16, block_k, warps), chain.output)
        for programs, block_n in ((sms, 4), (sms, 8), (64, 8), (32, 16), (16, 32)):
            row(f"persistent P{programs} n{block_n} w4",
                lambda: chain.persistent(programs, block_n, 256, 4), chain.output)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
