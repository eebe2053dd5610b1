"""The gated_linear pass: gated_act over a decode-shaped gate/up GEMV becomes one
fuser::gated_linear (bf16/fp16/fp32 weights) or fuser::fp8_gated_linear (precision="fp8").

On small exported MLPs: the fused op is there and the GEMV and gated_act it replaces are gone,
exact match counts, the same numbers as the graph without the pass (bit for bit on CPU, where the
ops run their references) and as eager, and negatives: the [M, 2I] GEMM output read elsewhere, a
bias between the GEMM and the activation, more rows than the kernel takes. The counts on every
supported family, in every graph of target and draft, are in tests/test_linear_pass.py (bf16 and
fp32) and tests/test_fp8_pass.py (FP8); greedy output against Hugging Face in
tests/test_generate_greedy.py, whose shared engines run the fused op (checked here).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fuser
from engines import assert_greedy_matches, hf_greedy, prompts
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes import PASSES, PassContext, run_passes
from fuser.passes.fx import count_targets
from fuser.runtime.steps import DECODE
from tiny import export_like_capture, random_prompts, tiny_model

aten = torch.ops.aten
fuser_ops = torch.ops.fuser

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WITHOUT_GATED_LINEAR = [p for p in PASSES if p.name != "gated_linear"]
WITHOUT_LINEAR = [p for p in PASSES if p.name != "linear"]  # as on CUDA where cuBLAS is kept


def gated_norm_gemvs(gm: torch.fx.GraphModule) -> int:
    """fuser::add_rms_norm_linear calls with an activation: the gated GEMV behind its norm (or
    stats_rms_norm_linear, where norm_stats moved a several-row norm into the GEMVs)."""
    ops = (fuser_ops.add_rms_norm_linear.default, fuser_ops.stats_rms_norm_linear.default)
    return sum(1 for n in gm.graph.nodes if n.target in ops and n.args[-1] is not None)


class _MLP(nn.Module):
    """down(act(gate(x)) * up(x)); `variant` says how gate and up are computed and what else the
    module returns."""

    def __init__(self, variant: str, hidden: int = 24, inter: int = 40) -> None:
        super().__init__()
        self.variant = variant
        bias = variant == "bias"
        if variant in ("chunk", "gate_up_used_elsewhere"):  # Phi-3's form: one GEMM, chunked
            self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.gate = nn.Linear(hidden, inter, bias=bias)
            self.up = nn.Linear(hidden, inter, bias=bias)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = x.sum(-1)
        if self.variant in ("chunk", "gate_up_used_elsewhere"):
            gate_up = self.gate_up(x)
            gate, up = gate_up.chunk(2, dim=-1)
            if self.variant == "gate_up_used_elsewhere":
                extra = gate_up.mean(-1)
        else:
            gate, up = self.gate(x), self.up(x)
        if self.variant == "gelu_tanh":
            act = nn.functional.gelu(gate, approximate="tanh")
        else:
            act = nn.functional.silu(gate)
        return self.down(act * up), extra


def rewrite(module: nn.Module, x: torch.Tensor, passes: list, precision: str | None = None
            ) -> tuple[torch.fx.GraphModule, dict, dict]:
    """(graph after `passes`, matches, fused ops) of `module` exported at x's shape as a decode
    step."""
    config = fuser.FuserConfig(precision=precision) if precision else fuser.FuserConfig()
    gm = export_like_capture(module, (x,))
    result = run_passes(gm, PassContext("mlp.decode", DECODE, config), passes)
    assert result.errors == []
    return gm, result.matches, result.fused_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("variant", "shape", "fused"), [
    ("separate", (1, 1), 1),                 # decode at batch 1: one row
    ("separate", (2, 8), 1),                 # MAX_ROWS rows (verification at batch 2)
    ("separate", (MAX_ROWS + 1, 1), 0),      # more rows than the kernel takes: GEMM + gated_act
    ("gelu_tanh", (1, 3), 1),                # GeGLU (Gemma)
    ("chunk", (1, 1), 1),                    # Phi-3's merged gate_up_proj, chunked
    ("gate_up_used_elsewhere", (1, 1), 0),   # the [M, 2I] output is read by another op: kept
    ("bias", (1, 1), 0),                     # a bias add between the GEMM and the activation
])
def test_fused_where_it_computes_the_same(variant: str, shape: tuple[int, int], fused: int,
                                          dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = _MLP(variant).eval().to(dtype)
    x = torch.randn(*shape, 24).to(dtype)
    gm, matches, ops = rewrite(module, x, PASSES)
    unfused, unfused_matches, _ = rewrite(module, x, WITHOUT_GATED_LINEAR)
    assert matches["gated_linear"] == fused
    assert matches["gated_act"] == unfused_matches["gated_act"] == 1
    assert ops.get("gated_linear", 0) == fused
    assert ops.get("gated_act", 0) == 1 - fused              # replaced, or left as it was
    decode_rows = shape[0] * shape[1] <= MAX_ROWS
    # the GEMV the fused op took over is gone: down_proj's alone is left (gate_up's too if not)
    assert ops.get("linear", 0) == (2 - fused if decode_rows else 0)
    assert count_targets(gm, aten.mm.default) + count_targets(gm, aten.addmm.default) == (
        0 if decode_rows else 2)
    with torch.no_grad():
        got, want = gm(x), unfused(x)
        for a, b in zip(got, want):  # CPU: the op's reference is the unfused pair, bit for bit
            assert torch.equal(a, b)
        for a, b in zip(got, module(x)):
            # merged GEMM blocking and F.silu vs its exported form differ from eager in the last
            # bits (tests/test_gated_mlp.py)
            tolerance = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_gemm_left_to_cublas_is_taken_too() -> None:
    # On CUDA the linear pass keeps gate/up's GEMM at several rows (prefers_cublas); the fused
    # kernel also saves the gated_act launch, so gated_linear takes the mm itself. Simulated
    # here by leaving the linear pass out.
    torch.manual_seed(1)
    module = _MLP("separate").eval()
    x = torch.randn(2, 5, 24)
    gm, matches, ops = rewrite(module, x, WITHOUT_LINEAR)
    assert matches["gated_linear"] == 1 and ops == {"gated_linear": 1}
    assert count_targets(gm, aten.mm.default) == 1  # down_proj
    unfused, _, _ = rewrite(module, x, [p for p in WITHOUT_LINEAR if p.name != "gated_linear"])
    with torch.no_grad():
        for a, b in zip(gm(x), unfused(x)):
            assert torch.equal(a, b)
    # ... but not past MAX_ROWS: prefill-sized GEMMs keep cuBLAS
    x = torch.randn(MAX_ROWS + 1, 1, 24)
    _, matches, ops = rewrite(module, x, WITHOUT_LINEAR)
    assert matches["gated_linear"] == 0 and ops == {"gated_act": 1}


@pytest.mark.parametrize("variant", ["separate", "gelu_tanh", "chunk"])
def test_fp8_gemv_takes_the_activation(variant: str) -> None:
    torch.manual_seed(2)
    module = _MLP(variant).eval()
    x = torch.randn(1, 2, 24)
    gm, matches, ops = rewrite(module, x, PASSES, precision="fp8")
    unfused, _, unfused_ops = rewrite(module, x, WITHOUT_GATED_LINEAR, precision="fp8")
    assert matches["fp8_linear"] == 2 and matches["gated_linear"] == 1
    assert ops == {"fp8_gated_linear": 1, "fp8_linear": 1}   # gate/up + act, down_proj
    assert unfused_ops == {"fp8_linear": 2, "gated_act": 1}
    # The fused op reads the codes and the one scale vector fp8_linear read: nothing new.
    assert sorted(n.target for n in gm.graph.nodes if n.op == "get_attr") == sorted(
        n.target for n in unfused.graph.nodes if n.op == "get_attr")
    with torch.no_grad():
        for a, b in zip(gm(x), unfused(x)):
            assert torch.equal(a, b)


def test_shared_greedy_engines_run_the_fused_op(engines) -> None:
    # tests/test_generate_greedy.py holds these engines' greedy output to Hugging Face's; make
    # sure that what it checks is the fused op in every decode-shaped graph.
    engine, target = engines("plain")
    layers = target.config.num_hidden_layers
    for graph in engine.target.steps.values():
        ops = graph.fused_ops
        if graph.kind.tokens is None:  # prefill
            assert ops.get("gated_linear", 0) == 0 and ops["gated_act"] == layers, graph.name
        else:  # the gated GEMV, then inside the post-attention norm's op (norm_linear)
            assert graph.matches["gated_linear"] == layers and "gated_act" not in ops, graph.name
            assert gated_norm_gemvs(graph.rewritten) == layers, graph.name
    assert engine.report().passes["gated_linear"] == layers
    ids, mask = prompts([5, 2], seed=11)
    ref, near_tie = hf_greedy(target, ids, mask, 10)
    assert_greedy_matches(engine.generate(ids, 10, attention_mask=mask), ref, near_tie, ids, eos=[])


def test_fp8_engine_saves_and_loads_the_fused_op(tmp_path) -> None:
    # The fused op reads the codes and scales fp8_linear registered, in the merged weight's own
    # row order: an engine file stores and restores them as they are. In the decode graph it
    # then sits inside the post-attention norm's op (norm_linear), FP8 scale and activation
    # among its arguments: the engine file stores that op too.
    model = tiny_model("llama", seed=5, layers=1)
    engine = fuser.optimize(model, config=fuser.FuserConfig(precision="fp8", max_batch_size=1,
                                                             max_seq_len=32))
    report = engine.report()
    assert report.passes["gated_linear"] == 1 and report.passes["norm_linear"] == 3
    assert report.fused_ops == {"add_rms_norm_linear": 2, "fp8_linear": 2, "rms_norm_linear": 1,
                                "rotary_cache_attention": 1}
    assert gated_norm_gemvs(engine.target[DECODE].rewritten) == 1
    engine.save(tmp_path / "engine")
    loaded = fuser.load(tmp_path / "engine")
    assert loaded.report().graphs["target.decode"] == report.fused_ops
    assert gated_norm_gemvs(loaded.target[DECODE].rewritten) == 1
    ids, mask = random_prompts(1, [5], model.config.vocab_size, seed=4)
    assert torch.equal(loaded.generate(ids, 6, attention_mask=mask, eos_token_id=[]),
                       engine.generate(ids, 6, attention_mask=mask, eos_token_id=[]))
