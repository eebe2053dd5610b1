"""The norm_stats pass (passes/norm_stats.py): at several rows, a GEMV -> residual add + RMSNorm
-> GEMV chain becomes fuser::linear_residual then fuser::stats_rms_norm_linear (no norm kernel).

The pass is on by default; these tests pin it on (the norm_stats_on fixture). On small
exported blocks: where it fires (2..16 rows, the producer's output read only by the
norm, on either side of the add), where it must not (one row, the GEMV output read elsewhere,
FP8 consumers), and the same numbers as the graph without the pass, bit for bit on
CPU (the ops run their references). Whole-model counts are in tests/test_linear_pass.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes import PASSES
from test_norm_linear_pass import rewrite

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "norm_stats_on")

WITHOUT_NORM_STATS = [p for p in PASSES if p.name != "norm_stats"]


class _Block(nn.Module):
    """o = proj_in(a); s = r + o (or o + r); HF RMSNorm of s feeding proj_out (or a gated
    MLP); `variant` says what else reads what."""

    def __init__(self, variant: str, hidden: int = 24, inner: int = 32, out: int = 40) -> None:
        super().__init__()
        self.variant = variant
        self.proj_in = nn.Linear(inner, hidden, bias=False)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.proj_out = nn.Linear(hidden, out, bias=False)
        self.gate = nn.Linear(hidden, out, bias=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm_weight * h.to(x.dtype)

    def forward(self, a: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = self.proj_in(a)
        s = o + r if self.variant == "gemv_first" else r + o
        h = self.norm(s)
        if self.variant == "gated":
            y = nn.functional.silu(self.gate(h)) * self.proj_out(h)
        else:
            y = self.proj_out(h)
        if self.variant == "gemv_read_elsewhere":
            return y, s * 2, o.sum(-1)
        return y, s * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("variant", "rows", "fires"), [
    ("residual_first", 3, True),
    ("gemv_first", MAX_ROWS, True),
    ("gated", 2, True),
    ("residual_first", 1, False),            # one row: the norm runs inside the GEMV already
    ("gemv_read_elsewhere", 3, False),       # the GEMV's output is read twice
    ("residual_first", MAX_ROWS + 1, False),  # not a decode shape: no GEMVs at all
])
def test_fires_where_it_computes_the_same(variant: str, rows: int, fires: bool,
                                          dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = _Block(variant).eval().to(dtype)
    args = (torch.randn(1, rows, 32).to(dtype), torch.randn(1, rows, 24).to(dtype))
    # gamma=0: a target decode graph of `rows` rows is its bucket's largest step
    gm, matches, ops = rewrite(module, args, PASSES, gamma=0)
    before, _, before_ops = rewrite(module, args, WITHOUT_NORM_STATS, gamma=0)
    assert matches["norm_stats"] == int(fires)
    if fires:
        assert ops["linear_residual"] == ops["stats_rms_norm_linear"] == 1
        assert "add_rms_norm_linear" not in ops and "linear" not in ops
        assert before_ops["add_rms_norm_linear"] == 1
    else:
        assert "linear_residual" not in ops and ops == before_ops
    with torch.no_grad():
        for a, b in zip(gm(*args), before(*args)):
            assert torch.equal(a, b)


def test_fp8_consumers_keep_the_norm_kernel() -> None:
    """An FP8 GEMV after the norm keeps add_rms_norm_linear (its norm kernel hands it x as e4m3
    pieces): no rewrite, the same numbers as without the pass."""
    torch.manual_seed(1)
    module = _Block("gated").eval().to(torch.bfloat16)
    args = (torch.randn(1, 4, 32).to(torch.bfloat16), torch.randn(1, 4, 24).to(torch.bfloat16))
    gm, matches, ops = rewrite(module, args, PASSES, precision="fp8", gamma=0)
    before, _, before_ops = rewrite(module, args, WITHOUT_NORM_STATS, precision="fp8", gamma=0)
    assert matches["norm_stats"] == 0 and ops == before_ops
    with torch.no_grad():
        for a, b in zip(gm(*args), before(*args)):
            assert torch.equal(a, b)


@pytest.mark.parametrize(("gamma", "fires"), [(0, True), (3, True), (4, False)])
def test_target_bucket_whose_verify_steps_exceed_max_rows_keeps_its_norms(gamma: int,
                                                                         fires: bool) -> None:
    # A target decode graph of 4 rows (bucket 4): verify steps have 4 (gamma + 1) rows, and at
    # gamma 4 (20 > MAX_ROWS) they keep the norm kernels, so the decode step must keep them too
    # (the same roundings in every target step of the bucket); a draft graph is rewritten anyway.
    torch.manual_seed(2)
    module = _Block("residual_first").eval().to(torch.bfloat16)
    args = (torch.randn(1, 4, 32).to(torch.bfloat16), torch.randn(1, 4, 24).to(torch.bfloat16))
    assert 4 * (3 + 1) == MAX_ROWS
    _, matches, _ = rewrite(module, args, PASSES, gamma=gamma)
    assert matches["norm_stats"] == int(fires)
    _, matches, _ = rewrite(module, args, PASSES, role="draft", gamma=gamma)
    assert matches["norm_stats"] == 1
