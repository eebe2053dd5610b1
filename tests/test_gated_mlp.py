"""fuser::gated_act and the gated_act pass: kernel vs reference, fused per layer, negatives.

Without a GPU the launcher runs under TRITON_INTERPRET=1 (set in conftest.py before any kernel is
defined); with one it runs for real.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fuser
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from fuser.ops.gated_act import ACTIVATIONS, BLOCK, gated_act_reference, gated_act_triton
from fuser.passes import run_passes
from fuser.runtime.steps import DECODE
from fuser.passes.fx import count_targets
from tiny import export_like_capture, hf_logits, pass_context, random_prompts, tiny_also_matching

aten = torch.ops.aten
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [
    # conftest.py: the interpreter's fp32 -> bf16 cast rounds to nearest even, as GPUs do
    pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu"),
    # exp(-z) overflows to inf in the tails (gelu_tanh: g below about -10): act -> -0, as intended
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

# I (the output width) either side of the column block (BLOCK = 1024) and of small powers of two.
WIDTHS = [1, 7, 63, 64, 65, 1023, BLOCK, 1025, 2100]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Elementwise bound |out - ref| <= rtol * (|ref| + (1 + |up|) * tiny) + cancellation * |gate * up|
# (tiny = the dtype's smallest normal), and the fraction of elements that must match bit for bit
# where gate > -3. Keyed by dtype:
TOLERANCE = {
    # exp and the division differ from PyTorch's vectorised ones by an ulp or two (measured at
    # most 2.6 ulps for silu). No bitwise fraction: most elements differ in the last bit.
    torch.float32: (4 * torch.finfo(torch.float32).eps, 0.0),
    # act is rounded to the dtype by both; a last-bit fp32 difference can move it to the
    # neighbouring value (<= 1 ulp) and the product is rounded again (<= 1 ulp): 2 eps, plus,
    # where act or the product is subnormal, the absolute rounding step (the tiny term). Such
    # flips need act within ~1e-7 of a rounding boundary, so nearly all elements match exactly;
    # a missing rounding of act before the multiply would break that on about half of them.
    torch.bfloat16: (2 * torch.finfo(torch.bfloat16).eps, 0.99),
    torch.float16: (2 * torch.finfo(torch.float16).eps, 0.99),
}
# PyTorch's gelu_tanh is 0.5 g (1 + tanh(y)): below g ~ -3, 1 + tanh(y) cancels and its fp32
# result carries an absolute error of up to about |g| * 2^-25 (half an ulp of tanh near -1, times
# g), which the kernel's g * sigmoid(2y) does not. This allows the reference's own error, with a
# factor 4 for tanh's last-bit error; silu has no cancellation.
CANCELLATION = {"silu": 0.0, "gelu_tanh": 2.0**-23}


def assert_close(out: torch.Tensor, ref: torch.Tensor, gate_up: torch.Tensor, activation: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    rtol, min_equal = TOLERANCE[ref.dtype]
    gate, up = gate_up.double().chunk(2, dim=-1)
    tiny = torch.finfo(ref.dtype).smallest_normal
    err = (out.double() - ref.double()).abs()
    bound = rtol * (ref.double().abs() + (1 + up.abs()) * tiny) + CANCELLATION[activation] * (gate * up).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {worst:.2f}x the {ref.dtype} {activation} tolerance"
    clear = gate > -3  # outside gelu_tanh's cancellation region in the reference
    equal = (out == ref)[clear].double().mean().item() if clear.any() else 1.0
    assert equal >= min_equal, f"only {equal:.4f} of elements bitwise equal, need {min_equal}"


def make_gate_up(rows_shape: tuple[int, ...], I: int, dtype: torch.dtype, layout: str, seed: int,
                 scale: float = 3.0) -> torch.Tensor:
    """[*rows_shape, 2I]; "strided_rows" takes the first 2I columns of wider rows (as a slice of
    a larger GEMM output would be)."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * I + (5 if layout == "strided_rows" else 0)
    t = (scale * torch.randn(*rows_shape, width, generator=g)).to(dtype).to(DEVICE)
    return t[..., : 2 * I]


def check_launcher(gate_up: torch.Tensor, activation: str) -> None:
    before = gate_up.clone()
    out = gated_act_triton(gate_up, activation)
    assert torch.equal(gate_up, before)  # input untouched
    assert out.is_contiguous() and out.data_ptr() != gate_up.data_ptr()
    assert_close(out, gated_act_reference(gate_up, activation), gate_up, activation)


# --- launcher under the interpreter (or on the GPU) ----------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("I", WIDTHS)
def test_launcher_at_block_boundaries(I: int, dtype: torch.dtype, activation: str) -> None:
    check_launcher(make_gate_up((3,), I, dtype, "contiguous", seed=I), activation)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(ACTIVATIONS),
    dtype=st.sampled_from(DTYPES),
    I=st.one_of(st.sampled_from(WIDTHS), st.integers(1, 1500)),
    rows_shape=st.sampled_from([(1,), (2,), (5,), (1, 1), (2, 3)]),  # decode is 1 row
    layout=st.sampled_from(["contiguous", "strided_rows"]),
    scale=st.sampled_from([1e-3, 1.0, 8.0]),  # 8: deep into both tails of the activations
    seed=st.integers(0, 2**16),
)
def test_launcher_matches_reference(activation, dtype, I, rows_shape, layout, scale, seed) -> None:
    check_launcher(make_gate_up(rows_shape, I, dtype, layout, seed, scale), activation)


def test_reference_is_hugging_face_eager() -> None:
    # HF: down(act_fn(gate_proj(x)) * up_proj(x)), act and product each rounded to the dtype.
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 33, generator=g).bfloat16() for _ in range(2))
    gate_up = torch.cat([gate, up], dim=-1)
    assert torch.equal(gated_act_reference(gate_up, "silu"), nn.functional.silu(gate) * up)
    gelu = nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(gated_act_reference(gate_up, "gelu_tanh"), gelu)


# --- custom op --------------------------------------------------------------------------------


def test_custom_op_cpu_is_the_reference_and_checks_arguments() -> None:
    x = torch.randn(2, 3, 2 * 40).bfloat16()
    for activation in ACTIVATIONS:
        assert torch.equal(torch.ops.fuser.gated_act(x, activation), gated_act_reference(x, activation))
    with pytest.raises(ValueError, match="activation"):
        torch.ops.fuser.gated_act(x, "relu")
    with pytest.raises(ValueError, match="even"):
        torch.ops.fuser.gated_act(torch.randn(3, 5), "silu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_and_fake(activation: str) -> None:
    for sample in (torch.randn(4, 64), torch.randn(2, 3, 130).bfloat16(), torch.randn(8, 2, 66)[:, 0]):
        torch.library.opcheck(torch.ops.fuser.gated_act.default, (sample, activation))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.fuser.gated_act(torch.empty(2, 5, 144, dtype=torch.float16), activation)
    assert out.shape == (2, 5, 72) and out.dtype == torch.float16


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("I", [1024, 11008, 14336])
def test_custom_op_cuda_bf16(I: int, activation: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(I)
    gate_up = (3 * torch.randn(7, 2 * I + 8, device="cuda", generator=g)).bfloat16()[:, : 2 * I]
    out = torch.ops.fuser.gated_act(gate_up, activation)
    assert torch.equal(out, gated_act_triton(gate_up, activation))  # the CUDA kernel is the Triton one
    assert_close(out, gated_act_reference(gate_up, activation), gate_up, activation)


# --- the pass on models that need no merge pass (Phi-3) or use GELU-tanh (Gemma-2) -------------
# Not supported families: cases where the fusions also match (tiny.FUSIONS_ALSO_MATCH).
# Phi-3 ships merged projections: qkv_proj, and gate_up_proj chunked into gate, up.
# Gemma-2: GeGLU (gelu_pytorch_tanh), soft-capping, alternating sliding-window layers.


def optimized(model: nn.Module) -> tuple[fuser.Engine, torch.fx.GraphModule]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "not in the supported list" fallback warning
        engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=2, max_seq_len=16))
    assert engine.target is not None, engine.report().fallbacks
    return engine, engine.target[DECODE].rewritten


def check_numbers(engine: fuser.Engine, model: nn.Module) -> None:
    ids, mask = random_prompts(2, [7, 4], model.config.vocab_size, seed=3)
    out = engine.logits(ids, attention_mask=mask)
    ref = hf_logits(model, ids, mask)
    assert relative_error(out[mask.bool()], ref[mask.bool()]) <= LOGITS_TOLERANCE[torch.float32]


def test_phi3_merged_projections_take_the_fast_path() -> None:
    model = tiny_also_matching("phi3")
    layers = model.config.num_hidden_layers
    engine, decode = optimized(model)
    report = engine.report()
    # The only fallback is the family notice: the step exported and every graph was built.
    assert [f for f in report.fallbacks if "supported list" not in f] == []
    check_numbers(engine, model)
    # Already merged: nothing for the merge passes, one SwiGLU per layer on the chunked GEMM.
    assert report.passes["gated_act"] == layers
    assert report.passes["merge_qkv"] == report.passes["merge_gate_up"] == 0
    for name, graph in engine.target.steps.items():
        ops = graph.fused_ops  # decode: gated_act inside gate_up's GEMV (gated_linear)
        assert ops.get("gated_act", 0) + graph.matches["gated_linear"] == layers, name
        assert count_targets(graph.rewritten, aten.sigmoid.default) == 0, name
    # qkv, o, gate_up, down per layer and lm_head: one GEMM each, as Phi-3 ships them; in the
    # decode graph gate_up's GEMV then takes the activation (tests/test_gated_linear_pass.py)
    assert report.passes["gated_linear"] == layers
    # ... and every norm then the GEMV it feeds (qkv, gate_up, lm_head: norm_linear)
    assert report.passes["norm_linear"] == 2 * layers + 1
    assert count_targets(decode, torch.ops.fuser.linear.default) == 2 * layers
    assert count_targets(decode, torch.ops.fuser.gated_linear.default) == 0


def test_gemma2_geglu_fused_per_layer() -> None:
    model = tiny_also_matching("gemma2")
    layers = model.config.num_hidden_layers
    engine, decode = optimized(model)
    check_numbers(engine, model)
    # Gemma-2's RMSNorm is (1 + w) * x and its family is not in the supported list: the
    # rms_norm passes do not match and report().fallbacks names the family. The MLP fuses.
    report = engine.report()
    assert any("gemma2" in f for f in report.fallbacks)
    assert report.passes["gated_act"] == report.passes["merge_gate_up"] == layers
    assert report.passes["merge_qkv"] == layers
    for name, graph in engine.target.steps.items():
        ops = graph.fused_ops
        assert ops.get("gated_act", 0) + ops.get("gated_linear", 0) == layers, name
        assert count_targets(graph.rewritten, aten.gelu.default) == 0, name
    assert report.passes["gated_linear"] == layers  # GeGLU in gate_up's decode GEMV
    assert count_targets(decode, torch.ops.fuser.linear.default) == 3 * layers + 1
    assert count_targets(decode, torch.ops.fuser.gated_linear.default) == layers


# --- negative tests on small exported modules --------------------------------------------------


class _GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `variant` says what else the module does."""

    def __init__(self, variant: str, hidden: int = 24, inter: int = 40) -> None:
        super().__init__()
        self.variant = variant
        merged = variant in ("chunk", "chunk_swapped")
        if merged:
            self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.gate = nn.Linear(hidden, inter, bias=False)
            self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.variant == "chunk":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        elif self.variant == "chunk_swapped":  # the op's layout is gate first: must not match
            up, gate = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        if self.variant == "gelu_exact":  # only the tanh approximation is a key of the op
            act = nn.functional.gelu(gate)
        elif self.variant == "bare_silu":  # in bf16: sigmoid and product each rounded
            act = gate * torch.sigmoid(gate)
        else:
            act = nn.functional.silu(gate)
        if self.variant == "act_used_elsewhere":
            return self.down(act * up), act.sum(-1)
        if self.variant == "product_used_elsewhere":
            h = act * up
            return self.down(h), h.mean(-1)
        return self.down(act * up), x.sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("variant", "merged", "fused"), [
    ("plain", (1, 0), 1),                   # the positive twin: the patterns do match
    ("act_used_elsewhere", (1, 0), 0),      # act(gate) has a second user: kept, no rewrite
    ("product_used_elsewhere", (1, 0), 1),  # the product is the op's output: used anywhere
    ("gelu_exact", (0, 1), 0),              # not a gated act the op has; merged as siblings
    ("chunk", (0, 0), 1),                   # Phi-3's form: already one GEMM
    ("chunk_swapped", (0, 0), 0),
    ("bare_silu", (1, 0), None),            # silu in fp32; in bf16 it rounds twice: not the op
])
def test_gated_act_only_where_it_computes_the_same(variant: str, merged: tuple[int, int],
                                                   fused: int | None, dtype: torch.dtype) -> None:
    if fused is None:
        fused = 1 if dtype == torch.float32 else 0
        merged = merged if fused else (0, 1)  # not a gated MLP: merged as plain siblings
    torch.manual_seed(0)
    m = _GatedMLP(variant).eval().to(dtype)
    x = torch.randn(2, 3, 24).to(dtype)
    gm = export_like_capture(m, (x,))
    result = run_passes(gm, pass_context("mlp"))
    assert result.errors == []
    assert (result.matches["merge_gate_up"], result.matches["merge_qkv"]) == merged
    assert result.matches["gated_act"] == fused
    # a decode-shaped graph (6 rows): gated_linear then folds the op into gate_up's GEMV
    ops = result.fused_ops
    assert ops.get("gated_act", 0) + ops.get("gated_linear", 0) == fused
    assert result.matches["gated_linear"] == ops.get("gated_linear", 0)
    with torch.no_grad():
        for got, want in zip(gm(x), m(x)):
            # fp32: F.silu vs the exported x * sigmoid(x), and the merged GEMM's blocking, differ
            # in the last bits; bf16: so do GEMM blocking and summation order, by up to an ulp.
            tolerance = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)

