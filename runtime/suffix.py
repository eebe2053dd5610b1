"""Suffix speculation: proposals copied from what came before, verified by the target.

Traffic that repeats itself (code edits that rewrite a file, templated answers, agent loops)
continues spans it has already seen. `SuffixIndex` (runtime/suffix_index.py) finds the longest
suffix of a request's tokens (prompt and output) that occurred before, in the request itself or
in recent outputs of other requests, and proposes the tokens that followed it. No model runs:
the proposals of a whole step cost one call into the index's compiled C on the host (a few
dozen numpy calls where it cannot be built; benchmarks/suffix_index.py measures them).

Verification (`suffix_step`) is the target's verify step over host-given proposals instead of
the draft's: greedy acceptance is unchanged (finish_greedy); for sampling, a proposal is a
draft whose distribution is a point mass, p = e_x, so Leviathan's rule accepts x with
probability min(1, q(x) / 1) = q(x) and at a rejection samples the residual
max(0, q - e_x) / (1 - q(x)): q with x removed, renormalised (`accept_proposals`). The output
follows q whatever is proposed, and rows with fewer proposals than gamma are padded with any
token: the target simply accepts or rejects them like any other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from fuser.ops.argmax import argmax
from fuser.runtime import speculative
from fuser.runtime.host_copies import copy_from_host
from fuser.runtime.sampling import PURPOSE_RESIDUAL, acceptance_uniforms, accepted_prefix, \
    draw_keys, sample
from fuser.runtime.step_kernels import fused_by_default
from fuser.runtime.steps import DECODE, ModelSteps, verify as verify_kind
from fuser.runtime.suffix_index import Proposal, SuffixIndex

__all__ = ["Proposal", "SuffixIndex", "SuffixProposals", "accept_proposals", "add_verify_steps",
           "mixed_step", "proposals_tensor", "suffix_step"]


def proposals_tensor(proposals: Sequence[Sequence[int]], gamma: int, batch: int | None = None,
                     device: torch.device | str | None = None, fill: int = 0
                     ) -> torch.Tensor:
    """Row b's proposals, cut to gamma and padded with `fill` (the target rejects what does
    not match, padding included): LongTensor [batch, gamma]; rows past len(proposals) (a
    bucket's dummy rows) are all padding."""
    batch = len(proposals) if batch is None else batch
    out = torch.full((batch, gamma), fill, dtype=torch.long)
    for b, row in enumerate(proposals):
        row = list(row)[:gamma]
        if row:
            out[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out if device is None else out.to(device)


# -- verification on the device -----------------------------------------------------------------


def accept_proposals(proposals: torch.Tensor, q: torch.Tensor,
                     generator: torch.Generator | None = None,
                     keys: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of point-mass drafts (p_i = e_{x_i}): (num_accepted [B],
    next_token [B]).

    proposals: [B, gamma], x_1..x_gamma. q: [B, gamma + 1, V], the target's distributions
    there and one past. x_i is accepted with probability q_i(x_i) (min(1, q/p) at p = 1),
    in order; at the first rejection (n < gamma) the next token is drawn from
        r(v) = max(0, q_n(v) - e_{x_n}(v)) / sum_w (...) = q_n(v) [v != x_n] / (1 - q_n(x_n)),
    after gamma acceptances from q_gamma. Each emitted token then follows q:
    P(v) = q(x) [v = x] + (1 - q(x)) r(v) = q(v). The same draws, in the same order, as
    `sampling.accept_sampling` with one-hot p: the same tokens, without the [B, gamma, V] p.
    keys: per-row random numbers instead of `generator`, as accept_sampling takes them.
    """
    B, gamma = proposals.shape
    q = q.float()
    q_x = q[:, :gamma].gather(2, proposals[:, :, None])[:, :, 0]  # [B, gamma] q_i(x_i)
    u = acceptance_uniforms(B, gamma, q.device, generator, keys)  # [B, gamma] U[0, 1)
    n = accepted_prefix(u < q_x)  # [B]
    index = n[:, None, None].expand(B, 1, q.shape[2])  # [B, 1, V]
    q_n = q.gather(1, index)[:, 0]  # [B, V]
    # x_n's mass removed where a proposal was rejected (n < gamma); the bonus keeps q_gamma.
    padded = torch.cat([proposals, proposals.new_zeros(B, 1)], dim=1)  # [B, gamma + 1]
    rejected = padded.gather(1, n[:, None])  # [B, 1]
    residual = torch.where(n[:, None] < gamma, q_n.scatter(1, rejected, 0.0), q_n)
    # All of q on the rejected token (q(x) = 1 can still be rejected by rounding): q itself.
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, q_n)
    rng = generator if keys is None else draw_keys(keys[0], keys[1] + n, PURPOSE_RESIDUAL)
    return n, sample(residual, rng)


def suffix_step(target: ModelSteps, state: speculative.DecodeState, proposals: torch.Tensor,
                vocab_size: int, do_sample: bool, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """The target verifies host-given proposals [B, gamma] (on the device) in one forward,
    accepts on the device and advances: the speculative step with the suffix index as the
    draft. Returns the packed result [B, gamma + 2], as `speculative.speculative_step`.

    Needs the target's verify step for gamma (`add_verify_steps` for an engine without a
    draft). The draft model is not run: where there is one, its cache falls behind by up to
    gamma + 1 tokens a row (`speculative.resync_draft` catches it up); `mixed_step` keeps it
    in step instead.
    Sampling draws from `generator`, or (None) the state's per-row keys, as speculative_step.
    """
    fused = not do_sample and fused_by_default(target.cache.seq_lens.device)
    logits = speculative.verify(target, state, proposals, vocab_size, fused)  # [B, g + 1, V]
    if not do_sample:  # the argmax in the logits' dtype: see speculative.choose
        return speculative.finish_greedy(target, state, proposals, argmax(logits)).packed()
    q = speculative.probs(state, logits.float())  # [B, gamma + 1, V]
    keys = None if generator is not None else (state.seed, state.generated)
    n, next_token = accept_proposals(proposals, q, generator, keys)
    result = speculative._emit(proposals, n, next_token)
    speculative._advance(target, state, result, speculative._new_last(state, proposals, n))
    return result.packed()


class SuffixProposals:
    """The static device buffer a captured suffix or mixed iteration reads its proposals from,
    filled by one host-to-device copy per step (`load`), and read relative to where each row
    is when the step runs (`aligned`), so that a step can be queued before the one before it
    is read back.

    Per row b: tokens[b, :length[b]], the index's continuation of the row's tokens as the host
    knew them when it made the proposal, the first for output index anchor[b] (the host's
    count of the row's output tokens then; -1: "wherever the row is when the step runs").
    Layout: one int64 buffer [B, K + 2]: tokens [B, K], then length, then anchor.
    """

    def __init__(self, batch: int, max_gamma: int, device: torch.device,
                 lookahead: int | None = None) -> None:
        """lookahead: tokens the steps in flight may emit before this one runs (default:
        max_gamma + 1, one step's most): the buffer keeps max_gamma + lookahead a row."""
        self.max_gamma = max_gamma
        self.width = max_gamma + (max_gamma + 1 if lookahead is None else lookahead)  # K
        self.packed = torch.zeros(batch, self.width + 2, dtype=torch.long, device=device)
        self.buffer = self.packed[:, :self.width]  # [B, K]
        self.length = self.packed[:, self.width]  # [B]
        self.anchor = self.packed[:, self.width + 1]  # [B]
        self.anchor.fill_(-1)
        self._columns = np.arange(self.width)  # [K] (load_arrays' mask)

    def load(self, proposals: Sequence[Sequence[int]], gamma: int | None = None, fill: int = 0,
             anchors: Sequence[int] | None = None) -> None:
        """Row b proposes proposals[b] (cut to the buffer's width; rows past them and missing
        ones propose nothing), anchored at anchors[b] (default -1: where the row is when the
        step runs). gamma: unused (the step's gamma cuts at run time), kept for callers that
        give it. On CUDA the copy is queued from pinned memory of its own (PyTorch's host
        allocator keeps it until the copy has run), so the host does not wait; queued on the
        step's stream, it lands after the steps queued before it have read the buffer."""
        K = self.buffer.shape[1]
        rows = [row[:K] for row in proposals]
        n = len(rows)
        lengths = np.fromiter(map(len, rows), np.int64, n)  # [n]
        tokens = np.full((n, K), fill, np.int64)
        total = int(lengths.sum())
        if total:  # every row's tokens in one scatter: row r's at columns 0 .. len - 1
            flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, total)
            first = np.cumsum(lengths) - lengths  # [n]
            tokens[np.repeat(np.arange(n), lengths),
                   np.arange(total) - np.repeat(first, lengths)] = flat
        self.load_arrays(tokens, lengths, anchors=anchors, fill=fill)

    def load_arrays(self, tokens: np.ndarray, counts: np.ndarray,
                    anchors: Sequence[int] | None = None, fill: int = 0) -> None:
        """`load` from `SuffixIndex.propose_arrays`' arrays: row b proposes tokens[b,
        :counts[b]] (tokens [n, W] int64, counts [n]; cut to the buffer's width; rows past n
        propose nothing), anchored as `load` anchors. No Python list a token."""
        B, K = self.buffer.shape
        n, width = tokens.shape
        if n > B:
            raise ValueError(f"{n} rows of proposals for a buffer of {B}")
        w = min(width, K)
        if width > K:  # (a count is at most the width: cut only where the buffer is narrower)
            counts = np.minimum(counts, w)  # [n]
        host = np.full((B, K + 2), fill, np.int64)
        if n < B:
            host[n:, K] = 0
        if anchors is None or n < B:
            host[n if anchors is not None else 0:, K + 1] = -1
        host[:n, :w] = np.where(self._columns[:w] < counts[:, None], tokens[:, :w], fill)
        host[:n, K] = counts
        if anchors is not None:
            host[:n, K + 1] = np.asarray(anchors[:n], np.int64)
        copy_from_host(self.packed, torch.from_numpy(host))

    def aligned(self, target: ModelSteps, state: speculative.DecodeState, gamma: int,
                fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The proposals for the step that runs now: (use [B, gamma] bool, tokens [B, gamma],
        count [B] = use.sum(1)), on the device, nothing read on the host.

        Row b is at output index G = state.generated[b] (pending is index G - 1, at cache
        slot L). Since the anchor A the device emitted j = G - A tokens the host had not seen,
        at slots L - j + 1 .. L of `state.history`; they must equal the proposal's first j
        tokens (else the proposal continued something that did not happen: none for the row).
        The step then proposes tokens[j : j + gamma], as many as remain.

        fused: True in one launch (`_aligned_kernel`, bit for bit the code below: ~15 small
        kernels in the mixed step's graph otherwise), False the eager code, None as
        `fused_by_default` (CUDA).
        """
        B, K = self.buffer.shape
        device = self.buffer.device
        L = target.cache.seq_lens  # [B]
        if fused is None:
            fused = fused_by_default(device)
        if fused:
            return aligned_fused(self.packed, state.generated, L, state.history, gamma)
        j = torch.where(self.anchor >= 0, state.generated - self.anchor, 0).clamp(0, K)  # [B]
        i = torch.arange(K, device=device)[None]  # [1, K]
        slots = (L[:, None] - j[:, None] + 1 + i).clamp(0, state.history.shape[1] - 1)
        seen = state.history.gather(1, slots)  # [B, K]
        agrees = ((seen == self.buffer) | (i >= j[:, None])).all(dim=1)  # [B]
        remaining = torch.where(agrees, (self.length - j).clamp(min=0), 0)  # [B]
        count = remaining.clamp(max=gamma)  # [B]
        at = (j[:, None] + i[:, :gamma]).clamp(max=K - 1)  # [B, gamma]
        tokens = self.buffer.gather(1, at)  # [B, gamma]
        use = i[:, :gamma] < count[:, None]  # [B, gamma]
        return use, torch.where(use, tokens, 0), count

    def iteration(self, target: ModelSteps, state: speculative.DecodeState, gamma: int,
                  vocab_size: int, do_sample: bool) -> Callable[[], torch.Tensor]:
        """The target verifying the aligned proposals alone (no draft; a row without any
        verifies padding): () -> packed [B, gamma + 3], tokens, the row's proposal count, n."""
        def step() -> torch.Tensor:
            _, tokens, count = self.aligned(target, state, gamma)
            packed = suffix_step(target, state, tokens, vocab_size, do_sample)
            return _with_counts(packed, count)
        return step

    def mixed_iteration(self, target: ModelSteps, draft: ModelSteps,
                        state: speculative.DecodeState, gamma: int, vocab_size: int,
                        do_sample: bool) -> Callable[[], torch.Tensor]:
        """`mixed_step` over this buffer: () -> packed [B, gamma + 3]."""
        return lambda: mixed_step(target, draft, state, self, gamma, vocab_size, do_sample)


@triton.jit
def _aligned_kernel(
    packed_ptr,      # [B, K + 2] int64: tokens [K], length, anchor (SuffixProposals.packed)
    generated_ptr,   # [B] int64: the output index G of each row's pending token
    seq_lens_ptr,    # [B] int64: the target cache's lengths L
    history_ptr,     # [B, H] int64: the token in each cache slot
    use_ptr,         # out: [B, gamma] uint8 (a bool's bytes)
    tokens_ptr,      # out: [B, gamma] int64
    count_ptr,       # out: [B] int64
    packed_stride, history_stride, H, K, gamma,
    BLOCK_K: tl.constexpr,  # power of two >= K
    BLOCK_G: tl.constexpr,  # power of two >= gamma
):
    # One program per row: SuffixProposals.aligned's eager code, op for op.
    row = tl.program_id(0).to(tl.int64)
    base = packed_ptr + row * packed_stride
    length = tl.load(base + K)
    anchor = tl.load(base + K + 1)
    generated = tl.load(generated_ptr + row)
    L = tl.load(seq_lens_ptr + row)
    j = tl.where(anchor >= 0, generated - anchor, 0)
    j = tl.minimum(tl.maximum(j, 0), K)
    i = tl.arange(0, BLOCK_K)
    inside = i < K
    slots = tl.minimum(tl.maximum(L - j + 1 + i, 0), H - 1)
    seen = tl.load(history_ptr + row * history_stride + slots, mask=inside, other=0)
    proposed = tl.load(base + i, mask=inside, other=0)
    agree = (seen == proposed) | (i >= j) | (i >= K)  # (lanes past K: not there)
    agrees = tl.min(agree.to(tl.int32), axis=0) > 0
    remaining = tl.where(agrees, tl.maximum(length - j, 0), 0)
    count = tl.minimum(remaining, gamma)
    g = tl.arange(0, BLOCK_G)
    columns = g < gamma
    at = tl.minimum(j + g, K - 1)
    token = tl.load(base + at, mask=columns, other=0)
    use = g < count
    tl.store(use_ptr + row * gamma + g, use.to(tl.uint8), mask=columns)
    tl.store(tokens_ptr + row * gamma + g, tl.where(use, token, 0), mask=columns)
    tl.store(count_ptr + row, count)


def aligned_fused(packed: torch.Tensor, generated: torch.Tensor, seq_lens: torch.Tensor,
                  history: torch.Tensor, gamma: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`SuffixProposals.aligned` in one launch: (use [B, gamma] bool, tokens [B, gamma],
    count [B]) from the proposals' packed buffer [B, K + 2], the rows' output indices, the
    target cache's lengths and the decode state's history."""
    B, K = packed.shape[0], packed.shape[1] - 2
    if not 1 <= gamma <= K:
        raise ValueError(f"gamma {gamma} must be in 1..{K} (the proposals' width)")
    assert packed.dtype == generated.dtype == seq_lens.dtype == history.dtype == torch.long
    assert packed.stride(1) == history.stride(1) == 1
    use = torch.empty(B, gamma, dtype=torch.bool, device=packed.device)
    tokens = torch.empty(B, gamma, dtype=torch.long, device=packed.device)
    count = torch.empty(B, dtype=torch.long, device=packed.device)
    if B:
        _aligned_kernel[(B,)](
            packed, generated, seq_lens, history, use.view(torch.uint8), tokens, count,
            packed.stride(0), history.stride(0), history.shape[1], K, gamma,
            BLOCK_K=triton.next_power_of_2(K), BLOCK_G=triton.next_power_of_2(gamma),
            num_warps=1)
    return use, tokens, count


def mixed_step(target: ModelSteps, draft: ModelSteps, state: speculative.DecodeState,
               proposals: SuffixProposals, gamma: int, vocab_size: int, do_sample: bool
               ) -> torch.Tensor:
    """One speculative step with per-row sources: a row with suffix proposals verifies them
    (the rest of its gamma positions the draft's), the others the draft's, in one verify.

    The draft runs for every row, fed the tokens that will be verified
    (`speculative.draft`'s `given`): its cache stays in step with the target's whatever each
    row's source, so no resync follows. Greedy acceptance is `finish_greedy`'s; sampling is
    speculative sampling with point-mass drafts at the suffix's positions (accept_proposals'
    rule), so each emitted token follows the target's distribution.
    Returns packed [B, gamma + 3]: tokens [gamma + 1], the row's suffix proposals used, n.
    """
    use, tokens, count = proposals.aligned(target, state, gamma)
    packed = speculative.speculative_step(target, draft, state, gamma, vocab_size, do_sample,
                                          given=(use, tokens))
    return _with_counts(packed, count)


def _with_counts(packed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, g + 2] (tokens, n) -> [B, g + 3] (tokens, count, n): the host reads tokens from
    the front and n from the back, as ever."""
    return torch.cat([packed[:, :-1], count[:, None], packed[:, -1:]], dim=1)


def add_verify_steps(target: ModelSteps, gammas: Sequence[int], config: object,
                     device: torch.device) -> list[int]:
    """Build the target's verify step for each gamma it lacks (an engine built without a
    draft has none), over the same model and cache; -> the gammas added. Where the model's
    steps were not exported (eager fallback), nothing can be added."""
    from fuser.build import add_step

    missing = [g for g in sorted(set(gammas)) if verify_kind(g) not in target]
    if not missing:
        return []
    view = getattr(target[DECODE].eager, "model", None)
    if view is None:
        raise ValueError(f"the target has no verify step for gamma {missing} and its steps "
                         "keep no module (a loaded engine): build the engine with those "
                         "gammas")
    for gamma in missing:
        add_step(target, view, verify_kind(gamma), config, device)
    return missing
