"""The l2_prefetch pass and fuser/ops/l2_prefetch.py: attention prefetches o_proj's weight into L2.

CPU: the pass gives every fixed-T attention its o_proj weight (bf16 and FP8 engines, exact
counts, nothing in prefill graphs), leaves an attention whose output is read elsewhere alone,
keeps greedy output equal to an engine without the pass, and survives an engine file's round
trip; the launcher's arithmetic covers the bytes it is asked for in 16-byte pieces and turns
itself off where the hint cannot be given. GPU (Hopper): the prefetch changes no bit of
attention's output or of the caches, and it is really on there (not a vacuous pass).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

import fuser
from fuser.ops import l2_prefetch
from fuser.ops.l2_prefetch import ALIGN, prefetch_args
from fuser.passes import PASSES
from fuser.passes.l2_prefetch import ATTENTION, next_weight
from tiny import random_prompts, tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


MODEL = dict(family="llama", seed=1)


def _engine(precision: str, without: str | None = None) -> fuser.Engine:
    """A tiny Llama engine; `without`: a pass left out of PASSES while it builds."""
    config = fuser.FuserConfig(max_batch_size=1, batch_buckets=(1,), max_seq_len=32,
                               precision=precision)
    original = list(PASSES)
    PASSES[:] = [p for p in PASSES if p.name != without]
    try:
        return fuser.optimize(tiny_model(**MODEL), config=config)
    finally:
        PASSES[:] = original


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_every_fixed_t_attention_prefetches_its_o_proj_weight(precision: str) -> None:
    engine = _engine(precision)
    layers = tiny_model(**MODEL).config.num_hidden_layers
    report = engine.report()
    fixed = 0
    for kind, step in engine.target.steps.items():
        gm = step.rewritten
        attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTENTION]
        if not kind.fixed:
            assert not attentions
            continue
        fixed += 1
        assert attentions, step.name
        for node in attentions:
            weight = node.kwargs.get("prefetch")
            assert weight is not None, step.name
            assert weight is next_weight(node)
            # the GEMV after attention reads this very node as its weight
            gemv = next(u for u in weight.users if u is not node)
            assert gemv.target in (torch.ops.fuser.linear.default,
                                   torch.ops.fuser.fp8_linear.default)
            assert gemv.args[1] is weight
            assert "o_proj" in weight.target, weight.target
            if precision == "fp8":
                assert getattr(gm, weight.target).dtype == torch.float8_e4m3fn
        assert len(attentions) == layers
    assert fixed > 0
    assert report.passes["l2_prefetch"] == fixed * layers


def test_greedy_output_equals_the_engine_without_the_pass() -> None:
    ids, mask = random_prompts(1, [7], 150, seed=4)
    with_pass = _engine("bf16").generate(ids, 6, attention_mask=mask)
    without = _engine("bf16", without="l2_prefetch")
    assert without.report().passes.get("l2_prefetch", 0) == 0
    assert torch.equal(with_pass, without.generate(ids, 6, attention_mask=mask))


def test_an_attention_read_elsewhere_gets_no_prefetch() -> None:
    # attention -> view -> linear, plus a second reader of the view: no single GEMV follows
    graph = Graph()
    args = [graph.placeholder(f"a{i}") for i in range(9)]
    attention = graph.call_function(ATTENTION, (*args, 0.1, 0, 0.0))
    view = graph.call_function(torch.ops.aten.view.default, (attention, [1, -1]))
    weight = graph.get_attr("w")
    linear = graph.call_function(torch.ops.fuser.linear.default, (view, weight))
    graph.output((linear,))
    gm = GraphModule({"w": torch.nn.Parameter(torch.zeros(4, 4))}, graph)
    assert next_weight(attention) is weight
    extra = graph.call_function(torch.ops.aten.neg.default, (view,))
    assert next_weight(attention) is None
    graph.erase_node(extra)
    # a GEMV reading attention as its weight, not its x: no prefetch either
    other = graph.call_function(torch.ops.fuser.linear.default, (weight, view))
    linear.replace_all_uses_with(other)
    graph.erase_node(linear)
    assert next_weight(attention) is None
    del gm


def test_engine_file_round_trip_keeps_the_prefetch(tmp_path) -> None:
    engine = _engine("bf16")
    engine.save(tmp_path / "e")
    loaded = fuser.load(tmp_path / "e")
    for kind, step in loaded.target.steps.items():
        if kind.fixed:
            nodes = [n for n in step.rewritten.graph.nodes
                     if n.op == "call_function" and n.target is ATTENTION]
            assert nodes and all(n.kwargs.get("prefetch") is not None for n in nodes)
    ids, mask = random_prompts(1, [5], 150, seed=2)
    assert torch.equal(engine.generate(ids, 4, attention_mask=mask),
                       loaded.generate(ids, 4, attention_mask=mask))


# --- the launcher's side ------------------------------------------------------------------------


@pytest.mark.parametrize("numel,programs,lanes", [(4096 * 4096, 264, 128), (4096, 1, 128),
                                                  (100_000, 7, 64), (64 * 4096, 528, 256)])
@pytest.mark.parametrize("max_bytes", [None, 24 << 20, 1000])
def test_lanes_cover_the_bytes_in_aligned_pieces(numel: int, programs: int, lanes: int,
                                                 max_bytes: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l2_prefetch, "prefetch_supported", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", max_bytes)
    t = torch.zeros(numel, dtype=torch.uint8)
    fallback = torch.zeros(1)
    got, nbytes, chunk, on = prefetch_args(t, programs, lanes, fallback)
    assert on and got is t
    want = numel if max_bytes is None else min(numel, max_bytes)
    assert nbytes == want - want % ALIGN
    assert chunk % ALIGN == 0 and chunk >= ALIGN
    # prefetch_l2's lanes: lane g takes [g * chunk, min((g + 1) * chunk, nbytes))
    starts = torch.arange(programs * lanes, dtype=torch.int64) * chunk
    sizes = (nbytes - starts).clamp(min=0, max=chunk)
    assert int(sizes.sum()) == nbytes and bool((sizes % ALIGN == 0).all())


def test_the_hint_turns_itself_off(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = torch.zeros(1)
    t = torch.zeros(4096, dtype=torch.uint8)
    assert prefetch_args(t, 4, 128, fallback) == (fallback, 0, ALIGN, False)  # CPU
    assert prefetch_args(None, 4, 128, fallback)[3] is False
    monkeypatch.setattr(l2_prefetch, "prefetch_supported", lambda device: True)
    assert prefetch_args(t, 4, 128, fallback)[3] is True
    assert prefetch_args(t[1:], 4, 128, fallback)[3] is False  # not 16-byte aligned
    assert prefetch_args(t.view(64, 64).t(), 4, 128, fallback)[3] is False  # not contiguous
    assert prefetch_args(t[:8], 4, 128, fallback)[3] is False  # fewer bytes than one piece
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 0)
    assert prefetch_args(t, 4, 128, fallback)[3] is False


# --- GPU --------------------------------------------------------------------------------------


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper GPU")


@needs_hopper
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_prefetch_changes_no_bit(tokens: int, fp8: bool) -> None:
    from fuser.ops.rotary_attention import rotary_cache_attention_triton
    from test_rotary_cache import make_case

    case = make_case(1, 32, 8, tokens, 128, 128, 1024, torch.bfloat16, seed=tokens,
                     seq_lens=[300], merged=True)
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = case
    starts = torch.zeros(1, dtype=torch.int64, device="cuda")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    if fp8:
        w = w.to(torch.float8_e4m3fn)
    assert prefetch_args(w, 8, 128, q)[3]  # really on here
    outs = []
    for prefetch in (None, w):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = rotary_cache_attention_triton(q, k, v, cos, sin, kc, vc, seq_lens, starts,
                                            128**-0.5, 0, 0.0, prefetch)
        torch.cuda.synchronize()
        outs.append((out, kc, vc))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
