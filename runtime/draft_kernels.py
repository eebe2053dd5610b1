"""The glue between a greedy iteration's model graphs as Triton kernels: one launch per seam.

Between the draft's and the target's model graphs, the eager code of runtime/speculative.py
(`draft`, `verify`, `step_positions`) runs tiny PyTorch kernels, ~2 us each inside a captured
CUDA graph: on an H200 the bundled pair's gamma-2 iteration measured 0.282 ms against 0.247 ms
for its model graphs alone (gamma 4: 0.375 vs 0.336). Per greedy iteration with gamma G:

    eager (launches)                                                         fused (launches)
    catch-up inputs: set_lengths(L - 1) (sub, copy), stack [last, pending],
                     step_positions(.., 2) (sub, arange, add)            6   catchup_inputs   1
    after each draft step: advance(k) (add_), argmax                  2 G   draft_advance    G
    before draft steps 2..G: step_positions(.., 1) (sub)              G - 1  (in draft_advance)
    stack(drafted)                                                       1   (drafted in place)
    verify inputs: cat [pending, drafts], step_positions(.., G + 1)      4   verify_inputs    1
    total                                                           3G + 10                G + 2

(gamma 2: 16 -> 4; gamma 4: 22 -> 6.) Then the target's argmax and runtime/step_kernels.py's
`finish_greedy_step`, unchanged. Each kernel does exactly what the eager code does, bit for bit
(tests/test_draft_kernels.py compares every output and every mutated tensor):

    catchup_inputs:  seq_lens = L - 1;  tokens = [last, pending];
                     positions = seq_lens - starts + [0, 1]
    draft_advance:   d = argmax(logits[b, :V]), or the proposal given at (b, i) (the mixed
                     step's, `speculative.draft`'s `given`);  drafted[b, i] = d;
                     seq_lens += k;  token = [d];  position = [seq_lens - starts]
                     (the next step's inputs)
    verify_inputs:   tokens = [pending, d_1..d_G];  positions = L - starts + [0..G]

(L: the target cache's lengths; seq_lens, starts: the draft cache's unless said otherwise.)

Argmax as torch.argmax: the first index of the maximum; a NaN counts as above every number (the
first NaN wins; torch's GreaterOrNan). bf16/fp16 logits are compared in float32, an exact
upcast that keeps the order and the ties.

Cost: catchup_inputs and verify_inputs move a few dozen bytes per row. draft_advance reads one
logits row per program, V x itemsize bytes (128256 x 2 = 250 KiB for a Llama-3 vocab in bf16),
with ~5 compares per element; one program per row, looping over V: at B <= 16 the step is
launch-bound, and a split over V would need a second launch to merge.

No host sync: every value stays on the device, so the kernels are captured with the rest of the
iteration (runtime/step_graphs.py). Which path runs is runtime/step_kernels.py's switch,
`fused_by_default` (CUDA, or FUSE_OFF_CUDA for tests): one switch for the greedy iteration's
kernels. Sampling keeps the eager code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuser.runtime.kv_cache import KVCache

# Logits elements per loop iteration of draft_advance: 16 iterations over a 128256 vocab,
# 16 KiB of bf16 in flight per program; small vocabularies take one power-of-two block.
MAX_BLOCK_V = 8192


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _step_inputs_kernel(
    head_ptr,        # [B] int64: tokens[:, 0]
    tail_ptr,        # [B, T - 1] int64, row stride tail_stride: tokens[:, 1:]
    lens_ptr,        # [B] int64: the lengths the step starts from (REWIND: plus one)
    seq_lens_ptr,    # [B] int64, set to lens - 1 in place when REWIND (else not touched)
    starts_ptr,      # [B] int64
    tokens_ptr,      # out: [B, T] int64, contiguous
    positions_ptr,   # out: [B, T] int64, contiguous
    tail_stride,
    T: tl.constexpr,       # tokens per row of the step
    BLOCK: tl.constexpr,   # power of two >= T
    REWIND: tl.constexpr,  # the draft's catch-up: the step starts one slot back
):
    # One program per row: rows share nothing, and each is a handful of scalars.
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK)
    length = tl.load(lens_ptr + row)
    if REWIND:
        length -= 1
        tl.store(seq_lens_ptr + row, length)
    head = tl.load(head_ptr + row)
    tail = tl.load(tail_ptr + row * tail_stride + t - 1, mask=(t >= 1) & (t < T), other=0)
    in_step = t < T
    tl.store(tokens_ptr + row * T + t, tl.where(t == 0, head, tail), mask=in_step)
    position = length - tl.load(starts_ptr + row) + t.to(tl.int64)  # slot - starts
    tl.store(positions_ptr + row * T + t, position, mask=in_step)


@triton.jit
def _overlap_catchup_kernel(
    lens_ptr,        # [B] int64: the target cache's lengths L
    last_ptr,        # [B] int64
    pending_ptr,     # [B] int64
    guesses_ptr,     # [B, >= G] int64, row stride guess_stride
    streaming_ptr,   # [B] bool
    seq_lens_ptr,    # [B] int64, the draft cache's lengths, set in place
    starts_ptr,      # [B] int64
    tokens_ptr,      # out: [B, 2] int64, contiguous
    positions_ptr,   # out: [B, 2] int64, contiguous
    guess_stride,
    G: tl.constexpr,  # gamma
):
    # One program per row (a handful of scalars): the overlapped step's catch-up, from the
    # guesses where the row streams, else the standard [last, pending].
    row = tl.program_id(0).to(tl.int64)
    streaming = tl.load(streaming_ptr + row) != 0
    guess_row = guesses_ptr + row * guess_stride
    pending = tl.load(pending_ptr + row)
    if G >= 2:
        before = tl.load(guess_row + G - 2)
    else:
        before = pending
    head = tl.where(streaming, before, tl.load(last_ptr + row))
    tail = tl.where(streaming, tl.load(guess_row + G - 1), pending)
    length = tl.load(lens_ptr + row) + tl.where(streaming, G, 0) - 1
    tl.store(seq_lens_ptr + row, length)
    position = length - tl.load(starts_ptr + row)
    tl.store(tokens_ptr + row * 2, head)
    tl.store(tokens_ptr + row * 2 + 1, tail)
    tl.store(positions_ptr + row * 2, position)
    tl.store(positions_ptr + row * 2 + 1, position + 1)


@triton.jit
def _draft_advance_kernel(
    logits_ptr,      # [B, V] logits (float), row stride logits_stride, unit column stride
    drafted_ptr,     # out: [B, G] int64, row stride drafted_stride; column `column` written
    seq_lens_ptr,    # [B] int64, the draft cache's lengths, += written in place
    starts_ptr,      # [B] int64
    token_ptr,       # out: [B, 1] int64, the next draft step's input token
    position_ptr,    # out: [B, 1] int64, its position
    use_ptr,         # GIVEN: [B, G] uint8 (a bool's bytes), row stride use_stride: the
    given_ptr,       # proposal given_ptr [B, G] int64 (row stride given_stride) replaces it
    logits_stride,
    drafted_stride,
    use_stride,
    given_stride,
    column,
    written,         # slots the draft step wrote: 2 (catch-up) or 1
    V,
    BLOCK_V: tl.constexpr,  # power of two, at most MAX_BLOCK_V
    GIVEN: tl.constexpr,  # proposals given (`speculative.draft`'s `given`)
):
    # One program per row, looping over the vocabulary. Each lane keeps the first maximum it
    # saw (strict >: later blocks hold larger indices) and the first NaN; at the end the row's
    # first maximum is the smallest index among the lanes holding the top value, as
    # torch.argmax. V stands for "none" (every real index is below it).
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_V)
    row_ptr = logits_ptr + row * logits_stride
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_at = lane  # an all -inf lane keeps its first index; lanes past V stay -inf at indices
    # above every real one, so they never win (lane 0 is real)
    nan_at = tl.zeros([BLOCK_V], tl.int32) + V
    for start in range(0, V, BLOCK_V):
        at = start + lane
        x = tl.load(row_ptr + at, mask=at < V, other=float("-inf")).to(tl.float32)
        nan_at = tl.minimum(nan_at, tl.where(x != x, at, V))  # NaN: unequal to itself
        better = x > best  # false for NaN
        best = tl.where(better, x, best)
        best_at = tl.where(better, at, best_at)
    top = tl.max(best, axis=0)
    first_top = tl.min(tl.where(best == top, best_at, V), axis=0)
    first_nan = tl.min(nan_at, axis=0)
    token = tl.where(first_nan < V, first_nan, first_top).to(tl.int64)
    if GIVEN:  # where given, the proposal is the draft's token and the next step's input
        use = tl.load(use_ptr + row * use_stride + column)
        token = tl.where(use != 0, tl.load(given_ptr + row * given_stride + column), token)

    tl.store(drafted_ptr + row * drafted_stride + column, token)
    length = tl.load(seq_lens_ptr + row) + written
    tl.store(seq_lens_ptr + row, length)
    tl.store(token_ptr + row, token)
    tl.store(position_ptr + row, length - tl.load(starts_ptr + row))


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _check_rows(B: int, *rows: torch.Tensor) -> None:
    for t in rows:  # read or written at ptr + row
        assert t.shape == (B,) and t.stride(0) == 1 and t.dtype == torch.long, \
            "per-row tensors must be contiguous [B] int64"


def _step_inputs(head: torch.Tensor, tail: torch.Tensor, lens: torch.Tensor,
                 cache: KVCache, rewind: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] = [head, tail...] and positions [B, T] from `lens` (see the kernel)."""
    B, T1 = tail.shape
    assert T1 == 1 or tail.stride(1) == 1, "tail: unit column stride"
    _check_rows(B, head, lens, cache.seq_lens, cache.starts)
    tokens = torch.empty(B, T1 + 1, dtype=torch.long, device=head.device)
    positions = torch.empty_like(tokens)
    _step_inputs_kernel[(B,)](
        head, tail, lens, cache.seq_lens, cache.starts, tokens, positions, tail.stride(0),
        T=T1 + 1, BLOCK=triton.next_power_of_2(T1 + 1), REWIND=rewind,
        num_warps=1,  # a few elements per row
    )
    return tokens, positions


def catchup_inputs(cache: KVCache, target_lens: torch.Tensor, last: torch.Tensor,
                   pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's catch-up step inputs in one launch; rewinds the draft cache in place.

    cache: the draft's; its seq_lens become target_lens - 1 (target_lens: [B] int64, the
    target cache's lengths L). last, pending: [B] int64, the tokens of slots L - 1 and L.
    Returns tokens [B, 2] = [last, pending] and positions [B, 2] = seq_lens - starts + [0, 1].
    """
    return _step_inputs(last, pending[:, None], target_lens, cache, rewind=True)


def overlap_catchup_inputs(cache: KVCache, target_lens: torch.Tensor, last: torch.Tensor,
                           pending: torch.Tensor, guesses: torch.Tensor, streaming: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The overlapped step's draft catch-up inputs in one launch (runtime/speculative.py,
    `overlapped_step`); sets the draft cache's lengths in place.

    Per row, G = guesses.shape[1]: streaming -> tokens [X_{G-1}, X_G] (X_0 = pending) at
    seq_lens = L + G - 1; else [last, pending] at seq_lens = L - 1 (`catchup_inputs`).
    positions = seq_lens - starts + [0, 1].
    """
    B, G = guesses.shape
    assert G >= 1 and guesses.stride(1) == 1 and guesses.dtype == torch.long
    assert streaming.shape == (B,) and streaming.dtype == torch.bool and streaming.stride(0) == 1
    _check_rows(B, target_lens, last, pending, cache.seq_lens, cache.starts)
    tokens = torch.empty(B, 2, dtype=torch.long, device=last.device)
    positions = torch.empty_like(tokens)
    _overlap_catchup_kernel[(B,)](
        target_lens, last, pending, guesses, streaming, cache.seq_lens, cache.starts, tokens,
        positions, guesses.stride(0), G=G, num_warps=1,
    )
    return tokens, positions


def draft_advance(logits: torch.Tensor, drafted: torch.Tensor, column: int, cache: KVCache,
                  written: int, given: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """After a draft step: its greedy token, the cache's advance and the next step's inputs,
    in one launch.

    logits: [B, V] (a view of the step's [B, T, V_padded] output: any row stride, unit column
    stride). drafted: [B, G] int64, column `column` set to argmax(logits) in place. cache: the
    draft's; its seq_lens advance by `written` (the step's T) in place. given: (use [B, G]
    bool, tokens [B, G] int64): where use[b, column], tokens[b, column] is row b's token in
    place of the argmax (`speculative.draft`'s proposals given).
    Returns the next draft step's token [B, 1] (the argmax, or the token given) and position
    [B, 1] (= new seq_lens - starts).
    """
    B, V = logits.shape
    assert logits.stride(1) == 1 and logits.dtype.is_floating_point, "logits: [B, V] float"
    assert drafted.shape[0] == B and drafted.dtype == torch.long and drafted.stride(1) == 1
    assert 0 <= column < drafted.shape[1], f"column {column} of {drafted.shape[1]}"
    _check_rows(B, cache.seq_lens, cache.starts)
    token = torch.empty(B, 1, dtype=torch.long, device=logits.device)
    position = torch.empty_like(token)
    block = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    if given is not None:
        use, tokens = given
        assert use.dtype == torch.bool and tokens.dtype == torch.long and \
            use.shape[0] == tokens.shape[0] == B and use.stride(1) == tokens.stride(1) == 1
        use = use.view(torch.uint8)  # (the same bytes)
    else:
        use, tokens = drafted, drafted  # (not read)
    _draft_advance_kernel[(B,)](
        logits, drafted, cache.seq_lens, cache.starts, token, position, use, tokens,
        logits.stride(0), drafted.stride(0), use.stride(0), tokens.stride(0), column, written,
        V, BLOCK_V=block, GIVEN=given is not None,
        # 8 warps over 8192 logits: 32 per thread and iteration (16-byte bf16 loads); untuned
        num_warps=8 if block >= 4096 else 4,
    )
    return token, position


def verify_inputs(cache: KVCache, pending: torch.Tensor, draft_tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's verify step inputs in one launch.

    cache: the target's (read only). pending: [B] int64. draft_tokens: [B, G] int64.
    Returns tokens [B, G + 1] = [pending, d_1..d_G] and positions [B, G + 1]
    = seq_lens - starts + [0..G].
    """
    return _step_inputs(pending, draft_tokens, cache.seq_lens, cache, rewind=False)
