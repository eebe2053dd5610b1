"""`Engine.generate` and `Engine.stream`: Hugging Face `generate` semantics over the fused steps.

The device work of each step lives in runtime/speculative.py; this file checks the arguments,
runs the steps, reads back what each step emitted (once per step), applies the per-row budget
and eos, and hands out one column of tokens at a time. Without a captured target (the
HF-eager fallback) it calls the user's model's own `generate`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fuser.runtime import speculative
from fuser.runtime.bucket_capture import stepping
from fuser.runtime.prompts import Prompts, check_prompts, pad_batch


class Engine(Protocol):
    """What generating reads of fuser.engine.Engine (which imports this module for
    `Engine.generate`; a Protocol, so that this module does not import it back)."""

    target: Any
    user_target: Any
    config: Any
    device: torch.device
    vocab_size: int
    stats: Any

    def bucket(self, batch: int) -> Any: ...
    def controller(self, bucket: int) -> Any: ...
    def next_gamma(self, controller: Any, bucket: Any = None) -> int: ...
    def record_step(self, controller: Any, num_accepted: list[int], was_active: list[bool],
                    gamma: int, modes: list[int] | None = None) -> None: ...
    def observe_tokens(self, count: int, seconds: float) -> None: ...
    def generating(self) -> Any: ...


@dataclass(frozen=True)
class Request:
    """A checked `generate`/`stream` call."""

    input_ids: torch.Tensor  # [B, T] the user's ids as given (cast to int64), on their device
    attention_mask: torch.Tensor | None
    prompts: Prompts | None  # None when the target runs as plain Hugging Face
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_id: list[int]
    pad_token_id: int | None
    seed: int | None


def generate(engine: Engine, input_ids: torch.Tensor, max_new_tokens: int, *,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
             seed: int | None = None) -> torch.Tensor:
    """LongTensor[B, T + n], n <= max_new_tokens: the prompts followed by what was generated.

    Hugging Face semantics (API.md). top_k/top_p None mean no filtering; eos/pad None mean the
    target's generation config (pad falls back to the first eos id, as in HF).
    """
    request = _check(engine, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                     eos_token_id, pad_token_id, attention_mask, seed)
    if engine.target is None:
        return _hf_generate(engine, request)
    new = torch.stack(list(_columns(engine, request)), dim=1)  # [B, n] on the host
    return torch.cat([request.input_ids, new.to(request.input_ids.device)], dim=1)


def stream(engine: Engine, input_ids: torch.Tensor, max_new_tokens: int, *,
           do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: int | list[int] | None = None,
           pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
           seed: int | None = None) -> Iterator[torch.Tensor]:
    """Yield LongTensor[B] per new position; concatenated, they equal generate(...)[:, T:].

    The arguments are checked now (a bad one raises here, not at the first `next`).
    """
    request = _check(engine, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                     eos_token_id, pad_token_id, attention_mask, seed)
    if engine.target is None:
        return iter(_hf_generate(engine, request)[:, request.input_ids.shape[1]:].unbind(1))
    device = request.input_ids.device
    return (column.to(device) for column in _columns(engine, request))


# -- the decoding loop ------------------------------------------------------------------------


def _columns(engine: Engine, request: Request) -> Iterator[torch.Tensor]:
    """Run prefill and decode/speculative steps; yield one column of new tokens at a time
    (LongTensor[B] on the host, where the step's read-back put them).

    A speculative step emits 1..gamma+1 tokens per row, different per row: they wait in a
    per-row queue, and a column goes out once every unfinished row has a token for it.
    """
    with engine.generating(), stepping(engine):
        yield from _decode_loop(engine, request)


def _decode_loop(engine: Engine, request: Request) -> Iterator[torch.Tensor]:
    prompts = request.prompts
    B, T = prompts.batch, prompts.length
    pad = request.pad_token_id if request.pad_token_id is not None else 0  # unused when None:
    # without eos every row stops at max_new_tokens, all in the same column
    bucket = engine.bucket(B)
    # Sampling draws from per-row seeds (row b: seed + b) and output indices, so the seed makes
    # the whole run (captured or not) reproducible.
    seed = request.seed if request.seed is not None else \
        int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
    do_sample = request.do_sample
    state = bucket.state
    state.load(request.max_new_tokens, request.eos_token_id, request.temperature, request.top_k,
               request.top_p, engine.vocab_size, seed)
    target, draft, V = bucket.target, bucket.draft, engine.vocab_size
    controller = engine.controller(bucket.batch)
    if controller is not None:
        controller.pause()  # (a generation left unfinished before left its steps issued)
    stats = engine.stats

    queues = [deque() for _ in range(B)]
    produced = [0] * B
    done = [False] * B

    def take(packed: torch.Tensor, gamma_used: int) -> tuple[list[int], list[bool] | None]:
        """Queue what each still-generating row keeps of one step's read-back; -> n per row,
        and for an overlapped step each row's mode code (else None; see
        `speculative.overlapped_step`).

        Steps are read back in the order they ran, so the rows not yet `done` here are exactly
        the rows the device still had active when it ran this step.
        """
        width = max(gamma_used, 0) + 1  # [tokens, (streamed,) n]
        tokens, n = packed[:B, :width].tolist(), packed[:B, -1].tolist()
        streamed = packed[:B, width].tolist() if packed.shape[1] == width + 2 else None
        for b in range(B):
            if done[b]:
                continue
            # Drop what lies past the budget, and past this row's first eos.
            kept = tokens[b][: min(n[b] + 1, request.max_new_tokens - produced[b])]
            for i, token in enumerate(kept):
                if token in request.eos_token_id:
                    kept = kept[: i + 1]
                    done[b] = True
                    break
            queues[b].extend(kept)
            produced[b] += len(kept)
            stats.num_generated_tokens += len(kept)
            done[b] = done[b] or produced[b] >= request.max_new_tokens
        return n, streamed

    def ready_columns() -> Iterator[torch.Tensor]:
        while any(queues) and all(queues[b] or done[b] for b in range(B)):
            column = [queues[b].popleft() if queues[b] else pad for b in range(B)]
            yield torch.tensor(column, dtype=torch.long)

    def may_need(in_flight: int) -> bool:
        """Whether another step can still emit a kept token: every step emits at least one
        token per active row, so a row needs no more once its in-flight steps cover its budget."""
        return any(not done[b] and produced[b] + in_flight < request.max_new_tokens
                   for b in range(B))

    # Target-only steps issued since the draft last saw the sequence: each moves a row on by at
    # most one token, so the host knows how far behind the draft is without asking the device.
    draft_behind = 0
    last_gamma = -1  # the prefill's

    def issue() -> tuple[ReadBack, int]:
        nonlocal draft_behind, last_gamma
        gamma = engine.next_gamma(controller, bucket) if draft is not None else 0
        if gamma > 0 and draft_behind:
            bucket.resync(draft_behind)  # speculation resumes: the draft catches up first
        if bucket.overlap and gamma != last_gamma:
            state.streaming.zero_()  # guesses drafted for another gamma (or none) are stale
        last_gamma = gamma
        draft_behind = draft_behind + 1 if gamma == 0 else 0  # a speculative step: caught up
        read_back = ReadBack(bucket.run(gamma, do_sample))
        if controller is not None:
            controller.sent()  # the host's part of the step ends here
        return read_back, gamma

    # The loop runs one step ahead of the host: step k + 1 is queued on the device before the
    # host waits for step k's read-back, so the GPU never idles while Python turns tokens into
    # columns. Step k + 1 depends on step k only through device state, and a row that step k
    # finished is frozen on the device, so a step issued "too early" emits nothing anyone keeps.
    if target.cache.paged:  # (one table for both models) this call's rows get their blocks
        _lay_out(target.cache, bucket.batch, T + request.max_new_tokens,
                 engine.config.resolved_gamma)
    start = time.perf_counter()
    padded = pad_batch(prompts, bucket.batch, min_length=bucket.prefill_length(T))
    result = speculative.prefill(target, draft, state, padded, T, V, do_sample)
    in_flight = deque([(ReadBack(result.packed()), -1)])  # -1: the prefill's first token
    while in_flight:
        if may_need(len(in_flight)):
            in_flight.append(issue())
        read_back, gamma_used = in_flight.popleft()
        packed = read_back.wait()
        rows_active = [not d for d in done]
        before = stats.num_generated_tokens
        num_accepted, streamed = take(packed, gamma_used)
        if gamma_used >= 0:
            engine.record_step(controller, num_accepted, rows_active, gamma_used, streamed)
        elapsed = time.perf_counter() - start
        stats.generate_seconds += elapsed
        engine.observe_tokens(stats.num_generated_tokens - before, elapsed)
        yield from ready_columns()
        start = time.perf_counter()
        if all(done):
            break
    yield from ready_columns()  # everything is done: flush, finished rows padded


def _lay_out(cache: Any, batch: int, tokens: int, gamma: int) -> None:
    """Blocks for `batch` rows of a paged cache: every slot of each row where the pool holds
    them (as allocated), else the slots this call can write: its tokens, and the slots a
    step writes past them (gamma + 1, and gamma more for an overlapped draft)."""
    if 1 + batch * cache.block_table.shape[1] <= cache.num_blocks:
        cache.lay_out(batch, cache.slots)
    else:
        cache.lay_out(batch, min(cache.slots, tokens + 2 * (gamma + 1)))


class ReadBack:
    """A step's packed result on its way to the host: the copy is queued now, read at `wait`.

    On CUDA the copy lands in pinned memory behind an event, so queuing it does not block the
    host; elsewhere it is an ordinary copy.
    """

    def __init__(self, packed: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            self.host = packed.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.cpu()

    def wait(self) -> torch.Tensor:
        """The packed result on the host ([B, g + 2]: tokens, then num_accepted)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


# -- arguments --------------------------------------------------------------------------------


def _check(engine: Engine, input_ids: object, max_new_tokens: object, do_sample: object,
           temperature: object, top_k: object, top_p: object, eos_token_id: object,
           pad_token_id: object, attention_mask: object, seed: object) -> Request:
    """Validate a call as API.md states it; each ValueError names its argument."""
    config = engine.config
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    prompts = check_prompts(input_ids, attention_mask, vocab_size=engine.vocab_size,
                            max_batch_size=config.max_batch_size,
                            max_tokens=config.max_seq_len, device=engine.device)
    T = prompts.length
    if T + max_new_tokens > config.max_seq_len:
        raise ValueError(f"the prompt ({T} tokens) plus max_new_tokens={max_new_tokens} is "
                         f"{T + max_new_tokens}, above max_seq_len={config.max_seq_len}: lower "
                         "max_new_tokens or build the engine with a larger max_seq_len")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample={do_sample!r} must be True or False")
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature):
        raise ValueError(f"temperature={temperature!r} must be a number")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 when do_sample=True")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be None or a number in (0, 1]")
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed={seed!r} must be None or an int")

    generation_config = getattr(engine.user_target, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    eos = _token_list(eos_token_id, "eos_token_id", engine.vocab_size)
    if pad_token_id is None:
        pad_token_id = getattr(generation_config, "pad_token_id", None)
        if isinstance(pad_token_id, (list, tuple)):
            pad_token_id = pad_token_id[0] if pad_token_id else None
        if pad_token_id is None and eos:
            pad_token_id = eos[0]  # as Hugging Face does
    if isinstance(pad_token_id, torch.Tensor) and pad_token_id.numel() == 1:
        pad_token_id = int(pad_token_id)
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise ValueError(f"pad_token_id={pad_token_id!r} must be None or an int")

    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    mask = attention_mask
    if isinstance(mask, torch.Tensor) and mask.dim() == 1:
        mask = mask[None]
    return Request(
        input_ids=ids.long(), attention_mask=mask,
        prompts=prompts if engine.target is not None else None,
        max_new_tokens=int(max_new_tokens), do_sample=do_sample,
        temperature=float(temperature), top_k=None if top_k is None else int(top_k),
        top_p=None if top_p is None else float(top_p), eos_token_id=eos,
        pad_token_id=None if pad_token_id is None else int(pad_token_id),
        seed=None if seed is None else int(seed),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_list(value: object, name: str, vocab_size: int) -> list[int]:
    """An int, a list of ints or an integer tensor -> list of ids in [0, vocab_size)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dim() > 1:
            raise ValueError(f"{name} must be an int or a list of ints")
        value = value.tolist()
    ids = [value] if not isinstance(value, (list, tuple)) else list(value)
    for token in ids:
        if not _is_int(token):
            raise ValueError(f"{name}={value!r} must be an int or a list of ints")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name}={value!r}: id {token} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return ids


# -- the HF-eager fallback --------------------------------------------------------------------


def _hf_generate(engine: Engine, request: Request) -> torch.Tensor:
    """The user's model's own `generate` with the same arguments (the target was not captured)."""
    model = engine.user_target
    device = next(model.parameters()).device
    ids = request.input_ids.to(device)
    mask = request.attention_mask
    mask = torch.ones_like(ids) if mask is None else mask.to(device=device, dtype=torch.long)
    kwargs: dict[str, object] = dict(
        attention_mask=mask, max_new_tokens=request.max_new_tokens, do_sample=request.do_sample,
        eos_token_id=request.eos_token_id or None, pad_token_id=request.pad_token_id,
    )
    if request.do_sample:
        # Our None means "no filtering"; HF's generation config would otherwise apply top_k=50.
        kwargs.update(temperature=request.temperature, top_k=request.top_k or 0,
                      top_p=1.0 if request.top_p is None else request.top_p)
    start = time.perf_counter()
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices, enabled=request.seed is not None):
        if request.seed is not None:
            torch.manual_seed(request.seed)
        out = model.generate(ids, **kwargs)
    engine.stats.generate_seconds += time.perf_counter() - start
    engine.stats.num_generated_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return torch.cat([request.input_ids, out[:, ids.shape[1]:].to(request.input_ids.device)], 1)
