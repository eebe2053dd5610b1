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

No function here reads a device value on the host (except `resync_draft`'s fallback, a full
re-prefill of the draft that runs rarely and outside any captured graph); the caller reads back
each step's packed tokens once, and that is the step's only sync. `plain_step` and
`speculative_step` are the whole per-token iteration, and `resync_chunk` the draft's catching up
after target-only steps: their Python values are only the shape-fixing ones (gamma, do_sample);
every per-request value (budget, eos ids, sampling parameters) is a device tensor of fixed shape
in `DecodeState`, so the same function runs uncaptured (CPU, tests) and captured once as one
CUDA graph (runtime/step_graphs.py). On CUDA a greedy step's work after the target's argmax is
one Triton kernel (`finish_greedy`, runtime/step_kernels.py), and the glue between its model
graphs one launch per seam (`draft`, `verify`: runtime/draft_kernels.py); the eager code stays
as their reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fuser.ops.argmax import argmax
from fuser.runtime.branches import run_concurrently
from fuser.runtime.draft_kernels import (catchup_inputs, draft_advance, overlap_catchup_inputs,
                                         verify_inputs)
from fuser.runtime.host_copies import copy_from_host, to_device
from fuser.runtime.steps import (CATCHUP, CHUNK, DECODE, PREFILL, RESYNC, ModelSteps,
                                 verify as verify_step)
from fuser.runtime.prompts import Prompts
from fuser.runtime.sampling import (PURPOSE_DRAFT, PURPOSE_TARGET, accept_greedy, accept_sampling,
                                    draw_keys, process_logits_rows, sample)
from fuser.runtime.step_kernels import finish_greedy_step, fused_by_default


EOS_SLOTS = 8  # eos ids per request held in the state, padded with -1 (never a token id)
# Proposals given from outside the draft: (use [B, gamma] bool, tokens [B, gamma] int64).
Given = tuple[torch.Tensor, torch.Tensor]
GUESS_SLOTS = 16  # the overlapped step's guesses per row: room for the largest gamma (15) + 1


@dataclass
class DecodeState:
    """Per-row device state of one generation, static for the life of a batch bucket (captured
    graphs read it where it lives; `load` refills it in place for each request).

    B = the bucket's batch (dummy rows included), S = the cache's slots per row.
        pending, last: [B] int64 (see the module docstring).
        active: [B] bool, the row still generates (dummy rows never do).
        generated: [B] int64, tokens emitted so far (pending included).
        max_new_tokens: [B] int64, the per-row budget.
        eos: [B, EOS_SLOTS] int64 stop ids per row, padded with -1.
        temperature: [B] float32; top_k: [B] int64 (>= V: off); top_p: [B] float32 (1: off).
        seed: [B] int64, the row's sampling seed: its random draws are `sampling.draw_keys` of
            (seed, output index), so a row samples the same tokens whatever shares its batch.
        history: [B, S] int64, the token in each cache slot (prompt and emitted), so that the
            draft can catch up after target-only steps (`resync_draft`).
        guesses: [B, GUESS_SLOTS] int64, the overlapped step's proposals for slots L+1..L+gamma
            (`overlapped_step`), drafted during the round before.
        streaming: [B] bool, the row's guesses continue what the target accepted (else they
            are stale and the next overlapped round only restarts the draft).
    """

    pending: torch.Tensor
    last: torch.Tensor
    active: torch.Tensor
    generated: torch.Tensor
    max_new_tokens: torch.Tensor
    eos: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    history: torch.Tensor
    guesses: torch.Tensor
    streaming: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, slots: int, device: torch.device) -> DecodeState:
        """Zeroed state for `batch` rows over `slots` cache slots."""
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(pending=longs(batch), last=longs(batch),
                   active=torch.zeros(batch, dtype=torch.bool, device=device),
                   generated=longs(batch), max_new_tokens=longs(batch),
                   eos=torch.full((batch, EOS_SLOTS), -1, dtype=torch.long, device=device),
                   temperature=torch.ones(batch, device=device), top_k=longs(batch),
                   top_p=torch.ones(batch, device=device), history=longs(batch, slots),
                   guesses=longs(batch, GUESS_SLOTS),
                   streaming=torch.zeros(batch, dtype=torch.bool, device=device),
                   seed=longs(batch))

    @property
    def batch(self) -> int:
        return self.pending.shape[0]

    def rows(self, batch: int) -> DecodeState:
        """The first `batch` rows as a state of their own: views, so the same memory (every
        batch bucket runs over rows [:bucket] of one state, as over one KV cache)."""
        return DecodeState(**{name: value[:batch] for name, value in vars(self).items()})

    def copy_row(self, dst: int, src: int) -> None:
        """Row dst becomes a copy of row src (every per-row tensor; a request moving slots)."""
        values = vars(self).values()  # (one call: the per-tensor loop runs in C++)
        torch._foreach_copy_([value[dst] for value in values], [value[src] for value in values])

    def load(self, max_new_tokens: int, eos: list[int], temperature: float, top_k: int | None,
             top_p: float | None, vocab_size: int, seed: int = 0) -> None:
        """Set one request's values in every row (in place). eos: at most EOS_SLOTS ids.
        seed: each row samples with its own seed derived from (seed, row), so that rows, and
        calls with nearby seeds, draw independent streams (`sampling.draw_keys`)."""
        B = self.batch
        self.load_rows([max_new_tokens] * B, [eos] * B, [temperature] * B, [top_k] * B,
                       [top_p] * B, vocab_size, [row_seed(seed, b) for b in range(B)])

    def load_rows(self, max_new_tokens: Sequence[int], eos: Sequence[Sequence[int]],
                  temperature: Sequence[float], top_k: Sequence[int | None],
                  top_p: Sequence[float | None], vocab_size: int, seeds: Sequence[int]) -> None:
        """Set requests' values in rows [0, k), k = len(max_new_tokens), request i's at index i
        of each (eos: at most EOS_SLOTS ids; top_k None or >= vocab_size: off; top_p None:
        off): each field is one copy from the host, not a few device writes a row (an
        admission's host time, measured on an H100: benchmarks/RESULTS.md), queued without
        making the host wait for the device (runtime/host_copies.py)."""
        k = len(max_new_tokens)
        if any(len(ids) > self.eos.shape[1] for ids in eos):
            raise ValueError(f"eos_token_id has {max(len(ids) for ids in eos)} ids; at most "
                             f"{self.eos.shape[1]} are supported")
        stops = torch.full((k, self.eos.shape[1]), -1, dtype=torch.long)
        for i, ids in enumerate(eos):
            if ids:
                stops[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        values = [
            (self.max_new_tokens, torch.tensor(max_new_tokens, dtype=torch.long)),
            (self.eos, stops),
            (self.temperature, torch.tensor(temperature, dtype=self.temperature.dtype)),
            (self.top_k, torch.tensor([vocab_size if t is None else min(t, vocab_size)
                                       for t in top_k], dtype=torch.long)),
            (self.top_p, torch.tensor([1.0 if p is None else p for p in top_p],
                                      dtype=self.top_p.dtype)),
            (self.seed, torch.tensor(seeds, dtype=torch.long)),
        ]
        for field, value in values:
            copy_from_host(field[:k], value)

    def keys(self, purpose: int, offset: torch.Tensor | int = 0,
             counter: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row random keys for the token at output index counter + offset (counter:
        default `generated`, the index of the token after `pending`)."""
        base = self.generated if counter is None else counter
        return draw_keys(self.seed, base + offset, purpose)


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a batch seeded with `seed`: a 64-bit mix of the two
    (splitmix64's finaliser), as a signed int64."""
    x = (seed * 0x9E3779B97F4A7C15 + row + 1) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x - 2**64 if x >= 2**63 else x


@dataclass
class StepResult:
    """What one step emitted: tokens [B, g + 1] of which row b keeps the first num_accepted[b] + 1,
    and num_accepted [B] (always 0 for a plain decode step). `joined` is the packed form when
    the step already wrote it (the fused greedy kernel does), else None."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    joined: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, packed: torch.Tensor) -> StepResult:
        """The result whose packed form is `packed` [B, g + 2] (views of it, no copy)."""
        return cls(packed[:, :-1], packed[:, -1], packed)

    def packed(self) -> torch.Tensor:
        """[B, g + 2]: tokens then num_accepted, so the host reads both back in one copy."""
        if self.joined is not None:
            return self.joined
        return torch.cat([self.tokens, self.num_accepted[:, None]], dim=1)


def probs(state: DecodeState, logits: torch.Tensor) -> torch.Tensor:
    """[B, ..., V] logits -> probabilities after each row's temperature/top-k/top-p."""
    return process_logits_rows(logits, state.temperature, state.top_k, state.top_p)


def choose(state: DecodeState, logits: torch.Tensor, do_sample: bool,
           counter: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V]: the argmax, or a draw from `probs`.

    The argmax is taken in the logits' own dtype: upcasting bf16 to float32 is exact and keeps
    the order (ties included), so a `.float()` first would only add a kernel. On CUDA it is
    fuser/ops/argmax.py's (torch.argmax's answer; one block of threads reduced a Llama-3 row in
    37.6 us).
    """
    if not do_sample:
        return argmax(logits)
    return sample(probs(state, logits.float()), state.keys(PURPOSE_TARGET, counter=counter))


def step_positions(cache_lens: torch.Tensor, starts: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] rotary positions of the T slots from cache_lens[b] on: slot - starts[b]."""
    if T == 1:  # the decode steps: one subtraction, no arange and add of zeros
        return (cache_lens - starts)[:, None]
    offsets = torch.arange(T, device=cache_lens.device)  # [T]
    return (cache_lens - starts)[:, None] + offsets[None]


def prefill(target: ModelSteps, draft: ModelSteps | None, state: DecodeState, prompts: Prompts,
            true_length: int, vocab_size: int, do_sample: bool,
            emitted: torch.Tensor | None = None) -> StepResult:
    """Run the prompts through both models; choose the first new token (into `state`, which
    `load` has filled with the request's values).

    prompts: padded to the bucket's batch and on the right to `Bucket.prefill_length` tokens
    (at least 2, which the prefill step needs; on CUDA a captured prefill's length);
    true_length is the prompt width before that right padding. Right-padding slots
    are written here and overwritten later: seq_lens is set to true_length.
    emitted: [B] int64, tokens each row emitted before (a request resumed after preemption,
    whose prompt here ends with them): the token chosen here is its output number emitted[b]
    (sampling keys, budget). None: 0.
    """
    B, T = prompts.tokens.shape
    positions = prompts.positions()  # [B, T]
    for model in (target, draft):
        if model is not None:
            model.cache.begin(prompts.starts)
    last = torch.full((B,), true_length - 1, dtype=torch.long, device=positions.device)
    logits = target.run_last(PREFILL, prompts.tokens, positions, last)  # [B, V_target]
    target.cache.set_lengths(true_length)
    if draft is not None:
        # The draft's logits here are not needed: its first proposal comes from `draft`'s
        # catch-up step, which re-feeds the prompt's last token (and sets its seq_lens).
        draft.run_last(PREFILL, prompts.tokens, positions, last)
    counter = torch.zeros_like(state.generated) if emitted is None else emitted  # output index
    first = choose(state, first_token_logits(logits, vocab_size), do_sample, counter=counter)
    return _start_rows(state, prompts.tokens, prompts.batch, true_length, first, emitted)


def first_token_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The [B, vocab_size] fp32 logits a prompt's first new token is chosen from, of the
    prompt's last position's [B, V_target] (fuser/build.py `warm_up` takes the argmax of the
    same, so that a build compiles the kernel variant a request runs)."""
    return logits[:, :vocab_size].float()


def prefill_chunk(target: ModelSteps, draft: ModelSteps | None, state: DecodeState,
                  tokens: torch.Tensor, cached: list[int], vocab_size: int, do_sample: bool,
                  emitted: torch.Tensor | None = None) -> StepResult:
    """`prefill` for rows whose prompts open with cached tokens (a paged cache's prefix-cache
    hit: the blocks of slots [0, cached[b]) already hold their k/v, in both models): each row's
    rest runs through the CHUNK step at seq_lens = cached, attending over the cached slots.

    tokens: [B, T] the whole prompts (one length, no padding); cached: per row, < T.
    The chunk is W = max(T - cached, 2) tokens wide (padded to a captured width where chunks
    are captured: `_chunk_width`); a row whose rest is shorter feeds its last token again past
    its end (slots written, masked, later overwritten; never a cached block's, which hold only
    slots below cached).
    """
    B, T = tokens.shape
    width = _chunk_width(target, draft, max(T - min(cached), 2))
    lengths, slots, chunk = _chunk(tokens, cached, width)
    for model in (target, draft):
        if model is not None:
            model.cache.begin(torch.zeros(B, dtype=torch.long, device=tokens.device))
            model.cache.set_lengths(lengths)
    last = T - 1 - lengths  # [B]: each row's last prompt token in the chunk
    logits = target.run_last(CHUNK, chunk, slots, last)  # [B, V_target] (positions = slots)
    if draft is not None:
        draft.run_last(CHUNK, chunk, slots, last)
    target.cache.set_lengths(T)
    counter = torch.zeros_like(state.generated) if emitted is None else emitted
    first = choose(state, first_token_logits(logits, vocab_size), do_sample, counter=counter)
    return _start_rows(state, tokens, B, T, first, emitted)


def _chunk_width(target: ModelSteps, draft: ModelSteps | None, width: int) -> int:
    """The width a chunk of `width` tokens a row runs at: where the CHUNK step is captured, a
    captured width (one that fits the caches), so that the chunk replays a graph. Its extra
    tokens repeat the row's prompt, or its last token past the prompt's end, at slots past the
    chunk: written and later overwritten (by the next chunk, or by decoding, as for a row whose
    prompt ends inside a chunk), or dropped past the cache's last slot."""
    room = min(m.cache.slots for m in (target, draft) if m is not None)
    return target.width(CHUNK, width, room)


def _chunk(tokens: torch.Tensor, progress: list[int], width: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lengths [B], slots [B, W], chunk [B, W]) of a prompt chunk of `width` tokens a row
    from slot progress[b] of the prompts `tokens` [B, T] (a row whose prompt ends inside the
    chunk feeds its last token again past its end)."""
    lengths = to_device(progress, tokens.device)  # [B] (no wait: `host_copies`)
    slots = lengths[:, None] + torch.arange(width, device=tokens.device)  # [B, W]
    return lengths, slots, tokens.gather(1, slots.clamp(max=tokens.shape[1] - 1))


def prefill_part(target: ModelSteps | None, draft: ModelSteps | None, tokens: torch.Tensor,
                 progress: list[int], width: int) -> None:
    """A prompt chunk that does not end the prompts (the scheduler's chunked prefill): row b's
    tokens [progress[b], progress[b] + width) run through the CHUNK step at seq_lens =
    progress[b], in both models, attending over the slots before; no token is chosen (the
    last chunk is `prefill_chunk`'s, with `cached` = the progress then). target None: the
    draft alone (the scheduler's `_refresh_draft`: cached blocks whose draft k/v an older
    draft computed).

    tokens: [B, T] the whole prompts (one length); width >= 2 (the chunk step's least; run at
    a captured width where chunks are captured, `_chunk_width`). A row whose prompt ends inside
    the chunk feeds its last token again past its end (slots written, later overwritten, as in
    `prefill_chunk`). The caches' lengths are left at progress + width (the next chunk sets
    its own). Nothing is read back and nothing waits for the device (runtime/host_copies.py): the
    scheduler queues a chunk while a decode step is still in flight (its run-ahead).
    """
    B = tokens.shape[0]
    # (The draft alone rewrites slots inside cached blocks, which other rows share: exactly its
    # width, never padding slots past it.)
    run_width = width if target is None else _chunk_width(target, draft, width)
    lengths, slots, chunk = _chunk(tokens, progress, run_width)
    last = torch.zeros(B, dtype=torch.long, device=tokens.device)
    for model in (target, draft):
        if model is not None:
            model.cache.begin(torch.zeros(B, dtype=torch.long, device=tokens.device))
            model.cache.set_lengths(lengths)
            model.run_last(CHUNK, chunk, slots, last)  # (the logits are not needed)
            model.cache.set_lengths(lengths + width)


def _start_rows(state: DecodeState, tokens: torch.Tensor, batch: int, true_length: int,
                first: torch.Tensor, emitted: torch.Tensor | None) -> StepResult:
    """The state after a prefill of `tokens` [B, T] (rows past `batch`: dummies) whose first
    chosen tokens are `first` [B]."""
    B, T = tokens.shape
    device = first.device
    state.history.zero_()
    state.history[:, :T].copy_(tokens)
    state.history[:, true_length].copy_(first)  # pending's slot
    state.pending.copy_(first)
    state.last.copy_(tokens[:, true_length - 1])
    state.active.copy_(torch.arange(B, device=device) < batch)  # dummy rows: never
    if emitted is None:
        state.generated.fill_(1)
    else:
        state.generated.copy_(emitted + 1)
    state.streaming.zero_()  # no guesses yet: an overlapped round starts by drafting
    result = StepResult(first[:, None], torch.zeros(B, dtype=torch.long, device=device))
    _finish_rows(state, result)
    return result


def plain_step(target: ModelSteps, state: DecodeState, vocab_size: int, do_sample: bool
               ) -> torch.Tensor:
    """The target-only iteration: feed `pending` at slot L, choose the next token, advance.

    Returns the packed result [B, 2] (token, num_accepted = 0).
    """
    result = decode_one_token(target, state, vocab_size, do_sample)
    return result.packed()


def decode_one_token(target: ModelSteps, state: DecodeState, vocab_size: int, do_sample: bool
                     ) -> StepResult:
    """Without a draft: feed `pending` at slot L, choose the next token from the target (greedy:
    the rest of the step is `finish_greedy`'s)."""
    cache = target.cache
    positions = step_positions(cache.seq_lens, cache.starts, 1)  # [B, 1]
    logits = target.run(DECODE, state.pending[:, None], positions)  # [B, 1, V_target]
    token = choose(state, logits[:, 0, :vocab_size], do_sample)  # [B]
    if not do_sample:
        return finish_greedy(target, state, None, token[:, None])
    result = StepResult(token[:, None], torch.zeros_like(token))
    _advance(target, state, result)
    return result


def draft(draft_model: ModelSteps, target_lens: torch.Tensor, state: DecodeState,
          gamma: int, vocab_size: int, do_sample: bool, fused: bool | None = None,
          start: tuple[torch.Tensor, torch.Tensor] | None = None,
          out: torch.Tensor | None = None, given: Given | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Propose gamma tokens: (draft_tokens [B, gamma], draft probs [B, gamma, V] or None).

    Draft-cache consistency. With the target at length L (pending token y for slot L), the
    draft cache is valid up to slot L-2 whatever happened before:
      - after the prompt (or `resync_draft`), it holds slots 0..L-1;
      - after a verify that accepted n of gamma drafts, the draft had written slots up to
        L_old + gamma - 1 (d_gamma itself is never fed), and L = L_old + n + 1; for n < gamma
        that covers slot L-1, for n == gamma exactly slot L-2.
    So the first forward of a round is the "catchup" graph (T = 2) fed [last, pending], the
    tokens of slots L-1 and L, at seq_lens = L-1: one uniform step for both cases (it rewrites
    slot L-1 with the token already there when n < gamma). Its last logits give d_1; then
    gamma-1 "decode" steps feed d_1..d_{gamma-1} at slots L+1..L+gamma-1.

    fused (greedy only): True runs the glue between the draft steps as runtime/draft_kernels.py's
    kernels (G + 1 launches instead of 3G + 6), False the eager code below (the reference: bit
    for bit the same), None the kernels on CUDA for a greedy draft (see `finish_greedy`).
    start: the catch-up's two tokens (the slots target_lens - 1 and target_lens) when not
    (state.last, state.pending): `overlapped_step` drafts on from its guesses.
    out (greedy only): [B, gamma] int64 to write the drafts into (returned).
    given: (use [B, gamma] bool, tokens [B, gamma] int64): where use[b, i], position i of row b
    proposes tokens[b, i] instead of the draft's choice, and the draft is fed that token (so
    its cache holds what the target verifies: after the step it is valid up to L-2 as after
    any other); its probability there is a point mass (sampling). The suffix index's
    proposals ride in the draft's step this way (runtime/suffix.py `mixed_step`).
    """
    if fused is None:
        fused = not do_sample and fused_by_default(target_lens.device)
    last, pending = start if start is not None else (state.last, state.pending)
    if fused:
        assert not do_sample, "the fused draft is greedy"
        return _draft_greedy_fused(draft_model, target_lens, last, pending, gamma, vocab_size,
                                   out, given), None
    cache = draft_model.cache
    cache.set_lengths(target_lens - 1)  # rewinds past whatever the last round left
    tokens = torch.stack([last, pending], dim=1)  # [B, 2]
    positions = step_positions(cache.seq_lens, cache.starts, 2)  # [B, 2]
    logits = draft_model.run(CATCHUP, tokens, positions)[:, -1, :vocab_size]  # [B, V]
    cache.advance(2)
    drafted, draft_probs = [], []
    for i in range(gamma):
        if i > 0:
            positions = step_positions(cache.seq_lens, cache.starts, 1)  # [B, 1]
            step_logits = draft_model.run(DECODE, drafted[-1][:, None], positions)
            logits = step_logits[:, 0, :vocab_size]  # [B, V]
            cache.advance(1)
        if do_sample:
            p = probs(state, logits.float())  # [B, V]
            token = sample(p, state.keys(PURPOSE_DRAFT, i))
        else:  # in the logits' dtype: see `choose`
            p, token = None, argmax(logits)
        if given is not None:
            use, tokens_given = given[0][:, i], given[1][:, i]  # [B] each
            token = torch.where(use, tokens_given, token)
            if p is not None:
                point = torch.nn.functional.one_hot(tokens_given, p.shape[-1]).to(p.dtype)
                p = torch.where(use[:, None], point, p)
        if p is not None:
            draft_probs.append(p)
        drafted.append(token)
    draft_tokens = torch.stack(drafted, dim=1)  # [B, gamma]
    if out is not None:
        draft_tokens = out.copy_(draft_tokens)
    return draft_tokens, (torch.stack(draft_probs, dim=1) if draft_probs else None)


def _draft_greedy_fused(draft_model: ModelSteps, target_lens: torch.Tensor, last: torch.Tensor,
                        pending: torch.Tensor, gamma: int, vocab_size: int,
                        out: torch.Tensor | None = None, given: Given | None = None
                        ) -> torch.Tensor:
    """`draft`'s greedy path with one kernel per seam: the same steps, tokens and lengths."""
    # seq_lens = L - 1; tokens = [last, pending], positions: [B, 2] each
    tokens, positions = catchup_inputs(draft_model.cache, target_lens, last, pending)
    return _draft_steps_fused(draft_model, tokens, positions, gamma, vocab_size, out, given)


def _draft_steps_fused(draft_model: ModelSteps, tokens: torch.Tensor, positions: torch.Tensor,
                       gamma: int, vocab_size: int, out: torch.Tensor | None = None,
                       given: Given | None = None) -> torch.Tensor:
    """The catch-up step over (tokens, positions) [B, 2], then gamma - 1 decode steps, each
    followed by `draft_advance`: the drafts [B, gamma] (into `out` when given). given: as
    `draft`'s, applied after each `draft_advance` (its column and the next step's token)."""
    cache = draft_model.cache
    drafted = out if out is not None else torch.empty(
        cache.batch_size, gamma, dtype=torch.long,
        device=tokens.device)  # [B, gamma], a column per draft step
    kind = CATCHUP
    for i in range(gamma):
        logits = draft_model.run(kind, tokens, positions)[:, -1, :vocab_size]  # [B, V]
        # drafted[:, i] = argmax (or the token given); seq_lens += T; the next step's token
        # and position: [B, 1]
        tokens, positions = draft_advance(logits, drafted, i, cache, kind.tokens, given)
        kind = DECODE
    return drafted


def verify(target: ModelSteps, state: DecodeState, draft_tokens: torch.Tensor,
           vocab_size: int, fused: bool | None = None) -> torch.Tensor:
    """The target over [pending, d_1..d_gamma] at slots L..L+gamma in one forward.

    Returns logits [B, gamma + 1, V] in the model's dtype (a view: the caller upcasts only to
    sample): row i scores the token after slot L + i.
    fused: True builds the step's tokens and positions in one launch
    (runtime/draft_kernels.py's `verify_inputs`), False with the eager code below (4 kernels),
    None as `fused_by_default`.
    """
    cache = target.cache
    if fused is None:
        fused = fused_by_default(draft_tokens.device)
    if fused:
        tokens, positions = verify_inputs(cache, state.pending, draft_tokens)  # [B, gamma + 1]
    else:
        tokens = torch.cat([state.pending[:, None], draft_tokens], dim=1)  # [B, gamma + 1]
        positions = step_positions(cache.seq_lens, cache.starts, tokens.shape[1])
    kind = verify_step(draft_tokens.shape[1])
    return target.run(kind, tokens, positions)[:, :, :vocab_size]


def speculative_step(target: ModelSteps, draft_model: ModelSteps, state: DecodeState,
                     gamma: int, vocab_size: int, do_sample: bool,
                     given: Given | None = None) -> torch.Tensor:
    """Draft gamma tokens, verify them in one target forward, accept on the device, advance.

    Emits n + 1 tokens per row: the n accepted drafts, then the target's correction (or the
    bonus token when n == gamma). Returns the packed result [B, gamma + 2].
    given: proposals that replace the draft's where marked (`draft`), verified the same way.
    """
    # Greedy: the glue between the model graphs as runtime/draft_kernels.py's (on CUDA);
    # sampling keeps the eager code.
    fused = not do_sample and fused_by_default(target.cache.seq_lens.device)
    draft_tokens, p = draft(draft_model, target.cache.seq_lens, state, gamma, vocab_size,
                            do_sample, fused, given=given)
    target_logits = verify(target, state, draft_tokens, vocab_size, fused)  # [B, gamma + 1, V]
    if not do_sample:  # the argmax in the logits' dtype: see `choose`
        target_tokens = argmax(target_logits)  # [B, gamma + 1]
        return finish_greedy(target, state, draft_tokens, target_tokens).packed()
    q = probs(state, target_logits.float())  # [B, gamma + 1, V]
    n, next_token = accept_sampling(draft_tokens, p, q, keys=(state.seed, state.generated))
    result = _emit(draft_tokens, n, next_token)
    _advance(target, state, result, _new_last(state, draft_tokens, n))
    return result.packed()


def finish_greedy(target: ModelSteps, state: DecodeState, draft_tokens: torch.Tensor | None,
                  target_tokens: torch.Tensor, fused: bool | None = None) -> StepResult:
    """Everything a greedy step does after the target's argmax: accept, advance, finish rows.

    draft_tokens: [B, gamma], or None for a plain decode step. target_tokens: [B, gamma + 1]
    (plain: [B, 1]), the target's argmax over [pending, d_1..d_gamma].
    fused: True runs runtime/step_kernels.py's one Triton kernel (one launch instead of ~30
    tiny ones), False the eager code below (the reference: bit for bit the same), None the
    kernel on CUDA (elsewhere too with step_kernels.FUSE_OFF_CUDA, for tests).
    """
    if fused is None:
        fused = fused_by_default(target_tokens.device)
    if fused:
        packed = finish_greedy_step(state, target.cache.seq_lens, draft_tokens, target_tokens)
        return StepResult.from_packed(packed)
    if draft_tokens is None:  # plain decode: the one token, nothing accepted
        token = target_tokens[:, 0]
        result = StepResult(target_tokens, torch.zeros_like(token))
        _advance(target, state, result)
        return result
    n, next_token = accept_greedy(draft_tokens, target_tokens)
    result = _emit(draft_tokens, n, next_token)
    _advance(target, state, result, _new_last(state, draft_tokens, n))
    return result


def overlapped_step(target: ModelSteps, draft_model: ModelSteps, state: DecodeState, gamma: int,
                    vocab_size: int, fused: bool | None = None) -> torch.Tensor:
    """A greedy speculative round whose drafting runs beside the target's verification.

    The standard step (`speculative_step`) drafts, then verifies: its time is the draft's gamma
    steps plus the target's one. Here the target verifies the guesses drafted during the round
    before while the draft, at the same time, drafts the next round's (runtime/branches.py: a
    side branch of the captured graph), so a round costs about the longer of the two.

    Per row, with the target at length L (pending y for slot L) and guesses X_1..X_gamma for
    slots L+1..L+gamma (`state.guesses`):
      target:  verify [y, X_1..X_gamma] -> t_0..t_gamma; n = the accepted prefix, forced to 0
               when the row is not `streaming` (its guesses are stale); emit X_1..X_n, t_n.
      draft:   streaming: feed [X_{gamma-1}, X_gamma] at slots L+gamma-1, L+gamma (X_0 = y),
                          then gamma decode steps: Z_1..Z_{gamma+1} for slots L+gamma+1.. ;
               not:       feed [last, y] at slots L-1, L (the standard catch-up), then gamma
                          decode steps: Z_1..Z_{gamma+1} for slots L+1.. .
      after:   the row streams on iff Z_1 guessed the slot of the new pending token and got it
               right (streaming: n == gamma and Z_1 == t_gamma; not: Z_1 == t_0); its guesses
               become Z_2..Z_{gamma+1}, for the slots after the new pending one.
    Every emitted token is the target's greedy choice after a prefix the target verified, so the
    output equals target-only greedy decoding whatever the guesses are (stale ones only cost
    tokens). The draft cache stays valid up to slot L-2, `draft`'s invariant, so plain and
    standard steps may follow an overlapped one; what breaks a stream is a gamma change (the
    engine clears `streaming`) or the prefill.

    The draft cache needs 2 gamma + 1 slots past max_seq_len - 1 (streaming rows draft ahead of
    the verified slots): fuser/pipeline.py allocates them. Greedy only: sampling keeps the
    standard step. Returns packed [B, gamma + 3]: the tokens row [gamma + 1], the row's mode
    code, num_accepted. The code is 2 * (the row streamed into this round) + (it streams on
    into the next): for a row that did not stream, the second bit says whether the draft's
    first guess was right, which the adaptive controller counts as a trial at position 1.
    """
    device = target.cache.seq_lens.device
    if fused is None:
        fused = fused_by_default(device)
    L = target.cache.seq_lens
    guesses = state.guesses[:, :gamma]  # [B, gamma]
    ahead = torch.empty(L.shape[0], gamma + 1, dtype=torch.long, device=device)  # Z, [B, g + 1]

    def draft_branch() -> torch.Tensor:
        if fused:  # the catch-up's inputs per row's mode in one launch
            tokens, positions = overlap_catchup_inputs(draft_model.cache, L, state.last,
                                                       state.pending, guesses, state.streaming)
            return _draft_steps_fused(draft_model, tokens, positions, gamma + 1, vocab_size,
                                      ahead)
        streaming = state.streaming
        before = guesses[:, gamma - 2] if gamma >= 2 else state.pending
        head = torch.where(streaming, before, state.last)
        tail = torch.where(streaming, guesses[:, gamma - 1], state.pending)
        lens = L + streaming.long() * gamma
        return draft(draft_model, lens, state, gamma + 1, vocab_size, do_sample=False,
                     fused=False, start=(head, tail), out=ahead)[0]

    def target_branch() -> torch.Tensor:
        return argmax(verify(target, state, guesses, vocab_size, fused))  # [B, gamma + 1]

    _, target_tokens = run_concurrently(draft_branch, target_branch, device)
    return finish_overlapped(target, state, guesses, target_tokens, ahead, fused)


def finish_overlapped(target: ModelSteps, state: DecodeState, guesses: torch.Tensor,
                      target_tokens: torch.Tensor, ahead: torch.Tensor,
                      fused: bool | None = None) -> torch.Tensor:
    """`finish_greedy` for `overlapped_step`: acceptance with n forced to 0 where the row was
    not streaming, then the next round's `streaming` and `guesses` from the draft's Z (ahead,
    [B, gamma + 1]). Returns packed [B, gamma + 3] (see `overlapped_step`).
    fused: runtime/step_kernels.py's kernel (True), the eager code below (False, the
    reference: bit for bit the same), None as `finish_greedy`."""
    if fused is None:
        fused = fused_by_default(target_tokens.device)
    if fused:
        return finish_greedy_step(state, target.cache.seq_lens, guesses, target_tokens,
                                  ahead=ahead)
    gamma = guesses.shape[1]
    streaming = state.streaming
    n, _ = accept_greedy(guesses, target_tokens)
    n = torch.where(streaming, n, 0)
    next_token = target_tokens.gather(1, n[:, None])[:, 0]  # [B]
    result = _emit(guesses, n, next_token)
    keep = (n == streaming.long() * gamma) & (ahead[:, 0] == next_token)
    _advance(target, state, result, _new_last(state, guesses, n))
    code = 2 * streaming.long() + keep.long()  # (streaming is this round's mode until here)
    state.streaming.copy_(keep)
    state.guesses[:, :gamma].copy_(ahead[:, 1:])
    return torch.cat([result.tokens, code[:, None], n[:, None]], dim=1)


def _emit(draft_tokens: torch.Tensor, n: torch.Tensor, next_token: torch.Tensor) -> StepResult:
    """The step's tokens [d_1..d_n, next, (stale drafts)]: row b keeps its first n + 1."""
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(draft_tokens.shape[0], 1)], dim=1)
    tokens = tokens.scatter(1, n[:, None], next_token[:, None])  # [B, gamma + 1]
    return StepResult(tokens, n)


def _new_last(state: DecodeState, draft_tokens: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The token now in slot L + n (y when n == 0, else d_n): the next round's `last` [B]."""
    fed = torch.cat([state.pending[:, None], draft_tokens], dim=1)  # [B, gamma + 1]
    return fed.gather(1, n[:, None])[:, 0]


# `resync_draft` catches up by RESYNC steps while that takes at most this many of them, else
# by one prefill over the whole sequence. A chunk costs about one draft decode step (it reads the
# weights once); a prefill of a few hundred tokens costs a few such steps, plus the host sync
# of reading the longest row's length (the issue-ahead pipeline stalls for a whole iteration) and,
# the first time a padded length comes up, a CUDA graph capture. A rule of thumb, not a
# measurement: at the default probe interval (64 target-only steps) the draft takes 5 chunks.
RESYNC_MAX_CHUNKS = 8


@torch.no_grad()
def resync_draft(draft_model: ModelSteps, target: ModelSteps, state: DecodeState, behind: int,
                 chunk: Callable[[], object] | None = None) -> None:
    """Bring the draft's cache up to the target's after steps without it: afterwards it holds
    slots 0..L-1 of every row and its lengths equal the target's, which `draft`'s invariant
    needs (valid up to L-2).

    behind: the most tokens a row moved since the draft last ran (a host-side count: one a
    target-only step, up to gamma + 1 a step verifying the suffix index's proposals without
    the draft, runtime/adaptive_scheduler.py). The draft was valid up to slot L-2 after its
    last speculative step (up to L-1 after the prompt), so every row's draft is valid below
    L - behind - 1.
    From there, the draft feeds each row's tokens from `state.history` RESYNC_TOKENS at a time
    (`resync_chunk`, ceil((behind + 1) / RESYNC_TOKENS) steps, nothing read on the host).
    chunk: runs one `resync_chunk` over these arguments (the bucket's captured graph of it);
    default: `resync_chunk` itself.

    A draft without the RESYNC step (an engine file written before it, a cache of fewer slots),
    or one more than RESYNC_MAX_CHUNKS chunks behind, is re-prefilled instead (`_reprefill`).
    """
    chunks = -(-(behind + 1) // RESYNC.tokens)
    if RESYNC not in draft_model or chunks > RESYNC_MAX_CHUNKS:
        _reprefill(draft_model, target, state)
        return
    # Left padding is re-fed too where behind reaches back into it (its slots are masked).
    draft_model.cache.set_lengths((target.cache.seq_lens - (behind + 1)).clamp(min=0))
    run_chunk = chunk or (lambda: resync_chunk(draft_model, target, state))
    for _ in range(chunks):
        run_chunk()


def resync_chunk(draft_model: ModelSteps, target: ModelSteps, state: DecodeState) -> None:
    """One RESYNC step of `resync_draft`: row b feeds the W = RESYNC_TOKENS tokens of
    `state.history` from its draft length D on (slots D..D+W-1), then its draft length becomes
    min(D + W, L). The same work whatever the lengths, so it is captured once per bucket.

    Slots past a row's L (a row less than W behind, or one already caught up) get whatever the
    history holds there: written, masked by the length, later overwritten; attention among the W
    tokens is causal, so they do not change the real ones. Where D + W would pass the cache's
    end, the row starts W slots before the end instead: the valid slots it re-feeds get the same
    tokens at the same positions (the same values, up to rounding).
    """
    cache = draft_model.cache
    W = RESYNC.tokens
    room = min(cache.slots, state.history.shape[1])  # >= max_seq_len + 1 > L
    cache.limit(room - W)
    slots = cache.seq_lens[:, None] + torch.arange(W, device=cache.seq_lens.device)  # [B, W]
    tokens = state.history.gather(1, slots.clamp(max=state.history.shape[1] - 1))  # [B, W]
    # The draft's starts are the target's (`prefill` began both caches at the prompts').
    positions = (slots - cache.starts[:, None]).clamp(min=0)  # [B, W]
    draft_model.run(RESYNC, tokens, positions)
    cache.advance(W)
    cache.limit(target.cache.seq_lens)


def _reprefill(draft_model: ModelSteps, target: ModelSteps, state: DecodeState) -> None:
    """`resync_draft` by the draft's prefill step (dynamic T) over `state.history`: every slot
    the target holds, afresh.

    It reads the longest row's length on the host: a sync (the issue-ahead pipeline waits for
    the device). Rows shorter than the longest get tokens past their end too: stale slots,
    masked and later overwritten, and prefill attention is causal, so they do not affect the
    real ones. Where the draft prefills through CUDA graphs, T is padded to a captured length in
    the same way: an uncaptured prefill at an arbitrary T launches every op from the host
    (milliseconds), and each new padded length is captured when it first comes up.
    """
    cache = draft_model.cache
    T = max(int(target.cache.seq_lens.max()), 2)
    T = draft_model.width(PREFILL, T, min(target.cache.slots, state.history.shape[1]))
    tokens = state.history[:, :T]  # [B, T]
    slots = torch.arange(T, device=tokens.device)[None]  # [1, T]
    positions = (slots - target.cache.starts[:, None]).clamp(min=0)  # [B, T]
    cache.begin(target.cache.starts)
    last = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    draft_model.run_last(PREFILL, tokens.contiguous(), positions, last)  # (logits not needed)
    cache.set_lengths(target.cache.seq_lens)


def _advance(target: ModelSteps, state: DecodeState, result: StepResult,
             new_last: torch.Tensor | None = None) -> None:
    """Move active rows on by what they emitted; finished and dummy rows stay where they are.

    A row moves by at most its remaining budget (a step may emit past it; the host drops the
    excess), so L <= prompt + max_new_tokens - 1 always holds, and a frozen row's later
    (ignored) steps write only slots up to L + gamma: inside the cache. The runtime issues
    steps ahead of its read-backs, so such steps do run. The emitted tokens go into `history`
    at slots L + 1.. (the first is the new pending's slot when n + 1 tokens are kept).
    With S = max_seq_len + gamma + 1 slots (fuser/pipeline.py) and L <= max_seq_len - 1, those
    slots end at L + 1 + gamma <= S - 1: the clamp below guards the bounds but never folds two
    tokens onto one slot (where it would, scatter_'s winner is the last on the CPU and
    unspecified on CUDA; runtime/step_kernels.py keeps the CPU's).
    """
    active = state.active
    n = result.num_accepted
    g1 = result.tokens.shape[1]
    L = target.cache.seq_lens
    next_token = result.tokens.gather(1, n[:, None])[:, 0]  # [B]
    if new_last is None:
        new_last = state.pending  # plain decode: pending went into slot L
    # history[b, L + 1 + i] = tokens[b, i] for active rows (slots past the kept ones are stale).
    slots = (L[:, None] + 1 + torch.arange(g1, device=L.device)[None])  # [B, g + 1]
    slots = slots.clamp(max=state.history.shape[1] - 1)
    old = state.history.gather(1, slots)
    state.history.scatter_(1, slots, torch.where(active[:, None], result.tokens, old))
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
    is_eos = (result.tokens[:, :, None] == state.eos[:, None, :]).any(dim=2)  # [B, g + 1]
    hit_eos = (is_eos & kept).any(dim=1)  # [B]
    state.active &= ~hit_eos & (state.generated < state.max_new_tokens)
