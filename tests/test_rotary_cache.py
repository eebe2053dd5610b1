"""fuser::rotary_cache_write and the rotary_cache pass: the kernel against the reference (caches
written at the right slots, nothing else touched), the pass on Llama, Mistral and Qwen2 through
engines with a draft (one match per layer in every fixed-T graph, no fuser::rotary or index_put
left there, and the rotary_attention pass after it folding each write into its attention:
decode/verify logits, greedy and speculative output), groups they must leave alone, and
Inductor's code for a rewritten step (the caches are written in place, never copied).

Without a GPU the launcher runs under TRITON_INTERPRET=1 (conftest.py); with one, for real.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from fuser.capture import StepModule, engine_view, export_step
from fuser.numerics import LOGITS_TOLERANCE
from fuser.ops.rope import rotary_cache_write_reference, rotary_cache_write_triton
from fuser.passes import run_passes
from fuser.passes.fx import count_targets
from fuser.runtime.steps import PREFILL, StepKind
from test_rope import TOLERANCE, error_scale, make_inputs, rounded_once
from tiny import (families_in_ci, hf_logits, pass_context, random_prompts, relative_error,
                  tiny_model)

aten = torch.ops.aten
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The interpreter must round fp32 -> bf16 as GPUs do for the bf16 checks to mean anything.
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")

FIXED_T_GRAPHS = ("target.decode", "target.verify", "draft.decode", "draft.catchup", "draft.resync")


# --- kernel ---------------------------------------------------------------------------------


def make_case(batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int,
              rotary_dim: int, slots: int, dtype: torch.dtype, seed: int,
              seq_lens: list[int], merged: bool = False) -> tuple[torch.Tensor, ...]:
    """(q, k, v, cos, sin, k_cache, v_cache, seq_lens): q, k, v as the model has them
    (transposes of [B, T, heads, D]; with `merged`, of slices of one merged-QKV output, as
    after the merge_qkv pass), caches [B, S, kv_heads, D] of random old contents."""
    q, k, cos, sin = make_inputs(batch, heads, kv_heads, tokens, head_dim, rotary_dim, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(batch, tokens, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = v.transpose(1, 2)
    if merged:  # qkv: [B, T, (H + 2 KH) * D]; q, k, v are views of its column blocks
        parts = [x.transpose(1, 2).reshape(batch, tokens, -1) for x in (q, k, v)]
        qkv = torch.cat(parts, dim=-1)
        q, k, v = (block.view(batch, tokens, -1, head_dim).transpose(1, 2)
                   for block in qkv.split([p.shape[-1] for p in parts], dim=-1))
    k_cache = torch.randn(batch, slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(batch, slots, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return q, k, v, cos, sin, k_cache.to(DEVICE), v_cache.to(DEVICE), lens.to(DEVICE)


def check_op(q, k, v, cos, sin, k_cache, v_cache, seq_lens) -> None:
    """The launcher on one case: rope(q) returned, rope(k) and v written at slots
    seq_lens[b] + t and nowhere else, inputs untouched; numbers as test_rope.py holds
    fuser::rotary to them (the kernel's own rounding exactly; HF's formula within TOLERANCE)."""
    inputs = [t.clone() for t in (q, k, v, cos, sin, seq_lens)]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = rotary_cache_write_reference(q, k, v, cos, sin, k_ref, v_ref, seq_lens)
    k_old, v_old = k_cache.clone(), v_cache.clone()
    q_out = rotary_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, seq_lens)
    for before, after in zip(inputs, (q, k, v, cos, sin, seq_lens)):  # inputs untouched
        assert torch.equal(before, after)
    assert q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.is_contiguous()
    # the kernel's contract: fp32 arithmetic rounded once (in fp32 the reference itself)
    assert torch.equal(q_out, rounded_once(q, cos, sin))
    B, _, T, _ = q.shape
    k_rope = rounded_once(k, cos, sin)  # [B, KH, T, D]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)  # [B, S]
    for b in range(B):
        slots = slice(int(seq_lens[b]), int(seq_lens[b]) + T)
        written[b, slots] = True
        assert torch.equal(k_cache[b, slots], k_rope[b].transpose(0, 1))
        assert torch.equal(v_cache[b, slots], v[b].transpose(0, 1))  # v copied bit for bit
    assert torch.equal(k_cache[~written], k_old[~written])  # every other slot untouched
    assert torch.equal(v_cache[~written], v_old[~written])
    # against the graph's old path (HF's formula in the input dtype, then index_put)
    for out, ref, x in ((q_out, q_ref, q), (k_cache, k_ref, None)):
        if x is None:  # compare the written slots of k against rope(k) in HF's roundings
            out, ref = out[written], ref[written]  # [B * T, KH, D]
            scale = error_scale(k, cos, sin).permute(0, 2, 1, 3).reshape(out.shape)
        else:
            scale = error_scale(x, cos, sin)
        bound = TOLERANCE[q.dtype] * torch.finfo(q.dtype).eps * scale
        err = (out.double() - ref.double()).abs()
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert torch.equal(v_cache, v_ref)
    if q.dtype == torch.float32:  # bitwise the graph's old path
        assert torch.equal(q_out, q_ref) and torch.equal(k_cache, k_ref)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("tokens", [1, 5, 16])  # decode, verify (gamma 4), the largest fixed T
def test_kernel_matches_reference(tokens, head_dim, dtype):
    # batch, GQA ratio and the rows' lengths vary with the other parameters
    case = tokens + head_dim // 16 + DTYPES.index(dtype)
    batch = 1 + case % 3
    heads, kv_heads = [(4, 1), (6, 2), (3, 3), (8, 2)][case % 4]
    slots = tokens + 7
    lens = [(7 * b + case) % 8 for b in range(batch)]
    check_op(*make_case(batch, heads, kv_heads, tokens, head_dim, head_dim, slots, dtype,
                        seed=case, seq_lens=lens, merged=case % 2 == 1))


@settings(max_examples=16, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),  # GQA ratio H / kv_heads
    tokens=st.sampled_from([1, 2, 3, 5, 9, 16]),  # the fixed T of decode, catch-up, verify
    head_dim=st.sampled_from([8, 24, 64, 80, 128]),
    rotary_frac=st.sampled_from([1.0, 0.5]),  # partial rotary: columns R.. written unchanged
    extra_slots=st.integers(0, 20),
    merged=st.booleans(),
    data=st.data(),
)
def test_kernel_matches_reference_random(dtype, batch, kv_heads, group, tokens, head_dim,
                                         rotary_frac, extra_slots, merged, data):
    slots = tokens + extra_slots
    # per-row lengths; the last row's new tokens end exactly at the cache's last slot
    lens = data.draw(st.lists(st.integers(0, extra_slots), min_size=batch, max_size=batch))
    lens[-1] = extra_slots
    seed = data.draw(st.integers(0, 2**16))
    check_op(*make_case(batch, kv_heads * group, kv_heads, tokens, head_dim,
                        max(2, int(head_dim * rotary_frac) // 2 * 2), slots, dtype, seed, lens,
                        merged))


def test_slots_past_the_cache_are_dropped():
    # seq_lens + T > S: the kernel writes what fits and never past the buffer (the engine never
    # asks for it; index_put would raise).
    q, k, v, cos, sin, k_cache, v_cache, lens = make_case(1, 2, 1, 4, 16, 16, 6, torch.float32,
                                                          seed=5, seq_lens=[4])
    k_old = k_cache.clone()
    rotary_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, lens)
    assert torch.equal(k_cache[0, :4], k_old[0, :4])
    assert torch.equal(k_cache[0, 4:], rounded_once(k, cos, sin)[0, :, :2].transpose(0, 1))
    assert torch.equal(v_cache[0, 4:], v[0, :, :2].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_op_cpu_equals_reference_and_opcheck(dtype):
    case = [t.cpu() for t in make_case(2, 4, 2, 3, 16, 8, 9, dtype, seed=1, seq_lens=[0, 6])]
    q, k, v, cos, sin, k_cache, v_cache, lens = case
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = rotary_cache_write_reference(q, k, v, cos, sin, k_ref, v_ref, lens)
    q_out = torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, lens)
    assert torch.equal(q_out, q_ref) and q_out.is_contiguous()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.library.opcheck(torch.ops.fuser.rotary_cache_write.default, tuple(case))


def test_op_checks_its_arguments():
    q, k, v, cos, sin, k_cache, v_cache, lens = make_case(1, 2, 1, 3, 16, 16, 8, torch.float32,
                                                          seed=0, seq_lens=[0])
    with pytest.raises(ValueError, match="share a dtype"):
        torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache.double(), v_cache.double(), lens)
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache[..., :8].contiguous(),
                                           v_cache[..., :8].contiguous(), lens)
    with pytest.raises(ValueError, match="int64"):
        torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, lens.int())
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(1, 8, 2, 16, device=k_cache.device)[:, :, :1]  # [B, S, 1, D]
        torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, strided, v_cache, lens)


# --- the pass through engines ----------------------------------------------------------------


def step_logits_error(engine: fuser.Engine, model: torch.nn.Module, kind_name: str, new: int,
                      lengths: list[int], seed: int) -> float:
    """Relative error against eager of the target's step `kind_name` (T = new) run after a
    prefill of each left-padded prompt but its last `new` tokens, over those last tokens."""
    steps, cache = engine.target, engine.target.cache
    kind = next(k for k in steps.steps if k.name == kind_name)
    assert kind.tokens == new
    B = cache.batch_size
    ids, mask = random_prompts(B, lengths, model.config.vocab_size, seed)
    ref = hf_logits(model, ids, mask)[:, -new:]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    T = ids.shape[1]
    cache.begin(T - mask.sum(-1))
    steps.run(PREFILL, ids[:, :-new], positions[:, :-new])
    cache.set_lengths(T - new)
    out = steps.run(kind, ids[:, -new:].contiguous(), positions[:, -new:].contiguous())
    cache.reset()
    return relative_error(out.float(), ref)


@pytest.mark.parametrize("family", families_in_ci("llama"))  # the others: -m slow
def test_pass_on_engines(family: str) -> None:
    window = 3 if family == "mistral" else None
    target = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=24, sliding_window=window)
    draft = tiny_model(family, layers=1, seed=1, heads=2, kv_heads=1, sliding_window=window)
    config = fuser.FuserConfig(max_batch_size=2, batch_buckets=(2,), max_seq_len=32, gamma=2)
    engine = fuser.optimize(target, draft=draft, config=config)
    report = engine.report()
    assert report.fallbacks == []

    # exact counts: one rewrite per layer in every fixed-T graph, prefill left as it was; then
    # the rotary_attention pass folds each write and the attention reading its rope(q) into
    # fuser::rotary_cache_attention (tests/test_rotary_attention.py)
    assert report.passes["rotary_cache"] == report.passes["rotary_attention"] == 2  # target decode
    assert report.fused_ops["rotary_cache_attention"] == 2 and "rotary" not in report.fused_ops
    layers = {"target": 2, "draft": 1}
    for steps in (engine.target, engine.draft):
        for kind, graph in steps.steps.items():
            n = layers[steps.role]
            if not kind.fixed:  # prefill: its k also feeds attention among the new tokens
                assert graph.matches["rotary_cache"] == 0 and graph.fused_ops["rotary"] == n
                assert graph.matches["rotary_attention"] == 0
                continue
            assert graph.name in FIXED_T_GRAPHS
            assert graph.matches["rotary_cache"] == n, graph.name
            assert graph.matches["rotary_attention"] == n, graph.name
            assert graph.fused_ops["rotary_cache_attention"] == n, graph.name
            for op in ("rotary", "rotary_cache_write", "cache_attention_read"):
                assert op not in graph.fused_ops, (graph.name, op)
            for op in (aten.index_put.default, aten.index_put_.default, aten.copy_.default):
                assert count_targets(graph.rewritten, op) == 0, (graph.name, op)

    # numbers: decode and verify logits against eager, per-row left padding
    tolerance = LOGITS_TOLERANCE[torch.float32]
    assert step_logits_error(engine, target, "decode", 1, [5, 3], seed=1) <= tolerance
    assert step_logits_error(engine, target, "verify", 3, [7, 5], seed=2) <= tolerance

    # greedy, speculative (rows accept different counts: per-row seq_lens) == Hugging Face
    ids, mask = random_prompts(2, [6, 3], target.config.vocab_size, seed=3)
    ours = engine.generate(ids, 10, attention_mask=mask)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, ref)
    assert engine.stats.num_drafts > 0


# --- groups the pass must leave alone --------------------------------------------------------


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, cos and sin already [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer(torch.nn.Module):
    """One layer's rotary, cache write and attention read, written as capture's
    `cache_attention` writes them; `variant` breaks one condition of the pass."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.register_buffer("k_cache", torch.zeros(2, 8, 1, 16))  # [B, S, kv_heads, D]
        self.register_buffer("v_cache", torch.zeros(2, 8, 1, 16))

    def forward(self, q, k, v, cos, sin, seq_lens):
        B, T = q.shape[0], q.shape[2]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D], once, as HF does
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        old = self.k_cache.sum() if self.variant == "old_cache_read" else 0.0
        slots = seq_lens[:, None] + torch.arange(T)
        if self.variant == "other_slots":
            slots = slots + 1
        rows = torch.arange(B)[:, None].expand(B, T)
        self.k_cache.index_put_((rows, slots), k.transpose(1, 2))
        self.v_cache.index_put_((rows, slots), v.transpose(1, 2))
        if self.variant == "cache_read_elsewhere":  # a read of the written cache between
            old = self.k_cache.sum()                 # the write and the attention
        out = torch.ops.fuser.cache_attention_read(q, self.k_cache, self.v_cache, seq_lens,
                                                   torch.zeros_like(seq_lens), 0.25, 0, 0.0)
        if self.variant == "k_used_elsewhere":
            out = out + k.sum()
        if self.variant == "q_used_elsewhere":  # (a max: the same bits in any memory order)
            out = out + q.amax()
        return out + old


def exported_layer(variant: str, tokens: int = 2
                   ) -> tuple[torch.fx.GraphModule, _Layer, tuple, torch.Tensor]:
    """`_Layer(variant)` over `tokens` new tokens, exported to core ATen, beside its eager twin
    already run: (graph, eager layer, args, eager output)."""
    q, k, v, cos, sin, _, _, lens = (t.cpu() for t in make_case(
        2, 2, 1, tokens, 16, 16, 8, torch.float32, seed=7, seq_lens=[3, 5]))
    args = (q, k, v, cos, sin, lens)
    eager = _Layer(variant)
    with torch.no_grad():
        want = eager(*args)
    gm = torch.export.export(_Layer(variant), args, strict=False).run_decompositions().module()
    return gm, eager, args, want


def assert_runs_as_eager(gm: torch.fx.GraphModule, eager: _Layer, args: tuple,
                         want: torch.Tensor) -> None:
    """The graph's output, and the caches it wrote, equal the eager layer's, bit for bit."""
    with torch.no_grad():
        got = gm(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gm.k_cache, eager.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(gm.v_cache, eager.v_cache, rtol=0, atol=0)


@pytest.mark.parametrize(("variant", "matches", "with_attention"), [
    ("clean", 1, 1), ("k_used_elsewhere", 0, 0), ("old_cache_read", 0, 0), ("other_slots", 0, 0),
    # the write is made, but stays apart from the attention (passes/rotary_attention.py)
    ("q_used_elsewhere", 1, 0), ("cache_read_elsewhere", 1, 0),
])
def test_groups_that_do_not_fit_are_not_rewritten(variant: str, matches: int,
                                                  with_attention: int) -> None:
    gm, eager, args, want = exported_layer(variant)
    result = run_passes(gm, pass_context(variant, StepKind("verify", 2)))
    assert result.errors == []
    assert result.matches["rotary"] == 1  # the positive twin proves the group is otherwise whole
    assert result.matches["rotary_cache"] == matches
    assert result.matches["rotary_attention"] == with_attention
    assert result.fused_ops.get("rotary_cache_write", 0) == matches - with_attention
    assert result.fused_ops.get("rotary_cache_attention", 0) == with_attention
    assert result.fused_ops.get("cache_attention_read", 0) == 1 - with_attention
    assert count_targets(gm, aten.index_put.default) == 2 * (1 - matches)
    assert_runs_as_eager(gm, eager, args, want)


def test_prefill_is_not_rewritten() -> None:
    # The same clean group in a graph the engine runs as prefill: the pass does not apply (the
    # writes stay index_puts, made in place by passes/cache_writes.py).
    gm = exported_layer("clean")[0]
    result = run_passes(gm, pass_context("target.prefill", PREFILL))
    assert result.matches["rotary"] == 1 and result.matches["rotary_cache"] == 0
    assert count_targets(gm, aten.index_put_.default) == 2


# --- Inductor keeps the write in place --------------------------------------------------------


def test_inductor_writes_the_cache_in_place() -> None:
    """Inductor's code for a rewritten decode step passes the cache buffers themselves to the op
    and to attention: no index_put, no copy_ back, no clone of a cache."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model("llama", layers=2)
    B, S, layers = 2, 12, 2
    k = [torch.zeros(B, S, 2, 16) for _ in range(layers)]  # [B, S, kv_heads, D]
    v = [torch.zeros(B, S, 2, 16) for _ in range(layers)]
    module = StepModule(engine_view(model, torch.float32, torch.device("cpu")), k, v,
                        prefill=False)
    _, gm = export_step(module, B, 1, max_tokens=S)
    result = run_passes(gm, pass_context("target.decode"))
    assert result.matches["rotary_cache"] == result.matches["rotary_attention"] == layers
    tokens = torch.tensor([[5], [9]])
    positions, lens = torch.tensor([[3], [6]]), torch.tensor([3, 6])
    with torch.no_grad():
        want = gm(tokens, positions, lens, torch.zeros_like(lens))
        written = [t.clone() for t in (*k, *v)]
        for t in (*k, *v):
            t.zero_()
        compiled = torch.compile(gm, fullgraph=True, dynamic=False)
        got, (code, *_) = run_and_get_code(compiled, tokens, positions, lens, torch.zeros_like(lens))
    # The buffers themselves were written. Inductor computes the rope cos/sin in its own C++
    # kernel, an ulp away from ATen's (seen: 1.5e-8 in k), so k and logits compare with fp32's
    # default tolerance; v is copied bit for bit.
    torch.testing.assert_close(got, want)
    for new, old in zip(k, written[:layers]):
        torch.testing.assert_close(new, old)
    assert all(torch.equal(new, old) for new, old in zip(v, written[layers:]))
    assert all(bool(t.any()) for t in (*k, *v))
    call = code[code.index("def call("):]
    # (the write inside fuser::rotary_cache_attention since the rotary_attention pass)
    assert call.count("torch.ops.fuser.rotary_cache_attention.default(") == layers
    for copying in ("index_put", ".copy_(", "clone", "aten.copy"):
        assert copying not in call, copying


# --- GPU --------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (4, 5), (2, 16)])
def test_cuda_llama3_8b_heads(batch: int, tokens: int) -> None:
    # Llama-3-8B: 32 query heads, 8 kv heads, head dim 128, bf16; a cache of 4096 slots; q, k, v
    # as views of one merged-QKV output, as the decode graph has them.
    lens = [4096 - tokens - 37 * b for b in range(batch)]
    case = make_case(batch, 32, 8, tokens, 128, 128, 4096, torch.bfloat16, seed=tokens,
                     seq_lens=lens, merged=True)
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = case
    k_op, v_op = k_cache.clone(), v_cache.clone()
    q_op = torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_op, v_op, seq_lens)
    check_op(*case)  # the launcher directly: contract, slots, untouched rest
    assert torch.equal(q_op, rounded_once(q, cos, sin))  # the op's CUDA path is the kernel
    assert torch.equal(k_op, k_cache) and torch.equal(v_op, v_cache)


@needs_cuda
def test_cuda_graph_replays_the_write() -> None:
    # Captured once, replayed with new lengths and new inputs: the slots follow seq_lens.
    case = make_case(2, 32, 8, 5, 128, 128, 64, torch.bfloat16, seed=3, seq_lens=[0, 9],
                     merged=True)
    q, k, v, cos, sin, k_cache, v_cache, seq_lens = case
    torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = torch.ops.fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens)
    new = make_case(2, 32, 8, 5, 128, 128, 64, torch.bfloat16, seed=4, seq_lens=[20, 31])
    for static, fresh in zip((q, k, v, cos, sin), new[:5]):
        static.copy_(fresh)
    seq_lens.copy_(new[7])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, rounded_once(q, cos, sin))
    for b, start in enumerate((20, 31)):
        slots = slice(start, start + 5)
        assert torch.equal(k_cache[b, slots], rounded_once(k, cos, sin)[b].transpose(0, 1))
        assert torch.equal(v_cache[b, slots], v[b].transpose(0, 1))
