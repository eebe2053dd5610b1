"""Fixed-T steps compiled by Inductor without Dynamo, each into an artifact an engine file keeps.

A rewritten step graph is already ATen (torch.export captured it, the passes rewrote it), so it
goes to Inductor directly (`torch._inductor.standalone_compile`), every tensor it reads (weights
and KV cache alike) lifted to an input (`fuser.compile_cpu.lift_tensors`); the cache writes
become input mutations, done in place. Dynamo never traces it: `torch.compile` would trace the
whole graph again, at build and at every load (on the H200, most of a 56-80 s load of the 8B +
1B engine directory was Dynamo tracing the saved graphs before their compile-cache entries
could hit).

Each compile yields a `torch._inductor.CompiledArtifact`: the generated code (and on CUDA the
compiled Triton kernels) under its cache key. `fuser.engine_io` saves it beside the graph, and
`fuser.load` rebuilds the step from it with `CompiledStep.from_artifact`: no tracing, no code
generation, no cache-key computation over the graph; `compile_count()` stays 0.

Device differences:
- CPU: the fused ops' references are inlined (fuser/compile_inline.py: `INLINE_REFERENCES`, a
  post-grad pass) so that the C++ backend fuses them, and fused cache-write + attention ops
  are split back (`fuser.ops.CPU_SPLIT`).
- CUDA: the fused ops stay opaque calls of their Triton kernels; Inductor fuses what lies
  between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fuser.compile_cpu import config as cpu_config
from fuser.compile_cpu import lift_tensors, read_tensors

if TYPE_CHECKING:
    from torch._inductor import CompiledArtifact

Args = list[torch.Tensor]


def options(device: torch.device) -> dict:
    """Inductor options of a step compiled for `device` (`standalone_compile`'s `options`)."""
    return {"config_patches": dict(cpu_config())} if device.type == "cpu" else {}


def compile_graph(gm: torch.fx.GraphModule, args: Args, device: torch.device
                  ) -> CompiledArtifact:
    """Inductor over an ATen graph whose inputs are `args`, specialized to their shapes."""
    import inspect

    import torch._inductor

    extra = {}
    # torch >= 2.12 may take over the graph module instead of copying it (2.11 has no such
    # argument).
    if "donate_graph_module" in inspect.signature(torch._inductor.standalone_compile).parameters:
        extra["donate_graph_module"] = True
    return torch._inductor.standalone_compile(
        gm, args, dynamic_shapes="from_example_inputs", options=options(device), **extra)


class CompiledStep:
    """A rewritten fixed-T step compiled by Inductor on its first call:
    (tokens, positions, seq_lens, starts) -> logits [B, T, V], writing the KV cache in place.

    Shapes, dtypes and strides are those of the first call (Inductor checks them on every
    call); the tensors `gm` reads are bound now and must keep their addresses.
    `artifact` holds the compiled code once compiled (None before): what an engine file
    saves, and what `from_artifact` rebuilds the step from. `tuning` holds what Inductor's
    autotuning chose during the first run (CUDA kernels with several launch configurations;
    None where nothing was tuned): `from_artifact` puts it back in Inductor's autotuning cache
    so that a load benchmarks nothing.
    """

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device) -> None:
        self.module, self.tensors = lift_tensors(gm, split=device.type == "cpu")
        self.device = device
        self.compiled: Callable | None = None
        self.artifact: CompiledArtifact | None = None
        self.tuning: bytes | None = None

    @classmethod
    def from_artifact(cls, gm: torch.fx.GraphModule, path: str | Path,
                      device: torch.device, tuning: str | Path | None = None,
                      loaded: LoadedCode | None = None) -> CompiledStep:
        """The step `gm` compiled before, from the artifact saved at `path`
        (`save_artifact`), and its autotuning choices from `tuning` (`save_tuning`'s file):
        nothing is traced, generated or benchmarked. loaded: what `load_code(path, tuning)`
        gave already (a load does that beside the weights' reading); the step then only binds
        `gm`'s tensors."""
        step = cls.__new__(cls)
        step.module, step.tensors = None, read_tensors(gm)
        step.device = device
        code = loaded if loaded is not None else load_code(path, tuning)
        step.artifact, step.tuning = code.artifact, code.tuning
        step.compiled = step.artifact
        return step

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        args = [*self.tensors, tokens, positions, seq_lens, starts]
        if self.compiled is None:
            return self._first_call(args)
        return self.compiled(*args)[0]

    def _first_call(self, args: Args) -> torch.Tensor:
        """Compile, run once, and keep what the run's autotuning recorded (`tuning`)."""
        from torch.compiler._cache import CacheArtifactManager

        module, self.module = self.module, None  # standalone_compile owns it now
        with CacheArtifactManager.with_fresh_cache():
            self.artifact = compile_graph(module, args, self.device)
            self.compiled = self.artifact
            out = self.compiled(*args)[0]
            recorded = torch.compiler.save_cache_artifacts()
        if recorded is not None and recorded[1].autotune_artifacts:
            self.tuning = recorded[0]
        return out

    def save_artifact(self, path: str | Path) -> None:
        """Write the compiled code to `path` (one file); the step must have run once."""
        if self.artifact is None:
            raise RuntimeError("this step has not been compiled yet (it compiles on its first "
                               "call): nothing to save")
        self.artifact.save(path=str(path), format="binary")

    def save_tuning(self, path: str | Path) -> bool:
        """Write the first run's autotuning choices to `path`; False (nothing written) where
        nothing was tuned."""
        if self.tuning is None:
            return False
        Path(path).write_bytes(self.tuning)
        return True


@dataclass(frozen=True)
class LoadedCode:
    """A compiled step's code loaded from its files, before any tensor is bound to it."""

    artifact: CompiledArtifact
    tuning: bytes | None  # the autotuning choices put back in Inductor's cache (None: none)


def load_code(path: str | Path, tuning: str | Path | None = None) -> LoadedCode:
    """The compiled code saved at `path` (`CompiledStep.save_artifact`), with its autotuning
    choices from `tuning` put back in Inductor's autotuning cache first. Reads no weight: a
    load runs it while the weights are read."""
    import torch._inductor

    choices = None
    if tuning is not None:
        choices = Path(tuning).read_bytes()
        torch.compiler.load_cache_artifacts(choices)
    return LoadedCode(torch._inductor.CompiledArtifact.load(path=str(path), format="binary"),
                      choices)


def compile_count() -> int:
    """Graphs Dynamo traced plus graphs Inductor compiled or looked up by hashing them, so far
    in this process: a load from an engine file leaves it unchanged."""
    from torch._dynamo.utils import counters

    return (int(counters["stats"]["unique_graphs"]) + int(counters["aot_autograd"]["total"])
            + int(counters["inductor"]["fxgraph_cache_miss"]))


__all__ = ["CompiledStep", "LoadedCode", "compile_count", "compile_graph", "load_code",
           "options"]
