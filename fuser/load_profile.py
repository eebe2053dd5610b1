"""Where a load's first run and capture spend their time: per step, per graph, per kind of
kernel work.

`fuser.load` runs every step once (the kernels load on their first launch: now, not in the
first request) and then captures batch bucket 1's iteration graphs. Both take seconds on an 8B
engine; this module says which step or graph took them, and what part of that was loading code
rather than running it:

- `StepTimes`: each step's first run timed between two device synchronizations; with `again`,
  a second run of it too (the launch and the work alone: the first run's excess over it is
  code loading and other first-call work).
- `KernelWork`: while active, what Triton and Inductor did to bring kernels in (Triton's cache
  lookups and compilations, kernel modules loaded onto the GPU, Inductor's precompilation and
  autotuning benchmarks), counted and timed through Triton's hooks and around Inductor's
  methods. A load that finds every binary compiles nothing and benchmarks nothing; this is
  what shows it.
- `python_profile`: the functions a stretch of the load (the compiled steps' code load) spent
  its seconds in, from cProfile: where that time goes when no kernel work explains it
  (FUSER_LOAD_PROFILE=python, `python_enabled()`). The code load then runs alone before the
  weights' reading rather than beside it: from Python 3.12 cProfile hears every thread, and
  an 8B load profiled beside its 16 reading threads credited 228 s to one function in a
  25 s code load (benchmarks/RESULTS.md).

Per-step and per-graph seconds are kept always; `FUSER_LOAD_PROFILE=1` adds the second runs
and the kernel work (`enabled()`), which benchmarks/engine_files.py asks for in its loading
process.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

ENV = "FUSER_LOAD_PROFILE"
CALLERS_OF = 3  # python_profile: the callers of the 3 slowest functions by own time, 3 each


def enabled() -> bool:
    """Whether the load profiles in detail (FUSER_LOAD_PROFILE=1, or =python)."""
    return os.environ.get(ENV, "") not in ("", "0")


def python_enabled() -> bool:
    """Whether the load also profiles its code load's Python (FUSER_LOAD_PROFILE=python:
    cProfile slows that thread, so the load's seconds are then not its own)."""
    return os.environ.get(ENV, "") == "python"


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s current stream (nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class StepTimes:
    """Seconds of each named run `__call__` is given, the device synchronized around it;
    with `again`, a second run's too."""

    def __init__(self, device: torch.device, again: bool = False) -> None:
        self.device = device
        self.again = again
        self.first: dict[str, float] = {}
        self.second: dict[str, float] = {}

    def __call__(self, name: str, run: Callable[[], object]) -> None:
        synchronize(self.device)
        start = time.perf_counter()
        run()
        synchronize(self.device)
        self.first[name] = self.first.get(name, 0.0) + time.perf_counter() - start
        if self.again:
            start = time.perf_counter()
            run()
            synchronize(self.device)
            self.second[name] = self.second.get(name, 0.0) + time.perf_counter() - start

    def line(self, title: str, top: int = 12) -> str:
        """`title`: the slowest `top` runs, "name 1.23 s (again 0.012 s)", and the rest summed."""
        ranked = sorted(self.first.items(), key=lambda item: -item[1])
        parts = []
        for name, seconds in ranked[:top]:
            again = f" (again {self.second[name]:.3f} s)" if name in self.second else ""
            parts.append(f"{name} {seconds:.2f} s{again}")
        if len(ranked) > top:
            rest = ranked[top:]
            parts.append(f"{len(rest)} more {sum(s for _, s in rest):.2f} s")
        total = sum(self.first.values())
        again = (f"; run again: {sum(self.second.values()):.2f} s in all" if self.second
                 else "")
        return f"{title} {total:.1f} s: " + ", ".join(parts) + again


class KernelWork:
    """Kernel work done on any thread while entered: counts and seconds per kind.

    Kinds: "triton lookups" (a kernel found in Triton's cache), "triton compiles" (one that was
    not), "modules loaded" (a Triton kernel's binary loaded onto the GPU), "inductor
    precompiles" (an Inductor kernel's launchers made, its binaries loaded) and "autotuning
    benchmarks" (an Inductor kernel's configurations timed: none where the engine's tuning
    choices were put back). Hooks that this Triton or torch lacks are skipped."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self._loading: dict[int, float] = {}

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.seconds[kind] += seconds

    def __enter__(self) -> KernelWork:
        self._stack.__enter__()
        for install in (self._triton_hooks, self._inductor_methods):
            try:
                self._stack.enter_context(install())
            except (ImportError, AttributeError):  # pragma: no cover - another version
                continue
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)

    @contextlib.contextmanager
    def _triton_hooks(self) -> Iterator[None]:
        from triton import knobs

        previous = knobs.compilation.listener

        def listen(*, src: Any, metadata: dict, metadata_group: dict, times: Any,
                   cache_hit: bool) -> None:
            micros = times.ir_initialization + sum(d for _, d in times.lowering_stages) \
                + times.store_results
            self.add("triton lookups" if cache_hit else "triton compiles", micros * 1e-6)
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group,
                         times=times, cache_hit=cache_hit)

        def load_start(*args: object) -> None:
            self._loading[threading.get_ident()] = time.perf_counter()

        def load_end(*args: object) -> None:
            begun = self._loading.pop(threading.get_ident(), None)
            if begun is not None:
                self.add("modules loaded", time.perf_counter() - begun)

        starts, ends = knobs.runtime.kernel_load_start_hook, knobs.runtime.kernel_load_end_hook
        if not (hasattr(starts, "add") and hasattr(ends, "add")):
            raise AttributeError("this Triton's kernel load hooks are not chains")
        knobs.compilation.listener = listen
        starts.add(load_start)
        ends.add(load_end)
        try:
            yield
        finally:
            knobs.compilation.listener = previous
            starts.remove(load_start)
            ends.remove(load_end)

    @contextlib.contextmanager
    def _inductor_methods(self) -> Iterator[None]:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        timed = {"precompile": "inductor precompiles",
                 "benchmark_all_configs": "autotuning benchmarks"}
        originals = {name: getattr(CachingAutotuner, name) for name in timed}

        def timing(name: str) -> Callable[..., Any]:
            original = originals[name]

            def method(tuner: Any, *args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(tuner, *args, **kwargs)
                finally:
                    self.add(timed[name], time.perf_counter() - start)
            return method

        for name in timed:
            setattr(CachingAutotuner, name, timing(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(CachingAutotuner, name, original)

    def line(self) -> str:
        """"triton lookups 120 in 0.41 s, modules loaded 300 in 1.20 s, ..." (kinds seen)."""
        if not self.counts:
            return "no kernel work"
        return ", ".join(f"{kind} {self.counts[kind]} in {self.seconds[kind]:.2f} s"
                         for kind in sorted(self.counts))


@contextlib.contextmanager
def kernel_work(device: torch.device, on: bool | None = None) -> Iterator[KernelWork | None]:
    """A `KernelWork` entered where `on` (default: `enabled()`) and `device` is CUDA; else
    None."""
    if device.type != "cuda" or not (enabled() if on is None else on):
        yield None
        return
    with KernelWork() as work:
        yield work


# Python source compiled while a profile runs, on any thread (the "compile" audit event):
# [(filename, bytes)], or None while none runs. An audit hook stays for the process's life,
# so one is added at the first profile and does nothing outside them.
_compiled: list[tuple[str, int]] | None = None
_hooked = False


def _on_audit(event: str, args: tuple) -> None:
    if event == "compile" and _compiled is not None and len(args) >= 2:
        source, filename = args[0], args[1]
        _compiled.append((str(filename), len(source) if source is not None else 0))


def _where(filename: str) -> str:
    """The package or folder a compiled file belongs to, for `compiled_line`: the part after
    site-packages (or dist-packages) up to the top package, else the file's folder."""
    parts = filename.replace(os.sep, "/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1]
    return os.path.dirname(filename) or filename


def compiled_line(compiled: list[tuple[str, int]], top: int = 5) -> str:
    """"compiled from source: N files (M MB); by where: ..." of `compiled` ((filename, bytes)
    each, as the audit hook saw them)."""
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for filename, size in compiled:
        entry = by[_where(filename)]
        entry[0] += 1
        entry[1] += size
    ranked = sorted(by.items(), key=lambda item: item[1][1], reverse=True)[:top]
    total = sum(size for _, size in compiled)
    return (f"compiled from source: {len(compiled)} files ({total / 1e6:.1f} MB); by where: "
            + ", ".join(f"{where} {n} ({size / 1e6:.1f} MB)" for where, (n, size) in ranked))


@contextlib.contextmanager
def python_profile(on: bool, top: int = 10) -> Iterator[list[str]]:
    """Within, with `on`: cProfile on the calling thread; the list yielded then gets one line:
    the `top` functions by cumulative seconds (the import machinery and module bodies left
    out: imports show as the function that made them, `import_inductor` and the like), then
    the `top` by their own seconds, each as "file:line(function) seconds", then the callers
    of the CALLERS_OF slowest by own seconds (the seconds of it each call site spent), then the
    Python source compiled meanwhile on any thread (`compiled_line`: `builtins.compile` is
    where a code load's own time went on CUDA, recorded in benchmarks/RESULTS.md). Off:
    nothing is profiled, the list stays empty."""
    global _compiled, _hooked
    lines: list[str] = []
    if not on:
        yield lines
        return
    if not _hooked:
        sys.addaudithook(_on_audit)
        _hooked = True
    compiled: list[tuple[str, int]] = []
    _compiled = compiled
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield lines
    finally:
        profiler.disable()
        _compiled = None
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        skip = ("<frozen", "<module>", "__import__", "import_module", "builtins.exec",
                "{method 'disable'")
        files = (contextlib.__file__, __file__)  # the profiled stretch's own frames
        rows = [(tt, ct, key) for key, (_, _, tt, ct, _) in stats.items()
                if key[0] not in files and not any(m in f"{key[0]}{key[2]}" for m in skip)]

        def name(key: tuple[str, int, str]) -> str:
            return f"{os.path.basename(key[0])}:{key[1]}({key[2]})"

        by_total = sorted(rows, key=lambda r: r[1], reverse=True)[:top]
        by_own = sorted(rows, reverse=True)[:top]
        callers = []
        for _, _, key in by_own[:CALLERS_OF]:  # where the slowest own time was called from
            of = sorted(((entry[2], caller) for caller, entry in stats[key][4].items()),
                        reverse=True)[:CALLERS_OF]
            if of:
                callers.append(f"{name(key)} from " + ", ".join(
                    f"{name(caller)} {tt:.2f} s" for tt, caller in of))
        lines.append("cumulative: " + ", ".join(f"{name(k)} {ct:.2f} s" for _, ct, k in by_total)
                     + "; own: " + ", ".join(f"{name(k)} {tt:.2f} s" for tt, _, k in by_own)
                     + ("; callers: " + "; ".join(callers) if callers else "")
                     + "; " + compiled_line(compiled))


__all__ = ["ENV", "KernelWork", "StepTimes", "compiled_line", "enabled", "kernel_work",
           "python_enabled", "python_profile", "synchronize"]
