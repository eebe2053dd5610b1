"""Prefill through CUDA graphs at padded lengths (runtime/prefill_graphs.py): which lengths are
captured, and on a CUDA device, that a replay computes what the uncaptured prefill computes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import fuser
from fuser.runtime.prefill_graphs import (
    MAX_LONG_GRAPHS,
    PREFILL_BLOCK,
    PREFILL_GRAPH_MAX_TOKENS,
    SHORT_PREFILL_TOKENS,
    padded_length,
)
from fuser.runtime.steps import PREFILL, last_logits
from engines import RunningGraph
from tiny import random_prompts, tiny_model


@given(tokens=st.integers(1, 700), slots=st.integers(1, 700))
def test_padded_length_is_the_next_block_that_fits(tokens: int, slots: int) -> None:
    padded = padded_length(tokens, slots)
    fits = -(-tokens // PREFILL_BLOCK) * PREFILL_BLOCK
    if tokens <= SHORT_PREFILL_TOKENS and fits <= slots:
        assert padded == fits and padded % PREFILL_BLOCK == 0 and tokens <= padded < tokens + PREFILL_BLOCK
    elif padded is not None:
        assert tokens <= padded <= slots


@given(tokens=st.integers(SHORT_PREFILL_TOKENS + 1, 2 * PREFILL_GRAPH_MAX_TOKENS))
def test_long_prompts_pad_by_at_most_an_eighth(tokens: int) -> None:
    padded = padded_length(tokens, 10**6)
    if tokens > PREFILL_GRAPH_MAX_TOKENS:
        assert padded is None
        return
    assert padded is not None and tokens <= padded <= PREFILL_GRAPH_MAX_TOKENS
    assert padded - tokens < max(PREFILL_BLOCK, padded / 8) and padded % PREFILL_BLOCK == 0
    assert padded_length(padded, 10**6) == padded  # a captured length maps to itself


def _triton_class(n: int) -> tuple[bool, bool]:
    """How Triton specialises an integer kernel argument: equal to 1, divisible by 16."""
    return n == 1, n % 16 == 0


@given(slots=st.one_of(st.integers(1, 64), st.integers(1, 5000)), data=st.data(),
       device=st.sampled_from(["cuda", "cpu"]))
def test_the_build_warms_up_every_class_a_prompt_runs_at(slots: int, data: st.DataObject,
                                                         device: str) -> None:
    """Every prompt length a request runs at (captured: `padded_length`; uncaptured: its own)
    is in the same Triton specialisation class as a length the build's warm-up ran prefill at,
    so an engine directory holds the kernels a request needs (on CUDA: the CPU's interpreter
    compiles nothing, and its warm-up stays at the two short lengths)."""
    from fuser.build import warm_up_lengths

    tokens = data.draw(st.integers(1, slots), label="tokens")  # a prompt that fits the cache
    lengths = warm_up_lengths(PREFILL, slots, torch.device(device))
    assert lengths[:2] == [2, 3] and all(T <= max(slots, 3) for T in lengths)
    if device == "cpu":
        assert lengths == [2, 3]
        return
    runs_at = padded_length(tokens, slots) or tokens
    if runs_at >= 2:  # (a one-token prompt runs at a captured length or pads to two)
        assert _triton_class(runs_at) in {_triton_class(T) for T in lengths}


def test_long_lengths_are_few() -> None:
    # Eight captured lengths per doubling above the short range: 2048 and 4096 among them.
    lengths = {padded_length(t, 10**6) for t in range(SHORT_PREFILL_TOKENS + 1, 4097)}
    assert len(lengths) == 24 and {1024, 2048, 4096} <= lengths


class _Step:
    """A stand-in captured step (PrefillGraphs only stores and calls them)."""

    def __init__(self, T: int) -> None:
        self.T = T
        self.replays = 0

    def __call__(self, *args: object) -> int:
        self.replays += 1
        return self.T


def test_long_prefill_graphs_are_kept_least_recently_used_first(monkeypatch) -> None:
    from types import SimpleNamespace

    from fuser.runtime import prefill_graphs

    cache = SimpleNamespace(slots=10**6, seq_lens=torch.zeros(1, dtype=torch.long), starts=None,
                            batch_size=1)
    model = SimpleNamespace(cache=cache, role="target")
    graphs = prefill_graphs.PrefillGraphs(model, pool=None)
    monkeypatch.setattr(graphs, "_capture",
                        lambda T: graphs.graphs.setdefault(T, _Step(T)))

    def run(T: int) -> int:
        return graphs.run(torch.zeros(1, T), torch.zeros(1, T), torch.zeros(1, dtype=torch.long))

    for T in (64, 1024, 2048, 3072, 4096, 1024):  # 1024 used again: now the most recent
        assert run(T) == T
    assert list(graphs.graphs) == [64, 2048, 3072, 4096, 1024]
    run(1152)  # a fifth long length drops the least recently used long one (2048), not 64
    assert list(graphs.graphs) == [64, 3072, 4096, 1024, 1152]
    assert MAX_LONG_GRAPHS == 4


def test_a_capture_after_a_longer_length_reads_positions_inside_it(monkeypatch) -> None:
    """A graph returns the logits at `last`, which its capture's warm-up runs read too: a
    capture at 32 tokens after a run at 64 whose position was past 32 must not read that stale
    position. Each run returns the uncaptured step's logits at its own positions."""
    from fuser.runtime import prefill_graphs

    monkeypatch.setattr(prefill_graphs, "CudaGraphStep", RunningGraph)
    engine = fuser.optimize(tiny_model("llama", layers=1), config=fuser.FuserConfig(
        max_seq_len=96, compile="fx"))
    model = engine.bucket(1).target
    graphs = prefill_graphs.PrefillGraphs(model, pool=None)
    generator = torch.Generator().manual_seed(0)
    for T, position in ((64, 40), (32, 5)):
        tokens = torch.randint(0, model.vocab_size, (1, T), generator=generator)
        positions, last = torch.arange(T)[None], torch.tensor([position])
        model.cache.begin(torch.zeros(1, dtype=torch.long))
        got = graphs.run(tokens, positions, last).clone()
        model.cache.begin(torch.zeros(1, dtype=torch.long))
        assert torch.equal(got, last_logits(model.run(PREFILL, tokens, positions), last))
    model.cache.reset()
    assert graphs.failures == [] and sorted(graphs.graphs) == [32, 64]


def test_padded_length_rejects_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        padded_length(0, 64)


def test_cpu_engines_prefill_uncaptured_at_the_prompts_length() -> None:
    engine = fuser.optimize(tiny_model("llama", layers=1), config=fuser.FuserConfig(
        max_seq_len=64, compile="fx"))
    bucket = engine.bucket(1)
    assert bucket.prefills == [] and bucket.target.prefill_graphs is None
    assert [bucket.prefill_length(t) for t in (1, 2, 9, 40)] == [2, 2, 9, 40]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefill_graph_replays_the_uncaptured_prefill() -> None:
    # fp32: the last check compares greedy tokens across two prefill widths (9 vs 32 rows in
    # the GEMMs); in bf16 a one-ulp logit difference could flip an argmax of random weights.
    target = tiny_model("llama", layers=2, dtype=torch.float32).to("cuda")
    draft = tiny_model("llama", layers=1, seed=1, dtype=torch.float32).to("cuda")
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=96, max_batch_size=2, gamma=2, compile="fx"))
    bucket = engine.bucket(2)
    assert bucket.prefill_length(9) == PREFILL_BLOCK
    ids, mask = random_prompts(2, [9, 5], target.config.vocab_size, seed=4)
    out = engine.generate(ids.cuda(), 12, attention_mask=mask.cuda(), eos_token_id=[])
    replays = engine.report().graph_replays
    assert replays[f"prefill.b2.target.t{PREFILL_BLOCK}"] == 1
    assert replays[f"prefill.b2.draft.t{PREFILL_BLOCK}"] == 1
    assert engine.report().fallbacks == []
    # The replay against the uncaptured step at the same padded length, same cache state.
    model = bucket.target
    tokens = torch.randint(0, target.config.vocab_size, (2, PREFILL_BLOCK), device="cuda")
    positions = torch.arange(PREFILL_BLOCK, device="cuda")[None].repeat(2, 1)
    last = torch.tensor([8, 4], device="cuda")  # each row's last prompt position
    model.cache.begin(torch.zeros(2, dtype=torch.long, device="cuda"))
    captured = model.run_last(PREFILL, tokens, positions, last).clone()
    model.cache.begin(torch.zeros(2, dtype=torch.long, device="cuda"))
    plain = model[PREFILL](tokens, positions, model.cache.seq_lens, model.cache.starts)
    assert torch.equal(captured, last_logits(plain, last))
    # Greedy output with captured prefill equals the output with it off.
    for prefill in bucket.prefills:
        prefill.model.prefill_graphs = None
    bucket.prefills = []
    again = engine.generate(ids.cuda(), 12, attention_mask=mask.cuda(), eos_token_id=[])
    assert torch.equal(out, again)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunk_graph_replays_the_uncaptured_chunk(monkeypatch) -> None:
    """A paged engine's CHUNK step through its captured graph (`ChunkGraphs`, in parts of 8
    ops here) gives the uncaptured step's logits at each row's chosen position and leaves the
    same pools, over slots a prefill wrote before it (fp32, the same kernels: bit for bit)."""
    from fuser.runtime import cuda_graphs
    from fuser.runtime.prefill_graphs import ChunkGraphs
    from fuser.runtime.steps import CHUNK

    monkeypatch.setattr(cuda_graphs, "PART_NODES", 8)

    target = tiny_model("llama", layers=2, dtype=torch.float32).to("cuda")
    engine = fuser.optimize(target, config=fuser.FuserConfig(
        max_seq_len=96, max_batch_size=2, compile="fx", kv_block_size=16))
    model = engine.bucket(2).target
    assert isinstance(model.chunk_graphs, ChunkGraphs)
    cache, V = model.cache, target.config.vocab_size
    cache.lay_out(2, cache.slots)
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompt, chunk = (torch.randint(0, V, (2, 32), device="cuda", generator=generator)
                     for _ in range(2))
    lengths = torch.tensor([20, 25], device="cuda")
    slots = lengths[:, None] + torch.arange(32, device="cuda")
    last = torch.tensor([5, 3], device="cuda")

    def run(captured: bool) -> list[torch.Tensor]:
        cache.begin(torch.zeros(2, dtype=torch.long, device="cuda"))
        model.run(PREFILL, prompt, torch.arange(32, device="cuda")[None].repeat(2, 1))
        cache.set_lengths(lengths)
        if captured:
            out = model.run_last(CHUNK, chunk, slots, last)
        else:
            out = last_logits(model[CHUNK](chunk, slots, cache.seq_lens, cache.starts), last)
        return [out.clone(), *(t.clone() for t in (*cache.k, *cache.v))]

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
    replays = engine.report().graph_replays
    assert [v for k, v in replays.items() if k.startswith("chunk.") and k.endswith(".target.t32")] \
        == [1], replays
    assert len(model.chunk_graphs.graphs[32].graphs) > 2  # (captured in parts)


class _Cache:
    def __init__(self, slots: int, seq_lens: torch.Tensor) -> None:
        self.slots, self.seq_lens = slots, seq_lens
        self.starts = torch.zeros_like(seq_lens)

    def begin(self, starts: torch.Tensor) -> None:
        self.starts = starts.clone()

    def set_lengths(self, lengths: torch.Tensor) -> None:
        self.seq_lens = lengths.clone()


class _Model:
    """A stand-in for ModelSteps without a RESYNC step: records the prefill widths it is asked
    to run (captured: padded as `PrefillGraphs.width` pads them)."""

    def __init__(self, cache: _Cache, captured: bool) -> None:
        self.cache, self.captured, self.widths = cache, captured, []

    def __contains__(self, kind: object) -> bool:
        return kind == PREFILL

    def width(self, kind: object, tokens: int, room: int) -> int:
        assert kind == PREFILL
        padded = padded_length(tokens, min(room, self.cache.slots)) if self.captured else None
        return padded or tokens

    def run_last(self, kind: object, tokens: torch.Tensor, positions: torch.Tensor,
                 last: torch.Tensor) -> None:
        assert kind == PREFILL and tokens.shape == positions.shape
        assert last.shape == (tokens.shape[0],)
        self.widths.append(tokens.shape[1])


@pytest.mark.parametrize("captured,width", [(False, 45), (True, 64)])
def test_resync_pads_the_draft_prefill_to_a_captured_length(captured, width) -> None:
    # After target-only steps a draft without the RESYNC step re-prefills the sequence; with
    # prefill graphs it runs at a captured length (45 -> 64) instead of an uncaptured prefill at
    # an arbitrary T.
    from types import SimpleNamespace

    from fuser.runtime.speculative import resync_draft

    lengths = torch.tensor([45, 30])
    target = _Model(_Cache(128, lengths), False)
    draft = _Model(_Cache(128, torch.zeros(2, dtype=torch.long)), captured)
    state = SimpleNamespace(history=torch.arange(2 * 128).reshape(2, 128))
    resync_draft(draft, target, state, behind=20)
    assert draft.widths == [width]
    assert torch.equal(draft.cache.seq_lens, lengths)  # lengths follow the target, not the pad


def test_a_step_run_in_parts_computes_what_the_step_computes(monkeypatch) -> None:
    """`in_parts` runs a rewritten prefill step op by op with a part boundary every `every`
    ops inside a capture (here one stood in for: a part list set, the boundary counted): the
    same logits and cache as the GraphModule's own code, and a boundary after every `every`
    ops; outside a capture (a warm-up) it runs the GraphModule's own code, no op by op."""
    from fuser.runtime import cuda_graphs

    engine = fuser.optimize(tiny_model("llama", layers=2), config=fuser.FuserConfig(
        max_seq_len=64, compile="fx"))
    model = engine.bucket(1).target
    step = model[PREFILL].uncaptured
    assert isinstance(step, torch.fx.GraphModule)
    ops = sum(n.op == "call_function" for n in step.graph.nodes)
    boundaries = []
    monkeypatch.setattr(cuda_graphs, "part_boundary", lambda: boundaries.append(1))
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12)[None]

    def run(fn) -> list[torch.Tensor]:
        model.cache.begin(torch.zeros(1, dtype=torch.long))
        out = fn(tokens, positions, model.cache.seq_lens, model.cache.starts)
        return [out.clone(), *(t.clone() for t in (*model.cache.k, *model.cache.v))]

    monkeypatch.setattr(cuda_graphs._parts, "graphs", [])  # "capturing"
    got = run(cuda_graphs.in_parts(step, every=10))
    monkeypatch.setattr(cuda_graphs._parts, "graphs", None)
    for got_one, want in zip(got, run(step)):
        assert torch.equal(got_one, want)
    assert len(boundaries) == ops // 10 > 2
    monkeypatch.setattr(cuda_graphs.PartsRunner, "run", None)  # (would raise if used)
    for got_one, want in zip(run(cuda_graphs.in_parts(step, every=10)), run(step)):
        assert torch.equal(got_one, want)
    assert cuda_graphs.in_parts(model[PREFILL].eager) is model[PREFILL].eager  # (no FX: whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_capture_in_parts_replays_its_parts_in_order() -> None:
    """`capture_graphs`: a function that calls `part_boundary` twice is captured as three
    graphs in one pool; replayed in order they compute what it computes on new inputs, the
    values made in one part and used in a later one kept (same pool: not reused under them)."""
    from fuser.runtime.cuda_graphs import capture_graphs, part_boundary

    device = torch.device("cuda")
    x = torch.zeros(1024, device=device)

    def fn() -> torch.Tensor:
        a = x * 2 + 1
        part_boundary()
        b = torch.empty_like(a).fill_(3) * a  # (a new block while `a` lives)
        part_boundary()
        return (a + b).sum(0, keepdim=True) + x[:1]

    graphs, out = capture_graphs(fn, None, device)
    assert len(graphs) == 3
    for value in (1.0, -2.5, 7.0):
        x.fill_(value)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        want = (4 * (2 * value + 1)) * 1024 + value
        assert out.item() == pytest.approx(want, rel=1e-5)


def test_a_pool_whose_capture_failed_is_replaced_for_later_captures(monkeypatch):
    """runtime/cuda_graphs.py `_release_capture`: after a failed capture into a shared pool,
    the device allocator is told it ended and the captures given that pool record into a new
    one from then on (`live_pool`; torch's pinned host allocator keeps the old one "recording"
    and would refuse them: the probe in benchmarks/RESULTS.md "GPU tests"); a private pool
    (None) stays None. On the CPU, with the CUDA calls stood in for."""
    from fuser.runtime import cuda_graphs

    handles = iter([(0, 101), (0, 102)])
    ended: list[object] = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                        lambda index, pool: ended.append((index, pool)), raising=False)
    monkeypatch.setattr(cuda_graphs, "release_generator", lambda device: None)
    monkeypatch.setattr(cuda_graphs, "_retired", {})
    device = torch.device("cuda", 0)
    pool = (0, 7)
    assert cuda_graphs.live_pool(pool) == pool and cuda_graphs.live_pool(None) is None
    cuda_graphs._release_capture(device, pool)
    assert cuda_graphs.live_pool(pool) == (0, 101)
    cuda_graphs._release_capture(device, cuda_graphs.live_pool(pool))  # its replacement fails too
    assert cuda_graphs.live_pool(pool) == (0, 102) and cuda_graphs.live_pool((0, 101)) == (0, 102)
    assert ended == [(0, (0, 7)), (0, (0, 101))]
    cuda_graphs._release_capture(device, None)  # a private pool: nothing to replace
    assert ended == [(0, (0, 7)), (0, (0, 101))] and len(cuda_graphs._retired) == 2
