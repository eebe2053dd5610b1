"""Where a decode step's GPU time goes: its kernels by group, and its GEMMs by shape.

    from breakdown import kernel_breakdown
    table = kernel_breakdown(step_fn, steps=20)

Profiles `step_fn` (an uncaptured step: the CUDA graph replays the same kernels without the
launch gaps) with torch.profiler and sums each kernel's device time per step. The group of a
kernel comes from its name: fuser's Triton kernels by their function names, cuBLAS GEMMs by
their library's naming, Inductor's generated kernels by what they fuse.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# (group, substrings of a kernel's name); the first group that matches wins.
KERNEL_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    # (_stream_kernel: fuser/ops/gemv_stream.py, bf16 one-row GEMVs on CUDA)
    ("GEMV: fuser::linear", ("_linear_kernel", "_stream_kernel")),
    # fuser/ops/e4m3_pieces.py: the several-row FP8 GEMVs' x as e4m3 pieces (FP8 verify)
    ("e4m3 pieces (norm, row split)", ("_norm_pieces_kernel", "_split_pieces_kernel")),
    # (_rotary_split_kernel: fuser::rotary_cache_attention, rotary and the KV-cache write inside)
    ("attention: fuser split-K", ("_split_kernel", "_rotary_split_kernel", "_combine_kernel")),
    ("rms_norm / add_rms_norm", ("_rms_norm_kernel",)),
    # fuser::rotary and fuser::rotary_cache_write (one kernel; the latter also writes k/v)
    ("rotary (+ KV cache write)", ("_rotary_kernel",)),
    ("gated activation", ("_gated_act_kernel",)),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce")),
    ("KV cache write", ("index_put", "scatter")),
    # Inductor's kernel building the step's rope cos/sin from positions (its name lists the
    # fused ops, "bmm" among them, so this group comes before attention's)
    ("rope cos/sin (Inductor)", ("_cos_", "_sin_")),
    ("attention: Inductor / ATen", ("softmax", "bmm", "amax", "exp", "where", "sdpa", "flash")),
]


HOST_ROWS = 12  # host-side (CPU) rows kept: the ops whose own CPU time is largest


def group_of(kernel: str) -> str:
    lower = kernel.lower()
    for group, needles in KERNEL_GROUPS:
        if any(n.lower() in lower for n in needles):
            return group
    return "other"


def kernel_breakdown(step_fn: Callable[[], object], steps: int = 20) -> dict:
    """{"groups": {group: us per step}, "kernels": {name: us per step}, "launches": per step,
    "gemms": {shape: us per step}, "ops": {fuser op and input shapes: us per step},
    "total_us": per step} from `steps` profiled calls."""
    for _ in range(5):
        step_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    launches = 0
    for event in prof.events():
        # "## Call CompiledFxGraph ... ##" is Inductor's annotation of a whole graph call on
        # the GPU timeline, not a kernel: counting it would count every kernel twice.
        if event.device_type == DeviceType.CUDA and not event.name.startswith("##"):
            kernels[event.name] += event.time_range.elapsed_us() / steps
            launches += 1
    groups: dict[str, float] = defaultdict(float)
    for name, us in kernels.items():
        groups[group_of(name)] += us
    gemms: dict[str, float] = {}
    ops: dict[str, float] = {}
    host = {avg.key: avg.self_cpu_time_total / steps for avg in prof.key_averages()}
    host = dict(sorted(host.items(), key=lambda kv: -kv[1])[:HOST_ROWS])
    for avg in prof.key_averages(group_by_input_shape=True):
        shapes = "x".join(str(s) for s in avg.input_shapes[:2])
        if avg.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm"):
            gemms[f"{avg.key} {shapes}"] = avg.self_device_time_total / steps
        elif avg.key.startswith("fuser::"):  # fuser's ops by shape: which GEMV is slow
            # the first two inputs and the largest one (an op's weight, where it reads one past
            # its first two inputs): ops whose first inputs agree but whose weights differ stay
            # apart, and rows that still share a key add up
            key = f"{avg.key} {shapes}{_largest_after(avg.input_shapes, 2)}"
            ops[key] = ops.get(key, 0.0) + avg.device_time_total / steps
    return {
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:40]),
        "launches": launches / steps,
        "gemms": dict(sorted(gemms.items(), key=lambda kv: -kv[1])),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "host": host,
        "total_us": sum(kernels.values()),
    }


def _largest_after(shapes: list, start: int) -> str:
    """" w[N, K]" for the input shape of most elements past the first `start`, when it has more
    elements than each of those; "" otherwise."""
    def numel(shape) -> int:
        n = 1
        for d in shape or [0]:
            n *= d
        return n

    first = max((numel(s) for s in shapes[:start]), default=0)
    rest = [s for s in shapes[start:] if isinstance(s, list) and s]
    if not rest:
        return ""
    big = max(rest, key=numel)
    return f" w{big}" if numel(big) > first else ""


def format_breakdown(table: dict, graph_ms: float | None = None, host: bool = False) -> str:
    """The groups as text lines, with the kernels' sum against the graph's replay time (and,
    with `host`, the ops that take the most CPU time: for a step run without a CUDA graph)."""
    total = table["total_us"]
    lines = [f"{'kernel group':<30}{'us/step':>10}{'share':>8}"]
    for group, us in table["groups"].items():
        lines.append(f"{group:<30}{us:>10.1f}{100 * us / total:>7.1f}%")
    lines.append(f"{'sum of kernel times':<30}{total:>10.1f}   ({table['launches']:.0f} kernels/step)")
    if graph_ms is not None:
        gap = graph_ms * 1e3 - total
        lines.append(f"{'graph replay (events)':<30}{graph_ms * 1e3:>10.1f}   gaps between kernels "
                     f"{gap:.1f} us ({gap / max(table['launches'], 1):.2f} us/kernel)")
    if table["gemms"]:
        lines.append("GEMMs by shape (us/step):")
        for shape, us in list(table["gemms"].items())[:8]:
            lines.append(f"  {shape:<60}{us:>10.1f}")
    if host and table.get("host"):
        lines.append("host: CPU time by op, own time (us/step):")
        for name, us in table["host"].items():
            lines.append(f"  {name[:60]:<60}{us:>10.1f}")
    if table.get("ops"):
        lines.append("fuser ops by shape (us/step, with the kernels they launch):")
        for shape, us in list(table["ops"].items())[:12]:
            lines.append(f"  {shape:<60}{us:>10.1f}")
    return "\n".join(lines)
