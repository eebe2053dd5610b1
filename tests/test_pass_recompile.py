"""run_passes regenerates a step graph's code once, after its last pass
(`fuser.passes.base.deferred_recompile`), and its replacements are traced with one
decomposition table (`core_aten_table`), not one materialized per trace; the graph comes out
exactly as before both: same code, same logits, same cache writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from fuser.build import allocate_cache
from fuser.capture import StepModule, engine_view, export_step
import fuser.passes.base
from fuser.passes import PASSES, PassContext, run_passes
from fuser.passes.base import core_aten_table
from fuser.passes.fx import prepare_graph
from fuser.runtime.steps import DECODE, verify
from tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = dict(vocab=96, heads=4, kv_heads=2, head_dim=8, intermediate=40, layers=2,
             init_range=0.3, bos=None, eos=None, pad=None)


def _step(batch: int, tokens: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A fresh tiny Llama's fixed-T step exported as the build exports it, and its KV cache."""
    model = tiny_model("llama", seed=0, **SHAPE)
    cache = allocate_cache("target", model.config, batch, 24, torch.float32,
                           torch.device("cpu"), 16)
    view = engine_view(model, torch.float32, torch.device("cpu"))
    module = StepModule(view, cache.k, cache.v, prefill=False, block_table=cache.block_table)
    return export_step(module, batch, tokens, max_tokens=24)[1], [*cache.k, *cache.v]


def _run(gm: torch.fx.GraphModule, cache: list[torch.Tensor], batch: int, tokens: int
         ) -> torch.Tensor:
    ids = torch.randint(0, SHAPE["vocab"], (batch, tokens), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3, 3 + tokens)[None].expand(batch, tokens).contiguous()
    lens = torch.full((batch,), 3, dtype=torch.long)
    for t in cache:
        t.copy_(torch.linspace(-1, 1, t.numel()).view_as(t))
    with torch.no_grad():
        return gm(ids, positions, lens, torch.zeros(batch, dtype=torch.long))


@settings(max_examples=3, deadline=None, derandomize=True)
@given(batch=st.sampled_from([1, 3, 8]), gamma=st.sampled_from([0, 3]))
def test_one_recompile_same_graph(batch: int, gamma: int) -> None:
    kind = DECODE if gamma == 0 else verify(gamma)
    context = PassContext(f"target.{kind.name}", kind,
                          fuser.FuserConfig(gamma=max(gamma, 1), compile="fx"), "target")
    # As before: every pass recompiling (each applied on its own, outside run_passes), every
    # trace materializing its own decomposition table.
    from torch._decomp import core_aten_decompositions
    from torch.export.decomp_utils import CustomDecompTable

    materialized = {"each": 0, "once": 0}
    phase = "each"
    materialize = CustomDecompTable.materialize

    def counted_materialize(self: CustomDecompTable) -> dict:
        materialized[phase] += 1
        return materialize(self)

    each, each_cache = _step(batch, kind.tokens)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CustomDecompTable, "materialize", counted_materialize)
        patch.setattr(fuser.passes.base, "core_aten_table", core_aten_decompositions)
        prepare_graph(each)
        for p in PASSES:
            if p.applies(context):
                p.apply(each, context)
    # run_passes, counting the regenerations of its graph's code.
    once, once_cache = _step(batch, kind.tokens)
    recompiles = []
    recompile = torch.fx.GraphModule.recompile

    def counted(self: torch.fx.GraphModule) -> object:
        if self is once:
            recompiles.append(1)
        return recompile(self)

    phase = "once"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.fx.GraphModule, "recompile", counted)
        patch.setattr(CustomDecompTable, "materialize", counted_materialize)
        result = run_passes(once, context)
    assert result.errors == []
    assert sum(result.matches.values()) > 0
    assert recompiles == [1]
    assert materialized["once"] <= 1 < materialized["each"]  # <= 1: the table's first use
    assert once.code == each.code
    assert torch.equal(_run(once, once_cache, batch, kind.tokens),
                       _run(each, each_cache, batch, kind.tokens))
    assert all(torch.equal(a, b) for a, b in zip(once_cache, each_cache))


def test_core_aten_table_is_kept() -> None:
    from torch._decomp import core_aten_decompositions

    table = core_aten_table()
    assert core_aten_table() is table
    assert table.keys() == dict(core_aten_decompositions().items()).keys()
