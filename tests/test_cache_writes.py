"""passes/cache_writes.py: prefill and chunk steps write their KV caches in place.

Export leaves each cache write functional (`index_put` into a new cache, `copy_` back at the
end); a step that runs uncompiled then copied every layer's whole cache per prompt and held a
second cache's worth of memory. Checked here: the rewrite on one layer (values and caches
bitwise equal to eager), the writes it must leave alone, and the engines' prefill and chunk
steps, contiguous and paged, which no longer make any cache-sized tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engines import engine_and_target, paged_engine
from fuser.passes import run_passes
from fuser.passes.cache_writes import CACHE_WRITES, write_caches_in_place
from fuser.passes.fx import count_targets
from fuser.runtime.steps import CHUNK, DECODE, PREFILL, StepKind
from test_rotary_cache import assert_runs_as_eager, exported_layer
from tiny import pass_context

aten = torch.ops.aten


@pytest.mark.parametrize("variant", ["clean", "old_cache_read", "cache_read_elsewhere"])
def test_a_prefill_layer_writes_its_caches_in_place(variant: str) -> None:
    """One layer as capture writes it (rotary, two cache writes, attention over the caches),
    exported and run as prefill: both writes in place, no copy back; output and caches equal to
    eager, bit for bit (a read of the old cache before the writes, or of the new one after them,
    changes nothing)."""
    gm, eager, args, want = exported_layer(variant, tokens=3)
    assert count_targets(gm, aten.index_put.default) == 2  # what export leaves: functional
    result = run_passes(gm, pass_context("target.prefill", PREFILL))
    assert result.errors == [] and result.matches["cache_writes"] == 2
    assert count_targets(gm, aten.index_put.default) == count_targets(gm, aten.copy_.default) == 0
    assert count_targets(gm, aten.index_put_.default) == 2
    assert_runs_as_eager(gm, eager, args, want)


def test_fixed_t_steps_are_left_to_rotary_cache_and_inductor() -> None:
    assert not CACHE_WRITES.applies(pass_context("target.decode", DECODE))
    assert not CACHE_WRITES.applies(pass_context("target.verify", StepKind("verify", 3)))
    assert CACHE_WRITES.applies(pass_context("target.prefill", PREFILL))
    assert CACHE_WRITES.applies(pass_context("target.chunk", CHUNK))


def _write_graph(read_old_after: bool = False, accumulate: bool = False,
                 copy_read: bool = False) -> torch.fx.GraphModule:
    """cache[rows, slots] = values as export leaves it, with one condition broken."""
    graph = torch.fx.Graph()
    cache, rows, slots, values = (graph.placeholder(n) for n in ("cache", "rows", "slots", "values"))
    write = graph.call_function(aten.index_put.default, (cache, [rows, slots], values, accumulate))
    out = graph.call_function(aten.sum.default, (write,))
    if read_old_after:
        out = graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.sum.default,
                                                                            (cache,))))
    copy = graph.call_function(aten.copy_.default, (cache, write))
    if copy_read:
        out = graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.sum.default,
                                                                            (copy,))))
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("broken", ["read_old_after", "accumulate", "copy_read"])
def test_writes_that_cannot_happen_in_place_are_left_alone(broken: str) -> None:
    """A read of the old cache after the write (in place it would see the new slots), an
    accumulating write, and a copy back whose result is read keep their functional write; the
    unbroken graph is rewritten and computes the same."""
    def run(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        rows, slots = torch.tensor([0, 2]), torch.tensor([1, 5])
        out = gm(cache, rows, slots, torch.tensor([100.0, 200.0]))
        return out, cache

    context = pass_context("target.prefill", PREFILL)
    clean, reference = _write_graph(), _write_graph()
    assert write_caches_in_place(clean, context) == 1
    clean.recompile()
    for got, want in zip(run(clean), run(reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    gm = _write_graph(**{broken: True})
    assert write_caches_in_place(gm, context) == 0
    assert count_targets(gm, aten.index_put.default) == 1


class _CacheCopies(TorchDispatchMode):
    """Records every op output shaped like one of `caches` that is not one of them."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        super().__init__()
        self.shapes = {tuple(c.shape) for c in caches}
        self.storages = {c.untyped_storage().data_ptr() for c in caches}
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes
                    and t.untyped_storage().data_ptr() not in self.storages):
                self.copies.append(f"{func} -> {tuple(t.shape)}")
        return out


@pytest.mark.parametrize("paged", [False, True])
def test_engine_prompts_make_no_copy_of_a_cache(paged: bool) -> None:
    """The engines' prefill (and, paged, chunk) graphs hold no functional cache write, and a
    prompt run through them makes no tensor the shape of a cache layer (before the rewrite: one
    per layer and cache, all alive until the graph's end)."""
    engine = paged_engine() if paged else engine_and_target("plain")[0]
    steps = engine.target
    kinds = [PREFILL, CHUNK] if paged else [PREFILL]
    for kind in kinds:
        gm = steps.steps[kind].rewritten
        assert count_targets(gm, aten.index_put.default) == 0, kind
        assert count_targets(gm, aten.index_put_.default) == 2 * len(steps.cache.k), kind
    cache = steps.cache
    B, T = cache.batch_size, 5
    tokens = torch.randint(0, steps.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T)[None].expand(B, T).contiguous()
    cache.reset()
    with torch.no_grad(), _CacheCopies([*cache.k, *cache.v]) as seen:
        steps.run(PREFILL, tokens, positions)
    cache.reset()
    assert seen.copies == []
