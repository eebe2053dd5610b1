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


def build_bundled_engine(path: Path) -> BuiltEngine:
    """Build the bundled pair as the demo does, generate greedily, save to `path`."""
    if bundled_pair() is None:
        pytest.skip("the bundled model pair is not installed")
    target_dir, draft_dir = bundled_pair()
    target, draft, tokenizer, _ = load_pair(str(target_dir), str(draft_dir))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine(target, draft, demo_config(), tokenizer)
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
