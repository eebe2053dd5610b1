"""Paged KV cache in the attention kernels: with a block table, `cache_attention_read`,
`rotary_cache_attention` and `rotary_cache_write` read and write a pool of blocks
[num_blocks, PAGE, KV, D] through it (runtime/blocks.py is what fills the table).

Each case builds a contiguous cache, scatters its rows' blocks over a pool in a random
(permuted) order with spare blocks that no row owns, and points the table entries a row does
not need at the null block 0 (holding garbage). Then:
  - the paged launchers equal the contiguous launchers bit for bit (same kernel, same slots in
    the same order, same splits), outputs and written slots alike;
  - the paged references equal the contiguous references (fp32: exactly), and the paged
    kernels equal the reference within test_ops_attention's tolerances;
  - writes land in the right block and offset, and no block a row does not own is touched.
Decode (T = 1) and verification (T = gamma + 1) are both drawn; block sizes, lengths, GQA
ratios and head dims vary. Without a GPU the launchers run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.ops.attention import (cache_attention_read_triton, cache_attention_reference,
                                 paged_view)
from fuser.ops.rope import rotary_cache_write_reference, rotary_cache_write_triton
from fuser.ops.rotary_attention import (rotary_cache_attention_reference,
                                        rotary_cache_attention_triton)
from test_ops_attention import check, visible_queries
from test_rotary_cache import make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")
SPARE = 3  # pool blocks no row owns: must never be written


def page(caches: list[torch.Tensor], page_size: int, used: torch.Tensor, seed: int
         ) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Scatter contiguous caches [B, S, KV, D] into pools [num_blocks, PAGE, KV, D].

    Row b owns ceil(used[b] / PAGE) blocks, drawn in a random order from the pool; its other
    table entries point at the null block 0. Every pool block starts as garbage (finite), so a
    slot read from the wrong block changes the result. Returns (pools, table, spare blocks)."""
    B, S = caches[0].shape[:2]
    max_blocks = -(-S // page_size)
    owned = [min(-(-int(n) // page_size), max_blocks) for n in used.tolist()]
    num_blocks = 1 + sum(owned) + SPARE
    g = torch.Generator().manual_seed(seed)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros((B, max_blocks), dtype=torch.int32)
    for b in range(B):
        table[b, :owned[b]] = torch.tensor(order[:owned[b]], dtype=torch.int32)
        del order[:owned[b]]
    pools = []
    for cache in caches:
        pool = torch.randn((num_blocks,) + (page_size,) + tuple(cache.shape[2:]), generator=g)
        pool = pool.to(cache.dtype).to(cache.device)
        padded = torch.cat([cache, cache.new_zeros((B, max_blocks * page_size - S) + cache.shape[2:])], 1)
        for b in range(B):
            for i in range(owned[b]):
                pool[int(table[b, i])] = padded[b, i * page_size:(i + 1) * page_size]
        pools.append(pool)
    return pools, table.to(caches[0].device), order  # what is left of `order`: the spare blocks


def owned_slots(table: torch.Tensor, page_size: int, S: int) -> torch.Tensor:
    """[B, S] bool: the slot lies in a block its row owns (not the null block)."""
    j = torch.arange(S, device=table.device)
    return table[:, j // page_size] != 0


def same_owned(pool: torch.Tensor, table: torch.Tensor, cache: torch.Tensor) -> bool:
    """The pool, read through the table, holds the contiguous cache's values at every slot its
    rows own."""
    S = cache.shape[1]
    mask = owned_slots(table, pool.shape[1], S)
    return torch.equal(paged_view(pool, table)[:, :S][mask], cache[mask])


CASES = dict(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    tokens=st.sampled_from([1, 1, 2, 4, 5, 9, 16]),       # decode and gamma + 1
    head_dim=st.sampled_from([16, 24, 64, 80]),
    page_size=st.sampled_from([1, 3, 4, 16, 64]),
    extra=st.integers(0, 40),
    window=st.sampled_from([0, 0, 5]),
    softcap=st.sampled_from([0.0, 0.0, 20.0]),
    splits=st.sampled_from([1, 3]),
    data=st.data(),
)


def draw_lengths(data, batch: int, tokens: int, extra: int) -> tuple[list[int], list[int], int]:
    lens = data.draw(st.lists(st.integers(0, extra), min_size=batch, max_size=batch))
    lens[-1] = extra                    # one row's new tokens end at the cache's last slot
    pad = [data.draw(st.integers(0, n + tokens)) for n in lens]  # left padding, up to a dummy row
    return lens, pad, data.draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**CASES)
def test_paged_read_equals_contiguous(dtype, batch, kv_heads, group, tokens, head_dim, page_size,
                                      extra, window, softcap, splits, data) -> None:
    """cache_attention_read through a block table: the contiguous kernel's bits, and the
    paged reference the contiguous reference's numbers."""
    lens, pad, seed = draw_lengths(data, batch, tokens, extra)
    S = tokens + extra
    q, _, _, _, _, k_cache, v_cache, seq_lens = make_case(
        batch, kv_heads * group, kv_heads, tokens, head_dim, head_dim, S, dtype, seed, lens)
    starts = torch.tensor(pad, dtype=torch.int64, device=DEVICE)
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], page_size, seq_lens + tokens, seed)
    scale = head_dim**-0.5
    want = cache_attention_read_triton(q, k_cache, v_cache, seq_lens, starts, scale, window,
                                       softcap, num_splits=splits, block_n=16)
    got = cache_attention_read_triton(q, k_pool, v_pool, seq_lens, starts, scale, window, softcap,
                                      table, num_splits=splits, block_n=16)
    assert torch.equal(got, want)
    ref = cache_attention_reference(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap)
    ref_paged = cache_attention_reference(q, k_pool, v_pool, seq_lens, starts, scale, window,
                                          softcap, table)
    seen = visible_queries(seq_lens.cpu(), starts.cpu(), tokens, S, window)
    check(ref_paged.cpu(), ref.cpu(), v_cache.cpu(), seen, dtype)
    check(got.cpu(), ref.cpu(), v_cache.cpu(), seen, dtype)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**CASES)
def test_paged_rotary_attention_equals_contiguous(dtype, batch, kv_heads, group, tokens, head_dim,
                                                  page_size, extra, window, softcap, splits,
                                                  data) -> None:
    """rotary_cache_attention through a block table: output and written slots the contiguous
    kernel's bit for bit, within tolerance of the reference; spare blocks untouched."""
    lens, pad, seed = draw_lengths(data, batch, tokens, extra)
    S = tokens + extra
    rotary = max(2, head_dim // 4 * 2)  # partial rotary
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = make_case(
        batch, kv_heads * group, kv_heads, tokens, head_dim, rotary, S, dtype, seed, lens,
        merged=tokens % 2 == 1)
    starts = torch.tensor(pad, dtype=torch.int64, device=DEVICE)
    (k_pool, v_pool), table, spare = page([k_cache, v_cache], page_size, seq_lens + tokens, seed)
    spare_before = k_pool[spare].clone(), v_pool[spare].clone()
    scale = head_dim**-0.5
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = rotary_cache_attention_triton(q, k, v, cos, sin, k_want, v_want, seq_lens, starts,
                                         scale, window, softcap, num_splits=splits, block_n=16)
    got = rotary_cache_attention_triton(q, k, v, cos, sin, k_pool, v_pool, seq_lens, starts,
                                        scale, window, softcap, table, num_splits=splits,
                                        block_n=16)
    assert torch.equal(got, want)
    assert same_owned(k_pool, table, k_want) and same_owned(v_pool, table, v_want)  # old and new
    assert torch.equal(k_pool[spare], spare_before[0]) and torch.equal(v_pool[spare], spare_before[1])

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = rotary_cache_attention_reference(q, k, v, cos, sin, k_ref, v_ref, seq_lens, starts,
                                           scale, window, softcap)
    (k_rpool, v_rpool), _, _ = page([k_cache, v_cache], page_size, seq_lens + tokens, seed)
    ref_paged = rotary_cache_attention_reference(q, k, v, cos, sin, k_rpool, v_rpool, seq_lens,
                                                 starts, scale, window, softcap, table)
    assert same_owned(k_rpool, table, k_ref) and same_owned(v_rpool, table, v_ref)
    seen = visible_queries(seq_lens.cpu(), starts.cpu(), tokens, S, window)
    check(ref_paged.cpu(), ref.cpu(), v.cpu(), seen, dtype)
    check(got.cpu(), ref.cpu(), v.cpu(), seen, dtype)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), batch=st.integers(1, 3),
       heads=st.sampled_from([(4, 4), (4, 2), (8, 2)]), head_dim=st.sampled_from([16, 32]),
       chunk=st.integers(1, 40), page_size=st.sampled_from([1, 4, 16, 64]),
       window=st.sampled_from([0, 0, 7]), softcap=st.sampled_from([0.0, 0.0, 5.0]),
       mask_all=st.booleans(), data=st.data())
def test_flash_prefill_chunk_over_a_paged_cache(dtype, batch, heads, head_dim, chunk, page_size,
                                                window, softcap, mask_all, data) -> None:
    """A prefill chunk after a cached prefix (a prefix-cache hit): T queries at slots
    prefix + t over a paged cache that already holds the prefix and the chunk's own keys,
    by the flash kernel through the table, against the reference over the contiguous cache."""
    check_paged_chunk(dtype, batch, heads, head_dim, chunk, page_size, window, softcap,
                      mask_all, data, max_prefix=40)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), batch=st.integers(1, 2),
       heads=st.sampled_from([(4, 4), (4, 2), (8, 2)]), chunk=st.integers(1, 40),
       page_size=st.sampled_from([1, 4, 16, 64]), window=st.sampled_from([0, 0, 7]),
       softcap=st.sampled_from([0.0, 0.0, 5.0]), mask_all=st.booleans(),
       splits=st.integers(2, 6), data=st.data())
def test_flash_prefill_split_chunk_over_a_paged_cache(dtype, batch, heads, chunk, page_size,
                                                      window, softcap, mask_all, splits,
                                                      data) -> None:
    """A prefix-cache hit's chunk with its key range split over `splits` programs (partials
    combined by log-sum-exp), through the table, against the reference over the contiguous
    cache: the same bar as the unsplit kernel's test above."""
    check_paged_chunk(dtype, batch, heads, 16, chunk, page_size, window, softcap, mask_all,
                      data, max_prefix=60, splits=splits)


def check_paged_chunk(dtype, batch, heads, head_dim, chunk, page_size, window, softcap,
                      mask_all, data, max_prefix: int, splits: int | None = None) -> None:
    """flash_prefill of a chunk after drawn prefixes of up to max_prefix slots, through a
    paged table (`splits` programs a query block, or the default), against the reference over
    the contiguous cache: finite, 0 where no key is visible, close where one is."""
    from fuser.ops.flash_prefill import flash_prefill

    H, KV = heads
    prefix = data.draw(st.lists(st.integers(0, max_prefix), min_size=batch, max_size=batch))
    pad = [data.draw(st.integers(0, n + chunk - 1)) for n in prefix]
    seed = data.draw(st.integers(0, 2**16))
    S = max(prefix) + chunk + data.draw(st.integers(0, 9))
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, chunk, H, head_dim, generator=g) * 2).to(dtype).to(DEVICE)
    q = q.transpose(1, 2)
    k_cache = torch.randn(batch, S, KV, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(batch, S, KV, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(prefix, dtype=torch.int64, device=DEVICE)
    starts = torch.tensor(pad, dtype=torch.int64, device=DEVICE)
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], page_size, lens + chunk, seed)
    slots = lens[:, None] + torch.arange(chunk, device=DEVICE)        # [B, T] query slots
    scale = head_dim**-0.5
    out = flash_prefill(q, k_pool, v_pool, slots, starts, scale, window, softcap, table,
                        mask_all=mask_all, splits=splits)
    ref = cache_attention_reference(q, k_cache, v_cache, lens, starts, scale, window, softcap)
    assert out.shape == ref.shape == (batch, chunk, H, head_dim) and out.is_contiguous()
    out, ref = out.cpu(), ref.cpu()
    seen = visible_queries(lens.cpu(), starts.cpu(), chunk, S, window)
    assert torch.isfinite(out).all() and (out[~seen] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[seen].float(), ref[seen].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens,page_size", [(1, 4), (5, 3), (40, 16)])
def test_paged_cache_write_lands_in_its_block_and_slot(tokens: int, page_size: int) -> None:
    """rotary_cache_write through a table (decode, verify and a prefill's T): each new token
    at (table[b, slot // PAGE], slot % PAGE), every other slot of the pool unchanged; the
    kernel and the reference agree bit for bit (fp32)."""
    lens = [3, 0, 22]
    S = 24 + tokens
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = make_case(
        3, 4, 2, tokens, 32, 32, S, torch.float32, seed=tokens, seq_lens=lens)
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], page_size, seq_lens + tokens, 7)
    k_old, v_old = k_pool.clone(), v_pool.clone()
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q_got = rotary_cache_write_triton(q, k, v, cos, sin, k_pool, v_pool, seq_lens, table)
    q_ref = rotary_cache_write_reference(q, k, v, cos, sin, k_ref, v_ref, seq_lens, table)
    assert torch.equal(q_got, q_ref)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    _, k_rot = torch.ops.fuser.rotary(q, k, cos, sin)  # rope(k): [B, KV, T, D]
    k_pool, v_pool, k_old, v_old, k_rot, v = (t.cpu() for t in (k_pool, v_pool, k_old, v_old,
                                                                 k_rot, v))
    table = table.cpu()
    written = torch.zeros(k_pool.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        for t in range(tokens):
            block, off = int(table[b, (n + t) // page_size]), (n + t) % page_size
            assert block != 0
            assert torch.equal(k_pool[block, off], k_rot[b, :, t])
            assert torch.equal(v_pool[block, off], v[b, :, t])
            written[block, off] = True
    assert torch.equal(k_pool[~written], k_old[~written])
    assert torch.equal(v_pool[~written], v_old[~written])


def test_custom_ops_take_a_block_table() -> None:
    """The ops' CPU paths (the references) and their schemas accept the table."""
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = make_case(
        2, 4, 2, 2, 16, 16, 12, torch.float32, seed=1, seq_lens=[3, 9])
    starts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], 4, seq_lens + 2, 3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = rotary_cache_attention_reference(q, k, v, cos, sin, k_ref, v_ref, seq_lens, starts,
                                            0.25, 0, 0.0)
    got = torch.ops.fuser.rotary_cache_attention(q, k, v, cos, sin, k_pool, v_pool, seq_lens,
                                                 starts, 0.25, 0, 0.0, table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    read = torch.ops.fuser.cache_attention_read(got.transpose(1, 2), k_pool, v_pool, seq_lens,
                                                starts, 0.25, 0, 0.0, table)
    assert read.shape == got.shape
    torch.library.opcheck(torch.ops.fuser.cache_attention_read.default,
                          (got.transpose(1, 2), k_pool, v_pool, seq_lens, starts, 0.25, 0, 0.0,
                           table))
    torch.library.opcheck(torch.ops.fuser.rotary_cache_attention.default,
                          (q, k, v, cos, sin, k_pool.clone(), v_pool.clone(), seq_lens, starts,
                           0.25, 0, 0.0, table))
    with pytest.raises(ValueError, match="block_table must be"):
        torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_pool, v_pool, seq_lens,
                                           table.long())


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 5])
def test_gpu_paged_llama3_8b_shape(tokens: int) -> None:
    """At the 8B shape (32 heads, 8 kv heads, D 128, bf16, 16-slot blocks, 2,000-token rows)
    the paged launchers with their default splits equal the contiguous ones bit for bit when
    given the contiguous ones' splits, and the reference within tolerance; then a CUDA graph
    captured once replays over a changed table and lengths."""
    B, H, KV, D, S, P = 8, 32, 8, 128, 2048, 16
    lens = [1999 - 150 * b for b in range(B)]
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = make_case(
        B, H, KV, tokens, D, D, S, torch.bfloat16, seed=0, seq_lens=lens)
    starts = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], P, seq_lens + tokens, 0)
    want = cache_attention_read_triton(q, k_cache, v_cache, seq_lens, starts, D**-0.5, 0, 0.0)
    got = cache_attention_read_triton(q, k_pool, v_pool, seq_lens, starts, D**-0.5, 0, 0.0, table)
    assert torch.equal(got, want)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = rotary_cache_attention_triton(q, k, v, cos, sin, k_want, v_want, seq_lens, starts,
                                         D**-0.5, 0, 0.0)
    got = rotary_cache_attention_triton(q, k, v, cos, sin, k_pool, v_pool, seq_lens, starts,
                                        D**-0.5, 0, 0.0, table)
    assert torch.equal(got, want)
    assert same_owned(k_pool, table, k_want)
    ref = cache_attention_reference(q, k_cache, v_cache, seq_lens, starts, D**-0.5, 0, 0.0)
    seen = visible_queries(seq_lens.cpu(), starts.cpu(), tokens, S, 0)
    want_read = cache_attention_read_triton(q, k_cache, v_cache, seq_lens, starts, D**-0.5, 0, 0.0)
    check(want_read.cpu(), ref.cpu(), v_cache.cpu(), seen, torch.bfloat16)

    # One capture, replayed with other tables and lengths (what a serving step does).
    static_table, static_lens = table.clone(), seq_lens.clone()
    run = lambda: cache_attention_read_triton(q, k_pool, v_pool, static_lens, starts, D**-0.5,  # noqa: E731
                                              0, 0.0, static_table)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    flipped = table.flip(0).contiguous()
    flipped_lens = seq_lens.flip(0).contiguous()
    static_table.copy_(flipped)
    static_lens.copy_(flipped_lens)
    graph.replay()
    direct = cache_attention_read_triton(q, k_pool, v_pool, flipped_lens, starts, D**-0.5, 0, 0.0,
                                         flipped)
    assert torch.equal(out, direct)


def test_benchmark_dry_run(tmp_path) -> None:
    """benchmarks/paged_attention.py's plumbing on CPU: both ops, paged equal to contiguous."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "paged.json"
    proc = subprocess.run([sys.executable, "benchmarks/paged_attention.py", "--dry-run", "--out",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["read_equal"] and r["rotary_equal"] for r in rows)


@needs_cuda
def test_gpu_flash_prefill_chunk_over_a_paged_cache_llama3_8b_shape() -> None:
    """A 512-token chunk after cached prefixes of ~1,000 tokens, 8B heads, bf16, 16-slot
    blocks scattered over the pool: the flash kernel through the table against the reference
    over the contiguous cache."""
    from fuser.ops.flash_prefill import flash_prefill

    B, H, KV, D, T, P = 2, 32, 8, 128, 512, 16
    prefix = torch.tensor([1024, 977])
    S = int(prefix.max()) + T
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g).to(torch.bfloat16).cuda().transpose(1, 2)
    k_cache = torch.randn(B, S, KV, D, generator=g).to(torch.bfloat16).cuda()
    v_cache = torch.randn(B, S, KV, D, generator=g).to(torch.bfloat16).cuda()
    lens, starts = prefix.cuda(), torch.tensor([0, 5]).cuda()
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], P, lens + T, 0)
    slots = lens[:, None] + torch.arange(T, device="cuda")
    ref = cache_attention_reference(q, k_cache, v_cache, lens, starts, D**-0.5, 0, 0.0)
    for mask_all, splits in ((True, None), (False, None), (True, 1), (True, 4), (False, 7)):
        out = flash_prefill(q, k_pool, v_pool, slots, starts, D**-0.5, 0, 0.0, table,
                            mask_all=mask_all, splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_cuda
def test_gpu_flash_prefill_prefix_hit_chunk_splits_by_default() -> None:
    """The 8B prefix hit's chunk (128 queries after 1,024 cached tokens, B = 1, 16-slot
    blocks): a grid of 32 programs, so the default splits the keys; split and unsplit, at
    either query tile, all match the reference."""
    from fuser.ops.flash_prefill import flash_prefill, prefill_splits

    B, H, KV, D, T, P = 1, 32, 8, 128, 128, 16
    lens = torch.tensor([1024], device="cuda")
    S = 1024 + T
    assert prefill_splits(B * H, S // 64) > 1
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, H, D, generator=g).to(torch.bfloat16).cuda().transpose(1, 2)
    k_cache = torch.randn(B, S, KV, D, generator=g).to(torch.bfloat16).cuda()
    v_cache = torch.randn(B, S, KV, D, generator=g).to(torch.bfloat16).cuda()
    starts = torch.zeros(1, dtype=torch.int64, device="cuda")
    (k_pool, v_pool), table, _ = page([k_cache, v_cache], P, lens + T, 1)
    slots = lens[:, None] + torch.arange(T, device="cuda")
    ref = cache_attention_reference(q, k_cache, v_cache, lens, starts, D**-0.5, 0, 0.0)
    for splits, block_m in ((None, None), (1, None), (None, 128), (1, 128)):
        out = flash_prefill(q, k_pool, v_pool, slots, starts, D**-0.5, 0, 0.0, table,
                            splits=splits, block_m=block_m)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
