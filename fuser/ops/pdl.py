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
one-row GEMVs, the LM head); FUSER_PDL=0 switches it off. Several-row launches (verification,
catch-up, prefill) take it only with FUSER_PDL_ROWS=1 (below).
Measured on the H200:
  - eighth session (benchmarks/pdl_lab.py, 16 layers of 8B-shape GEMVs): at one row +1.1-1.3% in
    FP8, nothing in bf16; at five rows (the verify step's MMA path) a chain of PDL launches was
    not bit-equal to ordinary launches, prefetch or not, although each kernel alone was (a likely
    cause: a load the MMA path's software pipelining issues ahead of `griddepcontrol.wait`; not
    confirmed). `tests/test_pdl.py` chains dependent launches since.
  - eleventh session (benchmarks/decode.py, the whole 8B step, one machine): FUSER_PDL=1 ran the
    FP8 decode step in 2.544 ms against 2.626 (generate 385.2 against 372.7 tok/s), and the FP8
    verify step (T = 5, where only attention took PDL) in 4.302 ms against 4.159: one row on,
    several rows off.
  - thirteenth session (the eighth's 5-row chain had overflowed to NaN, never equal to itself,
    so a switch, FUSER_PDL_ROWS=1, let a GPU run decide): with PDL at several rows the 8B FP8
    verify step's logits were not bit-equal to ordinary launches and tests/test_pdl.py's 5-row
    FP8 chain differed on half its elements (by up to 1.1e-6), a race not found; and it was
    slower: verify (T = 5) bf16 4.545 against 4.349 ms, FP8 4.055 against 3.458. The switch is
    gone; several-row launches stay ordinary.
  - twenty-second session: not a race. The several-row kernel summed the tiles it prefetched
    before its wait with the bf16 MMA's step whatever its path; on the fp16 path (FP8 rows then)
    the running power of two then scaled that first tile away, so every FP8 output of the chain
    differed (20480 of 40960 values: all of h, none of r). Fixed in fuser/ops/linear.py (the
    prefetched tiles take the loop's own step, `_rows_k_step`; tests/test_pdl.py holds the PDL
    variant to the ordinary one's bits on every path, on the interpreter). FUSER_PDL_ROWS=1
    brings several-row PDL back for measurement.
  - twenty-third session (benchmarks/RESULTS.md): bit-equal on the GPU now (the 5-row chains of
    tests/test_pdl.py under FUSER_PDL_ROWS=1), and still slower. 8B FP8 verify (T = 5) 3.178 ms
    with every several-row launch on PDL against 2.94 before; at 8 layers, replayed alike,
    0.910-0.917 ms with PDL on the GEMVs only (FUSER_PDL_ROWS=gemv), late or not, or on all,
    against 0.856 without: the gaps between kernels shrink by 15-29 us, the GEMVs take 47 us
    more. FUSER_PDL_LATE=1 also slows the one-row decode step. Several-row launches stay
    ordinary; fuser/ops/carveout.py holds the next guess at why (an SM changing its L1/shared
    split between kernels).
  - twenty-fourth and twenty-fifth sessions: neither the carveout (gap_lab: a 5-row kernel
    boundary costs ~0.2 us with or without it) nor room for the next kernel's programs beside
    the running ones explains it: with the 5-row GEMVs capped at 128 registers (four programs
    an SM instead of two, linear.FP8_ROWS_MAXNREG) the 8B FP8 verify step took 1.365x the
    decode step with PDL on the GEMVs against 1.287x without.
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

__all__ = ["HAVE_GDC", "late_launch_enabled", "launch_next", "pdl_enabled", "pdl_launch",
           "pdl_rows_enabled", "pdl_supported", "wait_for_inputs"]


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


PDL_ROWS_CHOICES = ("0", "1", "gemv")


def pdl_rows_enabled(gemv: bool = False) -> bool:
    """Whether several-row launches take PDL too (read at each launch like FUSER_PDL):
    FUSER_PDL_ROWS=1 every several-row launch, =gemv the GEMVs' only (gemv: the launch is one),
    0 (the default) none. Another value raises: a typo must not measure the default."""
    value = os.environ.get("FUSER_PDL_ROWS", "0")
    if value not in PDL_ROWS_CHOICES:
        raise ValueError(f"FUSER_PDL_ROWS={value!r} is not one of {PDL_ROWS_CHOICES}")
    return value == "1" or (value == "gemv" and gemv)


def pdl_launch(device: torch.device, one_row: bool, gemv: bool = False) -> dict[str, bool]:
    """Launch options for a kernel that keeps the contract above: `launch_pdl=True` where PDL is
    on and the launch is a one-row (decode) launch, or a several-row one with
    `pdl_rows_enabled(gemv)`; nothing otherwise (so the interpreter never sees the option)."""
    wanted = one_row or pdl_rows_enabled(gemv)
    return {"launch_pdl": True} if wanted and pdl_enabled(device) else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """Wait until the previous kernel has completed (its writes visible), then let the next
    kernel launch (LAUNCH_NEXT False: the kernel calls `launch_next` itself later). With PDL
    False (CPU, interpreter) nothing: the launch was ordinary."""
    if PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch (after `wait_for_inputs(PDL, LAUNCH_NEXT=False)`)."""
    if PDL:
        gdc_launch_dependents()


def late_launch_enabled() -> bool:
    """FUSER_PDL_LATE=1: the GEMVs let the next kernel launch after their K loop rather than
    right after their wait, so that the next kernel's programs (waiting, holding registers and
    shared memory) do not take SMs from this one's last programs. For measurement; off."""
    return os.environ.get("FUSER_PDL_LATE", "0") == "1"
