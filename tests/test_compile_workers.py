"""A build that compiles with Inductor starts Inductor's compile workers before its first
export (`fuser.build.start_compile_workers`), so that they are up by the first kernel; an FX
build starts none."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
import fuser.build
from fuser.build import start_compile_workers
from tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order: "pool" (the workers asked to start), "export", "compile"."""
    import torch._inductor.async_compile as async_compile

    happened: list[str] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: happened.append("pool"))
    export = fuser.build.export_step
    monkeypatch.setattr(fuser.build, "export_step",
                        lambda *a, **k: happened.append("export") or export(*a, **k))
    # The rewritten graph stands in for Inductor's code: the order is what is tested here.
    monkeypatch.setattr(fuser.build, "compile_step",
                        lambda gm, device: happened.append("compile") or gm)
    return happened


def test_only_for_inductor(events: list[str]) -> None:
    assert start_compile_workers("fx") is False and events == []
    assert start_compile_workers("inductor") is True and events == ["pool"]


@pytest.mark.parametrize(("mode", "first"), [("inductor", ["pool", "export"]),
                                             ("fx", ["export"])])
def test_build_starts_workers_first(events: list[str], mode: str, first: list[str]) -> None:
    model = tiny_model("llama", seed=0, vocab=64, heads=2, kv_heads=1, head_dim=8,
                       intermediate=24, layers=1)
    config = fuser.FuserConfig(max_batch_size=1, max_seq_len=16,
                               compile=mode, gamma=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(model, config=config)
    assert events[:len(first)] == first and events.count("pool") == first.count("pool")
    assert events.count("compile") == (mode == "inductor")  # the decode step
    assert engine.report().fallbacks == []
    ids = torch.tensor([[5, 7, 9]])
    assert engine.generate(ids, 4).shape == (1, 7)
