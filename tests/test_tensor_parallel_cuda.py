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
            got = scheduler.submit(ids[1].tolist(),
                                   SamplingParams(max_tokens=16, temperature=0.0)).result(120)
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


def test_two_gpus_a_model_directory_sliced_and_paged(tmp_path: Path) -> None:
    """From a model directory (each rank reads only its slices onto its own GPU), with a paged
    KV cache and CUDA graphs: each rank's steps hold the same bytes, under the whole model's;
    greedy tokens equal Hugging Face's up to its first near-tie, through generate and through
    a Scheduler whose requests start from cached prefix blocks (rank 0's table, sent with each
    step)."""
    from fuser.distributed import rank_held_bytes

    target = llama_target()
    target.save_pretrained(tmp_path / "model")
    target = target.to("cuda:0")
    config = fuser.FuserConfig(device="cuda:0", max_seq_len=64, max_batch_size=2,
                               batch_buckets=(1, 2), gamma=0, tensor_parallel=2,
                               kv_block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(tmp_path / "model", None, config)
    try:
        held = rank_held_bytes(engine)
        whole = sum(p.numel() * p.element_size() for p in target.parameters())
        assert held[0] == held[1] < whole, held
        ids, mask = prompts([7, 9], seed=4)
        ids, mask = ids.cuda(), mask.cuda()
        ref, near_tie = hf_greedy(target, ids, mask, 16)
        out = engine.generate(ids, 16, attention_mask=mask)
        assert_greedy_matches(out.cpu(), ref.cpu(), near_tie.cpu(), ids.cpu(), [])
        generator = torch.Generator().manual_seed(5)
        prefixes = [torch.randint(3, 160, (20,), generator=generator).tolist() for _ in "ab"]
        scheduler = Scheduler(engine)
        scheduler.start()
        try:
            for i in range(4):  # one at a time, the two prefixes taking turns
                prompt = torch.tensor([prefixes[i % 2] + [3 + i, 7 + i]], device="cuda:0")
                got = scheduler.submit(prompt[0].tolist(), SamplingParams(
                    max_tokens=12, temperature=0.0)).result(120)
                ref, near_tie = hf_greedy(target, prompt, torch.ones_like(prompt), 12)
                assert_greedy_matches(torch.tensor([prompt[0].tolist() + got]), ref.cpu(),
                                      near_tie.cpu(), prompt.cpu(), [])
            assert scheduler.blocks is not None and scheduler.blocks.prefix_hits > 0
        finally:
            scheduler.close()
    finally:
        engine.close()
