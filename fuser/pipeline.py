"""Where Engines come from: `fuser.optimize` builds one from Hugging Face models, `fuser.load`
puts one together from an engine directory (read by fuser/engine_io.py).

The build, in order: load and check the models; choose device, dtype and draft length; per
model, check it can be captured, allocate its KV cache and build its steps (export, passes,
compile: fuser/build.py); warm every step up; check the built steps against the eager model;
capture CUDA graphs. The Engine that comes out only runs what was built.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from fuser import kernel_store
from fuser.build import (allocate_cache, build_bucket_steps, build_shard, check_against_eager,
                         compile_mode, start_compile_workers, warm_up)
from fuser.capture import SUPPORTED_MODEL_TYPES, engine_view, supports_cache_attention
from fuser.config import FuserConfig
from fuser.distributed import (FollowerPlan, TensorParallelGroup, check_devices,
                               check_world_size, mirror, saved_world_size)
from fuser.engine import Engine
from fuser.engine_io import Log, open_engine
from fuser.rank_model import DirectoryWeights, ModuleWeights, RandomWeights, WeightSource
from fuser.runtime.steps import ModelSteps, StepKind, draft_steps, target_steps, verify

ModelLike = nn.Module | str | Path


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off for the duration (as they were, after)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_model(source: ModelLike, argument: str) -> tuple[nn.Module, object | None]:
    """A causal-LM instance (and its tokenizer, if a directory has one) from `source`."""
    if isinstance(source, nn.Module):
        if not hasattr(source, "config") or not hasattr(source.config, "vocab_size"):
            raise ValueError(f"{argument} must be a transformers causal LM (a module with a "
                             f"config), got {type(source).__name__}")
        return source, None
    if not isinstance(source, (str, Path)):
        raise ValueError(f"{argument} must be a transformers model or a path to a model "
                         f"directory, got {type(source).__name__}")
    path = Path(source)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{argument}={str(source)!r} is not a model directory "
                         "(a folder with config.json and safetensors weights)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _no_progress_bar():  # fuser says what it loads; a bar per model is noise
            model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{argument}={str(source)!r} could not be loaded as a causal LM: {e}") from None
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _check_draft_vocab(target: nn.Module, draft: nn.Module) -> int:
    """The vocabulary the pair shares. Sizes may differ only by padding rows; API.md."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    common = min(tv, dv)
    # Padding rows sit at the end: a real difference shows up in special-token ids or a size
    # gap that is not padding-sized (Qwen2.5 pads 151665 real tokens to 151936 / 152064).
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t, d = getattr(target.config, attr, None), getattr(draft.config, attr, None)
        if t is not None and d is not None and t != d:
            raise ValueError(f"draft is not compatible with target: {attr} differs "
                             f"(target {t}, draft {d}); the draft must use the target's tokenizer")
    if abs(tv - dv) > max(1024, common // 16):
        raise ValueError(f"draft is not compatible with target: vocabulary sizes {dv} and {tv} "
                         "differ by more than padding; the draft must use the target's tokenizer")
    return common


def optimize(target: ModelLike, draft: ModelLike | None = None,
             config: FuserConfig | None = None) -> Engine:
    """Capture, rewrite and compile `target` (and `draft`) into an Engine.

    target, draft: a transformers causal-LM instance or a path to a local model directory.
    The user's models are not modified. Pieces that cannot be optimized run in eager PyTorch
    with a warning and an entry in `report().fallbacks`.
    """
    if config is None:
        config = FuserConfig()
    if not isinstance(config, FuserConfig):
        raise ValueError(f"config must be a fuser.FuserConfig, got {type(config).__name__}")
    weights = None
    if config.tensor_parallel > 1 and isinstance(target, (str, Path)):
        # Each rank reads its own slices from the directory: the whole model is never loaded.
        target_model, tokenizer = load_meta_model(target, "target")
        weights = DirectoryWeights(str(target))
    else:
        target_model, tokenizer = load_model(target, "target")
    draft_model = load_model(draft, "draft")[0] if draft is not None else None
    return build_engine(target_model, draft_model, config, tokenizer, weights=weights)


def load_meta_model(source: str | Path, argument: str) -> tuple[nn.Module, object | None]:
    """The causal LM of model directory `source` on the meta device (its class, config, dtype
    and generation config; no weights, no memory), and its tokenizer if it has one: what a
    tensor-parallel build starts from, each rank reading its own slices of the weights
    (fuser/rank_model.py `DirectoryWeights`)."""
    path = Path(source)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{argument}={str(source)!r} is not a model directory "
                         "(a folder with config.json and safetensors weights)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        model_config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config,
                                                     dtype=model_config.dtype or torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{argument}={str(source)!r} could not be loaded as a causal LM: {e}") \
            from None
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def is_meta(model: nn.Module) -> bool:
    """Whether `model`'s weights are on the meta device (shapes only)."""
    return next(model.parameters()).device.type == "meta"


def _stop_followers_on_error(fn: Callable[..., Engine]) -> Callable[..., Engine]:
    """`fn` (a build or a load), stopping the tensor-parallel followers it started if it
    raises (a process holds one group at a time: `TensorParallelGroup`)."""
    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> Engine:
        before = TensorParallelGroup.running()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            started = TensorParallelGroup.running()
            if started is not None and started is not before:
                started.close()
            raise
    return wrapper


@_stop_followers_on_error
def build_engine(target: nn.Module, draft: nn.Module | None, config: FuserConfig,
                 tokenizer: object | None = None, weights: WeightSource | None = None
                 ) -> Engine:
    """The Engine for already loaded models (see the module docstring for the order).

    With tensor_parallel > 1 each rank builds its share of the target from `weights`
    (fuser/rank_model.py): None is the target module itself, or, for a target on the meta
    device, Hugging Face's random initialisation made per rank (`RandomWeights`: benchmarks of
    shapes no single device holds)."""
    start = time.perf_counter()
    if is_meta(target):
        if config.tensor_parallel == 1:
            raise ValueError("the target's weights are on the meta device: only a "
                             "tensor-parallel build (tensor_parallel > 1) makes them, per rank")
        weights = weights if weights is not None else RandomWeights()
    device = torch.device(config.device) if config.device is not None else \
        next(target.parameters()).device
    if device.type == "meta":
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    dtype = config.dtype_for(next(target.parameters()).dtype)
    # Triton's toolchain as a load will have it (the kernels' cache keys), then Inductor's
    # compile workers start while the steps are exported and rewritten.
    kernel_store.settle_triton_toolchain(device)
    start_compile_workers(compile_mode(config, device, target), device)
    gammas = config.gammas if draft is not None else ()
    # Without a draft, suffix speculation (runtime/suffix.py) still needs the target's verify
    # steps: built with the engine, so that a saved engine directory has them.
    suffix_gammas = config.gammas if draft is None and config.suffix_speculation else ()
    # With a draft, the suffix index's proposals verified alone at longer gammas (the
    # adaptive scheduler's long suffix arms).
    long_gammas = config.long_suffix_gammas if gammas and config.suffix_speculation else ()
    gamma = max(gammas + suffix_gammas + long_gammas, default=0)
    vocab_size = _check_draft_vocab(target, draft) if draft is not None else target.config.vocab_size
    # Slots per row: max_seq_len plus the gamma + 1 positions a verify step may write, for the
    # largest gamma in use.
    slots = config.max_seq_len + gamma + 1
    # The overlapped step's draft runs its gamma slots ahead of the verified ones
    # (runtime/speculative.py `overlapped_step`).
    draft_slots = slots + (max(gammas, default=0) if config.overlap else 0)
    sizes = config.buckets_for(device)
    num_blocks = 0
    if config.kv_block_size:
        # One block table for both models (the draft's blocks follow the target's): rows of
        # the same slots, pools of the same block count.
        slots = draft_slots = max(slots, draft_slots)
        num_blocks = paged_pool_blocks(config, target, draft if gammas else None, slots, dtype,
                                       device)
    shared_table: list[torch.Tensor] = []  # a paged target's table, which the draft shares
    fallbacks: list[str] = []
    fp8_lm_head = config.fp8_lm_head if config.precision == "fp8" else None

    def fallback(message: str) -> None:
        warnings.warn(f"fuser: {message}", stacklevel=3)
        fallbacks.append(message)

    def prepare(role: str, model: nn.Module, kinds: list[StepKind], slots: int
                ) -> dict[int, ModelSteps] | None:
        """The model's steps per batch bucket, over one cache of max_batch_size rows (bucket b
        uses rows [:b]), or None when the model cannot run through the engine's cache."""
        if role == "target" and group is not None:  # rank 0's share; the followers build theirs
            _progress(f"building rank 0 of {config.tensor_parallel}'s target steps for batch "
                      f"buckets {list(sizes)}")
            built = build_shard(type(model), model.config,
                                weights if weights is not None else ModuleWeights(model),
                                config, kinds, sizes, slots, dtype, device, 0,
                                config.tensor_parallel, progress=_progress,
                                num_blocks=num_blocks)
            table = built[max(built)].cache.block_table
            if table is not None:  # the draft's blocks follow rank 0's target table
                shared_table.append(table)
            return built
        if not supports_cache_attention(model):
            fallback(f"{role}: {type(model).__name__} does not dispatch attention through "
                     "transformers' attention registry; it runs in eager PyTorch, unfused")
            return None
        model_type = getattr(model.config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            fallback(f"{role}: model type {model_type!r} is not in the supported list "
                     f"{SUPPORTED_MODEL_TYPES}; fusions that match are applied, the rest runs "
                     "in eager PyTorch")
        cache = allocate_cache(role, model.config, config.max_batch_size, slots, dtype, device,
                               config.max_seq_len, config.kv_block_size, num_blocks,
                               shared_table[0] if shared_table else None)
        if cache.paged and not shared_table:
            shared_table.append(cache.block_table)
        view = engine_view(model, dtype, device)
        names = ", ".join(k.name + ("" if k.tokens is None else str(k.tokens)) for k in kinds)
        _progress(f"building {role} steps ({names}) for batch buckets {list(sizes)}")
        return build_bucket_steps(role, view, cache, sizes, kinds, config, device,
                                  progress=_progress)

    paged = bool(config.kv_block_size)
    target_kinds = target_steps(0, paged) + [
        verify(g) for g in sorted(set(gammas + suffix_gammas + long_gammas))]
    group = _start_followers(target, config, target_kinds, sizes, slots, dtype, device, weights,
                             num_blocks)
    target_built = prepare("target", target, target_kinds, slots)
    draft_built = None
    if draft is not None and gammas and target_built is not None:
        draft_built = prepare("draft", draft, draft_steps(draft_slots, paged), draft_slots)
    if group is not None:  # every rank has built its steps: from here on they run together
        group.join()
        target_built = mirror(target_built, group)
    for built in (target_built, draft_built):
        for size, steps in (built or {}).items():
            began = time.perf_counter()
            try:
                warm_up(steps)  # compiles the fixed-T steps (Inductor) on their first call
            except torch.OutOfMemoryError as e:
                raise torch.OutOfMemoryError(_out_of_memory(config, steps, size)) from e
            _progress(f"{steps.role} bucket {size}: every step run once (compiled where "
                      f"compiled) in {time.perf_counter() - began:.1f} s")
    top = config.max_batch_size
    if target_built is not None and not is_meta(target):
        # (a target on the meta device has no eager model to check against: its weights
        # exist only as the ranks' slices)
        problem = check_against_eager(target_built[top], target, config.max_seq_len,
                                      fp8_lm_head)
        if problem is not None and group is not None:
            raise ValueError(f"tensor_parallel={config.tensor_parallel}: the sharded target "
                             f"step disagrees with eager PyTorch ({problem})")
        if problem is not None:
            fallback(f"target: the captured step disagrees with eager PyTorch ({problem}); it "
                     "runs in eager PyTorch instead")
            target_built = draft_built = None
    if draft_built is not None:
        problem = check_against_eager(draft_built[top], draft, config.max_seq_len,
                                      fp8_lm_head)
        if problem is not None:
            fallback(f"draft: the captured step disagrees with eager PyTorch ({problem}); it "
                     "runs in eager PyTorch instead, without speculation")
            draft_built = None
    buckets = None
    if target_built is not None:
        buckets = {size: (target_built[size], draft_built[size] if draft_built else None)
                   for size in sizes}
    engine = Engine(target_built[top] if target_built else None,
                    draft_built[top] if draft_built else None, config=config,
                    user_target=target, tokenizer=tokenizer, device=device, dtype=dtype,
                    vocab_size=vocab_size, gamma=gamma if draft_built is not None else 0,
                    fallbacks=fallbacks, compile_seconds=0.0, buckets=buckets,
                    gammas=gammas if draft_built is not None else ())
    engine.tensor_parallel = group
    # Whole-iteration CUDA graphs (one per bucket, gamma and greedy/sampling; the model steps
    # inside run their compiled callables), every bucket before returning (a build's costs are
    # measured over all of them), and, with gamma="auto", their measured costs.
    engine.prepare(progress=_progress, background=False)
    engine.compile_seconds = time.perf_counter() - start
    return engine


def _out_of_memory(config: FuserConfig, steps: ModelSteps, size: int) -> str:
    """What to change when a build's first run of its steps finds no memory for them."""
    cache = steps.cache
    held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v)) / 2**30
    if config.kv_memory_fraction is not None and config.kv_block_size and not config.kv_blocks:
        lower = (f"lower kv_memory_fraction={config.kv_memory_fraction:g} (`fuser serve "
                 "--gpu-memory-fraction`), or set kv_blocks")
    elif config.kv_block_size:
        lower = f"lower kv_blocks={cache.num_blocks}"
    else:
        lower = "lower max_batch_size or max_seq_len, or page the cache (kv_block_size)"
    return (f"the {steps.role}'s steps at batch bucket {size} ran out of GPU memory on their "
            f"first run, beside a KV cache of {held:.2f} GiB: {lower}")


def paged_pool_blocks(config: FuserConfig, target: nn.Module, draft: nn.Module | None,
                      slots: int, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks per pool of a paged engine: config.kv_blocks; else, with kv_memory_fraction on
    CUDA, what that fraction of the free memory holds once the weights not yet on the device
    are there (`blocks_for_budget`, target and draft); else 0 (`KVCache.allocate`'s default:
    every row at full length). Tensor parallel: measured on rank 0's device (which also holds
    the draft), with the target's share (its KV heads / N, its weights / N, made anew
    wherever the caller's model is): every rank's pool has this count."""
    from fuser.capture import model_geometry
    from fuser.runtime.blocks import CacheShape, blocks_for_budget
    from fuser.runtime.kv_cache import free_memory_bytes

    if config.kv_blocks:
        return config.kv_blocks
    if config.kv_memory_fraction is None or device.type != "cuda":
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    ws = config.tensor_parallel
    layers, kv_heads, head_dim = model_geometry(target.config)
    shapes = [CacheShape(layers, kv_heads // ws, head_dim, dtype)]
    coming = sum(p.numel() * itemsize for p in target.parameters()
                 if ws > 1 or p.device != device) // ws
    if draft is not None:
        shapes.append(CacheShape(*model_geometry(draft.config), dtype))
        coming += sum(p.numel() * itemsize for p in draft.parameters() if p.device != device)
    free = free_memory_bytes(device) or 0
    budget = int(config.kv_memory_fraction * max(free - coming, 0))
    blocks = blocks_for_budget(budget, config.kv_block_size, shapes)
    max_blocks = -(-slots // config.kv_block_size)
    _progress(f"paged KV cache: {blocks} blocks of {config.kv_block_size} slots "
              f"({budget / 2**30:.2f} GiB, {config.kv_memory_fraction:g} of the "
              f"{max(free - coming, 0) / 2**30:.2f} GiB free after the weights; a full-length "
              f"row takes {max_blocks})")
    return blocks


def _start_followers(target: nn.Module, config: FuserConfig, kinds: list[StepKind],
                     sizes: tuple[int, ...], slots: int, dtype: torch.dtype,
                     device: torch.device, weights: WeightSource | None, num_blocks: int
                     ) -> TensorParallelGroup | None:
    """With config.tensor_parallel = N > 1: ranks 1..N-1 started, building their shares of
    the target's steps (from `weights`, or from `target` itself, which they then receive by
    shared memory or CUDA IPC) while rank 0 (this process) builds its own; else None."""
    world_size = config.tensor_parallel
    if world_size == 1:
        return None
    if not supports_cache_attention(target):
        raise ValueError(f"tensor_parallel={world_size}: {type(target).__name__} does not "
                         "dispatch attention through transformers' attention registry, so its "
                         "steps cannot be captured and sharded")
    check_world_size(target.config, world_size, device)
    group = TensorParallelGroup(world_size, device)
    group.start(target if weights is None else None, lambda rank: FollowerPlan(
        rank=rank, world_size=world_size, config=config, kinds=tuple(kinds),
        sizes=tuple(sizes), slots=slots, dtype=dtype, device=device,
        init_file=group.init_file, num_blocks=num_blocks, model_class=type(target),
        model_config=target.config, weights=weights))
    _progress(f"started tensor-parallel ranks 1..{world_size - 1} (pids {group.pids})")
    return group


@_stop_followers_on_error
def load(path: str | Path, device: str | torch.device | None = None, *,
         log: Log | None = None, wait_for_graphs: bool = False,
         tensor_parallel: int | None = None, tokenizer: str | Path | None = None) -> Engine:
    """The Engine saved at `path` (`engine.save`), without capture, passes or compilation:
    every batch bucket's steps, compiled ones from their saved code, and, with
    gamma="auto", the iteration costs measured at build time.

    On CUDA it returns once batch bucket 1's step graphs are captured: the other buckets'
    capture on a background thread while the engine already serves (a step that needs one not
    yet captured runs in a captured larger bucket, or uncaptured: correct, only slower).
    `engine.wait_for_graphs()` waits for them, `engine.close()` stops the thread;
    wait_for_graphs=True captures every bucket before returning (benchmarks).
    A tensor-parallel engine directory (rank0/, rank1/, ...) starts its follower processes,
    each loading its own rank. tensor_parallel: the world size to load at (None: the saved
    one); another than the saved one is refused, as is a rank directory loaded alone.
    tokenizer: a tokenizer directory loaded in place of the engine's own (for an engine saved
    without one; `fuser.engine_io.TokenizerError`, a ValueError, names it if it cannot be
    loaded), on a thread while the weights are read, as the engine's own is.

    Refuses (fuser.EngineFileError, a ValueError) an engine built elsewhere (versions, device,
    GPU, passes or kernel sources) or a missing, truncated, altered or half-written file,
    naming what differs. `log` receives a line per long step.
    """
    say = log or (lambda message: None)
    start = time.perf_counter()
    group = None
    if saved_world_size(path, tensor_parallel) > 1:  # rank 0 here, the others started
        group, path, device = _start_loading(Path(path), device)
    parts = open_engine(path, device, log=say, tokenizer=tokenizer)
    info = parts.manifest["info"]["engine"]
    target, draft = parts.models["target"], parts.models.get("draft", {})
    if group is not None:
        group.join()
        target = mirror(target, group)
        if parts.device.type == "cuda":  # the kernels load now (every rank), not in a request
            warm_up(target[max(target)])
    top = max(target)
    engine = Engine(target[top], draft.get(top), config=parts.config,
                    user_target=parts.user_target, tokenizer=parts.tokenizer,
                    device=parts.device, dtype=getattr(torch, info["dtype"]),
                    vocab_size=info["vocab_size"], gamma=info["gamma"],
                    fallbacks=info.get("fallbacks", []),
                    buckets={size: (steps, draft.get(size)) for size, steps in target.items()},
                    gammas=parts.gammas)
    engine.tensor_parallel = group
    # The whole-step CUDA graphs, bucket 1 first (the rest in the background unless
    # wait_for_graphs or tensor parallel); with gamma="auto" the costs measured at build time.
    prepared = time.perf_counter()
    engine.prepare(progress=say, known_costs=parts.step_costs or None,
                   background=not wait_for_graphs)
    engine.compile_seconds = engine.load_seconds = time.perf_counter() - start
    engine.load_timings = {**parts.timings, "capture": time.perf_counter() - prepared}
    engine.manifest = parts.manifest
    say(f"loaded in {engine.load_seconds:.1f} s")
    return engine


def _start_loading(root: Path, device: str | torch.device | None
                   ) -> tuple[TensorParallelGroup, Path, torch.device]:
    """`load` of a tensor-parallel directory: ranks 1..N-1 started, each loading
    root/rank<r>; -> (their group, rank 0's directory, rank 0's device)."""
    from fuser.engine_file import read_manifest
    from fuser.engine_io import resolve_device

    world_size = saved_world_size(root, None)
    resolved = resolve_device(read_manifest(root / "rank0"), device)
    check_devices(world_size, resolved)
    group = TensorParallelGroup(world_size, resolved)
    group.start(None, lambda rank: FollowerPlan(
        rank=rank, world_size=world_size, config=None, kinds=(), sizes=(), slots=0,
        dtype=None, device=resolved, init_file=group.init_file,
        engine_dir=str(root / f"rank{rank}")))
    return group, root / "rank0", resolved


def _progress(message: str) -> None:
    """Progress of the long build steps, through the "fuser" logger."""
    logging.getLogger("fuser").info(message)
