"""The one-shot all-reduce over peer-to-peer memory (fuser/ops/p2p_all_reduce.py): where
`fuser::all_reduce` sends a message, and on 2 GPUs that its sums equal NCCL's, eagerly and
replayed from a CUDA graph."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import fuser.ops.collectives  # noqa: F401  (registers fuser::all_reduce)
from fuser.ops import p2p_all_reduce
from fuser.ops.p2p_all_reduce import P2PAllReduce
from ranks import free_port, run_ranks

WORKER = Path(__file__).parent / "p2p_all_reduce_worker.py"


class _Recorder:
    """Stands in for an installed one-shot all-reduce: takes messages up to max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.calls = max_bytes, []

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return x * 3  # what a 3-rank sum of equal inputs gives


@pytest.fixture
def recorder():
    rec = _Recorder(max_bytes=64)
    p2p_all_reduce._INSTALLED[torch.device("cpu")] = rec
    yield rec
    p2p_all_reduce.uninstall()


def test_small_messages_go_one_shot_and_large_ones_keep_the_fallback(recorder) -> None:
    small, large = torch.ones(16), torch.ones(17)  # 64 and 68 bytes of fp32
    assert torch.equal(torch.ops.fuser.all_reduce(small), small * 3)
    assert recorder.calls == [(16,)]
    # Over the limit: the process-group path (no group here: a copy).
    assert torch.equal(torch.ops.fuser.all_reduce(large), large)
    assert recorder.calls == [(16,)]


def test_uninstall_restores_the_fallback(recorder) -> None:
    p2p_all_reduce.uninstall("cpu")
    x = torch.ones(4)
    assert torch.equal(torch.ops.fuser.all_reduce(x), x) and recorder.calls == []


def test_install_without_a_process_group_keeps_nccl(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="fuser"):
        assert p2p_all_reduce.install() is None
    assert "no process group" in caplog.text
    assert p2p_all_reduce.installed(torch.device("cpu")) is None


def test_staging_views_the_start_of_the_buffer() -> None:
    p2p = P2PAllReduce.__new__(P2PAllReduce)  # the buffer only (no rendezvous on the CPU)
    p2p.buffer, p2p.max_bytes, p2p.device = torch.zeros(64, dtype=torch.uint8), 64, \
        torch.device("cpu")
    staged = p2p.staged(torch.Size([2, 4]), torch.bfloat16)
    assert staged.shape == (2, 4) and staged.dtype == torch.bfloat16
    staged.fill_(1.0)
    assert p2p.buffer[:16].view(torch.bfloat16).eq(1.0).all() and p2p.buffer[16:].eq(0).all()
    assert p2p.fits(torch.ones(16)) and not p2p.fits(torch.ones(17))
    assert not p2p.fits(torch.ones(2, dtype=torch.int64))  # sums of floats only


def test_max_bytes_must_be_a_multiple_of_16() -> None:
    group = type("Group", (), {"group_name": "0"})()
    with pytest.raises(ValueError, match="max_bytes=10"):
        P2PAllReduce(group, torch.device("cpu"), max_bytes=10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (P2P, NCCL)")
def test_cuda_one_shot_equals_nccl_eager_and_graphed(tmp_path: Path) -> None:
    world_size, port = 2, free_port()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    outs = [tmp_path / f"rank{r}.pt" for r in range(world_size)]
    logs = run_ranks([[sys.executable, str(WORKER), str(r), str(world_size), str(port),
                       str(outs[r])] for r in range(world_size)], env, 300)
    results = [torch.load(o) for o in outs]
    assert all(res["installed"] for res in results), logs
    cases = [k for k in results[0] if k != "installed"]
    assert [results[0][k]["one_shot"] for k in cases] == [True, True, False]
    for key in cases:
        total = sum(res[key]["x"].double() for res in results)
        for r, res in enumerate(results):
            case = res[key]
            # Two ranks: one rounding of a + b whatever the order, so NCCL's bits exactly.
            assert torch.equal(case["eager"], case["nccl"]), (key, r)
            assert torch.equal(case["graphed"], case["eager"] * 2), (key, r)  # replayed on 2x
            torch.testing.assert_close(case["eager"].double(), total, rtol=1e-2, atol=1e-2)
            assert torch.equal(case["eager"], results[0][key]["eager"]), (key, r)
