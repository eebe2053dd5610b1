"""A paged KV cache under tensor parallelism (fuser/distributed.py): rank 0's scheduler fills
its block table (runtime/blocks.py `BlockManager`), and every step sends that table's rows with
the step's inputs, so each follower reads and writes its pool (its KV heads) through the same
blocks. On gloo ranks, the paged tensor_parallel=2 engine (with a draft on rank 0, whose blocks
follow rank 0's table) gives the contiguous tensor_parallel=1 target-only engine's greedy
tokens (fp32; speculative greedy decoding keeps the target's tokens) through generate and
through a Scheduler whose requests hit the prefix cache (chunk steps over blocks the followers
only know of through the table)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
from engines import TP_CONFIG, llama_target, one_rank_engine, perturbed
from fuser import SamplingParams, Scheduler

pytestmark = pytest.mark.xdist_group("tensor_parallel_engine")

CONFIG = dict(TP_CONFIG, gamma=3)


def test_paged_tensor_parallel_equals_one_rank() -> None:
    target = llama_target()
    draft = perturbed(target, 0.05, seed=3)
    single = one_rank_engine()  # (target-only: TP_CONFIG's gamma 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paged = fuser.optimize(target, draft, fuser.FuserConfig(**CONFIG, tensor_parallel=2,
                                                                kv_block_size=8))
    try:
        assert paged.target.cache.paged and paged.report().fallbacks == []
        ids = torch.randint(3, 160, (2, 9), generator=torch.Generator().manual_seed(1))
        expected = single.generate(ids, 20)
        for gamma in (0, None):  # target-only, then speculative
            paged.fix_gamma(gamma)
            before = paged.stats.num_drafts
            assert torch.equal(paged.generate(ids, 20), expected), gamma
            assert (paged.stats.num_drafts > before) == (gamma is None)
        # One request at a time, two prompts' prefixes taking turns: a prompt whose prefix is
        # cached starts from blocks another row (or an earlier request of its row) wrote, so a
        # follower that did not read rank 0's table would attend over another prefix's KV.
        generator = torch.Generator().manual_seed(5)
        prefixes = [torch.randint(3, 160, (20,), generator=generator).tolist() for _ in "ab"]
        requests = [(prefixes[i % 2] + [3 + i, 7 + i],
                     SamplingParams(max_tokens=6 + 3 * i, temperature=0.0)) for i in range(5)]
        results, hits = [], 0
        for engine in (single, paged):
            scheduler = Scheduler(engine, max_waiting=16)
            scheduler.start()
            try:
                results.append([scheduler.submit(p, params).result(120.0)
                                for p, params in requests])
                if scheduler.blocks is not None:
                    hits = scheduler.blocks.prefix_hits
            finally:
                scheduler.close()
        assert hits > 0  # later requests' prompts started from cached blocks (chunk steps)
        assert results[0] == results[1]
    finally:
        paged.close()
