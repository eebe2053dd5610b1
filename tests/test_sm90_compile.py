"""The GEMV's and attention's kernels compile for sm_90 (no GPU needed; tests/sm90_compile.py).

Recorded under the interpreter here, compiled in a process without TRITON_INTERPRET: every form
of _linear_kernel the engine launches (bf16 and FP8 weights at one row and at several rows, x
as e4m3 pieces, the residual epilogue and the rstd from sums of squares of norm_stats, the norm
prologue and the gated epilogue) and attention's combine kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sm90_compile
from fuser.ops import linear

ROOT = Path(__file__).resolve().parents[1]


def _default_paths() -> None:
    from fuser.ops.e4m3_pieces import split_pieces_triton
    from fuser.ops.fp8 import quantize_weight
    from fuser.ops.linear import linear_pieces_triton, linear_triton
    from fuser.ops.norm_linear import rms_norm_linear_triton
    from fuser.ops.norm_stats import linear_residual_triton, normed_linear_triton

    g = torch.Generator().manual_seed(0)
    M, K, H, I = 5, 256, 256, 256
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, H, generator=g).to(torch.bfloat16)
    nw = torch.ones(H, dtype=torch.bfloat16)
    wp, sp = quantize_weight(torch.randn(H, K, generator=g))
    wgu, sgu = quantize_weight(torch.randn(2 * I, H, generator=g))
    linear_triton(a, wp.to(torch.bfloat16))                       # several rows, bf16
    linear_triton(a, wp, weight_scale=sp)                         # several rows, fp16 MMA
    linear_triton(a, wgu, weight_scale=sgu, activation="silu")    # ... gated
    linear_pieces_triton(*split_pieces_triton(a), wp, sp)          # x as e4m3 pieces
    summed, gh, sq = linear_residual_triton(a, wp, r, nw, weight_scale=sp)  # norm_stats
    normed_linear_triton(gh, sq, 1e-5, wp.to(torch.bfloat16))
    linear_triton(a[:1], wp, weight_scale=sp)                     # one row, FP8
    rms_norm_linear_triton(a[:1], r[:1], nw, 1e-5, wp, weight_scale=sp)  # rstd after the sum
    rms_norm_linear_triton(a[:1], r[:1], nw, 1e-5, wgu, weight_scale=sgu, activation="silu")


def test_linear_kernels_compile_for_sm90(tmp_path: Path) -> None:
    records = sm90_compile.record_launches(linear, "_linear_kernel", _default_paths)
    assert len(records) == 9
    _compile(records, tmp_path)


def _compile(records: list[dict], tmp_path: Path) -> None:
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sm90_compile.py"), str(path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line]
    if lines and lines[0].startswith("SKIP"):
        pytest.skip(lines[0])
    assert lines == [f"{i} ok" for i in range(len(records))], lines


def _attention() -> None:
    from fuser.ops.rotary_attention import rotary_cache_attention_triton
    from test_rotary_cache import make_case

    case = make_case(2, 8, 2, 5, 64, 64, 48, torch.bfloat16, seed=3, seq_lens=[10, 30])
    q, k, v, cos, sin, k_cache, v_cache, lens = case
    starts = torch.zeros(2, dtype=torch.int64)
    rotary_cache_attention_triton(q, k, v, cos, sin, k_cache, v_cache, lens, starts, 0.125, 0,
                                  0.0)


def test_attention_combine_compiles_for_sm90(tmp_path: Path) -> None:
    from fuser.ops import rotary_attention

    records = sm90_compile.record_launches(rotary_attention, "_combine_kernel", _attention,
                                           kernel_id="fuser.ops.attention:_combine_kernel")
    assert len(records) == 1
    _compile(records, tmp_path)
