"""Per-op time at Llama-3-8B decode shapes on the GPU: each fused op against PyTorch, in one run.

    python benchmarks/ops.py --out $OUT/ops.json [--only rotary attention ...] [--no-compile]
    python benchmarks/ops.py --dry-run      # CPU, tiny shapes: every case once, no timing

Batch 1, bf16, T = 1, 5, 9 tokens per step (decode and verification); attention also at context
1024 and 8192 (cache of ctx + 16 slots, seq_lens = ctx, starts = 0). Ops: rms_norm,
add_rms_norm, rotary, rotary with the KV-cache write (rotary_cache), gated_act (silu), cache
attention, the merged q/k/v and gate/up GEMMs (one F.linear over the concatenated weight), the
plain o_proj, down_proj and lm_head GEMMs, fuser's decode GEMV (`linear`:
torch.ops.fuser.linear against F.linear at the five projection shapes qkv, o_proj, gate_up,
down, lm_head), and the GEMV with the gated activation in its epilogue (`gated_linear`:
torch.ops.fuser.gated_linear over the merged gate/up weight against F.linear then act(gate) * up;
compare with the `linear` gate_up row plus the `gated_act` row, the two kernels it replaces).

For every (op, case), three ways, each timed per call by CUDA-graph replay (benchmarks/timing.py:
warm-up on a side stream, CUDA_GRAPH_CALLS = 20 back-to-back calls captured into one graph,
`do_bench(g.replay)` median of warmup 25 ms / rep 100 ms, divided by the calls), as the engine
runs a step, so the host's launch overhead (Python dispatch, allocations; ~20-90 us, more than
the GPU work of a batch-1 op) is not what is measured:
  eager    the pure-PyTorch reference of the same subgraph (for the merged GEMMs: the separate
           F.linear calls; for the plain GEMMs and `linear`: F.linear, i.e. cuBLAS)
  compile  torch.compile(reference, mode="default", dynamic=False), compiled afresh for the
           case and run twice before capture (compilation stays outside the graph)
  fused    the torch.ops.fuser op, or F.linear over the merged weight (none for plain GEMMs)
do_bench flushes the L2 before each replay, but inside one replay the inputs are read 20 times.
Inputs a step streams from HBM are therefore rotated: GEMM weights and the K/V caches come in
ceil(200 MB / their bytes) distinct copies and call i reads copy i % copies (o_proj 6, qkv 4,
down 2, gate_up and lm_head 1; attention 47 at ctx 1024, 6 at 8192). The small ops' inputs
(< 1 MB) and q are not rotated: in a step they were just written by the previous kernel, so
reading them from L2 is realistic. If a capture fails (an op that syncs with the host, a
compiled function that recompiles), that way is timed by plain do_bench instead: its method is
"eager-launch" in the JSON (`*_timing`, with the reason in `timing_notes`) and its time carries
a `~` in the table (host overhead included; speedups against it are not like for like).

The fused output is checked once against eager: ||out - ref|| / ||ref|| in fp32, flagged above
2e-2. Bytes are the least the op must move (each input read once, each output written once;
attention: K and V of the ctx + T visible slots, q and out; GEMMs: the weight and the
activations), as GB/s and as a percentage of this GPU's read bandwidth (a sum over 2 GiB of
bf16, measured first). Plain GEMMs have no fused op: their GB/s is eager F.linear's.

A failing stage (setup, eager, fused, compile, check) is recorded in the row and the run goes
on (so is a missing torch.ops.fuser.linear: its rows fail at setup). Progress prints as it runs;
the table comes last, then one summary line. Results (env and rows) go to --out after every
case. Exit status: 0; 1 if any stage failed or an error was flagged; 2 without CUDA (unless
--dry-run, which runs on CPU, where the ops run their reference, untimed, over 2 copies).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.attention import cache_attention_reference
from fuser.ops.gated_act import gated_act_reference
from fuser.ops.rmsnorm import add_rms_norm_reference, rms_norm_reference
from fuser.ops.rope import rotary_cache_write_reference, rotary_reference
from timing import (CALLS, EAGER_LAUNCH, ROTATE_BYTES, Timing, copies_for,  # benchmarks/
                    log, measure_read_bandwidth, missing_gpu, time_us)

try:  # the decode GEMV is new: without it, ops.py still runs and records its rows as failed
    import fuser.ops.linear  # noqa: F401  (registers torch.ops.fuser.linear)
    LINEAR_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001
    LINEAR_IMPORT_ERROR = f"{type(e).__name__}: {e}"

DTYPE = torch.bfloat16
EPS = 1e-5
TOLERANCE = 2e-2  # relative error over the tensor, bf16
EXTRA_SLOTS = 16  # cache slots past the context: S = ctx + 16

RESULTS: dict = {}


@dataclass(frozen=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]


LLAMA_3_8B = Shapes(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                    vocab=128256, tokens=(1, 5, 9), contexts=(1024, 8192))
TINY = Shapes(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000,
              tokens=(1, 5, 9), contexts=(64,))


@dataclass
class Problem:
    """One case, built on its device: the tensors and the three ways to compute it."""
    args: tuple[Tensor, ...]
    reference: Callable[..., Any]               # eager PyTorch subgraph; also what compile gets
    fused: Callable[..., Any] | None            # fused op or merged GEMM; None: plain GEMM
    nbytes: int                                 # least bytes moved: inputs once, outputs once
    as_fused: Callable[[Any], Any] = lambda out: out  # reference output in the fused layout
    # Inputs a step streams from HBM (weights, K/V caches): `fresh` builds another args tuple
    # with distinct copies of them (`rotated` bytes per copy); timing cycles through copies.
    fresh: Callable[[], tuple[Tensor, ...]] | None = None
    rotated: int = 0


@dataclass
class Spec:
    op: str
    case: str
    make: Callable[[str], Problem]              # device -> Problem


@dataclass
class Row:
    op: str
    case: str
    nbytes: int | None = None
    eager_us: float | None = None
    compile_us: float | None = None
    fused_us: float | None = None
    compile_seconds: float | None = None
    rel_err: float | None = None                # fused vs eager
    compile_rel_err: float | None = None        # compiled vs eager
    flagged: bool = False
    gbps: float | None = None
    pct_bw: float | None = None
    gbps_of: str | None = None                  # "fused", or "eager" for plain GEMMs
    eager_timing: str | None = None             # "cuda-graph" or "eager-launch" (None: dry run)
    compile_timing: str | None = None
    fused_timing: str | None = None
    copies: int = 1                             # distinct copies of the rotated inputs
    calls_per_graph: int | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    seconds: float | None = None
    errors: dict[str, str] = field(default_factory=dict)
    tracebacks: dict[str, str] = field(default_factory=dict)
    timing_notes: dict[str, str] = field(default_factory=dict)  # why a capture failed


def save(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2)


def nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def randn(*shape: int, device: str) -> Tensor:
    return torch.randn(*shape, device=device, dtype=DTYPE)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def make_rms_norm(s: Shapes, T: int, device: str) -> Problem:
    x, w = randn(1, T, s.hidden, device=device), randn(s.hidden, device=device)
    return Problem((x, w), lambda x, w: rms_norm_reference(x, w, EPS),
                   lambda x, w: torch.ops.fuser.rms_norm(x, w, EPS),
                   nbytes(x, w) + nbytes(x))  # out like x


def make_add_rms_norm(s: Shapes, T: int, device: str) -> Problem:
    x, r = randn(1, T, s.hidden, device=device), randn(1, T, s.hidden, device=device)
    w = randn(s.hidden, device=device)
    return Problem((x, r, w), lambda x, r, w: add_rms_norm_reference(x, r, w, EPS),
                   lambda x, r, w: torch.ops.fuser.add_rms_norm(x, r, w, EPS),
                   nbytes(x, r, w) + 2 * nbytes(x))  # out and summed like x


def make_rotary(s: Shapes, T: int, device: str) -> Problem:
    # q and k as the step has them: head-split column slices of the merged qkv output,
    # transposed to [B, heads, T, D] (strided views, not copies).
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = randn(1, T, q_width + 2 * kv_width, device=device)
    q = qkv[..., :q_width].unflatten(-1, (s.heads, s.head_dim)).transpose(1, 2)
    k = qkv[..., q_width:q_width + kv_width].unflatten(-1, (s.kv_heads, s.head_dim)).transpose(1, 2)
    angles = torch.rand(1, T, s.head_dim, device=device) * (2 * math.pi)
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    return Problem((q, k, cos, sin), rotary_reference,
                   lambda q, k, cos, sin: torch.ops.fuser.rotary(q, k, cos, sin),
                   2 * nbytes(q, k) + nbytes(cos, sin))  # q_rot, k_rot like q, k


def make_rotary_cache(s: Shapes, T: int, device: str) -> Problem:
    # rotary with the step's KV-cache write (passes/rotary_cache.py): q, k, v as make_rotary's
    # views of one qkv output; the old path is rotary and two index_put_ into the caches
    # ([1, S, kv_heads, D], S = the largest context + 16; only the T new slots are touched, so
    # the caches are not streamed and not rotated). Compared: the returned rope(q).
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = randn(1, T, q_width + 2 * kv_width, device=device)
    q, k, v = (part.unflatten(-1, (-1, s.head_dim)).transpose(1, 2)
               for part in qkv.split([q_width, kv_width, kv_width], dim=-1))
    angles = torch.rand(1, T, s.head_dim, device=device) * (2 * math.pi)
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    slots = max(s.contexts) + EXTRA_SLOTS
    k_cache = randn(1, slots, s.kv_heads, s.head_dim, device=device)
    v_cache = randn(1, slots, s.kv_heads, s.head_dim, device=device)
    seq_lens = torch.full((1,), max(s.contexts), dtype=torch.int64, device=device)
    return Problem((q, k, v, cos, sin, k_cache, v_cache, seq_lens), rotary_cache_write_reference,
                   lambda *args: torch.ops.fuser.rotary_cache_write(*args),
                   2 * nbytes(q, k, v) + nbytes(cos, sin))  # q_rot, k and v slots like q, k, v


def make_gated_act(s: Shapes, T: int, device: str) -> Problem:
    gate_up = randn(1, T, 2 * s.intermediate, device=device)
    return Problem((gate_up,), lambda g: gated_act_reference(g, "silu"),
                   lambda g: torch.ops.fuser.gated_act(g, "silu"),
                   nbytes(gate_up) * 3 // 2)  # read 2I, write I


def make_attention(s: Shapes, T: int, ctx: int, device: str) -> Problem:
    slots = ctx + EXTRA_SLOTS
    q = randn(1, s.heads, T, s.head_dim, device=device)
    k_cache = randn(1, slots, s.kv_heads, s.head_dim, device=device)
    v_cache = randn(1, slots, s.kv_heads, s.head_dim, device=device)
    seq_lens = torch.full((1,), ctx, dtype=torch.int64, device=device)
    starts = torch.zeros(1, dtype=torch.int64, device=device)
    scale = s.head_dim ** -0.5
    visible_kv = 2 * (ctx + T) * s.kv_heads * s.head_dim * k_cache.element_size()
    return Problem(
        (q, k_cache, v_cache, seq_lens, starts),
        lambda q, k, v, lens, starts: cache_attention_reference(
            q, k, v, lens, starts, scale, 0, 0.0),
        lambda q, k, v, lens, starts: torch.ops.fuser.cache_attention_read(
            q, k, v, lens, starts, scale, 0, 0.0),
        visible_kv + 2 * nbytes(q),  # out [B, T, H, D] like q
        fresh=lambda: (q, k_cache.clone(), v_cache.clone(), seq_lens, starts),
        rotated=nbytes(k_cache, v_cache))


def separate_linears(x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
    return tuple(F.linear(x, w) for w in weights)


def make_merged(rows: tuple[int, ...], s: Shapes, T: int, device: str) -> Problem:
    """Sibling projections of x: separate F.linear per weight vs one over their concatenation.

    The separate weights are row slices of the merged one, as passes/projections.py leaves them.
    """
    x = randn(1, T, s.hidden, device=device)
    merged = randn(sum(rows), s.hidden, device=device)
    parts = merged.split(rows)

    def fresh() -> tuple[Tensor, ...]:
        copy = merged.clone()
        return (x, copy, *copy.split(rows))

    return Problem((x, merged, *parts),
                   lambda x, merged, *parts: separate_linears(x, *parts),
                   lambda x, merged, *parts: F.linear(x, merged),
                   nbytes(x, merged) + T * sum(rows) * x.element_size(),
                   as_fused=lambda outs: torch.cat(outs, dim=-1),
                   fresh=fresh, rotated=nbytes(merged))


def make_linear(out_features: int, in_features: int, T: int, device: str) -> Problem:
    x, w = randn(1, T, in_features, device=device), randn(out_features, in_features, device=device)
    return Problem((x, w), F.linear, None, nbytes(x, w) + T * out_features * x.element_size(),
                   fresh=lambda: (x, w.clone()), rotated=nbytes(w))


def make_fused_linear(out_features: int, in_features: int, T: int, device: str) -> Problem:
    """fuser's decode GEMV (torch.ops.fuser.linear) against F.linear (cuBLAS)."""
    if not hasattr(torch.ops.fuser, "linear"):
        raise RuntimeError("torch.ops.fuser.linear is not registered (fuser/ops/linear.py: "
                           f"{LINEAR_IMPORT_ERROR or 'imported, but no op'})")
    p = make_linear(out_features, in_features, T, device)
    p.fused = lambda x, w: torch.ops.fuser.linear(x, w)
    return p


def make_gated_linear(s: Shapes, T: int, device: str) -> Problem:
    """fuser's gated decode GEMV (torch.ops.fuser.gated_linear: gate/up GEMV and SwiGLU in one
    kernel) against F.linear (cuBLAS) over the merged weight, then act(gate) * up."""
    if not hasattr(torch.ops.fuser, "gated_linear"):
        raise RuntimeError("torch.ops.fuser.gated_linear is not registered (fuser/ops/linear.py: "
                           f"{LINEAR_IMPORT_ERROR or 'imported, but no op'})")
    x = randn(1, T, s.hidden, device=device)
    w = randn(2 * s.intermediate, s.hidden, device=device)   # gate rows, then up rows
    return Problem((x, w), lambda x, w: gated_act_reference(F.linear(x, w), "silu"),
                   lambda x, w: torch.ops.fuser.gated_linear(x, w, "silu"),
                   nbytes(x, w) + T * s.intermediate * x.element_size(),  # writes [T, I] only
                   fresh=lambda: (x, w.clone()), rotated=nbytes(w))


def linear_shapes(s: Shapes) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of the decode GEMMs, merged where the passes merge them."""
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv": (q_width + 2 * kv_width, s.hidden), "o_proj": (s.hidden, q_width),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate),
            "lm_head": (s.vocab, s.hidden)}


def specs(s: Shapes, only: list[str] | None) -> list[Spec]:
    qkv_rows = (s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim)
    per_token: dict[str, Callable[..., Problem] | None] = {
        "rms_norm": functools.partial(make_rms_norm, s),
        "add_rms_norm": functools.partial(make_add_rms_norm, s),
        "rotary": functools.partial(make_rotary, s),
        "rotary_cache": functools.partial(make_rotary_cache, s),
        "gated_act": functools.partial(make_gated_act, s),
        "attention": functools.partial(make_attention, s),
        "qkv_proj": functools.partial(make_merged, qkv_rows, s),
        "gate_up_proj": functools.partial(make_merged, (s.intermediate, s.intermediate), s),
        "o_proj": functools.partial(make_linear, s.hidden, s.heads * s.head_dim),
        "down_proj": functools.partial(make_linear, s.hidden, s.intermediate),
        "lm_head": functools.partial(make_linear, s.vocab, s.hidden),
        "linear": None,  # five shapes per T: linear_shapes
        "gated_linear": functools.partial(make_gated_linear, s),
    }
    out = []
    for op, make in per_token.items():
        if only and op not in only:
            continue
        for T in s.tokens:
            if op == "attention":
                out += [Spec(op, f"ctx={ctx} T={T}", functools.partial(make, T, ctx))
                        for ctx in s.contexts]
            elif op == "linear":
                out += [Spec(op, f"{name} T={T}", functools.partial(make_fused_linear, n, k, T))
                        for name, (n, k) in linear_shapes(s).items()]
            else:
                out.append(Spec(op, f"T={T}", functools.partial(make, T)))
    return out


OPS = ("rms_norm", "add_rms_norm", "rotary", "rotary_cache", "gated_act", "attention",
       "qkv_proj", "gate_up_proj", "o_proj", "down_proj", "lm_head", "linear", "gated_linear")


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


Timer = Callable[[list[Callable[[], Any]]], "Timing | None"]  # one callable per input copy


def gpu_timer(fns: list[Callable[[], Any]]) -> Timing:
    """CUDA-graph replay of CALLS calls cycling through the copies (timing.time_us)."""
    return time_us(fns, CALLS)


def run_once(fns: list[Callable[[], Any]]) -> None:
    """The dry run's stand-in for a timer: call once on each input copy, no time."""
    for fn in fns:
        fn()


def flat(out: Any) -> list[Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def rel_err(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in fp32 over all outputs, which must match in shape."""
    got, want = flat(out), flat(ref)
    shapes = [tuple(t.shape) for t in got], [tuple(t.shape) for t in want]
    if shapes[0] != shapes[1]:
        raise ValueError(f"output shapes {shapes[0]} != reference {shapes[1]}")
    a = torch.cat([t.float().reshape(-1) for t in got])
    b = torch.cat([t.float().reshape(-1) for t in want])
    return float((a - b).norm() / b.norm())


def attempt(row: Row, stage: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with the error recorded in the row under `stage`."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- one failing op must not end the run
        row.errors[stage] = f"{type(e).__name__}: {e}"[:500]
        row.tracebacks[stage] = traceback.format_exc()[-3000:]
        return None


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_and_run(row: Row, p: Problem, compile_fn: Callable[[Callable], Callable]) -> Callable:
    """Compile the reference afresh for this case and run it (the compile), then once more."""
    torch._dynamo.reset()  # no graphs of earlier cases piling up on the same code objects
    compiled = compile_fn(p.reference)
    start = time.perf_counter()
    compiled(*p.args)
    synchronize()
    row.compile_seconds = time.perf_counter() - start
    compiled(*p.args)
    return compiled


def record(row: Row, stage: str, timing: Timing | None) -> float | None:
    """The time of a Timing, its method and any note stored in the row (dry run: None)."""
    if timing is None:
        return None
    setattr(row, f"{stage}_timing", timing.method)
    row.calls_per_graph = max(row.calls_per_graph or 0, timing.calls)
    if timing.note:
        row.timing_notes[stage] = timing.note
    return timing.us


def run_case(spec: Spec, device: str, timer: Timer,
             compile_fn: Callable[[Callable], Callable] | None, bandwidth: float,
             rotate: bool = True) -> Row:
    row = Row(spec.op, spec.case)
    start = time.perf_counter()
    p: Problem | None = attempt(row, "setup", lambda: spec.make(device))
    if p is None:
        return row
    row.nbytes = p.nbytes
    args = p.args
    arg_sets = [args]
    if p.fresh is not None:  # weights / caches in copies that exceed the L2 (dry run: 2)
        copies = copies_for(p.rotated) if rotate else 2
        more = attempt(row, "setup", lambda: [p.fresh() for _ in range(copies - 1)])
        if more is None:
            return row
        arg_sets += more
    row.copies = len(arg_sets)

    def timed(stage: str, fn: Callable[..., Any]) -> float | None:
        """Time fn over the input copies (call i takes copy i % copies); errors to the row."""
        calls = [functools.partial(fn, *a) for a in arg_sets]
        return attempt(row, stage, lambda: record(row, stage, timer(calls)))

    ref = attempt(row, "eager", lambda: p.reference(*args))
    if ref is not None:
        row.eager_us = timed("eager", p.reference)

    if p.fused is not None:
        out = attempt(row, "fused", lambda: p.fused(*args))
        if out is not None:
            if ref is not None:
                row.rel_err = attempt(row, "check", lambda: rel_err(out, p.as_fused(ref)))
                row.flagged = row.rel_err is not None and not row.rel_err <= TOLERANCE
            del out
            row.fused_us = timed("fused", p.fused)

    if compile_fn is not None:
        compiled = attempt(row, "compile", lambda: compile_and_run(row, p, compile_fn))
        if compiled is not None:
            if ref is not None:
                row.compile_rel_err = attempt(row, "check", lambda: rel_err(compiled(*args), ref))
            row.compile_us = timed("compile", compiled)
        torch._dynamo.reset()  # drop the compiled graph (and what it holds) before the next case

    derive(row, bandwidth)
    row.seconds = time.perf_counter() - start
    return row


def valid(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def derive(row: Row, bandwidth: float) -> None:
    """GB/s and % of bandwidth of the fused op (eager for plain GEMMs); speedups of fused.

    The `linear` family's fused op is fuser's GEMV; its eager is cuBLAS."""
    row.gbps_of = "eager" if row.op in ("o_proj", "down_proj", "lm_head") else "fused"
    us = row.eager_us if row.gbps_of == "eager" else row.fused_us
    if valid(us) and row.nbytes:
        row.gbps = row.nbytes / (us * 1e-6) / 1e9
        if valid(bandwidth):
            row.pct_bw = 100 * row.gbps * 1e9 / bandwidth
    if valid(row.fused_us):
        if valid(row.eager_us):
            row.speedup_vs_eager = row.eager_us / row.fused_us
        if valid(row.compile_us):
            row.speedup_vs_compile = row.compile_us / row.fused_us


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def num(v: float | None, fmt: str, error: bool = False) -> str:
    if error:
        return "ERR"
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def launch_mark(row: Row, stage: str) -> str:
    """'~' after a time that was taken by eager launch (the capture failed), else ''."""
    return "~" if getattr(row, f"{stage}_timing") == EAGER_LAUNCH else ""


def progress(i: int, n: int, row: Row) -> str:
    parts = [f"eager {num(row.eager_us, '.1f')}{launch_mark(row, 'eager')} us"]
    if row.compile_seconds is not None:
        parts.append(f"compile {num(row.compile_us, '.1f')}{launch_mark(row, 'compile')} us "
                     f"(compiled in {row.compile_seconds:.1f} s)")
    if row.gbps_of != "eager":
        parts.append(f"fused {num(row.fused_us, '.1f')}{launch_mark(row, 'fused')} us")
    if row.gbps is not None:
        parts.append(f"{row.gbps:.0f} GB/s ({row.gbps_of})")
    if row.rel_err is not None:
        parts.append(f"rel err {row.rel_err:.1e}{' OVER ' + str(TOLERANCE) if row.flagged else ''}")
    if row.copies > 1:
        parts.append(f"{row.copies} input copies")
    errors = "".join(f" ERROR[{k}] {v.splitlines()[0][:200]}" for k, v in row.errors.items())
    errors += "".join(f" NOT CAPTURED[{k}] {v[:200]}" for k, v in row.timing_notes.items())
    took = f" ({row.seconds or 0:.1f} s)"
    return f"[{i:>2}/{n}] {row.op} {row.case}: " + ", ".join(parts) + took + errors


HEADER = (f"{'op':<13}{'case':<14}{'eager us':>10}{'compile us':>11}{'fused us':>10}"
          f"{'fused GB/s':>11}{'% of bw':>9}{'x eager':>9}{'x compile':>10}{'rel err':>10}")


def table_line(row: Row) -> str:
    e = row.errors
    mark = "*" if row.gbps_of == "eager" and row.gbps is not None else ""
    err = "-" if row.rel_err is None else f"{row.rel_err:.1e}" + ("!" if row.flagged else "")
    if "check" in e:
        err = "ERR"

    def time_cell(stage: str, us: float | None, error: bool) -> str:
        return num(us, ".1f", error) + launch_mark(row, stage)

    return (f"{row.op:<13}{row.case:<14}"
            f"{time_cell('eager', row.eager_us, 'eager' in e or 'setup' in e):>10}"
            f"{time_cell('compile', row.compile_us, 'compile' in e):>11}"
            f"{time_cell('fused', row.fused_us, 'fused' in e):>10}"
            f"{num(row.gbps, '.0f') + mark:>11}"
            f"{num(row.pct_bw, '.1f') + mark:>9}"
            f"{num(row.speedup_vs_eager, '.2f'):>9}"
            f"{num(row.speedup_vs_compile, '.2f'):>10}"
            f"{err:>10}")


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def summary(rows: list[Row], bandwidth: float, seconds: float, dry_run: bool) -> str:
    failed = [r for r in rows if r.errors]
    flagged = [r for r in rows if r.flagged]
    errs = [r.rel_err for r in rows if r.rel_err is not None]
    worst = f"{max(errs):.1e}" if errs else "-"
    head = (f"{len(rows)} cases, {len(failed)} with errors, {len(flagged)} over rel err "
            f"{TOLERANCE} (worst {worst})")
    if dry_run:
        return f"dry run on CPU, tiny shapes, no timing: {head}; {seconds:.0f} s"
    vs_eager = geomean([r.speedup_vs_eager for r in rows if r.speedup_vs_eager])
    vs_compile = geomean([r.speedup_vs_compile for r in rows if r.speedup_vs_compile])
    launched = sum(bool(r.timing_notes) for r in rows)
    return (f"{head}; fused geomean {num(vs_eager, '.2f')}x vs eager, "
            f"{num(vs_compile, '.2f')}x vs compile; read bandwidth {bandwidth / 1e12:.2f} TB/s; "
            f"{launched} rows with an eager-launch time (~); {seconds:.0f} s")


def footnote(rows: list[Row]) -> str:
    groups: dict[str, int] = {}  # op and case less T -> copies (the same for every T)
    for r in rows:
        if r.copies > 1:
            name = " ".join([r.op] + [w for w in r.case.split() if not w.startswith("T=")])
            groups[name] = r.copies
    copies = ", ".join(f"{name} x{n}" for name, n in groups.items())
    return (f"us per call by CUDA-graph replay of {CALLS} back-to-back calls (do_bench median, L2 "
            f"flushed per replay); ~ = not capturable, timed by eager launch (host overhead "
            f"included); * = eager F.linear (plain GEMM). Inputs rotated over copies "
            f"(>= {ROTATE_BYTES / 1e6:.0f} MB): {copies or 'none'}")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for env and rows")
    parser.add_argument("--only", nargs="+", choices=OPS, metavar="NAME",
                        help=f"only these ops: {', '.join(OPS)}")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, every case once against the reference, no timing")
    args = parser.parse_args(argv)
    if missing_gpu("ops.py", args.dry_run):
        return 2
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    shapes = TINY if args.dry_run else LLAMA_3_8B
    RESULTS["env"] = {"gpu": None if args.dry_run else torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "command": " ".join(sys.argv), "dry_run": args.dry_run,
                      "shapes": asdict(shapes), "dtype": str(DTYPE), "tolerance": TOLERANCE,
                      "timing": None if args.dry_run else {
                          "method": "cuda-graph replay, per call", "calls_per_graph": CALLS,
                          "do_bench": "median, warmup 25 ms, rep 100 ms, L2 flushed per replay",
                          "rotate_bytes": ROTATE_BYTES, "fallback": EAGER_LAUNCH}}
    bandwidth = math.nan
    if not args.dry_run:
        try:
            bandwidth = measure_read_bandwidth()
            log(f"HBM read bandwidth: {bandwidth / 1e12:.2f} TB/s")
        except Exception as e:  # noqa: BLE001 -- times are still worth having without it
            log(f"HBM read bandwidth: ERROR {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    RESULTS["bandwidth_TBps"] = bandwidth / 1e12 if math.isfinite(bandwidth) else None
    for name in ("recompile_limit", "cache_size_limit"):  # one graph per case; be generous
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    timer: Timer = run_once if args.dry_run else gpu_timer
    compile_fn: Callable[[Callable], Callable] | None = None
    if not args.no_compile:
        # The dry run checks the plumbing, not Inductor on CPU (slow): compile is the identity.
        compile_fn = (lambda fn: fn) if args.dry_run else (
            lambda fn: torch.compile(fn, mode="default", dynamic=False))

    torch.manual_seed(0)
    todo = specs(shapes, args.only)
    rows: list[Row] = []
    RESULTS["rows"] = []
    for i, spec in enumerate(todo, 1):
        row = run_case(spec, device, timer, compile_fn, bandwidth, rotate=not args.dry_run)
        rows.append(row)
        RESULTS["rows"].append(asdict(row))
        log(progress(i, len(todo), row))
        save(args.out)
    seconds = time.perf_counter() - started
    RESULTS["seconds"] = seconds
    save(args.out)

    log("\n" + HEADER)
    for row in rows:
        log(table_line(row))
    if not args.dry_run:
        log(footnote(rows))
    log(summary(rows, bandwidth, seconds, args.dry_run))
    return 1 if any(r.errors or r.flagged for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
