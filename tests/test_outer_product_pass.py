"""The outer_product pass: K = 1 matrix products (older transformers' rotary angles) become
multiplies, bit for bit, and nothing else changes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.passes import run_passes
from fuser.passes.fx import count_targets
from fuser.passes.outer_product import OUTER_PRODUCT
from tiny import export_like_capture, pass_context

aten = torch.ops.aten


class OldRotaryAngles(torch.nn.Module):
    """The rotary angles as transformers 5.17 computes them (LlamaRotaryEmbedding.forward)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv.float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class TwoTermProduct(torch.nn.Module):
    """A bmm over K = 2: not an outer product, left alone."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


@settings(max_examples=8, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), tokens=st.integers(1, 9), half=st.sampled_from([4, 8, 32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       start=st.integers(0, 100_000))
def test_rotary_angles_bmm_becomes_a_bit_equal_multiply(batch: int, tokens: int, half: int,
                                                        dtype: torch.dtype, start: int) -> None:
    module = OldRotaryAngles(2 * half)
    x = torch.zeros(batch, tokens, 2 * half, dtype=dtype)
    rows = torch.arange(tokens)[None].repeat(batch, 1)
    positions = start + rows * (1 + torch.arange(batch))[:, None]
    gm = export_like_capture(module, (x, positions))
    assert count_targets(gm, aten.bmm.default) == 1
    expected = gm(x, positions)
    result = run_passes(gm, pass_context("rotary"), [OUTER_PRODUCT])
    assert result.matches == {"outer_product": 1} and result.errors == []
    assert count_targets(gm, aten.bmm.default) == 0 and count_targets(gm, aten.mm.default) == 0
    for got, want in zip(gm(x, positions), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(gm(x, positions), module(x, positions), strict=True):
        assert torch.equal(got, want)


def test_products_over_more_than_one_term_stay() -> None:
    a, b = torch.randn(2, 3, 2), torch.randn(2, 2, 5)
    gm = export_like_capture(TwoTermProduct(), (a, b))
    result = run_passes(gm, pass_context("bmm"), [OUTER_PRODUCT])
    assert result.matches == {"outer_product": 0}
    assert count_targets(gm, aten.bmm.default) == 1
    assert torch.equal(gm(a, b), a @ b)


def test_integer_outer_product_stays() -> None:
    """Only floating-point products are rewritten (the pass's exactness argument is about one
    rounding; integers have none, but nothing needs them)."""
    a = torch.arange(6).reshape(2, 3, 1)
    b = torch.arange(8).reshape(2, 1, 4)
    gm = export_like_capture(TwoTermProduct(), (a, b))
    assert run_passes(gm, pass_context("int"), [OUTER_PRODUCT]).matches == {"outer_product": 0}
    assert torch.equal(gm(a, b), a @ b)
