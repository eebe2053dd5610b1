"""Engine directories for the engine-file tests: the bundled pair built once, and helpers to
run fuser in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fuser
from fuser.cli import DEMO_PROMPTS, _encode
from fuser.launch import load_pair
from fuser.models import bundled_pair
from fuser.pipeline import build_engine

NEW_TOKENS = 16
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BuiltEngine:
    """A saved engine and what the in-process engine produced before saving."""

    path: Path
    ids: torch.Tensor  # [B, T] left-padded prompts
    mask: torch.Tensor  # [B, T]
    tokens: torch.Tensor  # [B, T + n] greedy output of the in-process engine
    build_seconds: float


def demo_config() -> fuser.FuserConfig:
    """The configuration `fuser demo` builds (cli.cmd_demo), with the FX graphs run as they are.

    The demo compiles the fixed-T steps with Inductor's C++ backend (compile="auto" on CPU, for
    models this size): about two minutes per build on a 2-core CI machine, paid by every pytest
    worker. What compiling adds to an engine file (each compiled step's code, loaded without
    compiling in a fresh process) is tested on tiny models in test_compile_cpu.py and
    test_engine_load_compiles_nothing.py; these tests are about the files.
    """
    return fuser.FuserConfig(max_batch_size=len(DEMO_PROMPTS), max_seq_len=256, compile="fx")


def build_bundled_engine(path: Path, config: fuser.FuserConfig | None = None) -> BuiltEngine:
    """Build the bundled pair as the demo does (or with `config`), generate greedily, save to
    `path`."""
    if bundled_pair() is None:
        pytest.skip("the bundled model pair is not installed")
    target_dir, draft_dir = bundled_pair()
    target, draft, tokenizer, _ = load_pair(str(target_dir), str(draft_dir))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine(target, draft, config or demo_config(), tokenizer)
    build_seconds = time.perf_counter() - start
    ids, mask = _encode(tokenizer, DEMO_PROMPTS, engine.vocab_size)
    tokens = engine.generate(ids, NEW_TOKENS, attention_mask=mask)
    from fuser.engine_io import save

    save(engine, path, overwrite=True, source={"target": str(target_dir), "draft": str(draft_dir)})
    return BuiltEngine(path, ids, mask, tokens, build_seconds)


def run_fuser(*args: str, env: dict[str, str] | None = None, timeout: float = 600
              ) -> subprocess.CompletedProcess:
    """`fuser ARGS` in a fresh process (python -m fuser.cli), text output captured."""
    return subprocess.run([sys.executable, "-m", "fuser.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


LOAD_AND_GENERATE = """
import json, sys, time, torch
start = time.perf_counter()
import fuser
engine = fuser.load(sys.argv[1])
seconds = time.perf_counter() - start
ids, mask = torch.load(sys.argv[2])
out = engine.generate(ids, int(sys.argv[3]), attention_mask=mask)
print(json.dumps({"tokens": out.tolist(), "load_seconds": engine.load_seconds,
                  "import_and_load_seconds": seconds}))
"""


def load_in_fresh_process(built: BuiltEngine, scratch: Path) -> dict[str, object]:
    """Load `built` in a new Python process and generate the same prompts greedily."""
    inputs = scratch / "inputs.pt"
    torch.save((built.ids, built.mask), inputs)
    done = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(built.path), str(inputs),
                           str(NEW_TOKENS)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Every entry point that traces, generates, compiles or autotunes code, made to raise in the
# process that loads; on CUDA, Triton's compile is called for each kernel's first launch and must
# find the binary in the cache (a miss is counted), and its C compiler raises.
LOAD_COMPILING_NOTHING = """
import json, sys, torch

def forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"the load called {name}")
    return call

import torch._dynamo, torch.export, torch._inductor, torch._inductor.compile_fx
import torch._inductor.codecache, torch._inductor.cpp_builder
import torch._inductor.runtime.triton_heuristics as heuristics
import triton, triton.compiler.compiler
import fuser, fuser.compile
for owner, name in [(torch, "compile"), (torch._dynamo, "optimize"), (torch.export, "export"),
                    (torch._inductor, "standalone_compile"),
                    (torch._inductor.compile_fx, "compile_fx"),
                    (torch._inductor.compile_fx, "compile_fx_inner"),
                    (torch._inductor.codecache.FxGraphCache, "_save_graph"),
                    (torch._inductor.cpp_builder.CppBuilder, "build"),
                    (heuristics.CachingAutotuner, "benchmark_all_configs"),
                    (fuser.compile, "compile_graph")]:
    setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
misses, builds, phase = [], [], ["load"]

def launching():  # the Triton kernel whose launch is on the stack, and its specialization
    frame = sys._getframe()
    while frame is not None:
        kernel = frame.f_locals.get("self")
        if frame.f_code.co_name == "run" and hasattr(kernel, "device_caches"):
            return (getattr(kernel, "__name__", "?"),
                    str(frame.f_locals.get("specialization", "?"))[:400])
        frame = frame.f_back
    return ("(no kernel launch on the stack)", "")

if torch.cuda.is_available():
    def listen(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            misses.append((phase[0], metadata.get("name"), str(getattr(src, "attrs", "?"))[:400]))
    triton.knobs.compilation.listener = listen
    # Triton's C modules (its driver's utilities, the kernels' launchers) come from the engine
    # directory too: the host's C compiler never runs. A run is recorded with the kernel that
    # asked for it and its specialization (which the build did not launch), then let through,
    # so that one failure names every kernel the engine directory lacks.
    import triton.runtime.build
    build = triton.runtime.build._build
    def recorded(name, *args, **kwargs):
        builds.append((phase[0], name, *launching()))
        return build(name, *args, **kwargs)
    triton.runtime.build._build = recorded
else:
    triton.compile = triton.compiler.compiler.compile = forbidden("triton.compile")

engine = fuser.load(sys.argv[1])
phase[0] = "generate"
ids, mask = (t.to(engine.device) for t in torch.load(sys.argv[2]))
out = engine.generate(ids, int(sys.argv[3]), attention_mask=mask)
kept = [n for n in json.load(open(sys.argv[1] + "/manifest.json"))["extra"]
        if n.startswith("kernels/triton/") and "__triton_launcher" in n]
assert not misses and not builds, (
    "the engine directory lacked what this process compiled: Triton kernels (phase, name, "
    f"specialization) {misses}; C modules (phase, module, kernel, specialization) {builds}; "
    f"it held {len(kept)} launcher modules")
print(json.dumps({"tokens": out.tolist(), "compile_count": fuser.compile.compile_count()}))
"""


def load_compiling_nothing(path: Path, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                           scratch: Path) -> dict[str, object]:
    """Load engine `path` in a new process whose Inductor and Triton caches start empty and
    whose every compiler entry point raises, then generate `new_tokens` greedily."""
    scratch.mkdir(parents=True, exist_ok=True)
    inputs = scratch / "inputs.pt"
    torch.save((ids.cpu(), mask.cpu()), inputs)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
           "TRITON_CACHE_DIR": str(scratch / "triton")}
    done = subprocess.run([sys.executable, "-c", LOAD_COMPILING_NOTHING, str(path), str(inputs),
                           str(new_tokens)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
