"""The end of a greedy decoding iteration as one Triton kernel: acceptance, state update, finish.

After the target's argmax, the eager code of runtime/speculative.py (`accept_greedy`, the tokens
row, `_advance`, `_finish_rows`, `StepResult.packed`) is some 30 tiny PyTorch kernels per
iteration; at ~2 us each inside a captured CUDA graph that is about a quarter of a gamma-4 step
on an H200 with the bundled pair. `finish_greedy_step` does the same work, per row, in one
launch, bit for bit (tests/test_step_kernels.py compares every output and mutated tensor).

Per row b, with draft d_1..d_G (G = gamma; 0 for a plain decode step) and the target's argmax
t_0..t_G over [pending, d_1..d_G]:

    n        = the longest prefix with d_{i+1} == t_i            (0 <= n <= G)
    next     = t_n                                              (correction, or the bonus)
    tokens   = [d_1..d_G, 0] with tokens[n] = next              ([G + 1]; row keeps n + 1)
    new_last = [pending, d_1..d_G][n]                           (the token now in slot L + n)
    active rows only:  history[b, min(L + 1 + i, S - 1)] = tokens[i];  last = new_last;
                       pending = next;  moved = min(n + 1, max_new_tokens - generated)
    seq_lens += moved;  generated += moved                      (moved = 0 for inactive rows)
    active  &= no eos among tokens[0..n]  and  generated < max_new_tokens
    packed   = [tokens, n]                                      ([G + 2] int64)

Cost per row: (2G + 1) token loads, G + 1 history stores and G + 2 packed stores of 8 bytes,
plus 8 scalars and the row's EOS_SLOTS eos ids; no FLOPs to speak of. It is launch-bound: the point is
one launch instead of thirty.

No host sync: every value stays on the device, so the kernel is captured with the rest of the
iteration (runtime/step_graphs.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class GreedyState(Protocol):
    """The rows' device state `finish_greedy_step` reads and updates in place: the fields of
    runtime/speculative.py's DecodeState it uses (shapes there). A Protocol, so that this module,
    which speculative.py imports, does not import it back."""

    pending: torch.Tensor
    last: torch.Tensor
    active: torch.Tensor
    generated: torch.Tensor
    max_new_tokens: torch.Tensor
    eos: torch.Tensor
    history: torch.Tensor
    guesses: torch.Tensor
    streaming: torch.Tensor

# Off CUDA the eager code runs (it is the reference); tests set this (pytest's monkeypatch) to
# run the kernels under TRITON_INTERPRET=1 on the CPU too. Read at each call, never at import.
# One switch for the greedy iteration's kernels: this module's and runtime/draft_kernels.py's.
FUSE_OFF_CUDA = False


def fused_by_default(device: torch.device) -> bool:
    """Whether a greedy step on `device` runs its fused kernels unless told otherwise: its end
    in `finish_greedy_step`, its draft/verify glue in runtime/draft_kernels.py."""
    return device.type == "cuda" or FUSE_OFF_CUDA


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _finish_greedy_kernel(
    draft_ptr,        # draft tokens: [B, G] int64, row stride draft_stride (not read when G == 0)
    target_ptr,       # target argmax: [B, G + 1] int64, row stride target_stride
    pending_ptr,      # [B] int64, in place
    last_ptr,         # [B] int64, in place
    active_ptr,       # [B] bool, in place
    generated_ptr,    # [B] int64, in place
    max_new_ptr,      # [B] int64
    eos_ptr,          # [B, EOS] int64 stop ids per row, padded with -1, contiguous
    history_ptr,      # [B, S] int64, row stride history_stride, in place
    seq_lens_ptr,     # [B] int64, the target cache's lengths L, in place
    packed_ptr,       # out: [B, G + 2] int64 (AHEAD: [B, G + 3]), contiguous
    streaming_ptr,    # AHEAD: [B] bool, in place
    ahead_ptr,        # AHEAD: [B, G + 1] int64, row stride ahead_stride: the draft's Z
    guesses_ptr,      # AHEAD: [B, >= G] int64, row stride guess_stride, in place (the drafts)
    draft_stride,
    target_stride,
    history_stride,
    ahead_stride,
    guess_stride,
    S,
    G: tl.constexpr,          # gamma: draft tokens per row (0: plain decode)
    AHEAD: tl.constexpr,      # the overlapped step (runtime/speculative.py `finish_overlapped`)
    BLOCK: tl.constexpr,      # power of two >= G + 1
    EOS: tl.constexpr,        # eos slots
    EOS_BLOCK: tl.constexpr,  # power of two >= EOS
):
    # One program per row: B is a batch bucket (small), and rows share nothing.
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)  # position in the step's tokens
    in_step = i <= G
    target = tl.load(target_ptr + row * target_stride + i, mask=in_step, other=0)
    draft = tl.load(draft_ptr + row * draft_stride + i, mask=i < G, other=0)

    # Acceptance: n is the first i that stops the prefix; i == G always stops (no draft there).
    stops = (i >= G) | (draft != target)
    if AHEAD:  # a row not streaming has stale guesses: nothing accepted (every i stops)
        streamed = (tl.load(streaming_ptr + row) != 0).to(tl.int32)
        stops = stops | (i < BLOCK * (1 - streamed))
    n = tl.min(tl.where(stops, i, BLOCK), axis=0)
    next_token = tl.sum(tl.where(i == n, target, 0), axis=0)
    # [d_1..d_G, 0] with next at n: the stale entries are the eager row's, bit for bit.
    tokens = tl.where(i == n, next_token, draft)  # draft is 0 at i == G (masked load)
    pending = tl.load(pending_ptr + row)
    d_n = tl.sum(tl.where(i == n - 1, draft, 0), axis=0)
    new_last = tl.where(n == 0, pending, d_n)

    active = tl.load(active_ptr + row) != 0
    L = tl.load(seq_lens_ptr + row)
    # history[b, min(L + 1 + i, S - 1)] = tokens[i] for active rows. When the clamp folds several
    # i onto slot S - 1, the eager scatter_ leaves the last of them there (on the CPU; CUDA's
    # order is unspecified), i == G: only that one is stored here, so the result is
    # deterministic. The invariants keep active rows off the clamp anyway (L + 1 + G <= S - 1;
    # see `_advance`), and an inactive row's eager scatter writes back what was there.
    slot = L + 1 + i.to(tl.int64)
    # (a block mask from the row flag: the interpreter refuses a scalar bool in a mask)
    active_in_step = i < (G + 1) * active.to(tl.int32)
    writes = active_in_step & ((slot < S - 1) | (i == G))
    tl.store(history_ptr + row * history_stride + tl.minimum(slot, S - 1), tokens, mask=writes)

    last = tl.load(last_ptr + row)
    tl.store(last_ptr + row, tl.where(active, new_last, last))
    tl.store(pending_ptr + row, tl.where(active, next_token, pending))
    generated = tl.load(generated_ptr + row)
    max_new = tl.load(max_new_ptr + row)
    n64 = n.to(tl.int64)
    moved = tl.where(active, tl.minimum(n64 + 1, max_new - generated), 0)
    tl.store(seq_lens_ptr + row, L + moved)
    generated += moved
    tl.store(generated_ptr + row, generated)

    # Finish: an eos among the n + 1 kept tokens, or the budget spent.
    e = tl.arange(0, EOS_BLOCK)
    eos = tl.load(eos_ptr + row * EOS + e, mask=e < EOS, other=-1)  # -1 is never a token
    is_eos = (tokens[:, None] == eos[None, :]) & (i <= n)[:, None]  # [BLOCK, EOS_BLOCK]
    no_eos = tl.max(tl.max(is_eos.to(tl.int32), axis=1), axis=0) == 0
    still = active & no_eos & (generated < max_new)
    tl.store(active_ptr + row, still)

    if AHEAD:
        # The next round: streaming on iff Z_1 guessed the new pending slot (n == G when this
        # round streamed, n == 0 when not) and got it right; the guesses become Z_2..Z_{G+1}.
        ahead_row = ahead_ptr + row * ahead_stride
        keep = (n == G * streamed) & (tl.load(ahead_row) == next_token)
        tl.store(streaming_ptr + row, keep)
        nxt = tl.load(ahead_row + 1 + i, mask=i < G, other=0)
        tl.store(guesses_ptr + row * guess_stride + i, nxt, mask=i < G)
        packed_row = packed_ptr + row * (G + 3)
        tl.store(packed_row + i, tokens, mask=in_step)
        tl.store(packed_row + G + 1, (2 * streamed + keep.to(tl.int32)).to(tl.int64))
        tl.store(packed_row + G + 2, n64)
    else:
        packed_row = packed_ptr + row * (G + 2)
        tl.store(packed_row + i, tokens, mask=in_step)
        tl.store(packed_row + G + 1, n64)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def finish_greedy_step(state: GreedyState, seq_lens: torch.Tensor,
                       draft_tokens: torch.Tensor | None, target_tokens: torch.Tensor,
                       ahead: torch.Tensor | None = None) -> torch.Tensor:
    """Accept, advance and finish a greedy step in one launch (see the module docstring).

    state: the iteration's DecodeState, updated in place (history, last, pending, generated,
        active). seq_lens: [B] int64, the target cache's lengths, advanced in place.
    draft_tokens: [B, gamma] int64, or None for a plain decode step (gamma 0).
    target_tokens: [B, gamma + 1] int64, the target's argmax at each verified position.
    ahead: the overlapped step's (runtime/speculative.py `finish_overlapped`): [B, gamma + 1]
        int64, the draft's Z; draft_tokens are then state.guesses[:, :gamma], acceptance
        honours state.streaming, and both move to the next round in place.
    Returns packed [B, gamma + 2] int64: the tokens row, then num_accepted (with ahead:
    [B, gamma + 3], the tokens row, the row's mode code, num_accepted: see `overlapped_step`).
    """
    B, G1 = target_tokens.shape
    G = G1 - 1
    if draft_tokens is None:
        assert G == 0, f"a plain step chooses one token per row, got {G1}"
        draft_tokens = target_tokens  # a pointer the kernel never reads (G == 0)
    else:
        assert draft_tokens.shape == (B, G), f"draft {tuple(draft_tokens.shape)}, target {(B, G1)}"
    for t in (target_tokens, draft_tokens):
        assert t.dtype == torch.long and (t.shape[1] <= 1 or t.stride(1) == 1)
    rows = (state.pending, state.last, state.active, state.generated, state.max_new_tokens,
            seq_lens)
    for t in rows:  # written or read at ptr + row
        assert t.shape == (B,) and t.stride(0) == 1, "per-row state must be contiguous [B]"
    history = state.history
    assert history.shape[0] == B and history.stride(1) == 1 and state.eos.is_contiguous()
    if ahead is not None:
        assert G >= 1 and ahead.shape == (B, G + 1) and ahead.dtype == torch.long
        assert ahead.stride(1) == 1 and state.streaming.stride(0) == 1
        assert draft_tokens.data_ptr() == state.guesses.data_ptr(), "drafts: state.guesses"
    packed = torch.empty(B, G + 2 + (ahead is not None), dtype=torch.long,
                         device=target_tokens.device)
    # BLOCK >= 2 even for the plain step: one spare lane costs nothing, and every block stays a
    # vector rather than the one-element corner case of arange and the reductions.
    block = max(2, triton.next_power_of_2(G + 1))
    eos_slots = state.eos.shape[1]
    _finish_greedy_kernel[(B,)](
        draft_tokens, target_tokens, state.pending, state.last, state.active, state.generated,
        state.max_new_tokens, state.eos, history, seq_lens, packed,
        state.streaming, ahead if ahead is not None else target_tokens, state.guesses,
        draft_tokens.stride(0), target_tokens.stride(0), history.stride(0),
        ahead.stride(0) if ahead is not None else 0, state.guesses.stride(0), history.shape[1],
        G=G, AHEAD=ahead is not None, BLOCK=block, EOS=eos_slots, EOS_BLOCK=max(2, triton.next_power_of_2(eos_slots)),
        num_warps=1,  # a few dozen elements per row: one warp has lanes to spare
    )
    return packed
