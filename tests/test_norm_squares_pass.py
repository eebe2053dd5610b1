"""The norm_squares pass: a GEMV feeding add_rms_norm_linear becomes fuser::linear_add_squares +
fuser::squares_norm_linear (passes/norm_squares.py).

On whole tiny engines: FP8 decode and the several-row (verify) graphs of a bf16 engine get two
rewrites per layer (o_proj -> gate/up, down_proj -> the next qkv or the final norm + LM head),
a bf16 one-row decode graph none (its GEMVs stay the stream kernel's); the fused ops are there
and the ops they replace are gone; greedy output equals the engine built without the pass (the
CPU references are bit for bit the ops they replace). On a hand-built graph: a GEMV output read
elsewhere too is left alone.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph

import fuser
from fuser.passes import PASSES
from fuser.passes.norm_squares import ADD_SQUARES, NORM_LINEAR, SQUARES_NORM, _gemv_operand
from fuser.runtime.steps import DECODE
from tiny import random_prompts, tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
MODEL = dict(family="llama", seed=2)
VOCAB = 150  # below the tiny models' vocabulary


def _engine(precision: str, without: str | None = None, draft: bool = False) -> fuser.Engine:
    """A tiny Llama engine (draft: itself as the draft, so verify graphs exist)."""
    config = fuser.FuserConfig(max_batch_size=1, batch_buckets=(1,), max_seq_len=48,
                               precision=precision, **({"gamma": 2} if draft else {}))
    original = list(PASSES)
    PASSES[:] = [p for p in PASSES if p.name != without]
    try:
        model = tiny_model(**MODEL)
        return fuser.optimize(model, draft=tiny_model(**MODEL) if draft else None, config=config)
    finally:
        PASSES[:] = original


def _count(gm: torch.fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_two_rewrites_per_layer_where_the_kernels_run_both_gemvs(precision: str) -> None:
    engine = _engine(precision, draft=True)
    layers = tiny_model(**MODEL).config.num_hidden_layers
    rewritten = 0
    for model_steps in (engine.target, engine.draft):
        for kind, step in model_steps.steps.items():
            gm = step.rewritten
            want = 2 * layers if kind.fixed and (precision == "fp8" or kind.tokens > 1) else 0
            assert _count(gm, ADD_SQUARES) == want, (step.name, precision)
            assert _count(gm, SQUARES_NORM) == want, step.name
            if want:
                assert _count(gm, NORM_LINEAR) == 0, step.name  # every one was after a GEMV
            assert step.matches.get("norm_squares", 0) == want, step.name
            rewritten += want
    assert rewritten > 0
    # report().passes: the target's decode graph
    assert engine.report().passes["norm_squares"] == (2 * layers if precision == "fp8" else 0)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_speculative_greedy_output_equals_the_engine_without_the_pass(precision: str) -> None:
    ids, mask = random_prompts(1, [7], VOCAB, seed=5)
    with_pass = _engine(precision, draft=True)
    without = _engine(precision, without="norm_squares", draft=True)
    assert without.report().passes.get("norm_squares", 0) == 0
    ours = with_pass.generate(ids, 8, attention_mask=mask)
    assert torch.equal(ours, without.generate(ids, 8, attention_mask=mask))


def test_a_gemv_output_read_elsewhere_is_left_alone() -> None:
    graph = Graph()
    x, w, r, g, w2 = (graph.placeholder(n) for n in ("x", "w", "r", "g", "w2"))
    y = graph.call_function(torch.ops.fuser.linear.default, (x, w))
    view = graph.call_function(torch.ops.aten.view.default, (y, [1, 1, 8]))
    norm = graph.call_function(NORM_LINEAR, (r, view, g, 1e-6, w2, None, None))
    out = graph.call_function(operator.getitem, (norm, 0))
    graph.output((out,))
    gemv, views, other = _gemv_operand(norm)
    assert gemv is y and views == [view] and other is r
    graph.call_function(torch.ops.aten.neg.default, (y,))  # a second reader of y
    assert _gemv_operand(norm) is None


def test_decode_graph_of_a_bf16_engine_is_left_alone() -> None:
    engine = _engine("bf16")
    gm = engine.target.steps[DECODE].rewritten
    assert _count(gm, ADD_SQUARES) == 0 and _count(gm, NORM_LINEAR) > 0
