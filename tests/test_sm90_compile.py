"""The several-row GEMV's newer paths compile for sm_90 (no GPU needed; tests/sm90_compile.py).

Recorded under the interpreter here, compiled in a process without TRITON_INTERPRET: the
block-scaled e4m3 pieces (linear_pieces_triton scale_block), norm_stats' pieces producer and
consumer, the gated output as pieces, down_proj's producer on them; and the default several-
and one-row paths, which share the K-step helpers."""

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


def _block_pieces_chain() -> None:
    from fuser.ops.e4m3_pieces import split_pieces_triton
    from fuser.ops.fp8 import quantize_weight
    from fuser.ops.linear import linear_pieces_triton
    from fuser.ops.norm_stats import (linear_residual_pieces_triton,
                                      normed_pieces_gated_pieces_triton,
                                      normed_pieces_linear_triton)

    g = torch.Generator().manual_seed(0)
    M, K, H, I = 5, 256, 256, 256
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, H, generator=g).to(torch.bfloat16)
    nw = torch.ones(H, dtype=torch.bfloat16)
    wp, sp = quantize_weight(torch.randn(H, K, generator=g))
    wgu, sgu = quantize_weight(torch.randn(2 * I, H, generator=g))
    wd, sd = quantize_weight(torch.randn(H, I, generator=g))
    summed, (hi, lo, inv), sq = linear_residual_pieces_triton(a, wp, r, nw, 128, weight_scale=sp)
    linear_residual_pieces_triton(a, wp, r, nw, 128, weight_scale=sp,
                                  pieces=split_pieces_triton(a))
    normed_pieces_linear_triton(hi, lo, inv, sq, 1e-5, wp, sp, 128)
    y, (yh, yl, yi) = normed_pieces_gated_pieces_triton(hi, lo, inv, sq, 1e-5, wgu, sgu, 128, 64,
                                                        "silu")
    linear_residual_pieces_triton(y, wd, r, nw, 128, weight_scale=sd, pieces=(yh, yl, yi),
                                  block_k=64, split_k=2)
    linear_pieces_triton(yh, yl, yi, wd, sd, scale_block=64)
    # the default paths through the same K-step helper: bf16 and FP8 (fp16 MMA) rows, row
    # pieces, one row
    from fuser.ops.linear import linear_triton

    linear_triton(a, wp.to(torch.bfloat16))
    linear_triton(a, wp, weight_scale=sp)
    linear_pieces_triton(*split_pieces_triton(a), wp, sp)
    linear_triton(a[:1], wp, weight_scale=sp)


def test_block_pieces_kernels_compile_for_sm90(tmp_path: Path) -> None:
    records = sm90_compile.record_launches(linear, "_linear_kernel", _block_pieces_chain)
    assert len(records) == 10
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


def _attention_pieces() -> None:
    from fuser.ops.rotary_attention import _rotary_cache_attention_pieces_cuda
    from test_rotary_cache import make_case

    case = make_case(2, 8, 2, 5, 64, 64, 48, torch.bfloat16, seed=3, seq_lens=[10, 30])
    q, k, v, cos, sin, k_cache, v_cache, lens = case
    starts = torch.zeros(2, dtype=torch.int64)
    _rotary_cache_attention_pieces_cuda(q, k, v, cos, sin, k_cache, v_cache, lens, starts,
                                        0.125, 0, 0.0)
    from fuser.ops.rotary_attention import rotary_cache_attention_triton

    rotary_cache_attention_triton(q, k, v, cos, sin, k_cache, v_cache, lens, starts, 0.125, 0,
                                  0.0)


def test_attention_pieces_combine_compiles_for_sm90(tmp_path: Path) -> None:
    """The combine kernel writing the output as block pieces (PIECES), and the plain one."""
    from fuser.ops import rotary_attention

    records = sm90_compile.record_launches(rotary_attention, "_combine_kernel", _attention_pieces,
                                           kernel_id="fuser.ops.attention:_combine_kernel")
    assert [r["kwargs"]["PIECES"] for r in records] == [True, False]
    _compile(records, tmp_path)
