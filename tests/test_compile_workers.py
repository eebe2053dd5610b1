"""A build that compiles with Inductor on CUDA starts Inductor's Triton compile workers before
its first export (`fuser.build.start_compile_workers`), so that they are up by the first
kernel; FX builds and CPU builds (whose kernels compile on threads) start none."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
import fuser.build
import fuser.pipeline
from fuser.build import start_compile_workers
from tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_only_for_inductor_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.async_compile as async_compile

    started: list[int] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(1))
    assert start_compile_workers("fx", CUDA) is False
    assert start_compile_workers("inductor", CPU) is False
    assert started == []
    assert start_compile_workers("inductor", CUDA) is True
    assert started == [1]


@pytest.mark.parametrize("mode", ["inductor", "fx"])
def test_asked_before_the_first_export(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    events: list[object] = []
    start = fuser.build.start_compile_workers
    monkeypatch.setattr(fuser.pipeline, "start_compile_workers",
                        lambda *a: events.append(("workers", *a)) or start(*a))
    export = fuser.build.export_step
    monkeypatch.setattr(fuser.build, "export_step",
                        lambda *a, **k: events.append("export") or export(*a, **k))
    # The rewritten graph stands in for Inductor's code: the order is what is tested here.
    monkeypatch.setattr(fuser.build, "compile_step",
                        lambda gm, device: events.append("compile") or gm)
    model = tiny_model("llama", seed=0, vocab=64, heads=2, kv_heads=1, head_dim=8,
                       intermediate=24, layers=1)
    config = fuser.FuserConfig(max_batch_size=1, max_seq_len=16, compile=mode, gamma=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(model, config=config)
    assert events[:2] == [("workers", mode, CPU), "export"]
    assert events.count("compile") == (mode == "inductor")  # the decode step
    assert engine.report().fallbacks == []
    assert engine.generate(torch.tensor([[5, 7, 9]]), 4).shape == (1, 7)
