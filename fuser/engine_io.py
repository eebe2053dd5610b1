"""`engine.save(path)` and `fuser.load(path)`: an Engine to an engine directory and back.

The directory format (manifest, weights, JSON graphs, atomic writes, refusals) is
`fuser/engine_file.py`'s; this module decides what of an Engine goes in it and how a loaded one
is put back together:

- every rewritten step graph of the target and the draft, in every batch bucket (each model's
  tensors once: merged weights, and whatever a pass registered on the graph, e.g. FP8 weights
  and their scales); a graph of the largest bucket is stored under its step's name
  ("decode1"), one of a smaller bucket b under "decode1.b<b>";
- the KV cache is not saved: its shapes are in the manifest (`info.models`), and load allocates
  a fresh cache and attaches it (rows [:b] of it to bucket b's graphs; a paged cache: the
  pools as they are and rows [:b] of its block table, one table for the target and the
  draft, pools of the block count built, which compiled steps were specialised to);
- the compiled code of every step Inductor compiled (`<model>/compiled/<graph>.bin`, a
  `torch._inductor.CompiledArtifact`, fuser/compile.py), with its first run's autotuning
  choices where Inductor tuned anything (`<graph>.tuning.bin`);
- the machine code of the kernels the steps run (`kernels/`, fuser/kernel_store.py): the C++
  kernels' shared libraries (CPU) and fuser's Triton kernels' binaries (CUDA), put back in
  Inductor's and Triton's caches before the steps load, so that the load compiles nothing;
- the tokenizer (`tokenizer/`), the generation config (eos/pad ids used by `generate`), and
  the iteration costs measured at build time (gamma="auto").

A loaded engine has no Hugging Face model: `Engine.user_target` is a `DetachedModel` that carries
the generation config and raises a clear error if anything tries to run it. Loading runs
neither `torch.export` nor the passes nor Dynamo or Inductor: compiled steps come back from
their artifacts (`fuser.compile.compile_count()` does not move). `open_engine` reads the parts,
three things at once: the weights (read and hashed by threads, the graphs parsed meanwhile,
fuser/engine_file.py), the compiled steps' code (a thread: it needs no weight) and the
tokenizer (a thread); then it runs every step once (CUDA), each timed (fuser/load_profile.py).
`fuser.pipeline.load` puts the Engine together from them. This module does not import
`fuser.engine` (which imports it for `Engine.save`), not even for types: `save` takes any
`SavableEngine`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from fuser import engine_file as ef
from fuser import kernel_store, load_profile
from fuser.build import warm_up
from fuser.compile import CompiledStep, LoadedCode, load_code
from fuser.config import FuserConfig
from fuser.engine_file import EngineFileError
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import ModelSteps, StepGraph, StepKind

TOKENIZER_DIR = "tokenizer"
GENERATION_CONFIG = "generation_config.json"
# The draft's Hugging Face config: what rebuilds the draft's module for a loaded engine, so that
# `fuser serve ENGINE_DIR --adapt-draft` can distil it (runtime/distill.py `rebuild_draft`).
DRAFT_CONFIG = "draft_config.json"
TARGET_CONFIG = "target_config.json"  # the target's: what labels records with its top-k
COMPILED_DIR = "compiled"
TUNING_SUFFIX = ".tuning.bin"
Log = Callable[[str], None]


def stderr_log(message: str) -> None:
    """Progress line on stderr (the CLI's default for long steps)."""
    print(f"fuser: {message}", file=sys.stderr, flush=True)


def pass_names() -> list[str]:
    """The pass list a build runs now, by name (what the manifest records and load compares)."""
    from fuser.passes import PASSES

    return [p.name for p in PASSES]


def cache_buffer_names(num_layers: int, bucket: int | None = None) -> list[str]:
    """get_attr targets of the KV cache in a step graph (`fuser.capture.StepModule`'s buffers),
    as built; with `bucket`, as stored for a bucket below the largest ("k_cache_0__b4")."""
    suffix = "" if bucket is None else f"__b{bucket}"
    return [f"{kv}_cache_{i}{suffix}" for i in range(num_layers) for kv in "kv"]


def table_buffer_name(bucket: int | None = None) -> str:
    """get_attr target of a paged cache's block table in a step graph, as built; with `bucket`,
    as stored for a bucket below the largest."""
    return "block_table" if bucket is None else f"block_table__b{bucket}"


def runtime_buffer_names(cache: KVCache, bucket: int | None = None) -> list[str]:
    """The KV cache's stored get_attr targets (`cache_buffer_names`, and a paged cache's
    table)."""
    names = cache_buffer_names(len(cache.k), bucket)
    return names + [table_buffer_name(bucket)] if cache.paged else names


class SavableEngine(Protocol):
    """What `save` reads of an Engine (fuser.engine.Engine is one)."""

    target: ModelSteps | None
    draft: ModelSteps | None
    buckets: dict[int, Any]  # batch size -> Bucket (its .target and .draft steps)
    tokenizer: Any
    user_target: Any
    config: FuserConfig
    device: torch.device
    dtype: torch.dtype
    gamma: int | str
    vocab_size: int
    compile_seconds: float
    step_costs: dict[int, dict[int, float]]
    _fallbacks: list[str]

    def report(self) -> Any: ...


class DetachedModel:
    """Stands in for the Hugging Face model of a loaded engine, which has none.

    Carries the generation config (`generate` reads eos/pad ids from it); running it raises.
    """

    def __init__(self, generation_config: object | None, source: str) -> None:
        self.generation_config = generation_config
        self.source = source

    def _absent(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"this engine was loaded from {self.source}: it has no Hugging Face "
                           "model to run eagerly (load the model and call fuser.optimize for that)")

    __call__ = generate = parameters = _absent


# -- save ---------------------------------------------------------------------------------------


def config_dict(config: FuserConfig) -> dict[str, Any]:
    """FuserConfig as JSON (device as a string)."""
    out = dataclasses.asdict(config)
    out["device"] = None if config.device is None else str(config.device)
    return out


def graph_key(kind: StepKind, bucket: int | None = None) -> str:
    """A step's file name in the engine directory: its kind's name and T (a model may have
    several verify steps, one per gamma), and the bucket unless it is the largest."""
    key = kind.name if kind.tokens is None else f"{kind.name}{kind.tokens}"
    return key if bucket is None else f"{key}.b{bucket}"


def model_buckets(engine: SavableEngine, role: str) -> dict[int, ModelSteps]:
    """Batch size -> the steps of `role` ("target", "draft") in that bucket."""
    out = {}
    for size, bucket in sorted(engine.buckets.items()):
        steps = getattr(bucket, role)
        if steps is not None:
            out[size] = steps
    if not out:  # no buckets (an engine built without them): the top steps alone
        steps = getattr(engine, role)
        if steps is not None:
            out[steps.cache.batch_size] = steps
    return out


def model_info(buckets: dict[int, ModelSteps]) -> dict[str, Any]:
    """What load needs to rebuild a model's steps in every bucket around loaded graphs: cache
    shape, step kinds, and per stored graph its bucket, kind and whether it was compiled."""
    top = max(buckets)
    steps = buckets[top]
    cache = steps.cache
    _, slots, kv_heads, head_dim = cache.k[0].shape  # [B, S, kv_heads, D] (paged: the pool)
    paged = {}
    if cache.paged:  # pool [num_blocks, PAGE, kv_heads, D], table [B, max_blocks]
        paged = {"block_size": cache.k[0].shape[1], "num_blocks": cache.num_blocks}
        slots = cache.slots
    graphs = {}
    for size, bucket_steps in buckets.items():
        for kind, g in bucket_steps.steps.items():
            graphs[graph_key(kind, None if size == top else size)] = {
                "name": g.name, "bucket": size, "matches": g.matches, "fused_ops": g.fused_ops,
                "compiled": g.compiled is not None}
    return {
        "kinds": [[k.name, k.tokens] for k in steps.steps],
        "batch": cache.batch_size, "slots": slots, "layers": len(cache.k),
        "kv_heads": kv_heads, "head_dim": head_dim,
        "cache_dtype": str(cache.k[0].dtype).removeprefix("torch."),
        **paged,
        "vocab_size": steps.vocab_size,
        "buckets": sorted(buckets),
        "graphs": graphs,
        "fallbacks": list(steps.fallbacks),
    }


def savable_models(engine: SavableEngine) -> dict[str, dict[int, ModelSteps]]:
    """role -> batch size -> steps, refusing an engine with nothing compiled to save."""
    if engine.target is None:
        raise EngineFileError("this engine runs its target in eager Hugging Face PyTorch "
                              f"(fallbacks: {engine.report().fallbacks}); there is no compiled "
                              "graph to save")
    models = {role: model_buckets(engine, role) for role in ("target", "draft")}
    models = {role: buckets for role, buckets in models.items() if buckets}
    for buckets in models.values():
        for steps in buckets.values():
            for graph in steps.steps.values():
                if graph.rewritten is None:
                    raise EngineFileError(f"{graph.name} has no rewritten graph (it runs "
                                          "eagerly): cannot save it")
    return models


def renamed_buffers(gm: torch.fx.GraphModule, names: dict[str, str]) -> torch.fx.GraphModule:
    """A copy of `gm` whose get_attr targets in `names` read under their new names (the same
    tensors; the original module is left as it is)."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    attributes: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):  # (call_module: export's input guard)
            value = functools.reduce(getattr, node.target.split("."), gm)
            node.target = names.get(node.target, node.target)
            attributes[node.target] = value
    return torch.fx.GraphModule(attributes, graph, class_name="StoredStep")


def stored_graphs(role_buckets: dict[int, ModelSteps]) -> dict[str, torch.fx.GraphModule]:
    """Graph key -> the module to store: bucket b's graphs below the largest read their cache
    rows under the names of `cache_buffer_names(layers, b)`."""
    top = max(role_buckets)
    out = {}
    for size, steps in role_buckets.items():
        names = dict(zip(runtime_buffer_names(steps.cache),
                         runtime_buffer_names(steps.cache, size)))
        for kind, g in steps.steps.items():
            if size == top:
                out[graph_key(kind)] = g.rewritten
            else:
                out[graph_key(kind, size)] = renamed_buffers(g.rewritten, names)
    return out


def compiled_files(models: dict[str, dict[int, ModelSteps]], scratch: Path
                   ) -> dict[str, Path]:
    """`<role>/compiled/<graph key>.bin` -> the artifact written under `scratch`, for every
    step Inductor compiled."""
    files = {}
    for role, role_buckets in models.items():
        top = max(role_buckets)
        for size, steps in role_buckets.items():
            for kind, g in steps.steps.items():
                if g.compiled is None:
                    continue
                if not isinstance(g.compiled, CompiledStep) or g.compiled.artifact is None:
                    raise EngineFileError(f"{g.name} (bucket {size}) was compiled but has no "
                                          "compiled code to save (it never ran)")
                rel = f"{role}/{COMPILED_DIR}/{graph_key(kind, None if size == top else size)}.bin"
                path = scratch / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                g.compiled.save_artifact(path)
                files[rel] = path
                tuning = path.with_suffix(TUNING_SUFFIX)
                if g.compiled.save_tuning(tuning):
                    files[rel.removesuffix(".bin") + TUNING_SUFFIX] = tuning
    return files


def compiled_steps(models: dict[str, dict[int, ModelSteps]]) -> list[CompiledStep]:
    """Every compiled step of `models`, in every bucket."""
    return [g.compiled for buckets in models.values() for steps in buckets.values()
            for g in steps.steps.values() if isinstance(g.compiled, CompiledStep)]


def extra_files(engine: SavableEngine, models: dict[str, dict[int, ModelSteps]], scratch: Path
                ) -> dict[str, bytes | Path]:
    """Tokenizer, generation config and compiled code, as save_engine's `extra`."""
    extra: dict[str, bytes | Path] = {}
    if engine.tokenizer is not None:
        tokenizer_dir = scratch / TOKENIZER_DIR
        engine.tokenizer.save_pretrained(str(tokenizer_dir))
        for path in sorted(p for p in tokenizer_dir.rglob("*") if p.is_file()):
            extra[f"{TOKENIZER_DIR}/{path.relative_to(tokenizer_dir).as_posix()}"] = path
    generation_config = getattr(engine.user_target, "generation_config", None)
    if generation_config is not None:
        extra[GENERATION_CONFIG] = generation_config.to_json_string().encode()
    for name, role in ((DRAFT_CONFIG, "draft"), (TARGET_CONFIG, "target")):
        hf_config = model_hf_config(engine, role)
        if hf_config is not None:
            extra[name] = hf_config.to_json_string().encode()
    extra.update(compiled_files(models, scratch))
    extra.update(kernel_store.kernel_files([s.artifact for s in compiled_steps(models)],
                                           engine.device))
    return extra


def model_hf_config(engine: SavableEngine, role: str) -> object | None:
    """The Hugging Face config of the engine's `role` ("target" or "draft"): its module's (a
    built engine), else the one a loaded engine was given back (`engine.draft_config` /
    `engine.target_config`, set by runtime/distill.py's rebuild); None without."""
    kept = getattr(engine, f"{role}_config", None)
    if kept is not None:
        return kept
    for bucket in engine.buckets.values():
        steps = getattr(bucket, role)
        for graph in (steps.steps.values() if steps is not None else ()):
            config = getattr(getattr(graph.eager, "model", None), "config", None)
            if config is not None:
                return config
    return None


def save(engine: SavableEngine, path: str | Path, overwrite: bool = False,
         source: dict[str, str] | None = None) -> dict[str, Any]:
    """Write `engine` as an engine directory at `path` (atomically); returns the manifest.

    source: where the models came from (role -> model directory), recorded for `fuser bench`
    (its Hugging Face column) and `fuser inspect`.
    """
    models = savable_models(engine)
    graphs = {role: stored_graphs(role_buckets) for role, role_buckets in models.items()}
    runtime = {name for role_buckets in models.values() for size, steps in role_buckets.items()
               for name in runtime_buffer_names(steps.cache,
                                                None if size == max(role_buckets) else size)}
    infos = {role: model_info(role_buckets) for role, role_buckets in models.items()}
    info = {
        "engine": {"dtype": str(engine.dtype).removeprefix("torch."), "gamma": engine.gamma,
                   "vocab_size": engine.vocab_size,
                   "build_seconds": engine.compile_seconds,
                   "compile": "inductor" if any(g["compiled"] for i in infos.values()
                                                for g in i["graphs"].values()) else "fx",
                   "fallbacks": list(engine._fallbacks),
                   # the vector ISA the C++ kernels in kernels/ were built for (CPU)
                   "vector_isa": (kernel_store.vector_isa()
                                  if engine.device.type == "cpu" and compiled_steps(models)
                                  else None),
                   # gamma="auto": the iteration costs measured at build time, per bucket and
                   # gamma; a load reuses them (same device kind, the manifest checks)
                   # instead of timing every gamma again.
                   "step_costs": {str(b): {str(g): s for g, s in costs.items()}
                                  for b, costs in engine.step_costs.items()}},
        "models": infos,
        "source": dict(source or {}),
    }
    with tempfile.TemporaryDirectory() as scratch:
        return ef.save_engine(path, graphs, config=config_dict(engine.config),
                              device=engine.device, passes=pass_names(), runtime_buffers=runtime,
                              extra=extra_files(engine, models, Path(scratch)), info=info,
                              overwrite=overwrite)


# -- load ---------------------------------------------------------------------------------------


def resolve_device(manifest: dict[str, Any], device: str | torch.device | None) -> torch.device:
    """The device to load on: the one asked for, else the built device type; refuses CUDA
    engines where there is no CUDA device."""
    built = manifest["environment"]["device_type"]
    wanted = torch.device(device) if device is not None else torch.device(built)
    if wanted.type == "cuda" and not torch.cuda.is_available():
        raise EngineFileError(f"the engine was built for cuda ({manifest['environment']['gpu_name']}"
                              "), but this machine has no CUDA device")
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    return wanted


def allocate_caches(info: dict[str, Any], device: torch.device) -> dict[str, KVCache]:
    """A fresh KV cache per model, of the shapes the manifest records (paged: the draft
    shares the target's block table)."""
    caches: dict[str, KVCache] = {}
    for role in sorted(info["models"], key=lambda r: r != "target"):  # the target's first
        m = info["models"][role]
        table = caches["target"].block_table if role != "target" and "target" in caches else None
        caches[role] = KVCache.allocate(m["layers"], m["batch"], m["slots"], m["kv_heads"],
                                        m["head_dim"], getattr(torch, m["cache_dtype"]), device,
                                        m.get("block_size", 0), m.get("num_blocks", 0), table)
    return caches


def cache_buffers(info: dict[str, Any], caches: dict[str, KVCache]
                  ) -> dict[str, dict[str, torch.Tensor]]:
    """role -> stored buffer name -> tensor: the whole cache for the largest bucket's graphs,
    rows [:b] of it for bucket b's."""
    out = {}
    for role, cache in caches.items():
        buckets = info["models"][role].get("buckets", [cache.batch_size])
        out[role] = {}
        for size in buckets:
            rows = cache.rows(size)
            names = runtime_buffer_names(cache, None if size == max(buckets) else size)
            tensors = [t for pair in zip(rows.k, rows.v) for t in pair]
            out[role].update(zip(names, tensors + ([rows.block_table] if cache.paged else [])))
    return out


def no_eager(name: str, source: str) -> Callable[..., torch.Tensor]:
    """`StepGraph.eager` of a loaded step: there is no eager module to fall back to."""
    def step(*args: object) -> torch.Tensor:
        raise RuntimeError(f"{name} was loaded from {source}: it has no eager module")
    return step


def model_steps(role: str, info: dict[str, Any], cache: KVCache,
                graphs: dict[str, torch.fx.GraphModule], directory: Path,
                device: torch.device, code: dict[str, LoadedCode] | None = None
                ) -> dict[int, ModelSteps]:
    """Batch size -> the model's steps in that bucket, over the loaded rewritten graphs; each
    step compiled at build time comes back from its saved artifact (nothing is compiled), or
    from `code` (graph key -> its code, `load_all_code`'s) where given."""
    source = str(directory)
    buckets = info.get("buckets", [cache.batch_size])
    top = max(buckets)
    out = {}
    for size in buckets:
        steps = ModelSteps(role, cache.rows(size), info["vocab_size"],
                           fallbacks=info.get("fallbacks", []))
        for name, tokens in info["kinds"]:
            kind = StepKind(name, tokens)
            key = graph_key(kind, None if size == top else size)
            recorded = info["graphs"].get(key)
            if recorded is None or key not in graphs:
                raise EngineFileError(f"{directory}: {role} graph {key} is missing from the "
                                      "manifest")
            full = f"{role}.{name}"
            graph = StepGraph(full, kind, eager=no_eager(full, source), rewritten=graphs[key],
                              matches=dict(recorded["matches"]),
                              fused_ops=dict(recorded["fused_ops"]))
            if recorded["compiled"]:
                artifact, tuning = code_files(directory, role, key)
                loaded = (code or {}).get(key) or load_step_code(directory, role, key)
                graph.compiled = CompiledStep.from_artifact(graph.rewritten, artifact, device,
                                                            tuning, loaded=loaded)
            steps.steps[kind] = graph
        out[size] = steps
    return out


def code_files(directory: Path, role: str, key: str) -> tuple[Path, Path | None]:
    """(the compiled code of `role`'s graph `key`, its autotuning choices or None); refuses a
    missing code file."""
    artifact = directory / role / COMPILED_DIR / f"{key}.bin"
    if not artifact.is_file():
        raise EngineFileError(f"{directory}: the compiled code of {role} {key} "
                              f"({artifact.relative_to(directory)}) is missing")
    tuning = artifact.with_suffix(TUNING_SUFFIX)
    return artifact, tuning if tuning.is_file() else None


def load_step_code(directory: Path, role: str, key: str) -> LoadedCode:
    """The compiled code of `role`'s graph `key` loaded (`fuser.compile.load_code`); code this
    torch cannot load is refused, never compiled instead."""
    artifact, tuning = code_files(directory, role, key)
    try:
        return load_code(artifact, tuning)
    except Exception as e:  # noqa: BLE001 -- never compile instead: refuse
        raise EngineFileError(
            f"{directory}: the compiled code of {role} {key} cannot be loaded by "
            f"this torch ({type(e).__name__}: {str(e)[:200]}); rebuild the engine "
            "here (fuser build)") from e


@dataclasses.dataclass
class CodeLoad:
    """What `load_all_code` did: every compiled graph's code (role -> graph key -> code), the
    kernel binaries it put in the caches, its seconds, and its kernel work (profiled loads)."""

    code: dict[str, dict[str, LoadedCode]]
    seeded: int
    seconds: float
    work: str | None = None
    python: str | None = None  # profiled loads: where its Python seconds went (cProfile)
    alone: bool = False  # it ran before the reading, nothing beside it (profiled for Python)


def load_all_code(directory: Path, manifest: dict[str, Any], device: torch.device,
                  profile: bool, alone: bool = False) -> CodeLoad:
    """Put the engine's kernel binaries in Triton's and Inductor's caches and load the code
    of every graph compiled at build time: what needs none of the weights, so a load runs it
    on a thread while they are read (Inductor imported on that thread first). alone: it runs
    before the reading, nothing beside it, and profiles its Python (`python_profile`)."""
    start = time.perf_counter()
    code: dict[str, dict[str, LoadedCode]] = {}
    with load_profile.python_profile(alone) as python:
        import_inductor()
        info = manifest["info"]
        on_device = torch.cuda.device(device) if device.type == "cuda" \
            else contextlib.nullcontext()
        with on_device:
            kernel_store.settle_triton_toolchain(device)  # as the build did: the kernels' keys
            seeded = kernel_store.seed(directory, manifest["extra"], device)
            with kernel_store.loading(device, True), \
                    load_profile.kernel_work(device, profile) as work:
                if device.type == "cpu":
                    kernel_store.check_isa(info["engine"].get("vector_isa"), directory)
                for role, model in info["models"].items():
                    code[role] = {key: load_step_code(directory, role, key)
                                  for key, g in model["graphs"].items() if g["compiled"]}
    return CodeLoad(code, seeded, time.perf_counter() - start,
                    work.line() if work is not None else None, python[0] if python else None,
                    alone)


def import_inductor() -> None:
    """Import what loading a compiled step's artifact needs of Inductor (on the code's thread,
    while the weights are read: `load_all_code`; a failure shows where the artifacts load)."""
    import importlib

    for module in ("torch._inductor.standalone_compile", "torch._inductor.codecache",
                   "torch._inductor.output_code"):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 -- the load's own import reports it
            return


class TokenizerError(ValueError):
    """A tokenizer directory given in place of an engine's own (`fuser.load(tokenizer=...)`)
    that transformers cannot load; the message names the directory."""


def load_extras(directory: Path, tokenizer_dir: str | Path | None = None
                ) -> tuple[object | None, object | None]:
    """(tokenizer, generation config) stored in engine `directory`, None where absent;
    `tokenizer_dir`: a tokenizer directory loaded in place of the stored tokenizer (refused
    with TokenizerError)."""
    tokenizer = generation_config = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{tokenizer_dir}: cannot load a tokenizer ({e})") from None
    elif (directory / TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / TOKENIZER_DIR))
    if (directory / GENERATION_CONFIG).is_file():
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(str(directory))
    return tokenizer, generation_config


@dataclasses.dataclass
class EngineParts:
    """What `open_engine` read: everything an Engine over the saved steps is made of."""

    manifest: dict[str, Any]
    device: torch.device
    config: FuserConfig
    models: dict[str, dict[int, ModelSteps]]  # role -> batch size -> steps
    user_target: DetachedModel
    tokenizer: object | None
    step_costs: dict[int, dict[int, float]]  # bucket -> gamma -> seconds, measured at build
    # seconds of each part of the load, one after another: "read" (manifest, weights, graphs,
    # hashes), "code" (what the code's loading beside the read took longer, and the steps put
    # together), "first_run" (CUDA: each step once)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def gammas(self) -> tuple[int, ...]:
        """The draft lengths with stored verify steps (none without a draft; the suffix
        index's long verify steps, FuserConfig.long_suffix_gammas, are not the draft's)."""
        if "draft" not in self.models:
            return ()
        target = self.models["target"][max(self.models["target"])]
        return tuple(sorted(k.tokens - 1 for k in target.steps if k.name == "verify"
                            and k.tokens - 1 not in self.config.long_suffix_gammas))


def open_engine(path: str | Path, device: str | torch.device | None = None, *,
                log: Log | None = None, tokenizer: str | Path | None = None) -> EngineParts:
    """Read the engine directory at `path` onto `device`: its steps in every bucket (compiled
    ones from their artifacts), config, tokenizer and measured costs. Runs no capture, pass,
    Dynamo or Inductor compilation.

    Refuses (EngineFileError, a ValueError) an engine built elsewhere (versions, device, GPU,
    passes or kernel sources) or a missing, truncated, altered or half-written file, naming
    what differs. `log` receives a line per long step. `tokenizer`: a tokenizer directory
    loaded in place of the engine's own (TokenizerError if it cannot be), beside the reading
    as the engine's own would be.
    """
    say = log or (lambda message: None)
    directory = Path(path)
    manifest = ef.read_manifest(directory)
    device = resolve_device(manifest, device)
    ef.check_environment(manifest["environment"], ef.environment(device))
    info = manifest["info"]
    any_compiled = any(g["compiled"] for m in info["models"].values()
                       for g in m["graphs"].values())
    # The tokenizer (transformers' import: seconds) loads on a thread meanwhile, and so does
    # the compiled steps' code (Inductor's import first), which needs no weight: the weights'
    # reading leaves the interpreter mostly free.
    # Profiled for its Python (FUSER_LOAD_PROFILE=python), the code load runs alone first:
    # from Python 3.12 cProfile hears every thread, so beside the reading its profile would be
    # the reading's as much as its own.
    alone = any_compiled and load_profile.python_enabled()
    code: Future | None = None
    if alone:
        code = Future()
        code.set_result(load_all_code(directory, manifest, device, True, alone=True))
    extras = ThreadPoolExecutor(3, thread_name_prefix="fuser-load-extras")
    extras_loaded = extras.submit(load_extras, directory, tokenizer)
    extras.submit(kernel_store.prime_triton_key, device)  # (its first lookup's 0.4 s)
    if any_compiled and not alone:
        code = extras.submit(load_all_code, directory, manifest, device, load_profile.enabled())
    extras.shutdown(wait=False)
    try:
        return _open_engine(directory, device, manifest, code, extras_loaded, say)
    except BaseException:
        # A refused load leaves no import half done on the threads: the caller may import
        # transformers next (`fuser demo` rebuilds), and a module another thread is still
        # importing reads as a partly initialised one ("cannot import name ...").
        extras.shutdown(wait=True)
        raise


def _open_engine(directory: Path, device: torch.device, manifest: dict,
                 code_loading: Future | None, extras_loaded: Future, say: Log) -> EngineParts:
    """`open_engine` once its threads run: the weights read, the code (loading on a thread
    where steps were compiled) and steps put together, each step run once (CUDA)."""
    info = manifest["info"]
    any_compiled = code_loading is not None
    timings: dict[str, float] = {}
    start = time.perf_counter()
    caches = allocate_caches(info, device)
    say(f"checking and reading {directory} ...")
    try:
        loaded = ef.load_engine(directory, device, passes=pass_names(),
                                buffers=cache_buffers(info, caches), log=say)
    except BaseException:
        if code_loading is not None:
            code_loading.exception()  # its thread done (its failure, if any, explains less)
        raise
    timings["read"] = time.perf_counter() - start
    start = time.perf_counter()
    if code_loading is not None:  # the code loaded beside the reading
        code = code_loading.result()
    else:  # an engine of FX graphs: its Triton kernels' binaries alone, now
        kernel_store.settle_triton_toolchain(device)  # as the build did: the kernels' keys
        code = CodeLoad({}, kernel_store.seed(directory, manifest["extra"], device), 0.0)
    waited = time.perf_counter() - start
    models = {role: model_steps(role, info["models"][role], caches[role],
                                loaded.graphs[role], directory, device, code.code.get(role))
              for role in loaded.graphs}
    compiled = sum(g.compiled is not None for buckets in models.values()
                   for steps in buckets.values() for g in steps.steps.values())
    timings["code"] = time.perf_counter() - start  # what the read did not hide
    if code.alone:
        say(f"loaded the compiled code of {compiled} steps in {code.seconds:.1f} s before the "
            f"reading, alone to profile it ({code.seeded} kernel binaries put in the caches)")
    else:
        say(f"loaded the compiled code of {compiled} steps in {code.seconds:.1f} s beside the "
            f"reading, {waited:.1f} s of it after ({code.seeded} kernel binaries put in the "
            "caches)")
    if code.work is not None:
        say(f"kernel work in the code load: {code.work}")
    if code.python is not None:
        say(f"code load, Python: {code.python}")
    # (A tensor-parallel rank's steps run collectives: its first runs wait for the
    # process group, fuser/pipeline.py `_load_parallel`.)
    if device.type == "cuda" and manifest["config"].get("tensor_parallel", 1) == 1:
        # The fused ops' Triton kernels load (from Triton's cache, seeded above) on their
        # first launch: now, not in the first request. Smaller buckets launch the same
        # kernels.
        detail = load_profile.enabled()
        start = time.perf_counter()
        steps_timed = load_profile.StepTimes(device, again=detail)
        with kernel_store.loading(device, any_compiled), \
                load_profile.kernel_work(device, detail) as run_work:
            for role_buckets in models.values():
                warm_up(role_buckets[max(role_buckets)], steps_timed)
        timings["first_run"] = time.perf_counter() - start
        say(f"ran every step once in {timings['first_run']:.1f} s")
        say(steps_timed.line("first run by step:"))
        if run_work is not None:
            say(f"kernel work in the first run: {run_work.line()}")
    # JSON gave lists where the config holds tuples (gamma_candidates, batch_buckets).
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["config"].items()}
    config = FuserConfig(**{**saved, "device": str(device)})
    tokenizer, generation_config = extras_loaded.result()
    costs = {int(b): {int(g): float(s) for g, s in by_gamma.items()}
             for b, by_gamma in info["engine"].get("step_costs", {}).items()}
    return EngineParts(manifest, device, config, models,
                       DetachedModel(generation_config, str(directory)), tokenizer, costs,
                       timings)


__all__ = ["DetachedModel", "EngineFileError", "EngineParts", "SavableEngine", "TokenizerError",
           "open_engine", "save"]
