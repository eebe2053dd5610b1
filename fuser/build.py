"""Building one model's steps: export, passes, compilation, warm-up, the eager self-check and
CUDA-graph capture, each an explicit step that `fuser.optimize` calls in order.

Each step graph is exported (`fuser.capture`), rewritten by `fuser.passes.PASSES`, and then
run either as the rewritten FX graph ("fx") or compiled by Inductor ("inductor"). The batch
buckets and the fixed-T steps of a model share one export (`build_bucket_steps`). Whatever cannot
be exported or compiled runs in eager PyTorch with an entry in the model's fallbacks; building
never fails for a model the capture cannot handle.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fuser.capture import (StepModule, cache_names, engine_view, export_step, model_geometry,
                           specialize)
from fuser.compile import CompiledStep
from fuser.config import FuserConfig
from fuser.numerics import FP8_SELF_CHECK_TOLERANCE, SELF_CHECK_TOLERANCE, relative_error
from fuser.ops.argmax import argmax
from fuser.ops.fp8 import emulated_fp8
from fuser.passes import PassContext, run_passes
from fuser.rank_model import WeightSource, rank_model
from fuser.runtime.cuda_graphs import CudaGraphStep
from fuser.runtime.kv_cache import KVCache, free_memory_bytes
from fuser.runtime.prefill_graphs import padded_length
from fuser.runtime.speculative import first_token_logits
from fuser.runtime.steps import DECODE, PREFILL, ModelSteps, StepFn, StepGraph, StepKind


Progress = Callable[[str], None]


def allocate_cache(role: str, model_config: object, batch: int, slots: int, dtype: torch.dtype,
                   device: torch.device, max_seq_len: int, block_size: int = 0,
                   num_blocks: int = 0, table: torch.Tensor | None = None) -> KVCache:
    """The model's KV cache, after checking that it fits in the device's free memory
    (block_size > 0: paged, a pool of num_blocks blocks (0: every row at full length) and a
    block table, `table` when given (shared with the target): runtime/kv_cache.py)."""
    layers, kv_heads, head_dim = model_geometry(model_config)
    nbytes = KVCache.nbytes(layers, batch, slots, kv_heads, head_dim, dtype)
    what = f"max_batch_size={batch} x max_seq_len={max_seq_len}"
    if block_size and num_blocks:
        nbytes = KVCache.nbytes(layers, num_blocks, block_size, kv_heads, head_dim, dtype)
        what = f"{num_blocks} blocks of {block_size} slots"
    free = free_memory_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"the {role}'s KV cache needs {nbytes / 2**30:.2f} GiB for {what}, but only "
            f"{free / 2**30:.2f} GiB is free on {device}: lower one of them")
    return KVCache.allocate(layers, batch, slots, kv_heads, head_dim, dtype, device, block_size,
                            num_blocks, table)


# With compile="auto" on CPU, models below this many parameters run their FX graphs: compiling
# C++ kernels for a test-sized model takes longer than it will ever run.
CPU_INDUCTOR_MIN_PARAMETERS = 1_000_000


def compile_mode(config: FuserConfig, device: torch.device, model: nn.Module) -> str:
    """"inductor" or "fx": the config's choice; "auto" = Inductor on CUDA, and on CPU for
    models of at least CPU_INDUCTOR_MIN_PARAMETERS parameters (FX below that)."""
    if config.compile != "auto":
        return config.compile
    if device.type == "cuda":
        return "inductor"
    parameters = sum(p.numel() for p in model.parameters())
    return "inductor" if parameters >= CPU_INDUCTOR_MIN_PARAMETERS else "fx"


def start_compile_workers(mode: str, device: torch.device) -> bool:
    """Start Inductor's pool of Triton compile workers now, where `mode` (`compile_mode`) is
    "inductor" on CUDA: True if it was asked to start.

    Without Dynamo (fuser/compile.py) nothing starts the pool before the first kernel; until
    its workers are up (seconds), Inductor compiles each Triton kernel in this process, one
    after another. Started at the beginning of a build, the pool is ready once the exports and
    passes are done. Where a kernel is compiled changes nothing in what is compiled. (CPU
    kernels compile on threads of this process: no pool to start.)
    """
    if mode != "inductor" or device.type != "cuda":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: the pool starts with the first kernel
        return False
    maybe_warm_pool()
    return True


def build_steps(role: str, view: nn.Module, cache: KVCache, kinds: list[StepKind],
                config: FuserConfig, device: torch.device) -> ModelSteps:
    """Export, rewrite and compile each step of `kinds` for `view` (the engine's copy of a
    model, attending through the "fuser" attention function) over `cache`."""
    steps = ModelSteps(role, cache, view.config.vocab_size)
    for kind in kinds:
        add_step(steps, view, kind, config, device)
    return steps


def build_bucket_steps(role: str, view: nn.Module, cache: KVCache, sizes: Sequence[int],
                       kinds: list[StepKind], config: FuserConfig, device: torch.device,
                       progress: Progress | None = None, shard: Shard | None = None
                       ) -> dict[int, ModelSteps]:
    """The steps of `kinds` in every batch bucket of `sizes`, bucket b over rows [:b] of
    `cache` (which has max(sizes) rows): batch size -> steps.

    What does not depend on the shapes is done once: one export for every fixed-T step of
    every bucket (batch and T dynamic: `export_step(dynamic_batch=..., token_range=...)`),
    retraced at each step's shapes (`specialize`, a fraction of an export), then rewritten
    and compiled per step and bucket, since the passes choose kernels by row count; prefill
    (dynamic T, never compiled) is exported and rewritten once and that one graph serves every
    bucket. The passes' per-model state (weights quantized once) is shared. Where model code
    keeps a dimension from being dynamic, each step is exported on its own (as `add_step`).

    shard: one rank's share of a tensor-parallel engine (`Shard`): `view` is the rank's share
    of the model, `cache` its own, and every step graph gets its collectives before the
    passes (prefill too, batch and T symbolic).
    """
    say = progress or (lambda message: None)
    state: dict = {}
    buckets = {}
    for size in sorted(sizes):
        buckets[size] = ModelSteps(role, cache.rows(size), view.config.vocab_size)
        buckets[size].build_state = state
    fixed = [k.tokens for k in kinds if k.fixed]
    exported = False
    shared = None  # the fixed-T steps' shared export, once made (None: it failed)
    for kind in kinds:
        start = time.perf_counter()
        if any(g.rewritten is None for steps in buckets.values() for g in steps.steps.values()):
            for steps in buckets.values():  # the model already fell back to eager PyTorch
                add_step(steps, view, kind, config, device, shard)
        elif not kind.fixed:
            add_prefill(buckets, view, kind, config, device, say, shard)
        elif len(fixed) * len(buckets) == 1:
            add_step(buckets[max(buckets)], view, kind, config, device, shard)
        else:
            if not exported:
                shared, exported = export_fixed(buckets, view, max(2, *fixed), say), True
            add_fixed(buckets, view, kind, shared, config, device, say, shard)
        say(f"{role}.{_kind_name(kind)}: built for batch buckets {list(buckets)} in "
            f"{time.perf_counter() - start:.1f} s")
    return buckets


def export_fixed(buckets: dict[int, ModelSteps], view: nn.Module, max_tokens: int,
                 say: Progress) -> tuple[torch.export.ExportedProgram, torch.fx.GraphModule] | None:
    """One export for every fixed-T step of `buckets`: T dynamic in 1..max_tokens, the batch
    dynamic where there are several buckets; None when the model's code keeps them fixed."""
    top = buckets[max(buckets)]
    module = StepModule(view, top.cache.k, top.cache.v, prefill=False,
                        block_table=top.cache.block_table)
    start = time.perf_counter()
    try:
        shared = export_step(module, top.cache.batch_size, max_tokens,
                             max_tokens=top.cache.slots, dynamic_batch=len(buckets) > 1,
                             token_range=(1, max_tokens))
    except Exception as e:  # noqa: BLE001 -- then each step is exported on its own
        say(f"{top.role}: no export shared by the fixed-T steps ({first_line(e)}); exporting "
            "each")
        return None
    say(f"{top.role}: exported once for every fixed-T step in {time.perf_counter() - start:.1f} s")
    return shared


def add_fixed(buckets: dict[int, ModelSteps], view: nn.Module, kind: StepKind,
              shared: tuple[torch.export.ExportedProgram, torch.fx.GraphModule] | None,
              config: FuserConfig, device: torch.device, say: Progress,
              shard: Shard | None = None) -> None:
    """The fixed-T step `kind` in every bucket: the shared export retraced at the bucket's
    batch and `kind`'s T, rewritten and compiled (exported on its own where that fails)."""
    for size, steps in buckets.items():
        if shared is None:
            add_step(steps, view, kind, config, device, shard)
            continue
        exported, symbolic = shared
        try:
            rewritten = specialize(symbolic, steps.cache.k, steps.cache.v, kind.tokens,
                                   steps.cache.block_table)
        except Exception as e:  # noqa: BLE001 -- this one exports on its own
            say(f"{steps.role}.{_kind_name(kind)}: bucket {size} not retraced "
                f"({first_line(e)}); exporting it")
            add_step(steps, view, kind, config, device, shard)
            continue
        graph = _new_graph(steps, view, kind)
        graph.exported, graph.rewritten = exported, rewritten
        _rewrite_and_compile(steps, graph, view, config, device, shard)


def add_prefill(buckets: dict[int, ModelSteps], view: nn.Module, kind: StepKind,
                config: FuserConfig, device: torch.device, say: Progress,
                shard: Shard | None = None) -> None:
    """Prefill (or another step of dynamic T: a paged engine's chunk) in every bucket:
    exported with a dynamic batch and rewritten once (its row count is symbolic either way),
    one graph a bucket over that bucket's cache rows (with `shard`: its collectives added
    once)."""
    top = buckets[max(buckets)]
    if len(buckets) == 1:
        add_step(top, view, kind, config, device, shard)
        return
    module = StepModule(view, top.cache.k, top.cache.v, prefill=kind.starts_empty,
                        block_table=top.cache.block_table)
    try:
        exported, symbolic = export_step(module, top.cache.batch_size, None,
                                         max_tokens=top.cache.slots, dynamic_batch=True)
    except Exception as e:  # noqa: BLE001 -- the batch cannot stay dynamic: one export a bucket
        say(f"{top.role}.prefill: no export with a dynamic batch ({first_line(e)}); exporting "
            "each bucket")
        for steps in buckets.values():
            add_step(steps, view, kind, config, device, shard)
        return
    if shard is not None:
        symbolic = shard.graph(symbolic, top.cache.batch_size)
    context = PassContext(f"{top.role}.{kind.name}", kind, config, top.role,
                          model_state=top.build_state)
    result = run_passes(symbolic, context)
    for steps in buckets.values():
        graph = _new_graph(steps, view, kind)
        graph.exported = exported
        graph.rewritten = symbolic if steps is top else with_cache(symbolic, steps.cache)
        graph.matches, graph.fused_ops = dict(result.matches), dict(result.fused_ops)
        for error in result.errors:
            steps.fallback(error)


def _kind_name(kind: StepKind) -> str:
    return kind.name if kind.tokens is None else f"{kind.name}{kind.tokens}"


def _new_graph(steps: ModelSteps, view: nn.Module, kind: StepKind) -> StepGraph:
    """An empty StepGraph of `kind` in `steps`, its eager module over the steps' cache."""
    module = StepModule(view, steps.cache.k, steps.cache.v, prefill=kind.starts_empty,
                        block_table=steps.cache.block_table)
    graph = StepGraph(f"{steps.role}.{kind.name}", kind, eager=module)
    steps.steps[kind] = graph
    return graph


def with_cache(gm: torch.fx.GraphModule, cache: KVCache) -> torch.fx.GraphModule:
    """A module over a copy of `gm`'s graph, reading `cache` as its KV cache (the same other
    tensors): one rewritten graph run over another bucket's cache rows."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    own = dict(zip(cache_names(len(cache.k)), [*cache.k, *cache.v]))
    if cache.paged:  # the pools are every bucket's: only the table's rows differ
        own["block_table"] = cache.block_table
    attributes = {}
    for node in graph.find_nodes(op="get_attr"):
        attributes[node.target] = own.get(node.target) if node.target in own else \
            functools.reduce(getattr, node.target.split("."), gm)
    return torch.fx.GraphModule(attributes, graph)


def add_step(steps: ModelSteps, view: nn.Module, kind: StepKind, config: FuserConfig,
             device: torch.device, shard: Shard | None = None) -> StepGraph:
    """Build the step `kind` of `steps` (export, passes, compile) and add it; once export has
    failed for a model, its later steps run eagerly without trying again."""
    export_failed = any(g.rewritten is None for g in steps.steps.values())
    graph = _new_graph(steps, view, kind)
    if export_failed:
        return graph
    try:
        graph.exported, graph.rewritten = export_step(graph.eager, steps.cache.batch_size,
                                                      kind.tokens, max_tokens=steps.cache.slots)
    except Exception as e:  # unsupported model code: run eagerly, say so once
        if shard is not None:  # eager PyTorch is not sharded: no engine without the graph
            raise ValueError(f"tensor_parallel={shard.world_size}: the {steps.role}'s step "
                             f"{kind.name} could not be exported ({first_line(e)}); tensor "
                             "parallelism shards the captured graph") from e
        steps.fallback(f"{steps.role}: torch.export failed ({first_line(e)}); its steps run "
                       "in eager PyTorch with the engine's KV cache")
        return graph
    _rewrite_and_compile(steps, graph, view, config, device, shard)
    return graph


def _rewrite_and_compile(steps: ModelSteps, graph: StepGraph, view: nn.Module,
                         config: FuserConfig, device: torch.device,
                         shard: Shard | None = None) -> None:
    """Run the passes over `graph.rewritten` in place, then set up its compilation (with
    `shard`: over the rank's share of it)."""
    kind = graph.kind
    if shard is not None:
        graph.rewritten = shard.graph(graph.rewritten, steps.cache.batch_size)
    context = PassContext(graph.name, kind, config, steps.role, model_state=steps.build_state)
    result = run_passes(graph.rewritten, context)
    for error in result.errors:
        steps.fallback(error)
    graph.matches, graph.fused_ops = result.matches, result.fused_ops
    # Prefill (dynamic T) runs once per request: on the GPU its ATen kernels are long enough;
    # Inductor is kept for the fixed-T steps that run once per token.
    if compile_mode(config, device, view) == "inductor" and kind.fixed:
        graph.compiled = compile_step(graph.rewritten, device)


def compile_step(gm: torch.fx.GraphModule, device: torch.device) -> StepFn:
    """Inductor over a rewritten fixed-T step, without Dynamo (fuser/compile.py; on CPU the C++
    backend with the fused ops' references inlined). Compiles on the first call."""
    return CompiledStep(gm, device)


def warm_up_lengths(kind: StepKind, slots: int, device: torch.device) -> list[int]:
    """The T values `warm_up` runs `kind` at: a fixed-T step's T; for a step of any T (prefill,
    chunk) 2 and 3, and on CUDA the shortest captured prefill length too
    (runtime/prefill_graphs.py `padded_length`, a multiple of 16; 16 where none fits).

    Triton compiles a kernel once per class of its integer arguments (1, divisible by 16, other).
    A request's prompt runs at a captured length: a build that never met that class left those
    kernels out of the engine directory, and the first request compiled them. (The CPU runs
    Triton's interpreter, which compiles nothing.)"""
    if kind.fixed:
        return [kind.tokens]
    if device.type != "cuda":
        return [2, 3]
    # (a cache too short for any captured length runs prompts uncaptured: 16 stands for them)
    divisible = padded_length(1, slots) or (16 if slots >= 16 else None)
    return [2, 3] + ([divisible] if divisible is not None else [])


@torch.no_grad()
def warm_up(steps: ModelSteps, timed: Callable[[str, Callable[[], object]], None] | None = None
            ) -> None:
    """Run every step once, at each of its `warm_up_lengths`, so that compilation happens now,
    not in the first request; after each prefill, the first token's argmax as a request takes
    it (runtime/speculative.py `first_token_logits`). timed: runs each as `timed(name, run)`
    ("target.prefill T=16"; fuser/load_profile.py `StepTimes` times them)."""
    cache = steps.cache
    device, B = cache.seq_lens.device, cache.batch_size
    for kind in steps.steps:
        for T in warm_up_lengths(kind, cache.slots, device):
            tokens = torch.zeros(B, T, dtype=torch.long, device=device)
            positions = torch.arange(T, device=device)[None].expand(B, T).contiguous()

            def run(kind: StepKind = kind, T: int = T, tokens: torch.Tensor = tokens,
                    positions: torch.Tensor = positions) -> None:
                cache.reset()
                logits = steps.run(kind, tokens, positions)
                if kind == PREFILL:
                    argmax(first_token_logits(logits[:, T - 1], steps.vocab_size))

            if timed is None:
                run()
            else:
                timed(f"{steps.steps[kind].name} T={T}", run)
    cache.reset()


@torch.no_grad()
def check_against_eager(steps: ModelSteps, model: nn.Module, max_seq_len: int,
                        fp8_lm_head: bool | None = None) -> str | None:
    """Run the built prefill and decode steps and the user's eager model on a short random
    prompt; None when they agree (numerics.SELF_CHECK_TOLERANCE), else what differs.

    A model family whose capture is subtly wrong then falls back to eager PyTorch instead of
    giving silently wrong answers. An FP8 engine (fp8_lm_head not None: its LM head quantized
    or not) is checked against the eager model with FP8 emulated (fuser.ops.fp8.emulated_fp8):
    quantization error itself is not what the check looks for.
    """
    cache = steps.cache
    device = cache.seq_lens.device
    T = min(6, max_seq_len)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, steps.vocab_size, (1, T), generator=generator)
    user_device = next(model.parameters()).device
    with contextlib.ExitStack() as stack:
        if fp8_lm_head is not None:  # the first T - 1 positions run as prefill, the last decodes
            stack.enter_context(emulated_fp8(model, lm_head=fp8_lm_head, prefill_tokens=T - 1))
        ref = model(input_ids=ids.to(user_device),
                    position_ids=torch.arange(T, device=user_device)[None]).logits.float()
    B = cache.batch_size
    tokens = ids.to(device).expand(B, T).contiguous()
    positions = torch.arange(T, device=device)[None].expand(B, T).contiguous()
    if cache.paged:  # every row its blocks where the pool holds them, else row 0 (compared)
        full = 1 + B * cache.block_table.shape[1] <= cache.num_blocks
        cache.lay_out(B if full else 1, cache.slots if full else T)
    cache.reset()
    out = steps.run(PREFILL, tokens[:, :-1], positions[:, :-1])[:1]
    cache.set_lengths(T - 1)
    # Fresh [B, 1] tensors: a slice's strides differ from the runtime's, and a compiled
    # step guards on strides (the check would cost a second Inductor compile).
    last = steps.run(DECODE, tokens[:, -1:].clone(memory_format=torch.contiguous_format),
                     positions[:, -1:].clone(memory_format=torch.contiguous_format))[:1]
    cache.reset()
    got = torch.cat([out, last], dim=1).float().to(ref.device)
    error = relative_error(got, ref)
    # The coarser of the two dtypes sets the bound: an fp32 engine of a bf16 model is checked
    # against bf16 eager logits.
    dtypes = (cache.k[0].dtype if cache.k else torch.float32, next(model.parameters()).dtype)
    table = SELF_CHECK_TOLERANCE if fp8_lm_head is None else FP8_SELF_CHECK_TOLERANCE
    tolerance = max(table.get(d, table[torch.bfloat16]) for d in dtypes)
    if error <= tolerance:
        return None
    return f"relative error {error:.2e} > {tolerance:g}"


def capture_cuda_graphs(steps: ModelSteps) -> None:
    """Capture every fixed-T step as a CUDA graph, all in one memory pool (call after
    `warm_up`; CUDA only)."""
    pool = torch.cuda.graph_pool_handle()
    cache = steps.cache
    for graph in steps.steps.values():
        if graph.kind.fixed and graph.captured is None:
            graph.captured = CudaGraphStep(graph.uncaptured, cache.batch_size, graph.kind.tokens,
                                           cache.seq_lens, cache.starts, pool=pool)
    cache.reset()


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


@dataclass
class Shard:
    """One rank's share of a tensor-parallel engine's target: its step graphs are exported from
    the rank's share of the model (fuser/rank_model.py, over the rank's own KV cache of
    kv_heads / world_size heads) and get their collectives (passes/tensor_parallel.py
    `add_collectives`) before the passes.

    Attributes:
        rank, world_size: this rank of how many.
    """

    rank: int
    world_size: int

    def graph(self, gm: torch.fx.GraphModule, batch: int) -> torch.fx.GraphModule:
        """The rank's step graph `gm` (at `batch` rows) with its collectives, in place."""
        from fuser.passes.tensor_parallel import add_collectives

        return add_collectives(gm, self.world_size)


def build_shard(model_class: type, model_config: object, weights: WeightSource,
                config: FuserConfig, kinds: list[StepKind], sizes: Sequence[int], slots: int,
                dtype: torch.dtype, device: torch.device, rank: int, world_size: int,
                progress: Progress | None = None, num_blocks: int = 0
                ) -> dict[int, ModelSteps]:
    """Rank `rank`'s target steps of a tensor-parallel engine, per batch bucket: its share of
    the model (`rank_model`: only its slices of the weights, from `weights`), exported over
    its own KV cache, given its collectives, rewritten and compiled. Nothing on the rank ever
    holds the whole model: the steps' eager modules (never run under tensor parallelism) are
    over the same share. With config.kv_block_size the cache is paged, a pool of `num_blocks`
    blocks (rank 0's count: the table rank 0's scheduler fills indexes every rank's pool)."""
    if device.type == "cuda" and device.index is None:  # the index engine_view compares
        device = torch.device("cuda", torch.cuda.current_device())
    model = rank_model(model_class, model_config, weights, rank, world_size, dtype, device)
    cache = allocate_cache("target", model.config, config.max_batch_size, slots, dtype, device,
                           config.max_seq_len, config.kv_block_size, num_blocks)
    view = engine_view(model, dtype, device)
    return build_bucket_steps("target", view, cache, sizes, kinds, config, device, progress,
                              shard=Shard(rank, world_size))
