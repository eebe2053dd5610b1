"""passes/common_subexpressions.py: prefill and chunk graphs compute each layer's cache indices
once.

Checked: identical index math merged and reads of a written tensor kept apart (one small graph,
values equal to the unmerged graph's); scalars of another type kept apart; the paged engine's
chunk graph, whose paged indices (a gather of the block table, ...) come once instead of once a
layer, and whose logits and caches are bitwise those of the same graph without the pass.
"""

from __future__ import annotations

import copy

import torch

from engines import paged_engine
from fuser.capture import export_step
from fuser.passes import PASSES, run_passes
from fuser.passes.common_subexpressions import COMMON_SUBEXPRESSIONS, merge_common_subexpressions
from fuser.passes.fx import count_targets
from fuser.runtime.steps import CHUNK, DECODE, PREFILL
from tiny import pass_context

aten = torch.ops.aten


def _index_graph() -> torch.fx.GraphModule:
    """Two layers as a chunk step writes its cache: each computes the slots from seq_lens, sums
    the cache (before, then after its own in-place write) and writes it at those slots."""
    graph = torch.fx.Graph()
    cache, lens, values = (graph.placeholder(n) for n in ("cache", "lens", "values"))
    outs = []
    for _ in range(2):
        offsets = graph.call_function(aten.arange.start_step, (0, 3), {"dtype": torch.int64})
        slots = graph.call_function(aten.add.Tensor, (lens, offsets))       # [3]
        before = graph.call_function(aten.sum.default, (cache,))
        graph.call_function(aten.index_put_.default, (cache, [slots], values))
        after = graph.call_function(aten.sum.default, (cache,))
        outs += [before, after, graph.call_function(aten.mul.Tensor, (slots, 2))]
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_index_math_merges_and_reads_of_a_written_cache_do_not() -> None:
    gm = _index_graph()
    want_gm = copy.deepcopy(gm)
    merged = merge_common_subexpressions(gm, pass_context("target.chunk", CHUNK))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert merged == 3                                   # arange, add, mul of the second layer
    assert count_targets(gm, aten.arange.start_step) == count_targets(gm, aten.add.Tensor) == 1
    assert count_targets(gm, aten.sum.default) == 4      # every read of the cache stays
    assert count_targets(gm, aten.index_put_.default) == 2
    args = (torch.zeros(8), torch.tensor(2), torch.tensor([1.0, 2.0, 3.0]))
    want = want_gm(args[0].clone(), *args[1:])
    got = gm(args[0].clone(), *args[1:])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [float(x) for x in got[:4:3]] == [0.0, 6.0]  # layer 2 reads layer 1's write


def test_the_sizes_of_a_written_cache_stay_mergeable() -> None:
    # rows = arange(cache.shape[0]) in each layer, after a write into the cache: one size read,
    # one arange.
    graph = torch.fx.Graph()
    cache, values = graph.placeholder("cache"), graph.placeholder("values")
    outs = []
    for _ in range(2):
        rows = graph.call_function(aten.sym_size.int, (cache, 0))
        index = graph.call_function(aten.arange.start_step, (0, rows), {"dtype": torch.int64})
        graph.call_function(aten.index_put_.default, (cache, [index], values))
        outs.append(index)
    graph.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert merge_common_subexpressions(gm, pass_context("target.prefill", PREFILL)) == 2
    assert count_targets(gm, aten.arange.start_step) == count_targets(gm, aten.sym_size.int) == 1
    cache = torch.zeros(3)
    got = gm(cache, torch.ones(3))
    assert torch.equal(got[0], torch.arange(3)) and torch.equal(cache, torch.ones(3))


def test_scalars_of_another_type_and_random_ops_are_not_merged() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ints = graph.call_function(aten.add.Tensor, (x, 1))
    floats = graph.call_function(aten.add.Tensor, (x, 1.0))
    real = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
    noise = [graph.call_function(aten.rand_like.default, (real,)) for _ in range(2)]
    graph.output((ints, floats, *noise))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert merge_common_subexpressions(gm, pass_context("target.prefill", PREFILL)) == 0
    out = gm(torch.arange(3))
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.float32
    assert not torch.equal(out[2], out[3])


def test_only_the_uncompiled_steps_take_it() -> None:
    assert COMMON_SUBEXPRESSIONS.applies(pass_context("target.chunk", CHUNK))
    assert COMMON_SUBEXPRESSIONS.applies(pass_context("target.prefill", PREFILL))
    assert not COMMON_SUBEXPRESSIONS.applies(pass_context("target.decode", DECODE))


def test_the_paged_chunk_graph_computes_its_indices_once_and_the_same_values() -> None:
    """The engine's chunk graph: one gather of the block table (each layer had its own), the
    writes as they were; the same graph exported again and rewritten without the pass gives
    bitwise the same logits and caches for a chunk after a cached prefix."""
    engine = paged_engine()
    steps = engine.buckets[1].target
    layers = len(steps.cache.k)
    chunk = steps.steps[CHUNK]
    assert chunk.matches["common_subexpressions"] >= layers - 1
    assert count_targets(chunk.rewritten, aten.gather.default) == 1
    assert count_targets(chunk.rewritten, aten.index_put_.default) == 2 * layers

    _, unmerged = export_step(chunk.eager, steps.cache.batch_size, None,
                              max_tokens=steps.cache.slots)
    without = [p for p in PASSES if p is not COMMON_SUBEXPRESSIONS]
    result = run_passes(unmerged, pass_context("target.chunk", CHUNK), without)
    assert result.errors == [] and count_targets(unmerged, aten.gather.default) == layers

    cache = steps.cache
    g = torch.Generator().manual_seed(0)
    B, T, prefix = cache.batch_size, 6, 9
    tokens = torch.randint(0, steps.vocab_size, (B, T), generator=g)
    positions = prefix + torch.arange(T)[None].expand(B, T)
    seq_lens = torch.full((B,), prefix, dtype=torch.long)
    starts = torch.zeros(B, dtype=torch.long)
    pools = [*cache.k, *cache.v]
    kept = [p.clone() for p in pools]  # the shared engine's pools, put back at the end
    try:
        for pool in pools:
            pool.copy_(torch.randn(pool.shape, generator=g).to(pool.dtype))
        before = [p.clone() for p in pools]
        outs, after = [], []
        for gm in (chunk.rewritten, unmerged):
            for pool, old in zip(pools, before):
                pool.copy_(old)
            with torch.no_grad():
                outs.append(gm(tokens, positions, seq_lens, starts))
            after.append([p.clone() for p in pools])
    finally:
        for pool, old in zip(pools, kept):
            pool.copy_(old)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*after))
    assert not all(torch.equal(a, b) for a, b in zip(after[0], before))  # the chunk was written
