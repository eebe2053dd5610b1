"""fuser::rotary_cache_attention and the rotary_attention pass: the fused kernel against the two
ops it replaces (attention's output within test_ops_attention's tolerances, the caches' new
slots bit for bit rotary_cache_write's kernel, every other slot untouched), a kernel that read
the stale cache at the new slots would fail (they are poisoned), the op's CPU path and checks,
and the pass on Phi-3 and Gemma-2 engines (tests/test_rotary_cache.py runs it on the supported
families) with greedy output equal to Hugging Face's.

Without a GPU the launchers run under TRITON_INTERPRET=1 (conftest.py); with one, for real.
The GPU tests (named *gpu*) hold the CUDA op to the reference at Llama-3-8B's shape.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuser
from fuser.ops.attention import cache_attention_read_triton
from fuser.ops.rope import rotary_cache_write_triton
from fuser.ops.rotary_attention import (MAX_FUSED_TOKENS, rotary_cache_attention_reference,
                                        rotary_cache_attention_triton)
from test_ops_attention import check, visible_queries
from test_rotary_cache import make_case
from tiny import random_prompts, tiny_also_matching

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")


def starts_for(pad: list[int]) -> torch.Tensor:
    """[B] first real slot of each row: pad[b] slots of left padding (pad >= seq_len + T makes
    a dummy row, whose queries see nothing)."""
    return torch.tensor(pad, dtype=torch.int64, device=DEVICE)


def run_fused(case: tuple, starts: torch.Tensor, scale: float, window: int, softcap: float,
              poison: bool = False, **tuning: object) -> None:
    """The fused launcher on one case against the two kernels and the reference."""
    q, k, v, cos, sin, k_cache, v_cache, lens = case
    B, H, T, D = q.shape
    S = k_cache.shape[1]
    # what the two ops write: the rotary kernel's slots, bit for bit
    k_want, v_want = k_cache.clone(), v_cache.clone()
    rotary_cache_write_triton(q, k, v, cos, sin, k_want, v_want, lens)
    # the reference: the two references in a row
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = rotary_cache_attention_reference(q, k, v, cos, sin, k_ref, v_ref, lens, starts, scale,
                                           window, softcap)
    if poison:  # the new slots hold NaN: reading them instead of the new k, v shows
        rows = torch.arange(B, device=DEVICE)[:, None]
        slots = (lens[:, None] + torch.arange(T, device=DEVICE)).clamp(max=S - 1)
        k_cache[rows, slots] = float("nan")
        v_cache[rows, slots] = float("nan")
    inputs = [t.clone() for t in (q, k, v, cos, sin, lens, starts)]
    out = rotary_cache_attention_triton(q, k, v, cos, sin, k_cache, v_cache, lens, starts, scale,
                                        window, softcap, **tuning)
    for before, after in zip(inputs, (q, k, v, cos, sin, lens, starts)):
        assert torch.equal(before, after)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)  # NaN-free: all written
    seen = visible_queries(lens.cpu(), starts.cpu(), T, S, window)
    check(out.cpu(), ref.cpu(), v.cpu(), seen, q.dtype)
    assert (out.cpu()[~seen] == 0).all()  # as the split kernel: zeros where nothing is visible


DTYPES = [torch.float32, torch.bfloat16, torch.float16]

FIXED = [
    # B, H, KV, T, D, R, S, lens, pad, dtype, window, softcap, splits, block_n
    (1, 4, 1, 1, 64, 64, 40, [17], [0], torch.float32, 0, 0.0, None, 64),      # decode, GQA 4
    (2, 8, 2, 5, 64, 64, 48, [10, 43], [3, 0], torch.bfloat16, 0, 0.0, 3, 16),  # verify, end of cache
    (3, 6, 3, 16, 24, 12, 40, [0, 7, 24], [0, 2, 30], torch.float16, 0, 0.0, 2, 16),  # partial, dummy row
    (2, 4, 2, 3, 80, 80, 36, [20, 5], [1, 0], torch.float32, 4, 30.0, None, 16),  # window + softcap
    (2, 2, 2, 9, 128, 128, 32, [23, 0], [0, 0], torch.bfloat16, 2, 0.0, 4, 16),  # MHA, window 2
]


@pytest.mark.parametrize("B,H,KV,T,D,R,S,lens,pad,dtype,window,softcap,splits,block_n", FIXED)
def test_fixed_cases(B, H, KV, T, D, R, S, lens, pad, dtype, window, softcap, splits, block_n):
    case = make_case(B, H, KV, T, D, R, S, dtype, seed=S + T, seq_lens=lens, merged=T % 2 == 1)
    run_fused(case, starts_for(pad), D**-0.5, window, softcap, num_splits=splits,
              block_n=block_n)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tokens=st.integers(1, 16),
    head_dim=st.sampled_from([16, 24, 64]),
    rotary_frac=st.sampled_from([1.0, 0.5]),
    extra=st.integers(0, 40),
    window=st.sampled_from([0, 1, 5]),
    softcap=st.sampled_from([0.0, 0.0, 20.0]),
    splits=st.sampled_from([None, 1, 3]),
    merged=st.booleans(),
    data=st.data(),
)
def test_random_cases(dtype, batch, kv_heads, group, tokens, head_dim, rotary_frac, extra,
                      window, softcap, splits, merged, data):
    slots = tokens + extra
    lens = data.draw(st.lists(st.integers(0, extra), min_size=batch, max_size=batch))
    lens[-1] = extra  # the last row's new tokens end at the cache's last slot
    pad = [data.draw(st.integers(0, n + tokens)) for n in lens]  # up to a dummy row
    seed = data.draw(st.integers(0, 2**16))
    rotary = max(2, int(head_dim * rotary_frac) // 2 * 2)
    case = make_case(batch, kv_heads * group, kv_heads, tokens, head_dim, rotary, slots, dtype,
                     seed, lens, merged)
    run_fused(case, starts_for(pad), head_dim**-0.5, window, softcap, num_splits=splits,
              block_n=16)


@pytest.mark.parametrize("tokens", [1, 5])
def test_stale_new_slots_are_never_read(tokens: int) -> None:
    # NaN in the slots this step writes: a kernel attending over the cache there (instead of
    # the new k, v it computes), or loading them in a block and multiplying by p = 0, gives NaN.
    lens = [30, 9]
    case = make_case(2, 4, 2, tokens, 64, 64, 32 + tokens, torch.float32, seed=tokens,
                     seq_lens=lens)
    run_fused(case, starts_for([0, 2]), 0.125, 0, 0.0, poison=True, num_splits=2,
              block_n=16)


def test_poison_fails_a_kernel_that_reads_the_cache() -> None:
    # The poison is seen: cache_attention_read (which reads the new slots from the cache) run
    # on the poisoned cache after the write is skipped gives NaN on every real query.
    q, k, v, cos, sin, k_cache, v_cache, lens = make_case(1, 4, 2, 3, 64, 64, 20, torch.float32,
                                                          seed=0, seq_lens=[10])
    q_rot = rotary_cache_write_triton(q, k, v, cos, sin, k_cache.clone(), v_cache.clone(), lens)
    k_cache[:, 10:13], v_cache[:, 10:13] = float("nan"), float("nan")
    out = cache_attention_read_triton(q_rot, k_cache, v_cache, lens, torch.zeros_like(lens),
                                      0.125, 0, 0.0)
    assert torch.isnan(out).all()


def test_longer_steps_run_the_two_kernels() -> None:
    # T > MAX_FUSED_TOKENS: rotary_cache_write's kernel then cache_attention_read's.
    T = MAX_FUSED_TOKENS + 1
    case = make_case(1, 2, 1, T, 16, 16, T + 4, torch.float32, seed=2, seq_lens=[4])
    run_fused(case, starts_for([1]), 0.25, 0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_op_cpu_equals_the_two_ops_and_opcheck(dtype) -> None:
    case = [t.cpu() for t in make_case(2, 4, 2, 3, 16, 8, 9, dtype, seed=1, seq_lens=[0, 6])]
    q, k, v, cos, sin, k_cache, v_cache, lens = case
    starts = torch.tensor([0, 2])
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q_rot = torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_two, v_two, lens)
    want = torch.ops.fuser.cache_attention_read(q_rot, k_two, v_two, lens, starts, 0.25, 3, 10.0)
    got = torch.ops.fuser.rotary_cache_attention(q, k, v, cos, sin, k_cache, v_cache, lens,
                                                 starts, 0.25, 3, 10.0)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(k_cache, k_two) and torch.equal(v_cache, v_two)
    torch.library.opcheck(torch.ops.fuser.rotary_cache_attention.default,
                          (*case, starts, 0.25, 3, 10.0))


def test_op_checks_its_arguments() -> None:
    q, k, v, cos, sin, k_cache, v_cache, lens = (t.cpu() for t in make_case(
        1, 3, 2, 2, 16, 16, 8, torch.float32, seed=0, seq_lens=[0]))
    starts = torch.zeros(1, dtype=torch.int64)
    op = torch.ops.fuser.rotary_cache_attention
    with pytest.raises(ValueError, match="group"):  # 3 heads over 2 kv heads
        op(q, k, v, cos, sin, k_cache, v_cache, lens, starts, 0.25, 0, 0.0)
    q = q[:, :2]
    with pytest.raises(ValueError, match="starts"):
        op(q, k, v, cos, sin, k_cache, v_cache, lens, starts.int(), 0.25, 0, 0.0)
    with pytest.raises(ValueError, match="share a dtype"):
        op(q, k, v, cos, sin, k_cache.double(), v_cache.double(), lens, starts, 0.25, 0, 0.0)


# --- the pass on families outside the supported list -------------------------------------------


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_pass_on_phi3_and_gemma2(family: str) -> None:
    # Phi-3: partial rotary, q and k slices of one qkv output; Gemma-2: soft-capping, a sliding
    # window, head dim 12. One rewrite per layer in the decode graph; greedy output equals HF.
    overrides = {"phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5}),
                 "gemma2": {}}[family]
    model = tiny_also_matching(family, **overrides)
    layers = model.config.num_hidden_layers
    config = fuser.FuserConfig(max_batch_size=2, batch_buckets=(2,), max_seq_len=32)
    engine = fuser.optimize(model, config=config)
    report = engine.report()
    assert report.passes["rotary_attention"] == layers
    for kind, graph in engine.target.steps.items():
        want = layers if kind.fixed else 0
        assert graph.fused_ops.get("rotary_cache_attention", 0) == want, graph.name
        assert "cache_attention_read" not in graph.fused_ops, graph.name
        assert "rotary_cache_write" not in graph.fused_ops, graph.name

    ids, mask = random_prompts(2, [6, 3], model.config.vocab_size, seed=3)
    ours = engine.generate(ids, 8, attention_mask=mask)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, ref)


# --- GPU --------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("context", [300, 3000])
def test_gpu_llama3_8b_shape(tokens: int, context: int) -> None:
    # Llama-3-8B: 32 query heads over 8 kv heads, D = 128, bf16; q, k, v views of one merged-QKV
    # output as the decode graph has them; the CUDA op (the fused kernel) and the launcher with
    # the NaN-poisoned new slots, against the reference and rotary_cache_write's kernel.
    S = 4096
    lens = [context, context // 3]
    case = make_case(2, 32, 8, tokens, 128, 128, S, torch.bfloat16, seed=context + tokens,
                     seq_lens=lens, merged=True)
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = case
    starts = starts_for([0, 17])
    k_op, v_op = k_cache.clone(), v_cache.clone()
    out = torch.ops.fuser.rotary_cache_attention(q, k, v, cos, sin, k_op, v_op, seq_lens, starts,
                                                 128**-0.5, 0, 0.0)
    direct = rotary_cache_attention_triton(q, k, v, cos, sin, k_cache.clone(), v_cache.clone(),
                                           seq_lens, starts, 128**-0.5, 0, 0.0)
    assert torch.equal(out, direct)  # the op's CUDA path is the fused launcher
    run_fused(case, starts, 128**-0.5, 0, 0.0, poison=True)
    assert torch.equal(k_op, k_cache) and torch.equal(v_op, v_cache)


@needs_cuda
def test_gpu_window_softcap_and_cuda_graph_replay() -> None:
    # Captured once and replayed with new lengths and inputs: the slots follow seq_lens, the
    # output the reference (a window and softcap, as Gemma-2's layers have).
    case = make_case(2, 32, 8, 5, 128, 128, 512, torch.bfloat16, seed=3, seq_lens=[0, 9],
                     merged=True)
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = case
    starts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    args = (128**-0.5, 64, 50.0)
    op = torch.ops.fuser.rotary_cache_attention
    op(q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts, *args)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts, *args)
    new = make_case(2, 32, 8, 5, 128, 128, 512, torch.bfloat16, seed=4, seq_lens=[200, 311])
    for static, fresh in zip((q, k, v, cos, sin, k_cache, v_cache), new[:7]):
        static.copy_(fresh)
    seq_lens.copy_(new[7])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = rotary_cache_attention_reference(q, k, v, cos, sin, k_ref, v_ref, seq_lens, starts,
                                           *args)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    rotary_cache_write_triton(q, k, v, cos, sin, k_want, v_want, seq_lens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    seen = visible_queries(seq_lens.cpu(), starts.cpu(), 5, 512, 64)
    check(out.cpu(), ref.cpu(), v.cpu(), seen, torch.bfloat16)
