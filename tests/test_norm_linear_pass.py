"""The norm_linear pass: fuser::rms_norm / add_rms_norm feeding only a decode GEMV becomes one
fuser::rms_norm_linear / add_rms_norm_linear (any of the four GEMVs: plain, gated, FP8, both).

On small exported blocks: the fused op is there and the norm and GEMV it replaces are gone, exact
match counts, the same numbers as the graph without the pass (bit for bit on CPU, where the ops
run their references), and negatives: the normed tensor read elsewhere, more rows than the
kernel takes. The counts on whole models (2 per layer and the final norm, in every decode-shaped
graph) are in tests/test_linear_pass.py, tests/test_fp8_pass.py and tests/test_gated_linear_pass.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fuser
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes import PASSES, PassContext, run_passes
from fuser.runtime.steps import DECODE
from tiny import export_like_capture

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WITHOUT_NORM_LINEAR = [p for p in PASSES if p.name != "norm_linear"]


class _Block(nn.Module):
    """An HF RMSNorm (after a residual add, or not) feeding a projection; `variant` says which
    projection and what else reads the norm's tensors."""

    def __init__(self, variant: str, hidden: int = 24, out: int = 40) -> None:
        super().__init__()
        self.variant = variant
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.proj = nn.Linear(hidden, out, bias=False)
        self.gate = nn.Linear(hidden, out, bias=False)  # variant "gated": act(gate) * up
        self.down = nn.Linear(out, hidden, bias=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm_weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x if self.variant == "no_residual" else x + r
        h = self.norm(summed)
        if self.variant == "gated":
            y = self.down(nn.functional.silu(self.gate(h)) * self.proj(h))
        else:
            y = self.proj(h)
        extra = h.mean(-1) if self.variant == "normed_used_elsewhere" else summed * 2
        return y, extra


def rewrite(module: nn.Module, args: tuple, passes: list, precision: str | None = None,
            role: str = "target", **config_fields) -> tuple[torch.fx.GraphModule, dict, dict]:
    """The passes on `module`'s graph as a decode graph of `role`, built with the config
    fields given."""
    if precision:
        config_fields["precision"] = precision
    config = fuser.FuserConfig(**config_fields)
    gm = export_like_capture(module, args)
    result = run_passes(gm, PassContext(f"{role}.decode", DECODE, config, role), passes)
    assert result.errors == []
    return gm, result.matches, result.fused_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("variant", "rows", "fused"), [
    ("residual", 1, {"add_rms_norm_linear": 1}),
    ("residual", MAX_ROWS, {"add_rms_norm_linear": 1}),
    ("no_residual", 3, {"rms_norm_linear": 1}),
    ("gated", 2, {"add_rms_norm_linear": 1, "linear": 1}),   # gate/up's GEMV with act; down
    ("normed_used_elsewhere", 1, {"linear": 1}),             # the norm's output read twice
    ("residual", MAX_ROWS + 1, {}),                          # not a decode shape: no GEMV
])
def test_fused_where_it_computes_the_same(variant: str, rows: int, fused: dict,
                                          dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = _Block(variant).eval().to(dtype)
    args = (torch.randn(rows, 1, 24).to(dtype), torch.randn(rows, 1, 24).to(dtype))
    gm, matches, ops = rewrite(module, args, PASSES)
    unfused, _, unfused_ops = rewrite(module, args, WITHOUT_NORM_LINEAR)
    expected = fused.get("rms_norm_linear", 0) + fused.get("add_rms_norm_linear", 0)
    assert matches["norm_linear"] == expected
    for name in ("rms_norm_linear", "add_rms_norm_linear", "linear"):
        assert ops.get(name, 0) == fused.get(name, 0), name
    if expected:  # the norm and the GEMV it fed are gone
        assert sum(ops.get(n, 0) for n in ("rms_norm", "add_rms_norm", "gated_linear")) == 0
        assert sum(unfused_ops.get(n, 0) for n in ("rms_norm", "add_rms_norm")) == 1
    with torch.no_grad():
        for a, b in zip(gm(*args), unfused(*args)):  # CPU: the unfused references, bit for bit
            assert torch.equal(a, b)
        for a, b in zip(gm(*args), module(*args)):
            tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("variant", ["residual", "gated"])
def test_fp8_gemv_takes_the_norm(variant: str) -> None:
    torch.manual_seed(1)
    module = _Block(variant).eval()
    args = (torch.randn(2, 1, 24), torch.randn(2, 1, 24))
    gm, matches, ops = rewrite(module, args, PASSES, precision="fp8")
    unfused, _, _ = rewrite(module, args, WITHOUT_NORM_LINEAR, precision="fp8")
    assert matches["norm_linear"] == 1 and ops["add_rms_norm_linear"] == 1
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.fuser.add_rms_norm_linear.default)
    weight_scale, activation = fused.args[-2:]
    assert weight_scale is not None and activation == ("silu" if variant == "gated" else None)
    assert "fp8_gated_linear" not in ops and ops.get("fp8_linear", 0) == (variant == "gated")
    with torch.no_grad():
        for a, b in zip(gm(*args), unfused(*args)):
            assert torch.equal(a, b)
