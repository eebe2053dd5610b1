"""FuserConfig(kv_block_size=N): an engine over a paged KV cache (one pool of N-slot blocks per
model, rows' blocks interleaved over it, every step reading and writing through the block
table) generates the tokens of the contiguous engine, exactly (fp32 on CPU), target-only and
speculative, over a left-padded batch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fuser
from fuser.runtime.kv_cache import KVCache
from engines import MAX_SEQ_LEN, llama_target, mistral_draft, paged_engine, prompts

def build(model, draft, **config) -> fuser.Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(model, draft=draft, config=fuser.FuserConfig(
            max_seq_len=MAX_SEQ_LEN, max_batch_size=4, **config))


# (speculative: two more engine builds, ~50 s on a 2-core CPU)
@pytest.mark.parametrize(("name", "gamma"), [("plain", 0),
                                             pytest.param("g1", 1, marks=pytest.mark.slow)])
def test_paged_engine_generates_the_contiguous_tokens(engines, name: str, gamma: int) -> None:
    """The shared engines of tests/engines.py ("plain": target only; "g1": a Mistral draft,
    gamma 1) against the same build over 5-slot blocks (slots per row not a multiple of 5)."""
    contiguous, target = engines(name)
    ids, mask = prompts([7, 12, 3, 9], seed=4)
    want = contiguous.generate(ids, attention_mask=mask, max_new_tokens=24)
    engine = build(target, mistral_draft() if gamma else None, gamma=gamma, kv_block_size=5)
    assert engine.report().fallbacks == []
    for steps in (engine.target, engine.draft):
        if steps is not None:
            assert steps.cache.paged and steps.cache.k[0].shape[1] == 5
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(got, want)


def test_paged_engine_with_batch_buckets(engines) -> None:
    """Buckets 1, 2, 4 over one pool (each bucket's steps cut only the block table's rows;
    one shared export specialised per bucket): each batch size's tokens are the contiguous
    engine's, and the steps read the pools themselves (no copies per bucket)."""
    contiguous, _ = engines("plain")
    engine = paged_engine()  # (4-slot blocks; built once for tests/test_paged_scheduler.py too)
    assert sorted(engine.buckets) == [1, 2, 4]
    pools = engine.target.cache.k[0]
    for size, bucket in engine.buckets.items():
        cache = bucket.target.cache
        assert cache.k[0] is pools and cache.block_table.shape[0] == size
    for rows, seed in ((1, 5), (2, 6), (3, 7)):
        ids, mask = prompts([9, 4, 11][:rows], seed=seed)
        want = contiguous.generate(ids, attention_mask=mask, max_new_tokens=12)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), want)


def test_paged_config_refusals() -> None:
    with pytest.raises(ValueError, match="kv_block_size"):
        fuser.FuserConfig(kv_block_size=-1)
    with pytest.raises(ValueError, match="kv_blocks"):
        fuser.FuserConfig(kv_block_size=4, kv_blocks=1)
    with pytest.raises(ValueError, match="set kv_block_size"):
        fuser.FuserConfig(kv_blocks=8)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        fuser.FuserConfig(kv_block_size=4, kv_memory_fraction=1.5)


def test_paged_allocation_and_row_moves() -> None:
    cache = KVCache.allocate(1, 3, 10, 2, 4, torch.float32, torch.device("cpu"), block_size=4)
    assert cache.slots == 12 and cache.k[0].shape == (1 + 3 * 3, 4, 2, 4)
    assert cache.block_table.tolist() == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]
    assert cache.rows(2).k[0] is cache.k[0] and cache.rows(2).block_table.shape == (2, 3)
    cache.seq_lens[2] = 7
    cache.move_row(2, 0)
    assert cache.block_table.tolist() == [[3, 6, 9], [2, 5, 8], [1, 4, 7]]
    assert cache.seq_lens[0] == 7
    cache.lay_out(2, 5)  # rows 0, 1: two blocks each, interleaved; row 2: none
    assert cache.block_table.tolist() == [[1, 3, 0], [2, 4, 0], [0, 0, 0]]
    small = KVCache.allocate(1, 3, 10, 2, 4, torch.float32, torch.device("cpu"), block_size=4,
                             num_blocks=5)  # fewer than every row needs: no blocks up front
    assert small.num_blocks == 5 and small.block_table.tolist() == [[0] * 3] * 3
    with pytest.raises(ValueError, match="pool has 5"):
        small.lay_out(3, 10)
    draft = KVCache.allocate(1, 3, 10, 1, 4, torch.float32, torch.device("cpu"), block_size=4,
                             num_blocks=5, table=small.block_table)
    assert draft.block_table is small.block_table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_paged_engine_generates_the_contiguous_tokens() -> None:
    """On the GPU (Triton kernels, Inductor, CUDA graphs), fp32: the paged engine's greedy
    tokens equal the contiguous engine's. (Same fused kernels through the table; the split
    count follows the slots per row, which paging rounds up to whole blocks, so the sums may
    group differently: ~1e-6 apart in fp32, and this model's greedy tokens have no near-tie
    that close.)"""
    target = copy.deepcopy(llama_target()).to("cuda")  # (the CPU tests share the cached one)
    draft = mistral_draft().to("cuda")
    ids, mask = prompts([7, 12, 3, 9], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    for gamma in (0, 2):
        want = build(target, draft if gamma else None, gamma=gamma, batch_buckets=(4,),
                     precision="fp32").generate(ids, attention_mask=mask, max_new_tokens=24)
        engine = build(target, draft if gamma else None, gamma=gamma, batch_buckets=(4,),
                       precision="fp32", kv_block_size=16)
        assert engine.report().fallbacks == [] and engine.target.cache.paged
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=24)
        assert torch.equal(got, want), gamma


def test_pool_sizes_from_blocks_or_a_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_blocks is taken as given; kv_memory_fraction sizes the pools on CUDA from the free
    memory less the weights still to come (target and draft: blocks_for_budget); on the CPU
    the default size (every row at full length) stands."""
    import fuser.runtime.kv_cache as kv_cache
    from fuser.build import model_geometry
    from fuser.pipeline import paged_pool_blocks
    from fuser.runtime.blocks import CacheShape, blocks_for_budget

    target, draft = llama_target(), mistral_draft()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = fuser.FuserConfig(kv_block_size=4, kv_blocks=9)
    assert paged_pool_blocks(config, target, draft, 64, torch.float32, cuda) == 9
    half = fuser.FuserConfig(kv_block_size=4, kv_memory_fraction=0.5)
    assert paged_pool_blocks(half, target, draft, 64, torch.float32, cpu) == 0
    weights = 4 * sum(p.numel() for m in (target, draft) for p in m.parameters())
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: weights + 2**20)
    shapes = [CacheShape(*model_geometry(m.config), torch.float32) for m in (target, draft)]
    want = blocks_for_budget(2**19, 4, shapes)
    assert want > 2 and paged_pool_blocks(half, target, draft, 64, torch.float32, cuda) == want


def test_a_build_out_of_memory_names_what_to_lower(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build whose steps find no GPU memory on their first run says so, with the cache it
    sits beside and the setting to lower (a paged pool of kv_blocks here; tests/test_cli.py:
    the CLI prints it as one line)."""
    import fuser.pipeline

    def out_of_memory(steps) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 994.00 MiB")

    monkeypatch.setattr(fuser.pipeline, "warm_up", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match=r"target's steps at batch bucket \d+ ran "
                       r"out of GPU memory .* KV cache of [\d.]+ GiB: lower kv_blocks=9"):
        build(llama_target(), None, kv_block_size=4, kv_blocks=9)


@pytest.mark.slow  # (an engine with a draft, saved and loaded: ~40 s on a 2-core CPU;
# tests/test_serve_cli.py builds, saves and serves a target-only paged engine in the fast set)
def test_paged_engine_files_round_trip(tmp_path) -> None:
    """engine.save / fuser.load of a paged engine with a draft (gamma 2, buckets 1 and 4, a
    pool of 30 blocks, fewer than every row at full length): the manifest keeps the geometry,
    the loaded draft shares the target's table, and the loaded engine generates, and serves
    through the scheduler, the built engine's tokens."""
    from fuser import SamplingParams, Scheduler

    engine = build(llama_target(), mistral_draft(), gamma=2, kv_block_size=4, kv_blocks=30,
                   batch_buckets=(1, 4), compile="fx")
    ids, mask = prompts([7, 12, 3, 9], seed=8)
    want = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    manifest = engine.save(tmp_path / "engine")
    info = manifest["info"]["models"]
    assert {m["block_size"] for m in info.values()} == {4}
    assert {m["num_blocks"] for m in info.values()} == {30}
    loaded = fuser.load(tmp_path / "engine")
    cache = loaded.target.cache
    assert cache.paged and cache.num_blocks == 30 and loaded.draft.cache.block_table is \
        cache.block_table
    assert all(b.target.cache.k[0] is cache.k[0] for b in loaded.buckets.values())
    assert torch.equal(loaded.generate(ids, attention_mask=mask, max_new_tokens=6), want)
    requests = [(ids[b][mask[b].bool()].tolist(), SamplingParams(max_tokens=10, temperature=0.0,
                                                                  ignore_eos=True))
                for b in range(4)]
    outputs = []
    for eng in (engine, loaded):
        sched = Scheduler(eng)
        sched.start()
        try:
            outputs.append([sched.submit(p, params).result(120) for p, params in requests])
        finally:
            sched.close()
    assert outputs[0] == outputs[1]
