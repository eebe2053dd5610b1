"""The decoding steps on the device: prefill, plain decode, and the speculative draft/verify step.

Cache layout (runtime/kv_cache.py): row b holds its tokens in slots [starts[b], seq_lens[b]); the
rotary position of slot j is j - starts[b]. A step writes its T tokens at slots
seq_lens[b] + t and does not advance seq_lens: the functions here do, through the cache's own
methods (in place: captured CUDA graphs read the lengths where they live).

State between steps, per row (all on the device):
    target.cache.seq_lens = L: slots 0..L-1 hold the prompt and every token emitted but one;
    pending: the last emitted token, not yet in any cache (its slot will be L);
    last: the token in slot L-1.
The draft cache is only ever trusted up to slot L-2 (see `draft`), so a rejected draft needs no
rollback in either cache: lengths move back, stale slots are masked and later overwritten.

No function here reads a device value on the host; the caller reads back each step's emitted
tokens once (`StepResult.packed`), and that is the step's only sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser.runtime.steps import CATCHUP, DECODE, PREFILL, ModelSteps, verify as verify_step
from fuser.runtime.prompts import Prompts
from fuser.runtime.sampling import accept_greedy, accept_sampling, process_logits, sample


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy (argmax) or sampled after HF's warpers."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] probabilities after temperature/top-k/top-p."""
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` [..., V]: the argmax, or a draw from `probs`."""
        if not self.do_sample:
            return torch.argmax(logits, dim=-1)
        return sample(self.probs(logits), self.generator)


@dataclass
class DecodeState:
    """Per-row device state of one generation (B = the engine's fixed batch, dummy rows included).

    pending, last: [B] int64 (see the module docstring). active: [B] bool, the row still
    generates (dummy rows never do). generated: [B] int64, tokens emitted so far (pending
    included). eos: [E] int64 stop ids (E may be 0). max_new_tokens: the per-row budget.
    """

    pending: torch.Tensor
    last: torch.Tensor
    active: torch.Tensor
    generated: torch.Tensor
    eos: torch.Tensor
    max_new_tokens: int


@dataclass
class StepResult:
    """What one step emitted: tokens [B, g + 1] of which row b keeps the first num_accepted[b] + 1,
    and num_accepted [B] (always 0 for a plain decode step)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def packed(self) -> torch.Tensor:
        """[B, g + 2]: tokens then num_accepted, so the host reads both back in one copy."""
        return torch.cat([self.tokens, self.num_accepted[:, None]], dim=1)


def step_positions(cache_lens: torch.Tensor, starts: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] rotary positions of the T slots from cache_lens[b] on: slot - starts[b]."""
    offsets = torch.arange(T, device=cache_lens.device)  # [T]
    return (cache_lens - starts)[:, None] + offsets[None]


def prefill(target: ModelSteps, draft: ModelSteps | None, prompts: Prompts,
            true_length: int, vocab_size: int, sampling: Sampling, eos: torch.Tensor,
            max_new_tokens: int) -> tuple[DecodeState, StepResult]:
    """Run the prompts through both models; choose the first new token.

    prompts: padded to the engine's batch and to at least 2 tokens (the prefill graph needs
    T >= 2); true_length is the prompt width before that right padding. Right-padding slots
    are written here and overwritten later: seq_lens is set to true_length.
    """
    B = prompts.tokens.shape[0]
    positions = prompts.positions()  # [B, T]
    for model in (target, draft):
        if model is not None:
            model.cache.begin(prompts.starts)
    logits = target.run(PREFILL, prompts.tokens, positions)  # [B, T, V_target]
    target.cache.set_lengths(true_length)
    if draft is not None:
        # The draft's logits here are not needed: its first proposal comes from `draft`'s
        # catch-up step, which re-feeds the prompt's last token (and sets its seq_lens).
        draft.run(PREFILL, prompts.tokens, positions)
    first = sampling.choose(logits[:, true_length - 1, :vocab_size].float())  # [B]

    device = first.device
    real = torch.arange(B, device=device) < prompts.batch  # dummy rows never generate
    state = DecodeState(
        pending=first,
        last=prompts.tokens[:, true_length - 1].clone(),
        active=real,
        generated=torch.ones(B, dtype=torch.long, device=device),
        eos=eos,
        max_new_tokens=max_new_tokens,
    )
    result = StepResult(first[:, None], torch.zeros(B, dtype=torch.long, device=device))
    _finish_rows(state, result)
    return state, result


def decode_one_token(target: ModelSteps, state: DecodeState, vocab_size: int,
                     sampling: Sampling) -> StepResult:
    """Without a draft: feed `pending` at slot L, choose the next token from the target."""
    cache = target.cache
    positions = step_positions(cache.seq_lens, cache.starts, 1)  # [B, 1]
    logits = target.run(DECODE, state.pending[:, None], positions)  # [B, 1, V_target]
    token = sampling.choose(logits[:, 0, :vocab_size].float())  # [B]
    result = StepResult(token[:, None], torch.zeros_like(token))
    _advance(target, state, result)
    return result


def draft(draft_model: ModelSteps, target_lens: torch.Tensor, state: DecodeState,
          gamma: int, vocab_size: int, sampling: Sampling
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Propose gamma tokens: (draft_tokens [B, gamma], draft probs [B, gamma, V] or None).

    Draft-cache consistency. With the target at length L (pending token y for slot L), the
    draft cache is valid up to slot L-2 whatever happened before:
      - after the prompt, it holds slots 0..L-1;
      - after a verify that accepted n of gamma drafts, the draft had written slots up to
        L_old + gamma - 1 (d_gamma itself is never fed), and L = L_old + n + 1; for n < gamma
        that covers slot L-1, for n == gamma exactly slot L-2.
    So the first forward of a round is the "catchup" graph (T = 2) fed [last, pending], the
    tokens of slots L-1 and L, at seq_lens = L-1: one uniform step for both cases (it rewrites
    slot L-1 with the token already there when n < gamma). Its last logits give d_1; then
    gamma-1 "decode" steps feed d_1..d_{gamma-1} at slots L+1..L+gamma-1.
    """
    cache = draft_model.cache
    cache.set_lengths(target_lens - 1)  # rewinds past whatever the last round left
    tokens = torch.stack([state.last, state.pending], dim=1)  # [B, 2]
    positions = step_positions(cache.seq_lens, cache.starts, 2)  # [B, 2]
    logits = draft_model.run(CATCHUP, tokens, positions)[:, -1, :vocab_size].float()  # [B, V]
    cache.advance(2)
    drafted, probs = [], []
    for i in range(gamma):
        if i > 0:
            positions = step_positions(cache.seq_lens, cache.starts, 1)  # [B, 1]
            step_logits = draft_model.run(DECODE, drafted[-1][:, None], positions)
            logits = step_logits[:, 0, :vocab_size].float()  # [B, V]
            cache.advance(1)
        if sampling.do_sample:
            p = sampling.probs(logits)  # [B, V]
            probs.append(p)
            drafted.append(sample(p, sampling.generator))
        else:
            drafted.append(torch.argmax(logits, dim=-1))
    draft_tokens = torch.stack(drafted, dim=1)  # [B, gamma]
    return draft_tokens, (torch.stack(probs, dim=1) if probs else None)  # p: [B, gamma, V]


def verify(target: ModelSteps, state: DecodeState, draft_tokens: torch.Tensor,
           vocab_size: int) -> torch.Tensor:
    """The target over [pending, d_1..d_gamma] at slots L..L+gamma in one forward.

    Returns float32 logits [B, gamma + 1, V]: row i scores the token after slot L + i.
    """
    cache = target.cache
    tokens = torch.cat([state.pending[:, None], draft_tokens], dim=1)  # [B, gamma + 1]
    positions = step_positions(cache.seq_lens, cache.starts, tokens.shape[1])
    kind = verify_step(draft_tokens.shape[1])
    return target.run(kind, tokens, positions)[:, :, :vocab_size].float()


def speculative_step(target: ModelSteps, draft_model: ModelSteps, state: DecodeState,
                     gamma: int, vocab_size: int, sampling: Sampling) -> StepResult:
    """Draft gamma tokens, verify them in one target forward, accept on the device.

    Emits n + 1 tokens per row: the n accepted drafts, then the target's correction (or the
    bonus token when n == gamma).
    """
    draft_tokens, p = draft(draft_model, target.cache.seq_lens, state, gamma, vocab_size,
                            sampling)
    target_logits = verify(target, state, draft_tokens, vocab_size)  # [B, gamma + 1, V]
    if sampling.do_sample:
        q = sampling.probs(target_logits)  # [B, gamma + 1, V]
        n, next_token = accept_sampling(draft_tokens, p, q, sampling.generator)
    else:
        n, next_token = accept_greedy(draft_tokens, torch.argmax(target_logits, dim=-1))
    # [d_1..d_n, next, (stale drafts)]: row b keeps its first n + 1.
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(draft_tokens.shape[0], 1)], dim=1)
    tokens = tokens.scatter(1, n[:, None], next_token[:, None])  # [B, gamma + 1]
    # The token now in slot L + n (y when n == 0, else d_n) is the next round's `last`.
    fed = torch.cat([state.pending[:, None], draft_tokens], dim=1)  # [B, gamma + 1]
    new_last = fed.gather(1, n[:, None])[:, 0]
    result = StepResult(tokens, n)
    _advance(target, state, result, new_last)
    return result


def _advance(target: ModelSteps, state: DecodeState, result: StepResult,
             new_last: torch.Tensor | None = None) -> None:
    """Move active rows on by what they emitted; finished and dummy rows stay where they are.

    A row moves by at most its remaining budget (a step may emit past it; the host drops the
    excess), so L <= prompt + max_new_tokens - 1 always holds, and a frozen row's later
    (ignored) steps write only slots up to L + gamma: inside the cache. The runtime issues
    steps ahead of its read-backs, so such steps do run.
    """
    active = state.active
    n = result.num_accepted
    next_token = result.tokens.gather(1, n[:, None])[:, 0]  # [B]
    if new_last is None:
        new_last = state.pending  # plain decode: pending went into slot L
    state.last.copy_(torch.where(active, new_last, state.last))
    state.pending.copy_(torch.where(active, next_token, state.pending))
    moved = torch.where(active, torch.minimum(n + 1, state.max_new_tokens - state.generated), 0)
    target.cache.advance(moved)
    state.generated.add_(moved)
    _finish_rows(state, result)


def _finish_rows(state: DecodeState, result: StepResult) -> None:
    """Mark rows done that emitted an eos token or reached max_new_tokens (on the device)."""
    g1 = result.tokens.shape[1]
    kept = torch.arange(g1, device=result.tokens.device)[None] <= result.num_accepted[:, None]
    hit_eos = (torch.isin(result.tokens, state.eos) & kept).any(dim=1)  # [B]
    state.active &= ~hit_eos & (state.generated < state.max_new_tokens)
