"""The tensor-parallel engine on 2 GPUs (NCCL; rank r on cuda:r), as
tests/test_tensor_parallel_engine.py runs it on the CPU: greedy tokens, target-only and
speculative, equal Hugging Face's up to its first near-tie, through generate, the Scheduler and
a saved and loaded engine directory. Needs 2 CUDA devices (`bash benchmarks/gpu.sh tp`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import fuser
from engines import assert_greedy_matches, hf_greedy, llama_target, perturbed, prompts
from fuser import SamplingParams, Scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("tensor_parallel_cuda"),
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices (NCCL)")]


@pytest.mark.parametrize("cuda_graphs, one_shot", [(True, False), (False, False), (True, True)],
                         ids=["graphs", "no-graphs", "graphs-one-shot"])
def test_two_gpus_generate_schedule_save_load(tmp_path: Path, cuda_graphs: bool, one_shot: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """graphs: the iterations are CUDA graphs on both ranks (the follower captures its part
    with rank 0's capture and replays it with each replay), and they do replay. one-shot: the
    all-reduces one-shot through peer buffers (fuser/ops/p2p_all_reduce.py), not NCCL."""
    if one_shot:  # read by every rank's all_reduce (the follower inherits the environment)
        monkeypatch.setenv("FUSER_ONE_SHOT_ALL_REDUCE", "1")
    target = llama_target().to("cuda:0")  # the follower receives it by CUDA IPC
    draft = perturbed(target, 0.05, seed=3)
    config = fuser.FuserConfig(device="cuda:0", max_seq_len=64, max_batch_size=2,
                               batch_buckets=(1, 2), gamma=3, tensor_parallel=2,
                               cuda_graphs=cuda_graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft, config)
    if one_shot:  # installed on rank 0 (the follower does the same in its _init_group)
        from fuser.ops import p2p_all_reduce

        assert p2p_all_reduce.installed(torch.device("cuda:0")) is not None
    ids, mask = prompts([7, 9], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    ref, near_tie = hf_greedy(target, ids, mask, 16)
    try:
        for gamma in (0, None):
            engine.fix_gamma(gamma)
            out = engine.generate(ids, 16, attention_mask=mask)
            assert_greedy_matches(out.cpu(), ref.cpu(), near_tie.cpu(), ids.cpu(), [])
        scheduler = Scheduler(engine)
        scheduler.start()
        try:
            got = scheduler.submit(ids[1].tolist(), SamplingParams(max_tokens=16)).result(120)
        finally:
            scheduler.close()
        assert_greedy_matches(torch.tensor([ids[1].tolist() + got]), ref[1:].cpu(),
                              near_tie[1:].cpu(), ids[1:].cpu(), [])
        engine.fix_gamma(None)
        expected = engine.generate(ids, 16, attention_mask=mask)
        replays = sum(n for name, n in engine.report().graph_replays.items()
                      if name.startswith("step.b2.gamma3"))
        assert (replays > 0) == cuda_graphs, engine.report().graph_replays
        engine.save(tmp_path / "engine")
    finally:
        engine.close()
    loaded = fuser.load(tmp_path / "engine")
    try:
        assert torch.equal(loaded.generate(ids, 16, attention_mask=mask), expected)
    finally:
        loaded.close()
