"""The engines the generate tests share, on tests/tiny.py's models, and greedy comparison against
Hugging Face `generate`.

Engines are expensive to build on CPU (torch.export of every step graph, ~5 s each), so a few are
built once per session (per xdist worker: `engine_and_target` is cached) and shared by every
tests/test_generate_*.py and tests/test_stream.py through the `engines` fixture (conftest.py):

    plain   Llama target, no draft
    g1      Llama target, a different random Mistral draft, gamma 1 (rejects nearly everything)
    g4self  Qwen2 target, draft = a copy of the target, gamma 4 (accepts everything: bonus path)
    g8      Llama target, draft = the target with 5% weight noise, gamma 8 (partial acceptance),
            max_batch_size 64 for the sampling-distribution test

Greedy output must equal Hugging Face's on the target, token for token, up to the first near-tie
of the reference (top-2 logits within fuser.numerics.NEAR_TIE; DESIGN.md, numerics contract).
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch

import fuser
from fuser.numerics import NEAR_TIE
from tiny import random_prompts, tiny_model

VOCAB = 160
MAX_SEQ_LEN = 64
# No special tokens in the models' configs: each test says which eos/pad it wants.
NO_SPECIAL = dict(bos=None, eos=None, pad=None)
# Logits with std ~2.4 (init_range 0.3): varied greedy continuations, near-ties rare.
SHAPE = dict(vocab=VOCAB, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
             init_range=0.3, **NO_SPECIAL)

ENGINES = ("plain", "g1", "g4self", "g8")


@functools.cache
def llama_target() -> torch.nn.Module:
    return tiny_model("llama", seed=0, **SHAPE)


@functools.cache
def qwen_target() -> torch.nn.Module:
    return tiny_model("qwen2", seed=1, **SHAPE)


def mistral_draft() -> torch.nn.Module:
    return tiny_model("mistral", seed=2, vocab=VOCAB, heads=2, kv_heads=1, head_dim=16,
                      intermediate=64, layers=1, init_range=0.3, **NO_SPECIAL)


def perturbed(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of `noise` x each tensor's std added to its weights."""
    copy_ = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(p.device) * noise * p.std())
    return copy_


@functools.cache
def engine_and_target(name: str) -> tuple[fuser.Engine, torch.nn.Module]:
    """The engine `name` (see the module docstring) and the HF target it must agree with."""
    config = functools.partial(fuser.FuserConfig, max_seq_len=MAX_SEQ_LEN, max_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "plain":
            target = llama_target()
            engine = fuser.optimize(target, config=config())
        elif name == "g1":
            target = llama_target()
            engine = fuser.optimize(target, draft=mistral_draft(), config=config(gamma=1))
        elif name == "g4self":
            target = qwen_target()
            engine = fuser.optimize(target, draft=copy.deepcopy(target), config=config(gamma=4))
        elif name == "g8":
            target = llama_target()
            engine = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3),
                                    config=config(gamma=8, max_batch_size=64))
        else:
            raise KeyError(name)
    assert engine.target is not None and engine.report().fallbacks == []
    assert (engine.draft is None) == (name == "plain")
    return engine, target


# The tensor-parallel tests' engines (tests/test_tensor_parallel_*.py): on the CPU, rows 2,
# buckets 1 and 2.
TP_CONFIG = dict(device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch_size=2, batch_buckets=(1, 2),
                 gamma=0, compile="fx")


@functools.cache
def one_rank_engine() -> fuser.Engine:
    """The Llama target alone at tensor_parallel=1 (TP_CONFIG): the tokens, logits and held
    bytes the tensor-parallel engines are checked against. Shared by
    tests/test_tensor_parallel_load.py and tests/test_tensor_parallel_paged.py (xdist group
    "tensor_parallel_engine": built once per run); never closed or changed by them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(llama_target(), None, fuser.FuserConfig(**TP_CONFIG))


def prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded (pad id 0): (input_ids, attention_mask)."""
    return random_prompts(len(lengths), lengths, VOCAB, seed)


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
              eos: int | list[int] | None = None, pad: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face greedy output [B, T + n] and where its top-2 logits nearly tie [B, n]."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad,
                             output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1)  # [B, n, V]
    top2 = logits.topk(2, dim=-1).values  # [B, n, 2]
    return out.sequences, (top2[..., 0] - top2[..., 1]) < NEAR_TIE


def assert_greedy_matches(ours: torch.Tensor, ref: torch.Tensor, near_tie: torch.Tensor,
                          ids: torch.Tensor, eos: list[int]) -> None:
    """ours == ref up to each row's first near-tie (exactly, shape included, when there is none)."""
    T = ids.shape[1]
    assert torch.equal(ours[:, :T], ids), "the prompt part must be the input unchanged"
    new = ref[:, T:]
    # Only ties while a row is still generating matter; after its eos it is padding.
    finished_before = torch.zeros_like(near_tie)
    if eos:
        is_eos = torch.isin(new, torch.tensor(eos))
        finished_before[:, 1:] = is_eos.long().cummax(dim=1).values[:, :-1].bool()
    ties = near_tie & ~finished_before
    if not ties.any():
        assert ours.shape == ref.shape, (ours, ref)
        assert torch.equal(ours, ref), (ours, ref)
        return
    for b in range(ref.shape[0]):
        cut = int(ties[b].long().argmax()) if ties[b].any() else new.shape[1]
        assert torch.equal(ours[b, T:T + cut], new[b, :cut]), (b, cut, ours, ref)


def eos_that_ends_one_row(ref: torch.Tensor, T: int) -> tuple[int, int, int]:
    """(token, row, index): a token that row `row` emits first at new index 1..5 and no other
    row ever emits, so that as eos it ends that row early while the others go on."""
    new = ref[:, T:]
    for index in range(1, 6):
        for row in range(new.shape[0]):
            token = int(new[row, index])
            others = torch.cat([new[:row], new[row + 1:]]).flatten()
            if token not in new[row, :index].tolist() and token not in others.tolist():
                return token, row, index
    raise AssertionError(f"no token ends exactly one row early in {new}")


def check_stats(engine: fuser.Engine) -> fuser.SpecStats:
    stats = engine.stats
    assert stats.num_draft_tokens == engine.gamma * stats.num_drafts
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    per_position = stats.accepted_per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position
    return stats


def prompt(length: int, seed: int) -> list[int]:
    """A seeded prompt of `length` ids in [3, VOCAB)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def greedy(max_tokens: int) -> fuser.SamplingParams:
    return fuser.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def sampled(max_tokens: int, seed: int) -> fuser.SamplingParams:
    return fuser.SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=30, seed=seed,
                                ignore_eos=True)


@functools.cache
def contiguous_engine(draft: bool = False, /) -> fuser.Engine:
    """The Llama target over a contiguous cache: 4 rows, buckets 1, 2, 4, "fx"; draft: the target
    with 5% weight noise, gamma fixed at 3 (a fixed gamma keeps seeded sampling exactly
    reproducible whatever the batch). Shared by tests/test_scheduler.py and
    tests/test_bucket_capture.py (xdist group "contiguous_engine": built once per run; `draft`
    positional only, so that every call hits the one cache entry)."""
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 2, 4),
                               gamma=3 if draft else 0, compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(target, draft=perturbed(target, 0.05, seed=3) if draft else None,
                              config=config)


@functools.cache
def paged_engine(blocks: int = 0, draft: bool = False) -> fuser.Engine:
    """The Llama target over a paged cache of 4-slot blocks: 4 rows, buckets 1, 2, 4, "fx";
    `blocks` per pool (0: every row at full length); draft: the target with 5% weight noise,
    gamma 3 (tests/test_paged_scheduler.py, tests/test_paged_engine.py)."""
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 2, 4),
                               gamma=3 if draft else 0, compile="fx", kv_block_size=4,
                               kv_blocks=blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3) if draft else None,
                               config=config)
    assert built.report().fallbacks == [] and built.target.cache.paged
    return built


class RunningGraph:
    """A CPU stand-in for runtime/cuda_graphs.py `CudaGraphStep`: runs the step once when
    made, as a capture's warm-up does (zero tokens at the cache's lengths, writing those
    slots), and again at each call (tests simulating captured prefills and chunks)."""

    def __init__(self, fn, batch: int, T: int, seq_lens: torch.Tensor, starts: torch.Tensor,
                 pool: object = None) -> None:
        self.fn, self.replays = fn, 0
        fn(torch.zeros(batch, T, dtype=torch.long), torch.arange(T)[None].repeat(batch, 1),
           seq_lens, starts)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        self.replays += 1
        return self.fn(tokens, positions, seq_lens, starts)


def checking_issues_ahead(sched: object, set_mode: object) -> dict[str, int]:
    """Make `sched` (a runtime/scheduler.py Scheduler, driven by hand) run everything between
    its decision to queue a step ahead of a read-back (`_may_run_ahead` true) and that step's
    issue under set_mode("error"), and set_mode(0) again after: on CUDA,
    `torch.cuda.set_sync_debug_mode`, so that an op there which makes the host wait for the
    device (an `.item()`, a `torch.tensor(..., device="cuda")`) raises, naming itself, where it
    would silently cost the overlap. Returns counts: "checked" (steps issued under the mode),
    "collected" (read-backs, each asserted to run with the mode off)."""
    counts = {"checked": 0, "collected": 0}
    on = [False]
    may, grow, issue, collect = sched._may_run_ahead, sched._grow_rows, sched._issue, \
        sched._collect

    def switch(value: bool) -> None:
        on[0] = value
        set_mode("error" if value else 0)

    def may_run_ahead(in_flight: object) -> bool:
        ahead = may(in_flight)
        if ahead:
            switch(True)
        return ahead

    def grow_rows(steps: int = 1) -> bool:
        grown = grow(steps)
        if not grown and on[0]:  # nothing is queued ahead after all
            switch(False)
        return grown

    def issue_step() -> object:
        checked = on[0]
        try:
            return issue()
        finally:
            if checked:
                switch(False)
                counts["checked"] += 1

    def collect_step(step: object) -> None:
        assert not on[0], "a read-back ran under the sync check"
        counts["collected"] += 1
        collect(step)

    sched._may_run_ahead, sched._grow_rows = may_run_ahead, grow_rows
    sched._issue, sched._collect = issue_step, collect_step
    return counts


class SyncMode:
    """A `torch.cuda.set_sync_debug_mode` stand-in that keeps the mode it was last given (and
    passes it on to `forward`, on CUDA)."""

    def __init__(self, forward: object = None) -> None:
        self.mode: object = 0
        self.forward = forward

    def __call__(self, mode: object) -> None:
        self.mode = mode
        if self.forward is not None:
            self.forward(mode)


def adaptive_rounds_checked(built: fuser.Engine, batch: list[list[int]], max_tokens: int,
                            sync: SyncMode, costs: dict | None = None
                            ) -> tuple[list[list[list[int]]], dict[str, int], dict]:
    """The adaptive scheduler (suffix proposals from min_match 2, no distillation), driven by
    hand, over `batch` twice (the second time its answers are recent outputs: mixed steps),
    every step it queues ahead checked by `checking_issues_ahead` through `sync`. Returns the
    outputs per round, the counts (with "mixed": mixed steps issued under the check) and the
    snapshot."""
    from fuser import SamplingParams
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler

    sched = AdaptiveScheduler(built, suffix=True, adapt_draft=False, background=False,
                              suffix_min_match=2, costs=costs,
                              controller_options=dict(probe_share=0.2, refresh=8))
    counts = checking_issues_ahead(sched, sync)
    counts["mixed"] = 0
    run_suffix = sched._run_suffix

    def run_mixed(*args: object) -> torch.Tensor:
        counts["mixed"] += sync.mode == "error"
        return run_suffix(*args)
    sched._run_suffix = run_mixed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = []
    try:
        with built.generating():
            for _ in range(2):
                streams = [sched.submit(p, params) for p in batch]
                while not all(s.done for s in streams):
                    sched._iteration()
                sched._retire()
                outputs.append([s.output_ids for s in streams])
        return outputs, counts, sched.snapshot()
    finally:
        sched.close()
