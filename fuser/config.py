"""FuserConfig: every knob of `fuser.optimize`, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["auto", "fp32", "bf16", "fp16", "fp8"]
CompileMode = Literal["auto", "inductor", "fx"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's own dtype
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": None,  # FP8 weights; activations in the model's own dtype
}
MAX_GAMMA = 15
# gamma="auto" chooses among these draft lengths per step (runtime/controller.py). Each is one
# more compiled verify graph per batch bucket (and two more captured iterations), so the set is
# small; Leviathan's model with a draft/target cost ratio c ~ 0.25 (1B vs 8B, DESIGN.md) puts
# the best gamma at 1 for alpha ~ 0.5, 2-4 for alpha ~ 0.7-0.8 and 4-6 for alpha ~ 0.9, and
# the curve is flat enough near its top that the gaps cost a few percent at most.
AUTO_GAMMAS = (1, 2, 4, 6)
# With a draft and suffix speculation, the suffix index's proposals are also verified alone at
# these lengths (FuserConfig.long_suffix_gammas): at the draft's gammas a step emits at most
# gamma + 1 tokens a row, where repetitive text (an answer that repeats its prompt) offers
# dozens. Each is one more compiled verify graph per batch bucket and widens every row's KV
# cache by its length + 1 slots.
LONG_SUFFIX_GAMMAS = (16, 32)
MAX_SUFFIX_GAMMA = 64


@dataclass(frozen=True)
class FuserConfig:
    """How `fuser.optimize` builds an engine.

    Attributes:
        precision: "auto" (the model's own dtype), "fp32", "bf16", "fp16", or "fp8": every
            linear reads float8 e4m3fn weights with per-output-channel scales computed once from
            the model's weights (passes/fp8.py); activations stay in the model's dtype (decode)
            or are quantized per token (prefill); embeddings and norms are not quantized.
        gamma: draft tokens per speculative step, 0..15 (fixed; 0 = no speculation), or "auto":
            with a draft, every step uses the gamma of `gamma_candidates` (or 0, target-only)
            whose measured wall time per emitted token is lowest; the others are probed now
            and then, at most ~5% of the steps (runtime/controller.py).
        gamma_candidates: the draft lengths gamma="auto" may choose (each one compiled verify
            graph per batch bucket); ignored for an int gamma.
        max_batch_size: most sequences per call.
        batch_buckets: the batch sizes steps are built for; a call with B rows runs in the
            smallest bucket >= B. "auto": 1, 2, 4, 8, 16, ... up to max_batch_size on CUDA;
            on CPU (a correctness target, where each bucket is another export) only
            max_batch_size. A tuple gives them explicitly (max_batch_size is always added).
        max_seq_len: most tokens per sequence, prompt plus generated. The KV cache keeps
            gamma + 1 slots of headroom beyond this itself.
        cuda_graphs: capture each decoding iteration (target-only, and each speculative gamma,
            greedy and sampling) as one CUDA graph per batch bucket (ignored on CPU).
        device: where the engine runs; default is the target model's device.
        compile: "fx" runs the rewritten FX graph as is, "inductor" compiles each fixed-T step
            with Inductor (on CPU its C++ backend, the fused ops' references inlined:
            fuser/compile_cpu.py); "auto" picks Inductor on CUDA, and on CPU for models of at
            least a million parameters ("fx" for test-sized ones, where compiling would take
            longer than they ever run: fuser.build.compile_mode).
        dump_graphs: a directory to write every graph before and after every pass (also set by
            the FUSER_DUMP_GRAPHS environment variable).
        fused_attention: decode and verification steps attend through the split-K Triton op
            `fuser::cache_attention_read` (validated and timed on an H200: benchmarks/RESULTS.md)
            instead of ATen ops over every cache slot. False keeps the ATen path (its CPU path
            is the same math either way).
        fp8_lm_head: with precision="fp8", quantize the LM head too (False keeps it in the
            model's dtype).
        overlap: greedy speculative steps as overlapped rounds (runtime/speculative.py
            `overlapped_step`): the draft drafts the next round on a parallel branch of the
            step's CUDA graph while the target verifies this round's guesses, so a round costs
            about the longer of the two instead of their sum. It pays where both models are
            launch-bound (small models at small batches); a large target that fills the GPU
            leaves the draft nothing to overlap with. The draft's KV cache keeps gamma more
            slots. Sampling keeps the standard step.
        adapt_draft: distil the draft online on the traffic the scheduler serves
            (runtime/distill.py): every distill_every finished requests, fine-tune a copy for at
            most distill_budget_s seconds on the target's outputs, and swap it into the
            engine's draft tensors only if it agrees better with the target on held-out recent
            requests. The target's outputs never change. Needs a draft.
        suffix_speculation: also propose tokens from the request's own context and recent
            outputs (runtime/suffix.py); the scheduler's controller picks target-only, draft or
            suffix per step (runtime/controller.py).
        long_suffix_gammas: with a draft and suffix_speculation, the target's verify steps
            built for the suffix index's proposals alone (ints above every draft gamma, up
            to 64; () for none): the adaptive scheduler's long suffix arms
            (runtime/adaptive_scheduler.py), after which the draft catches up. Ignored
            without a draft (the suffix arms are then the gammas' own).
        distill_every: finished requests between two draft updates (200: an update a window
            of issue 44's stream, each DistillConfig.max_steps steps; a candidate the held-out
            records cannot yet tell better trains on in the next update, over more of them:
            docs/performance-notes.md).
        distill_budget_s: at most this many seconds of work per draft update (the target's
            labelling, training, held-out evaluation); DistillConfig.max_steps usually ends it
            first on a GPU.
        kv_block_size: 0 (the default) keeps each row's KV slots contiguous; N > 0 pages the
            cache: one pool of N-slot blocks per model and a block table per row, read and
            written through the table by every step (runtime/kv_cache.py, runtime/blocks.py).
            The same tokens as the contiguous cache. A `Scheduler` over a paged engine gives
            blocks to requests as they need them (runtime/blocks.py), with prefix caching.
            Engine files keep the pool as built (docs/paged-kv.md).
        kv_blocks: a paged cache's blocks per pool (the null block included); 0 (default):
            enough for every row at full length (1 + max_batch_size x slots per row / N), or
            what kv_memory_fraction gives. Fewer blocks than that serve more rows than fit at
            full length at once: requests wait (and are preempted) when blocks run out.
        kv_memory_fraction: size a paged cache's pools (target and draft) from this fraction
            of the device's free memory once the weights are on it (`blocks_for_budget`);
            CUDA only (on CPU the default size stands). None: off.
            The same tokens as the contiguous cache. Not yet with several batch buckets or
            engine files (both refuse it), nor in the server's scheduler.
        tensor_parallel: processes (one per GPU on CUDA, cuda:r for rank r from the engine's
            device; gloo processes on the CPU) one engine's target is sharded over
            (passes/tensor_parallel.py, fuser/distributed.py). Rank 0 is the caller's process
            and runs the engine's API; ranks 1..N-1 follow its steps. The draft runs on rank 0
            only. `engine.close()` stops the followers. The heads, KV heads, intermediate size
            and vocabulary must divide by N; a paged cache (kv_block_size > 0) is refused, and
            prefill runs uncaptured on CUDA.
    """

    precision: Precision = "auto"
    gamma: int | Literal["auto"] = "auto"
    gamma_candidates: tuple[int, ...] = AUTO_GAMMAS
    max_batch_size: int = 1
    batch_buckets: tuple[int, ...] | Literal["auto"] = "auto"
    max_seq_len: int = 2048
    cuda_graphs: bool = True
    device: str | torch.device | None = None
    compile: CompileMode = "auto"
    dump_graphs: str | None = None
    fused_attention: bool = True
    fp8_lm_head: bool = True
    overlap: bool = False
    adapt_draft: bool = False
    suffix_speculation: bool = False
    long_suffix_gammas: tuple[int, ...] = LONG_SUFFIX_GAMMAS
    distill_every: int = 200
    distill_budget_s: float = 2.0
    kv_block_size: int = 0
    kv_blocks: int = 0
    kv_memory_fraction: float | None = None
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not one of {sorted(PRECISIONS)}"
            )
        if not isinstance(self.fp8_lm_head, bool):
            raise ValueError(f"fp8_lm_head={self.fp8_lm_head!r} must be True or False")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r} must be True or False")
        for name in ("adapt_draft", "suffix_speculation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        _check_positive_int("distill_every", self.distill_every)
        _check_positive_int("tensor_parallel", self.tensor_parallel)
        if isinstance(self.kv_block_size, bool) or not isinstance(self.kv_block_size, int) or \
                self.kv_block_size < 0:
            raise ValueError(f"kv_block_size={self.kv_block_size!r} must be 0 (contiguous) or a "
                             "positive int (slots per block of a paged KV cache)")
        if isinstance(self.kv_blocks, bool) or not isinstance(self.kv_blocks, int) or \
                self.kv_blocks < 0 or self.kv_blocks == 1:
            raise ValueError(f"kv_blocks={self.kv_blocks!r} must be 0 (sized for every row) or an "
                             "int >= 2 (block 0 is the null block)")
        fraction = self.kv_memory_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(
                fraction, (int, float)) or not 0 < fraction <= 1):
            raise ValueError(f"kv_memory_fraction={fraction!r} must be None or a number in (0, 1]")
        if (self.kv_blocks or fraction is not None) and not self.kv_block_size:
            raise ValueError("kv_blocks and kv_memory_fraction size a paged KV cache: set "
                             "kv_block_size too (e.g. 16)")
        if isinstance(self.distill_budget_s, bool) or not isinstance(
                self.distill_budget_s, (int, float)) or not self.distill_budget_s > 0:
            raise ValueError(f"distill_budget_s={self.distill_budget_s!r} must be a number of "
                             "seconds > 0")
        if self.gamma != "auto":
            if isinstance(self.gamma, bool) or not isinstance(self.gamma, int):
                raise ValueError(f"gamma={self.gamma!r} must be an int in 0..{MAX_GAMMA} or 'auto'")
            if not 0 <= self.gamma <= MAX_GAMMA:
                raise ValueError(f"gamma={self.gamma} is outside 0..{MAX_GAMMA}")
        _check_positive_int("max_batch_size", self.max_batch_size)
        if not isinstance(self.gamma_candidates, tuple) or not self.gamma_candidates or any(
                isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GAMMA
                for g in self.gamma_candidates):
            raise ValueError(f"gamma_candidates={self.gamma_candidates!r} must be a non-empty "
                             f"tuple of ints in 1..{MAX_GAMMA}")
        if not isinstance(self.long_suffix_gammas, tuple) or any(
                isinstance(g, bool) or not isinstance(g, int)
                or not self.resolved_gamma < g <= MAX_SUFFIX_GAMMA
                for g in self.long_suffix_gammas):
            raise ValueError(f"long_suffix_gammas={self.long_suffix_gammas!r} must be a tuple of "
                             f"ints in {self.resolved_gamma + 1}..{MAX_SUFFIX_GAMMA} (longer "
                             "than every draft gamma)")
        if self.batch_buckets != "auto":
            if not isinstance(self.batch_buckets, tuple) or any(
                    isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.max_batch_size
                    for b in self.batch_buckets):
                raise ValueError(f"batch_buckets={self.batch_buckets!r} must be 'auto' or a "
                                 f"tuple of ints in 1..max_batch_size={self.max_batch_size}")
        _check_positive_int("max_seq_len", self.max_seq_len)
        if self.compile not in ("auto", "inductor", "fx"):
            raise ValueError(f"compile={self.compile!r} is not one of 'auto', 'inductor', 'fx'")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device={self.device!r} is not a torch device: {e}") from None

    @property
    def gammas(self) -> tuple[int, ...]:
        """The draft lengths to build verify steps for: the candidates with "auto", else the
        fixed gamma (none for 0)."""
        if self.gamma == "auto":
            return tuple(sorted(set(self.gamma_candidates)))
        return (int(self.gamma),) if self.gamma > 0 else ()

    @property
    def resolved_gamma(self) -> int:
        """The largest draft length the engine may use (the KV cache's headroom)."""
        return max(self.gammas, default=0)

    def buckets_for(self, device: torch.device) -> tuple[int, ...]:
        """The batch buckets to build on `device` (see `batch_buckets`)."""
        from fuser.runtime.step_graphs import bucket_sizes

        if self.batch_buckets == "auto":
            return bucket_sizes(self.max_batch_size, every=device.type == "cuda")
        return tuple(sorted(set(self.batch_buckets) | {self.max_batch_size}))

    def dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the engine computes in, for a model whose parameters are `model_dtype`."""
        return PRECISIONS[self.precision] or model_dtype


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
