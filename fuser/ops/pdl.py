"""Programmatic dependent launch (PDL): the next kernel starts before this one has finished.

A decode step at batch 1 is ~240 short kernels in a row (benchmarks/RESULTS.md: 237 per step at
the Llama-3-8B shape, an FP8 weight GEMV of 4-30 us each). Between two of them the GPU drains the
first kernel's last blocks, flushes its writes, then launches and ramps up the second: ~0.4-0.7 us
of gaps per kernel on an H200, plus each GEMV's first weight bytes arriving only after its launch.
On Hopper a kernel launched with PDL (CUDA's programmatic stream serialization, Triton's
`launch_pdl=True`) may start while the kernel before it still runs: its blocks become resident as
soon as every block of the previous kernel has executed `griddepcontrol.launch_dependents`
(or exited), and `griddepcontrol.wait` holds them until the previous kernel has completed and
its writes are visible. Whatever a kernel does before its wait overlaps the previous kernel's
tail: the GEMVs load their first weight tiles there (weights never depend on the previous
kernel), everything else only gets its launch and scheduling out of the way.

The contract every kernel launched with `launch_pdl` keeps (see `wait_for_inputs`):
  - before `wait_for_inputs`, it reads only what no kernel of the step writes (weights), and
    writes nothing;
  - it calls `wait_for_inputs` (wait, then let the next kernel launch) on every path.
Completion is transitive: a kernel completes only after its own wait returned, so waiting for the
previous kernel is waiting for every kernel before it. A kernel launched without PDL (cuBLAS,
Inductor's, PyTorch's) is serialized as usual; a PDL kernel after it just waits for it.

CUDA graphs keep the dependency (stream capture turns it into a programmatic edge, CUDA >= 12.3).
`griddepcontrol.wait` is a no-op in a kernel launched without PDL, so the same compiled kernel is
correct either way.

On by default for one-row launches only: the decode step's kernels (T = 1: attention, the
one-row GEMVs, the LM head); FUSER_PDL=0 switches it off (to debug, or to measure without it).
Several-row launches (verification, catch-up, prefill) stay ordinary. Measured on an H200
(docs/performance-notes.md has the details): the whole 8B FP8 decode step took 2.544 ms with PDL
against 2.626 without (generate 385.2 against 372.7 tok/s); with PDL on every several-row launch
as well, bit-equal to ordinary launches, the 8B FP8 verify step (T = 5) took 3.178 ms against
2.94: the gaps between kernels shrank by 15-29 us a step, the GEMVs took 47 us longer. Letting
the next kernel launch only after the K loop, a shared-memory carveout common to all kernels and
a register cap that fits four GEMV programs an SM explained none of that loss.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 (the GPU machine has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off, the kernels never call these
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass

__all__ = ["HAVE_GDC", "pdl_enabled", "pdl_launch", "pdl_supported", "wait_for_inputs"]


def pdl_supported(device: torch.device) -> bool:
    """Whether a kernel on `device` can launch with PDL at all: CUDA, compute capability >= 9.0,
    Triton's intrinsics present, not interpreted."""
    if device.type != "cuda" or not HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether one-row kernels on `device` launch with PDL: pdl_supported, and FUSER_PDL not
    "0" (read at each launch, so a benchmark can compare both in one process; CUDA graphs keep
    what they were captured with). The stream GEMV (fuser/ops/gemv_stream.py) has its own
    switch."""
    if os.environ.get("FUSER_PDL", "1") == "0":
        return False
    return pdl_supported(device)


def pdl_launch(device: torch.device, one_row: bool) -> dict[str, bool]:
    """Launch options for a kernel that keeps the contract above: `launch_pdl=True` where PDL is
    on and the launch is a one-row (decode) launch; nothing otherwise (so the interpreter never
    sees the option)."""
    return {"launch_pdl": True} if one_row and pdl_enabled(device) else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has completed (its writes visible), then let the next
    kernel launch. With PDL False (CPU, interpreter) nothing: the launch was ordinary."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
