"""Batch buckets share the build: one export for a model's fixed-T steps and one for its
prefill, whatever the number of buckets and steps, and each bucket's steps are the ones a build
of that bucket alone makes (same rewrites, same logits)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
from engines import perturbed, prompts
from fuser.runtime.steps import PREFILL
from tiny import tiny_model

SHAPE = dict(vocab=160, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
             init_range=0.3, bos=None, eos=None, pad=None)
BUCKETS = (1, 2, 4)

# One xdist worker runs the module: the shared engine (~20 s on a 2-core CPU) is built once.
pytestmark = pytest.mark.xdist_group("engine_build_buckets")


def build(buckets: tuple[int, ...], monkeypatch: pytest.MonkeyPatch | None = None
          ) -> tuple[fuser.Engine, int]:
    """A speculative engine of `buckets` (draft: the target with noise), and how many times
    torch.export ran while building it."""
    target = tiny_model("llama", seed=0, **SHAPE)
    draft = perturbed(target, 0.05, seed=3)
    exports = []
    if monkeypatch is not None:
        export = torch.export.export
        monkeypatch.setattr(torch.export, "export",
                            lambda *a, **k: exports.append(1) or export(*a, **k))
    config = fuser.FuserConfig(max_batch_size=max(buckets), batch_buckets=buckets,
                               max_seq_len=40, gamma=3, compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=draft, config=config)
    return engine, len(exports)


@pytest.fixture(scope="module")
def shared() -> fuser.Engine:
    with pytest.MonkeyPatch.context() as monkeypatch:
        engine, exports = build(BUCKETS, monkeypatch)
    engine.exports = exports
    return engine


def test_two_exports_per_model(shared: fuser.Engine) -> None:
    # target: prefill, decode, verify4; draft: prefill, decode, catchup, resync; 3 buckets
    assert shared.exports == 4
    assert sorted(shared.buckets) == list(BUCKETS)
    assert shared.report().fallbacks == []


@pytest.mark.parametrize("size", [1, 2])
def test_each_bucket_is_what_its_own_build_makes(shared: fuser.Engine, size: int) -> None:
    alone, _ = build((size,))
    mine, theirs = shared.buckets[size], alone.buckets[size]
    for role in ("target", "draft"):
        steps, own = getattr(mine, role), getattr(theirs, role)
        assert list(steps.steps) == list(own.steps)
        for kind, graph in steps.steps.items():
            assert graph.matches == own[kind].matches and graph.fused_ops == own[kind].fused_ops, \
                (role, kind)
    ids, mask = prompts([5, 3][:size], seed=size)
    want = alone.generate(ids, 10, attention_mask=mask)
    assert torch.equal(shared.generate(ids, 10, attention_mask=mask), want)


def test_prefill_is_one_graph_over_each_buckets_rows(shared: fuser.Engine) -> None:
    graphs = [b.target[PREFILL].rewritten for b in shared.buckets.values()]
    codes = {g.code for g in graphs}
    assert len(codes) == 1  # one rewritten graph ...
    for size, bucket in shared.buckets.items():  # ... over each bucket's own cache rows
        assert bucket.target[PREFILL].rewritten.k_cache_0 is bucket.target.cache.k[0]
        assert bucket.target.cache.k[0].shape[0] == size
