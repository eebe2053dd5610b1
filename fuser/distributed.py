"""The multi-process tensor-parallel engine: one process per rank, rank 0 in the caller's.

    engine = fuser.optimize(target, draft, FuserConfig(tensor_parallel=N))

Every rank builds its share of the target's steps from its own share of the model, never the
whole (fuser/rank_model.py: its slices of the weights, read from the caller's model, from a
model directory's safetensors, or made at random): the same capture over its own KV cache of
KV heads [r * KVH / N, (r + 1) * KVH / N), the collectives (passes/tensor_parallel.py
`add_collectives`) and the fusion passes (fuser/build.py `build_shard`). Rank 0 runs the
Engine as on one device (generate, stream, the Scheduler, `fuser serve`'s HTTP server); ranks
1..N-1 are followers (torch.multiprocessing, spawn) that run, in the same order, every target
step rank 0 runs:

    rank 0, each target step              follower r, forever
    ------------------------              -------------------
    command (pipe): STEP bucket kind B T  wait on the pipe (no timeout: a server may idle)
    broadcast [tokens, positions,         broadcast (receive) the same packed int64 tensor
               seq_lens, starts]          copy seq_lens, starts into its cache
    run its sharded step                  run its sharded step (the same collectives)

The step's inputs are rank 0's, bit for bit (one broadcast of 2*B*T + 2*B int64 per step, and
with a paged KV cache the bucket's block table rows after them, B * max_blocks more: rank 0's
scheduler edits rank 0's table only), so the followers never sample, schedule or decide
anything. The logits are gathered on every
rank by the vocab-parallel head; only rank 0's are read. A scheduler's row move of the KV cache
(`KVCache.move_row`) is a command too (`MirroredCache`).

Speculation: the draft runs on rank 0 only, unsharded. It is small (the draft/target cost ratio
~0.1-0.25), so replicating it would save nothing on rank 0's critical path: with a replicated
draft every rank would draft the same tokens in the same time, and rank 0 would still verify
only after its own drafting. What a replicated draft would save is the per-step broadcast of
the verify step's tokens, one small collective against the 2 all-reduces per layer the step
already makes (64 at the 8B shape); what rank-0-only saves is the draft's memory and its
passes on every other GPU and any need for the draft's steps (and the adaptive controller's
choices, which follow wall time) to stay in lockstep across processes.

The command channel is one `multiprocessing` pipe per follower (rank 0 -> follower: commands;
follower -> rank 0: "built", and an error's traceback). The process group (gloo on the CPU,
NCCL on cuda:r with NVLink multicast off) is torch.distributed's default group, which the
collective ops (fuser/ops/collectives.py) use; rank 0's is created in the caller's process, so
one tensor-parallel engine runs per process at a time. `engine.close()`, or interpreter exit,
stops the followers; a follower that fails or dies surfaces on rank 0 as `FollowerError`
naming its rank.

CUDA graphs: rank 0 captures each decoding iteration (runtime/step_graphs.py) as on one GPU;
the target steps it runs while capturing are sent as usual, between CAPTURE_BEGIN and
CAPTURE_END, and each follower captures its part (the input broadcast and its sharded steps,
NCCL collectives inside) into a graph of its own under the same key. Each replay on rank 0
sends REPLAY key first. Prefill, captured per length on first use on one GPU, runs uncaptured
under tensor parallelism. (The CUDA paths, NCCL and capture, have not run on 2 GPUs yet:
tests/test_tensor_parallel_cuda.py and `benchmarks/gpu.sh tp` are written for that.)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fuser.ops import p2p_all_reduce
from fuser.runtime.cuda_graphs import collector_held
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import CHUNK, PREFILL, ModelSteps, StepKind

ONE_SHOT_ENV = "FUSER_ONE_SHOT_ALL_REDUCE"  # "1": the one-shot all-reduce (see _init_group)

# Set for every rank (and the caller's process, rank 0): NVLink multicast off. NVLS and
# multicast symmetric memory are not available on the machines fuser is tested on.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Commands rank 0 sends, each a struct of int64s: (op, *args).
STEP, MOVE_ROW, STOP, SAVE, CAPTURE_BEGIN, CAPTURE_END, REPLAY, HELD = 1, 2, 3, 4, 5, 6, 7, 8
KIND_NAMES = ("prefill", "decode", "verify", "catchup", "resync", "chunk")
# Collectives wait this long for a peer before failing (a follower that died mid-step on NCCL
# is found by the watchdog after it); the command pipe itself never times out.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_POLL_S = 0.2  # how often rank 0 looks at the followers while it waits for them


# A tensor-parallel engine directory: TP_MANIFEST ({"format", "world_size", "ranks"}) and one
# engine directory per rank, "rank0", "rank1", ...
TP_MANIFEST = "tensor_parallel.json"
TP_FORMAT = "fuser-tensor-parallel"


class FollowerError(RuntimeError):
    """A follower rank failed (its exception, or its exit) or cannot be reached."""


def _pack(*words: int) -> bytes:
    return struct.pack(f"<{len(words)}q", *words)


def _unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 8}q", data))


def check_world_size(model_config: object, world_size: int, device: torch.device) -> None:
    """Refuse a world size the model or the machine cannot take, before any process starts:
    heads, KV heads, intermediate size and vocabulary must divide (ValueError naming each),
    and on CUDA the ranks need world_size devices from the engine's own."""
    from fuser.capture import model_geometry
    from fuser.passes.tensor_parallel import ShardShape

    _, kv_heads, head_dim = model_geometry(model_config)
    ShardShape(heads=model_config.num_attention_heads, kv_heads=kv_heads, head_dim=head_dim,
               intermediate=model_config.intermediate_size,
               vocab=model_config.vocab_size).check(world_size, "vocab")
    check_devices(world_size, device)


def check_devices(world_size: int, device: torch.device) -> None:
    """On CUDA, ranks 0..N-1 run on cuda:first..cuda:first+N-1: refuse where fewer are
    visible; elsewhere only the CPU (gloo) runs ranks."""
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + world_size > count:
            raise ValueError(f"tensor_parallel={world_size}: ranks on cuda:{first}.."
                             f"cuda:{first + world_size - 1}, but {count} CUDA device(s) are "
                             "visible")
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel={world_size} runs on CUDA (NCCL) or the CPU (gloo), "
                         f"not on {device}")


def saved_world_size(path: str | os.PathLike, asked: int | None) -> int:
    """The world size engine directory `path` was saved with, checked against `asked` (None:
    whatever it was saved with). Refuses (EngineFileError naming both sizes) a load at another
    world size, a rank directory loaded alone, and a directory whose ranks disagree."""
    from fuser.engine_file import MANIFEST, EngineFileError, read_manifest

    root = Path(path)
    if (root / TP_MANIFEST).is_file():
        try:
            manifest = json.loads((root / TP_MANIFEST).read_text())
            world_size, ranks = int(manifest["world_size"]), list(manifest["ranks"])
        except (ValueError, KeyError, TypeError) as e:
            raise EngineFileError(f"{root / TP_MANIFEST} is not a tensor-parallel manifest "
                                  f"({e})") from None
        if asked is not None and asked != world_size:
            raise EngineFileError(f"{root} is a tensor-parallel engine of world size "
                                  f"{world_size}; it cannot load at world size {asked} (rebuild "
                                  f"it with tensor_parallel={asked})")
        if ranks != [f"rank{r}" for r in range(world_size)]:
            raise EngineFileError(f"{root / TP_MANIFEST}: ranks {ranks} for world size "
                                  f"{world_size}")
        for name in ranks:
            saved = read_manifest(root / name)["config"].get("tensor_parallel", 1)
            if saved != world_size:
                raise EngineFileError(f"{root / name} was saved at world size {saved}, but "
                                      f"{root / TP_MANIFEST} says {world_size}")
        return world_size
    saved = 1
    if (root / MANIFEST).is_file():
        saved = read_manifest(root)["config"].get("tensor_parallel", 1)
    if saved > 1:
        raise EngineFileError(f"{root} is one rank of a tensor-parallel engine of world size "
                              f"{saved}; it cannot load alone (world size 1): load its parent "
                              "directory")
    if asked is not None and asked != 1:
        raise EngineFileError(f"{root} is an engine of world size 1; it cannot load at world "
                              f"size {asked} (rebuild it with tensor_parallel={asked})")
    return 1


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(first + r) from the engine's cuda:first; the CPU for all."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def _init_group(rank: int, world_size: int, init_file: str, device: torch.device) -> None:
    for name, value in NCCL_ENV.items():
        os.environ.setdefault(name, value)
    if sys.platform == "linux":  # gloo over loopback: one host, whatever the hostname resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda" and os.environ.get(ONE_SHOT_ENV) == "1":
        # Small all-reduces one-shot over peer-to-peer memory (fuser/ops/p2p_all_reduce.py):
        # off until measured on 2 GPUs (`benchmarks/tensor_parallel.py --one-shot`). A
        # collective: every rank gets here right after joining the group.
        p2p_all_reduce.install(device=device)


@dataclass(frozen=True)
class FollowerPlan:
    """What a follower builds (rank 0's choices, so that both sides build the same steps), or
    the rank directory of a saved engine it loads instead (`engine_dir`)."""

    rank: int
    world_size: int
    config: Any  # FuserConfig (None when loading: the rank directory has it)
    kinds: tuple[StepKind, ...]
    sizes: tuple[int, ...]
    slots: int
    dtype: torch.dtype | None
    device: torch.device  # rank 0's: rank r runs on `rank_device(device, r)`
    init_file: str
    engine_dir: str | None = None
    num_blocks: int = 0  # a paged KV cache's pool, rank 0's count (every rank's tables match)
    model_class: type | None = None  # the target's transformers class and config
    model_config: Any = None
    weights: Any = None  # a fuser.rank_model.WeightSource; None: the module sent with the plan


def follower_main(plan: FollowerPlan, target: Any, conn: Any) -> None:
    """A follower's process: build its shard, join the process group, then run rank 0's
    commands until STOP or until rank 0 is gone. An exception goes back to rank 0 (its
    traceback) before the process exits with status 1."""
    try:
        device = rank_device(plan.device, plan.rank)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads() // plan.world_size))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        config, dtype = plan.config, plan.dtype
        if plan.engine_dir is not None:
            from fuser.engine_io import open_engine

            parts = open_engine(plan.engine_dir, device)
            buckets = parts.models["target"]
            config = parts.config
            dtype = getattr(torch, parts.manifest["info"]["engine"]["dtype"])
        else:
            from fuser import kernel_store
            from fuser.build import build_shard
            from fuser.rank_model import ModuleWeights

            kernel_store.settle_triton_toolchain(device)  # as rank 0 (pipeline.build_engine)

            weights = plan.weights if plan.weights is not None else ModuleWeights(target)
            buckets = build_shard(plan.model_class, plan.model_config, weights, plan.config,
                                  list(plan.kinds), plan.sizes, plan.slots, plan.dtype, device,
                                  plan.rank, plan.world_size, num_blocks=plan.num_blocks)
            del target, weights
        conn.send_bytes(b"built")
        _init_group(plan.rank, plan.world_size, plan.init_file, device)
        try:
            follow(buckets, conn, device, RankEngine.of(buckets, config, dtype, device))
        finally:
            p2p_all_reduce.uninstall()
            dist.destroy_process_group()
    except (EOFError, ConnectionError, KeyboardInterrupt):
        return  # rank 0 is gone (closed without STOP, or its process ended): nothing to report
    except BaseException:  # noqa: BLE001 -- reported to rank 0, then this process ends
        try:
            conn.send_bytes(b"error:" + traceback.format_exc().encode())
        except (OSError, ValueError):
            pass
        sys.exit(1)


@torch.no_grad()
def follow(buckets: dict[int, ModelSteps], conn: Any, device: torch.device,
           engine: RankEngine) -> None:
    """Run rank 0's commands over this rank's steps (bucket -> steps) until STOP."""
    from fuser.engine_io import save

    top = buckets[max(buckets)]
    graphs: dict[int, torch.cuda.CUDAGraph] = {}  # rank 0's iteration graph key -> our part
    # The capture under way between BEGIN and END (torch.cuda.graph of `graph`, the cyclic
    # collector held off: runtime/cuda_graphs.py `collector_held`)
    capture: contextlib.ExitStack | None = None
    graph: torch.cuda.CUDAGraph | None = None
    pool = None
    while True:
        op, *args = _unpack(conn.recv_bytes())
        if op == STOP:
            return
        if op == REPLAY:
            graphs[args[0]].replay()
        elif op == CAPTURE_BEGIN:  # the STEPs until CAPTURE_END are captured, not run
            pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with contextlib.ExitStack() as opening:
                opening.enter_context(collector_held())
                opening.enter_context(torch.cuda.graph(graph, pool=pool))
                capture = opening.pop_all()  # (closed at END)
        elif op == CAPTURE_END:
            key, failed = args
            ending, capture = capture, None
            ending.close()  # the capture's end, then the collector back
            if not failed:
                graphs[key] = graph
        elif op == SAVE:  # then the directory, as UTF-8
            (overwrite,) = args
            save(engine, conn.recv_bytes().decode(), overwrite=bool(overwrite))
            conn.send_bytes(b"saved")
        elif op == MOVE_ROW:
            top.cache.move_row(*args)
        elif op == HELD:
            conn.send_bytes(_pack(held_bytes(buckets)))
        elif op == STEP:
            batch, name, B, T = args
            steps = buckets[batch]
            kind = {"prefill": PREFILL, "chunk": CHUNK}.get(KIND_NAMES[name]) or \
                StepKind(KIND_NAMES[name], T)
            cache = steps.cache
            table = cache.block_table
            packed = torch.empty(2 * B * T + 2 * B + (table.numel() if cache.paged else 0),
                                 dtype=torch.long, device=device)
            dist.broadcast(packed, src=0)
            tokens, positions, seq_lens, starts, blocks = _split(packed, B, T)
            cache.seq_lens.copy_(seq_lens)
            cache.starts.copy_(starts)
            if cache.paged:  # rank 0's block table rows, as its scheduler left them
                table.copy_(blocks.view(table.shape))
            steps.run(kind, tokens, positions)
        else:
            raise RuntimeError(f"unknown command {op}")


@dataclass
class _BucketSteps:
    target: ModelSteps
    draft: None = None


@dataclass
class RankEngine:
    """A follower's steps as `engine_io.save` reads an Engine (target only, no tokenizer)."""

    target: ModelSteps
    buckets: dict[int, _BucketSteps]
    config: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    draft: None = None
    tokenizer: None = None
    user_target: None = None
    gamma: int = 0
    compile_seconds: float = 0.0
    step_costs: dict = field(default_factory=dict)
    _fallbacks: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, buckets: dict[int, ModelSteps], config: Any, dtype: torch.dtype,
           device: torch.device) -> RankEngine:
        top = buckets[max(buckets)]
        return cls(top, {size: _BucketSteps(steps) for size, steps in buckets.items()}, config,
                   device, dtype, top.vocab_size)

    def report(self) -> Any:
        from fuser.report import Report

        return Report(fallbacks=list(self.target.fallbacks))


def _held_tensors(step: Any) -> list[torch.Tensor]:
    """The tensors one step holds: its graphs' attributes, its eager module's, its exported
    program's and its compiled callable's."""
    out: list[torch.Tensor] = []
    for module in (step.rewritten, step.eager):
        if isinstance(module, torch.nn.Module):
            out += [*module.parameters(), *module.buffers()]
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.find_nodes(op="get_attr"):
                    value: Any = module
                    for part in str(node.target).split("."):
                        value = getattr(value, part)
                    if isinstance(value, torch.Tensor):
                        out.append(value)
    if step.exported is not None:
        out += [t for t in [*step.exported.state_dict.values(), *step.exported.constants.values()]
                if isinstance(t, torch.Tensor)]
    out += [t for t in getattr(step.compiled, "tensors", None) or []
            if isinstance(t, torch.Tensor)]
    return out


def held_bytes(buckets: dict[int, ModelSteps]) -> int:
    """Bytes of the tensors a model's steps (batch bucket -> steps) hold, counted once per
    storage, the KV cache and its lengths left out: on a tensor-parallel rank, its share of the
    weights and whatever the passes made of them (fuser/rank_model.py `resident_bytes`)."""
    from fuser.rank_model import resident_bytes

    cache = buckets[max(buckets)].cache
    exclude = [*cache.k, *cache.v, cache.seq_lens, cache.starts]
    if cache.block_table is not None:
        exclude.append(cache.block_table)
    tensors = [t for steps in buckets.values() for step in steps.steps.values()
               for t in _held_tensors(step)]
    return resident_bytes(tensors, exclude)


def rank_held_bytes(engine: Any) -> list[int]:
    """Every rank's `held_bytes` of its target steps, rank 0 first (one rank: [its own])."""
    own = held_bytes({size: bucket.target for size, bucket in engine.buckets.items()})
    group = engine.tensor_parallel
    return [own] if group is None else [own, *group.held_bytes()]


def _split(packed: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, ...]:
    """[tokens [B, T], positions [B, T], seq_lens [B], starts [B], the block table's rows
    flat (paged; else empty)] from one flat int64 tensor."""
    n = B * T
    return (packed[:n].view(B, T), packed[n:2 * n].view(B, T), packed[2 * n:2 * n + B],
            packed[2 * n + B:2 * n + 2 * B], packed[2 * n + 2 * B:])


class TensorParallelGroup:
    """Rank 0's side of the engine's processes: starts the followers, sends them commands,
    stops them. `close()` is idempotent and also runs at interpreter exit."""

    _open: TensorParallelGroup | None = None  # the one group this process may hold

    def __init__(self, world_size: int, device: torch.device) -> None:
        if TensorParallelGroup._open is not None:
            raise ValueError("a tensor-parallel engine is already running in this process "
                             "(its process group is torch.distributed's default group): close "
                             "it first (engine.close())")
        if dist.is_initialized():
            raise ValueError("tensor_parallel > 1 creates torch.distributed's default process "
                             "group, but this process already has one (launched by torchrun?); "
                             "fuser starts its own worker processes: run it as a single process")
        self.world_size = world_size
        self.device = device
        self.processes: list[Any] = []
        self.conns: list[Any] = []
        self._dir = tempfile.mkdtemp(prefix="fuser-tp-")
        self.init_file = os.path.join(self._dir, "store")
        self.closed = False
        self.failure: FollowerError | None = None
        self.joined = False
        self._sending = threading.Lock()
        TensorParallelGroup._open = self
        atexit.register(self.close)

    @classmethod
    def running(cls) -> TensorParallelGroup | None:
        """The group this process holds now (not closed), if any."""
        return cls._open

    def start(self, target: Any, plan: Callable[[int], FollowerPlan]) -> None:
        """Spawn ranks 1..N-1, each building from `target` (the causal-LM module, sent by
        torch.multiprocessing's pickler: CPU tensors through shared memory, CUDA ones by
        IPC) by plan(rank), or loading plan(rank).engine_dir (target None)."""
        import torch.multiprocessing as mp

        for name, value in NCCL_ENV.items():  # inherited by the spawned processes
            os.environ.setdefault(name, value)
        context = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(target=follower_main, args=(plan(rank), target, theirs),
                                      name=f"fuser-tp-rank{rank}", daemon=False)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)

    def join(self) -> None:
        """Wait until every follower has built its steps, then join the process group."""
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(_POLL_S):
                if not process.is_alive():
                    raise self._failed(rank, "exited while building its steps")
            message = self._receive(rank, conn)
            if message != b"built":
                raise FollowerError(f"tensor-parallel rank {rank}: unexpected message "
                                    f"{message[:80]!r}")
        _init_group(0, self.world_size, self.init_file, self.device)
        self.joined = True

    def _receive(self, rank: int, conn: Any) -> bytes:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            raise self._failed(rank, "closed its pipe") from None
        if message.startswith(b"error:"):
            raise self._failed(rank, "failed:\n" + message[6:].decode(errors="replace"))
        return message

    def _failed(self, rank: int, what: str) -> FollowerError:
        """The error for rank `rank` (kept: every later call raises it too)."""
        process = self.processes[rank - 1]
        code = process.exitcode
        status = "" if code is None else f" (exit status {code})"
        self.failure = FollowerError(f"tensor-parallel rank {rank} {what}{status}")
        return self.failure

    def check(self) -> FollowerError | None:
        """After a failed command or collective: the follower to blame (its own error message
        if it sent one, else how it ended), or None when every follower still runs."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
                try:
                    if conn.poll():
                        message = conn.recv_bytes()
                        if message.startswith(b"error:"):
                            return self._failed(rank, "failed:\n" + message[6:].decode(
                                errors="replace"))
                except (EOFError, OSError):
                    pass
                if not process.is_alive():
                    return self._failed(rank, "died")
            time.sleep(0.05)
        return None

    def _check_usable(self) -> None:
        """Raise the followers' failure, or that the engine was closed."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise FollowerError("this tensor-parallel engine was closed (engine.close())")

    def send(self, *words: int) -> None:
        """One command to every follower."""
        self._check_usable()
        data = _pack(*words)
        with self._sending:  # one command at a time, whole, whatever thread sends it
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send_bytes(data)
                except (OSError, ValueError) as e:
                    raise (self.check() or self._failed(rank, f"cannot be reached ({e})")) \
                        from e

    def save(self, engine: Any, path: str | os.PathLike, overwrite: bool = False,
             source: dict[str, str] | None = None) -> dict[str, Any]:
        """Write the engine as `path`/rank0, rank1, ... (each an engine directory of its rank's
        steps, rank 0's with the draft and tokenizer; every manifest's config says the world
        size), then `path`/TP_MANIFEST naming them, last. Returns that file's contents.
        source: where the models came from (`engine_io.save`), recorded in rank 0's."""
        from fuser.engine_file import EngineFileError
        from fuser.engine_io import save

        self._check_usable()
        root = Path(path)
        if root.exists() and not overwrite:
            raise EngineFileError(f"{root} exists (pass overwrite=True to replace it)")
        if root.exists():
            if not (root / TP_MANIFEST).is_file() and any(root.iterdir()):
                raise EngineFileError(f"{root} is not a tensor-parallel engine directory: not "
                                      "replaced")
            shutil.rmtree(root)
        root.mkdir(parents=True)
        ranks = [f"rank{r}" for r in range(self.world_size)]
        with self._sending:  # the command and its directory, back to back
            for rank, (conn, name) in enumerate(zip(self.conns, ranks[1:]), start=1):
                try:
                    conn.send_bytes(_pack(SAVE, int(overwrite)))
                    conn.send_bytes(str((root / name).resolve()).encode())
                except (OSError, ValueError) as e:
                    raise (self.check() or self._failed(rank, f"cannot be reached ({e})")) \
                        from e
        save(engine, root / ranks[0], overwrite=overwrite, source=source)
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(_POLL_S):
                if not process.is_alive():
                    raise self._failed(rank, "exited while saving its steps")
            if self._receive(rank, conn) != b"saved":
                raise FollowerError(f"tensor-parallel rank {rank}: no reply to the save")
        manifest = {"format": TP_FORMAT, "world_size": self.world_size, "ranks": ranks}
        (root / TP_MANIFEST).write_text(json.dumps(manifest, indent=1))
        return manifest

    def held_bytes(self) -> list[int]:
        """Each follower's `held_bytes` of its steps (rank 1 first)."""
        out = []
        with self._sending:
            self._check_usable()
            for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
                try:
                    conn.send_bytes(_pack(HELD))
                except (OSError, ValueError) as e:
                    raise (self.check() or self._failed(rank, f"cannot be reached ({e})")) \
                        from e
                while not conn.poll(_POLL_S):
                    if not process.is_alive():
                        raise self._failed(rank, "died")
                (count,) = _unpack(self._receive(rank, conn))
                out.append(count)
        return out

    # -- CUDA graphs: runtime/step_graphs.py `CaptureMirror` -------------------------------------

    def begin(self) -> int:
        """Rank 0 begins capturing an iteration: the followers capture the STEPs that follow,
        under the returned key."""
        self._captures = getattr(self, "_captures", 0) + 1
        self.send(CAPTURE_BEGIN, self._captures)
        return self._captures

    def end(self, failed: bool) -> None:
        """Rank 0's capture ended: the followers end theirs (and drop it if rank 0's failed)."""
        self.send(CAPTURE_END, self._captures, int(failed))

    def replay(self, key: int) -> None:
        """Rank 0 replays iteration graph `key`: the followers replay their part of it."""
        self.send(REPLAY, key)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers (STOP, then join; terminate any that do not exit) and leave
        the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(_pack(STOP))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        if self.joined and dist.is_initialized():
            p2p_all_reduce.uninstall()
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)
        if TensorParallelGroup._open is self:
            TensorParallelGroup._open = None
        atexit.unregister(self.close)

    @property
    def pids(self) -> list[int]:
        """The followers' process ids (rank 1 first)."""
        return [p.pid for p in self.processes]


class MirroredSteps(ModelSteps):
    """Rank 0's steps of one bucket: each `run` first sends the step to the followers; an
    iteration graph that captures them has the followers capture theirs (`capture_mirror`,
    runtime/step_graphs.py `IterationGraph`)."""

    def __init__(self, steps: ModelSteps, group: TensorParallelGroup) -> None:
        super().__init__(steps.role, steps.cache, steps.vocab_size, steps.steps,
                         steps.fallbacks)
        self.build_state = steps.build_state
        self.prefill_graphs = steps.prefill_graphs
        self.group = group
        self.capture_mirror = group

    @torch.no_grad()
    def run(self, kind: StepKind, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        cache = self.cache
        self.group.send(STEP, cache.batch_size, KIND_NAMES.index(kind.name), B, T)
        try:
            # one collective for the step's inputs: [tokens, positions, seq_lens, starts] and,
            # paged, the rows' block table (the scheduler's BlockManager edits rank 0's only)
            parts = [tokens.reshape(-1), positions.reshape(-1), cache.seq_lens, cache.starts]
            if cache.paged:
                parts.append(cache.block_table.reshape(-1).long())
            packed = torch.cat(parts).long()
            dist.broadcast(packed, src=0)
            return super().run(kind, tokens, positions)
        except RuntimeError as e:  # a collective with a follower that is gone?
            failure = self.group.check()
            if failure is None:
                raise
            raise failure from e


class MirroredCache(KVCache):
    """Rank 0's KV cache (every row): a row move is also sent to the followers' caches."""

    group: TensorParallelGroup | None = None

    def move_row(self, src: int, dst: int, table: bool = True) -> None:
        # (paged: nothing to send; the lengths and the table go with every step)
        if self.group is not None and not self.paged:
            self.group.send(MOVE_ROW, src, dst)
        super().move_row(src, dst, table)


def mirror(buckets: dict[int, ModelSteps], group: TensorParallelGroup
           ) -> dict[int, ModelSteps]:
    """Rank 0's built target steps (bucket -> steps), each sending its steps to the
    followers; the top bucket's cache sends its row moves."""
    top = max(buckets)
    cache = buckets[top].cache
    mirrored_cache = MirroredCache(cache.k, cache.v, cache.seq_lens, cache.starts,
                                   cache.block_table)
    mirrored_cache.group = group
    out = {}
    for size, steps in buckets.items():
        out[size] = MirroredSteps(steps, group)
        if size == top:
            out[size].cache = mirrored_cache
    return out
