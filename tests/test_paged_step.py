"""A model's step over a paged KV cache (fuser/capture.py with a block table): the same logits
as over the contiguous cache, bit for bit in fp32, through a prefill with left padding, decode
steps, a verify-sized step and a rollback; the pools read through the table hold what the
contiguous cache holds. The rows' blocks are scattered over the pool in a random order, unowned
table entries point at the null block, and every pool block starts as garbage.
"""

from __future__ import annotations

import pytest
import torch

from fuser.capture import StepModule, engine_view, export_step
from fuser.ops.attention import paged_view
from tiny import tiny_model

B, S, PAGE, KV, D, LAYERS = 3, 24, 4, 2, 16, 2


def caches(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                               list[torch.Tensor], torch.Tensor]:
    """Contiguous caches (zeros), pools of garbage, and a table of scattered blocks."""
    max_blocks = S // PAGE
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + B * max_blocks + 2
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = order[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    table[0, -2:] = 0  # row 0 never gets that far: its last entries are the null block
    k = [torch.zeros(B, S, KV, D) for _ in range(LAYERS)]
    v = [torch.zeros(B, S, KV, D) for _ in range(LAYERS)]
    kp = [torch.randn(num_blocks, PAGE, KV, D, generator=g) for _ in range(LAYERS)]
    vp = [torch.randn(num_blocks, PAGE, KV, D, generator=g) for _ in range(LAYERS)]
    return k, v, kp, vp, table


def test_paged_steps_equal_contiguous_steps() -> None:
    model = tiny_model("llama", layers=LAYERS, init_range=0.3)
    view = engine_view(model, torch.float32, torch.device("cpu"))
    k, v, kp, vp, table = caches(0)
    contiguous = {p: StepModule(view, k, v, prefill=p) for p in (True, False)}
    paged = {p: StepModule(view, kp, vp, prefill=p, block_table=table) for p in (True, False)}

    pad = torch.tensor([4, 0, 7])                       # left padding per row
    T = 9
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 160, (B, T), generator=g)
    positions = (torch.arange(T)[None] - pad[:, None]).clamp(min=0)
    starts, lens = pad.clone(), torch.zeros(B, dtype=torch.int64)

    def step(prefill: bool, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            want = contiguous[prefill](tokens, positions, lens, starts)
            got = paged[prefill](tokens, positions, lens, starts)
        assert torch.equal(got, want)
        n = int(lens.max()) + tokens.shape[1]
        for pool, cache in zip(kp + vp, k + v):
            view_ = paged_view(pool, table)
            for b in range(B):
                m = min(int(lens[b]) + tokens.shape[1], S)
                assert torch.equal(view_[b, :m], cache[b, :m]), (b, m, n)
        return want

    logits = step(True, tokens, positions)               # prefill
    lens += T
    for _ in range(2):                                   # decode
        nxt = logits[:, -1:].argmax(-1)
        logits = step(False, nxt, positions[:, -1:] + 1)
        positions = positions[:, -1:] + 1
        lens += 1
    three = torch.randint(3, 160, (B, 3), generator=g)  # a verify-sized step (gamma 2)
    logits = step(False, three, positions + 1 + torch.arange(3))
    lens += 1                                             # one of the three accepted: rollback
    logits = step(False, three[:, 1:2], positions + 2)  # overwrites the stale slots


def test_exported_paged_step_equals_exported_contiguous_step() -> None:
    """export_step records the paged cache writes (index_put on the pools through the table)
    and the attention's block table: the exported paged decode step equals the exported
    contiguous one (same decompositions on both sides) and writes the same slots."""
    model = tiny_model("llama", layers=LAYERS, init_range=0.3)
    view = engine_view(model, torch.float32, torch.device("cpu"))
    k, v, kp, vp, table = caches(2)
    for pool, cache in zip(kp + vp, k + v):   # the same old contents on both sides
        cache.copy_(paged_view(pool, table))
    _, paged = export_step(StepModule(view, kp, vp, prefill=False, block_table=table), B, 1,
                           max_tokens=S)
    _, contiguous = export_step(StepModule(view, k, v, prefill=False), B, 1, max_tokens=S)
    tokens = torch.tensor([[5], [9], [11]])
    lens = torch.tensor([3, 13, 0])
    positions, starts = lens[:, None].clone(), torch.tensor([0, 2, 0])
    with torch.no_grad():
        got = paged(tokens, positions, lens, starts)
        want = contiguous(tokens, positions, lens, starts)
    assert torch.equal(got, want)
    for pool, cache in zip(kp + vp, k + v):
        for b in range(B):
            owned = int((table[b] != 0).sum()) * PAGE
            assert torch.equal(paged_view(pool, table)[b, :owned], cache[b, :owned])
    attention = [n for n in paged.graph.nodes if n.target is torch.ops.fuser.cache_attention.default]
    assert len(attention) == LAYERS and all(len(n.args) == 9 for n in attention)


@pytest.mark.parametrize("tokens", [1, 3])
def test_passes_fuse_the_paged_write_and_attention(tokens: int) -> None:
    """rotary_cache and rotary_attention recognise the paged write (index_put at each slot's
    (block, offset)): the paged step becomes one fuser::rotary_cache_attention per layer with
    the table, and after every pass it equals the contiguous step after every pass."""
    from fuser.passes import run_passes
    from test_rotary_cache import pass_context

    model = tiny_model("llama", layers=LAYERS, init_range=0.3)
    view = engine_view(model, torch.float32, torch.device("cpu"))
    k, v, kp, vp, table = caches(3)
    for pool, cache in zip(kp + vp, k + v):   # the same old contents on both sides
        cache.copy_(paged_view(pool, table))
    graphs = {}
    for name, module in (("paged", StepModule(view, kp, vp, prefill=False, block_table=table)),
                         ("contiguous", StepModule(view, k, v, prefill=False))):
        _, gm = export_step(module, B, tokens, max_tokens=S)
        result = run_passes(gm, pass_context("target.decode"))
        assert result.matches["rotary_cache"] == result.matches["rotary_attention"] == LAYERS
        graphs[name] = gm
    fused = [n for n in graphs["paged"].graph.nodes
             if n.target is torch.ops.fuser.rotary_cache_attention.default]
    assert len(fused) == LAYERS and all(n.args[-1].target == "block_table" for n in fused)
    assert not any(n.target is torch.ops.aten.index_put.default for n in graphs["paged"].graph.nodes)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 160, (B, tokens), generator=g)
    lens = torch.tensor([3, 13, 0])
    positions = lens[:, None] + torch.arange(tokens)
    starts = torch.tensor([0, 2, 0])
    with torch.no_grad():
        got = graphs["paged"](ids, positions, lens, starts)
        want = graphs["contiguous"](ids, positions, lens, starts)
    assert torch.equal(got, want)
    for pool, cache in zip(kp + vp, k + v):
        for b in range(B):
            owned = int((table[b] != 0).sum()) * PAGE
            assert torch.equal(paged_view(pool, table)[b, :owned], cache[b, :owned])
