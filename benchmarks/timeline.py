"""Where the device waited: a torch.profiler timeline of a stretch of serving, and its GPU's idle
gaps with what the host did meanwhile.

    from timeline import profiled
    with profiled(out_dir / "profile_on") as summary:   # -> profile_on.txt, .trace.json
        serve(...)
    log(summary["line"])      # GPU busy / span, idle gaps, the host's ops during them

A decoding loop that keeps the GPU fed shows no gaps between its steps; one whose host work
(lookups, copies, admission, a graph's launch) sits on the step's path shows them, and the ops
the host ran inside each gap say which work it was. The profiler records every thread (the
scheduler runs on its own) where this torch can; kernels, copies and memsets are the device's
events, `cpu_op` and `cuda_runtime` events the host's. Its own overhead (a CUPTI buffer request,
`overhead` events) is left out of the host's share.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "python_function", "user_annotation")
MIN_GAP_US = 20.0  # shorter idle spans are the launch queue's breathing, not a wait for the host


def device_gaps(events: list[dict[str, Any]], min_gap_us: float = MIN_GAP_US,
                top: int = 8) -> dict[str, Any]:
    """The device's idle time in a chrome trace's complete events (`ph` "X", `ts`/`dur` in
    microseconds): busy (the union of its events), span (first start to last end), the gaps
    of at least `min_gap_us` between them (count, total, the `top` longest with the device
    event that ended each), and the host's ops that overlapped the gaps, by name (microseconds
    of overlap, the `top` largest; nested ops each count)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in complete if e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    if not device:
        return {"busy_us": 0.0, "span_us": 0.0, "gaps": 0, "gap_us": 0.0, "longest": [],
                "host_in_gaps": []}
    gaps: list[tuple[float, float, str]] = []  # (start, length, the event after it)
    busy, end = 0.0, device[0]["ts"]
    for e in device:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start - end >= min_gap_us:
            gaps.append((end, start - end, e.get("name", "?")))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    host = sorted((e for e in complete if e.get("cat") in HOST_CATEGORIES),
                  key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    longest_host = max((e["dur"] for e in host), default=0.0)
    during: Counter = Counter()
    for start, length, _ in gaps:  # (the host ops that began at most `longest_host` before)
        stop = start + length
        for e in host[bisect.bisect_left(starts, start - longest_host):
                      bisect.bisect_left(starts, stop)]:
            overlap = min(stop, e["ts"] + e["dur"]) - max(start, e["ts"])
            if overlap > 0:
                during[e.get("name", "?")] += overlap
    return {"busy_us": busy, "span_us": end - device[0]["ts"], "gaps": len(gaps),
            "gap_us": sum(length for _, length, _ in gaps),
            "longest": [(round(length, 1), name[:60]) for _, length, name in
                        sorted(gaps, key=lambda g: -g[1])[:top]],
            "host_in_gaps": [(name[:60], round(us, 1)) for name, us in during.most_common(top)]}


def gaps_line(label: str, gaps: dict[str, Any]) -> str:
    """One line of `device_gaps`' figures, in milliseconds."""
    longest = ", ".join(f"{us / 1e3:.2f} ({name})" for us, name in gaps["longest"])
    host = ", ".join(f"{name} {us / 1e3:.2f}" for name, us in gaps["host_in_gaps"])
    return (f"{label}: device busy {gaps['busy_us'] / 1e3:.2f} of {gaps['span_us'] / 1e3:.2f} "
            f"ms; {gaps['gaps']} idle gaps >= {MIN_GAP_US:.0f} us, {gaps['gap_us'] / 1e3:.2f} "
            f"ms in all; longest (ms, before): {longest or '-'}; host ops in the gaps (ms): "
            f"{host or '-'}")


@contextlib.contextmanager
def profiled(stem: Path, rows: int = 30) -> Iterator[dict[str, Any]]:
    """torch.profiler over the block, every thread where this torch can (CPU, and CUDA where
    present). At exit: `<stem>.trace.json` (the timeline, chrome://tracing or Perfetto),
    `<stem>.txt` (the ops and kernels by self device time, then by self host time, `rows`
    each, and the gaps' line), and the yielded dict gets "gaps" (`device_gaps`) and "line"."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    try:  # (a scheduler's own thread runs the steps)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # a torch without it: the calling thread only
        config = None
    summary: dict[str, Any] = {}
    with profile(activities=activities, experimental_config=config) as prof:
        yield summary
    stem.parent.mkdir(parents=True, exist_ok=True)
    trace = stem.with_name(stem.name + ".trace.json")
    prof.export_chrome_trace(str(trace))
    gaps = device_gaps(json.loads(trace.read_text()).get("traceEvents", []))
    line = gaps_line(stem.name, gaps)
    events = prof.key_averages()
    device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    stem.with_name(stem.name + ".txt").write_text(
        line + "\n" + events.table(sort_by=device_sort, row_limit=rows) + "\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=rows))
    summary.update(gaps=gaps, line=line)
