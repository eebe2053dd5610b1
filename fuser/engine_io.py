"""`engine.save(path)` and `fuser.load(path)`: an Engine to an engine directory and back.

The directory format (manifest, weights, JSON graphs, atomic writes, refusals) is
`fuser/engine_file.py`'s; this module decides what of an Engine goes in it and how a loaded one
is put back together:

- every rewritten step graph of the target and the draft (each model's tensors once: merged
  weights, and whatever a pass registered on the graph, e.g. FP8 weights and their scales);
- the KV cache is not saved: its shapes are in the manifest (`info.models`), and load allocates
  a fresh cache and attaches it to every graph of its model;
- the tokenizer (`tokenizer/`), the generation config (eos/pad ids used by `generate`), and, when
  steps were compiled by Inductor, the compile-cache artifacts (`compile_cache.bin`).

A loaded engine has no Hugging Face model: `Engine.user_target` is a `DetachedModel` that carries
the generation config and raises a clear error if anything tries to run it. Loading runs
neither `torch.export` nor the passes; with Inductor steps it installs the saved compile cache
before `torch.compile` so Inductor finds its code instead of generating it again.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fuser import engine_file as ef
from fuser.build import compile_step, warm_up
from fuser.config import FuserConfig
from fuser.engine import Engine
from fuser.engine_file import EngineFileError
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import ModelSteps, StepGraph, StepKind

TOKENIZER_DIR = "tokenizer"
GENERATION_CONFIG = "generation_config.json"
COMPILE_CACHE = "compile_cache.bin"
Log = Callable[[str], None]


def stderr_log(message: str) -> None:
    """Progress line on stderr (the CLI's default for long steps)."""
    print(f"fuser: {message}", file=sys.stderr, flush=True)


def pass_names() -> list[str]:
    """The pass list a build runs now, by name (what the manifest records and load compares)."""
    from fuser.passes import PASSES

    return [p.name for p in PASSES]


def cache_buffer_names(num_layers: int) -> list[str]:
    """get_attr targets of the KV cache in a step graph (`fuser.capture.StepModule`'s buffers)."""
    return [f"{kv}_cache_{i}" for i in range(num_layers) for kv in "kv"]


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


def graph_key(kind: StepKind) -> str:
    """A step's file name in the engine directory: its kind's name and T (a model may have
    several verify steps, one per gamma)."""
    return kind.name if kind.tokens is None else f"{kind.name}{kind.tokens}"


def model_info(steps: ModelSteps) -> dict[str, Any]:
    """What load needs to rebuild `steps` around loaded graphs: cache shape and step kinds."""
    cache = steps.cache
    _, slots, kv_heads, head_dim = cache.k[0].shape  # [B, S, kv_heads, D]
    return {
        "kinds": [[k.name, k.tokens] for k in steps.steps],
        "batch": cache.batch_size, "slots": slots, "layers": len(cache.k),
        "kv_heads": kv_heads, "head_dim": head_dim,
        "cache_dtype": str(cache.k[0].dtype).removeprefix("torch."),
        "vocab_size": steps.vocab_size,
        "graphs": {g.name: {"matches": g.matches, "fused_ops": g.fused_ops,
                            "compiled": g.compiled is not None} for g in steps.steps.values()},
        "fallbacks": list(steps.fallbacks),
    }


def savable_models(engine: Engine) -> dict[str, ModelSteps]:
    """role -> steps, refusing an engine with nothing compiled to save."""
    if engine.target is None:
        raise EngineFileError("this engine runs its target in eager Hugging Face PyTorch "
                              f"(fallbacks: {engine.report().fallbacks}); there is no compiled "
                              "graph to save")
    models = {"target": engine.target}
    if engine.draft is not None:
        models["draft"] = engine.draft
    for steps in models.values():
        for graph in steps.steps.values():
            if graph.rewritten is None:
                raise EngineFileError(f"{graph.name} has no rewritten graph (it runs eagerly): "
                                      "cannot save it")
    return models


def extra_files(engine: Engine, scratch: Path) -> dict[str, bytes | Path]:
    """Tokenizer, generation config and compile cache, as save_engine's `extra`."""
    extra: dict[str, bytes | Path] = {}
    if engine.tokenizer is not None:
        engine.tokenizer.save_pretrained(str(scratch))
        for path in sorted(p for p in scratch.rglob("*") if p.is_file()):
            extra[f"{TOKENIZER_DIR}/{path.relative_to(scratch).as_posix()}"] = path
    generation_config = getattr(engine.user_target, "generation_config", None)
    if generation_config is not None:
        extra[GENERATION_CONFIG] = generation_config.to_json_string().encode()
    compiled = any(g.compiled is not None for m in (engine.target, engine.draft) if m is not None
                   for g in m.steps.values())
    if compiled:
        blob = ef.compile_cache_bytes()
        if blob is None:
            raise EngineFileError("the engine's steps were compiled by Inductor but this process "
                                  "has no compile-cache artifacts to save")
        extra[COMPILE_CACHE] = blob
    return extra


def save(engine: Engine, path: str | Path, overwrite: bool = False,
         source: dict[str, str] | None = None) -> dict[str, Any]:
    """Write `engine` as an engine directory at `path` (atomically); returns the manifest.

    source: where the models came from (role -> model directory), recorded for `fuser bench`
    (its Hugging Face column) and `fuser inspect`.
    """
    models = savable_models(engine)
    graphs = {role: {graph_key(kind): g.rewritten for kind, g in steps.steps.items()}
              for role, steps in models.items()}
    runtime = {name for steps in models.values() for name in cache_buffer_names(len(steps.cache.k))}
    info = {
        "engine": {"dtype": str(engine.dtype).removeprefix("torch."), "gamma": engine.gamma,
                   "vocab_size": engine.vocab_size,
                   "build_seconds": engine.compile_seconds,
                   "compile": "inductor" if any(i["compiled"] for m in models.values()
                                                for i in model_info(m)["graphs"].values())
                   else "fx",
                   "fallbacks": list(engine._fallbacks),
                   # gamma="auto": the iteration costs measured at build time, per gamma, of the
                   # bucket the file keeps (max_batch_size); a load reuses them (same device
                   # kind, the manifest checks) instead of timing every gamma again.
                   "step_costs": {str(g): s for g, s in
                                  engine.step_costs.get(engine.config.max_batch_size, {}).items()}},
        "models": {role: model_info(steps) for role, steps in models.items()},
        "source": dict(source or {}),
    }
    with tempfile.TemporaryDirectory() as scratch:
        return ef.save_engine(path, graphs, config=config_dict(engine.config),
                              device=engine.device, passes=pass_names(), runtime_buffers=runtime,
                              extra=extra_files(engine, Path(scratch)), info=info,
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
    """A fresh KV cache per model, of the shapes the manifest records."""
    caches = {}
    for role, m in info["models"].items():
        caches[role] = KVCache.allocate(m["layers"], m["batch"], m["slots"], m["kv_heads"],
                                        m["head_dim"], getattr(torch, m["cache_dtype"]), device)
    return caches


def no_eager(name: str, source: str) -> Callable[..., torch.Tensor]:
    """`StepGraph.eager` of a loaded step: there is no eager module to fall back to."""
    def step(*args: object) -> torch.Tensor:
        raise RuntimeError(f"{name} was loaded from {source}: it has no eager module")
    return step


def model_steps(role: str, info: dict[str, Any], cache: KVCache,
                graphs: dict[str, torch.fx.GraphModule], source: str) -> ModelSteps:
    """ModelSteps over loaded rewritten graphs (not compiled yet)."""
    steps = ModelSteps(role, cache, info["vocab_size"], fallbacks=info.get("fallbacks", []))
    for name, tokens in info["kinds"]:
        kind = StepKind(name, tokens)
        full = f"{role}.{name}"
        recorded = info["graphs"].get(full, {})
        steps.steps[kind] = StepGraph(full, kind, eager=no_eager(full, source),
                                      rewritten=graphs[graph_key(kind)],
                                      matches=dict(recorded.get("matches", {})),
                                      fused_ops=dict(recorded.get("fused_ops", {})))
    return steps


def compile_steps(steps: ModelSteps, info: dict[str, Any], device: torch.device) -> None:
    """Compile the steps that were compiled at build time (fixed T, Inductor) as the build did
    (`fuser.build.compile_step`)."""
    for graph in steps.steps.values():
        if info["graphs"].get(graph.name, {}).get("compiled"):
            graph.compiled = compile_step(graph.rewritten, device)


def load_extras(directory: Path) -> tuple[object | None, object | None]:
    """(tokenizer, generation config) stored in engine `directory`, None where absent."""
    tokenizer = generation_config = None
    if (directory / TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / TOKENIZER_DIR))
    if (directory / GENERATION_CONFIG).is_file():
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(str(directory))
    return tokenizer, generation_config


def load(path: str | Path, device: str | torch.device | None = None, *,
         log: Log | None = None) -> Engine:
    """The Engine saved at `path`, without capture, passes or code generation.

    Refuses (EngineFileError, a ValueError) an engine built elsewhere (versions, device, GPU,
    passes or kernel sources) or a missing, truncated, altered or half-written file, naming
    what differs. `log` receives a line per long step.
    """
    say = log or (lambda message: None)
    start = time.perf_counter()
    directory = Path(path)
    manifest = ef.read_manifest(directory)
    device = resolve_device(manifest, device)
    ef.check_environment(manifest["environment"], ef.environment(device))
    info = manifest["info"]
    caches = allocate_caches(info, device)
    buffers = {role: dict(zip(cache_buffer_names(len(c.k)), [t for pair in zip(c.k, c.v) for t in pair]))
               for role, c in caches.items()}
    say(f"checking and reading {directory} ...")
    loaded = ef.load_engine(directory, device, passes=pass_names(), buffers=buffers)
    source = str(directory)
    models = {role: model_steps(role, info["models"][role], caches[role], loaded.graphs[role], source)
              for role in loaded.graphs}
    if info["engine"]["compile"] == "inductor":
        cache_file = directory / COMPILE_CACHE
        ef.install_compile_cache(cache_file.read_bytes())
        say("compiling the fixed-T steps from the saved compile cache ...")
        for role, steps in models.items():
            compile_steps(steps, info["models"][role], device)
    if info["engine"]["compile"] == "inductor" or device.type == "cuda":
        for steps in models.values():  # compile now (from the cache), not in the first request
            warm_up(steps)
    # JSON gave lists where the config holds tuples (gamma_candidates, batch_buckets).
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["config"].items()}
    config = FuserConfig(**{**saved, "device": str(device)})
    tokenizer, generation_config = load_extras(directory)
    engine_info = info["engine"]
    engine = Engine(models["target"], models.get("draft"), config=config,
                    user_target=DetachedModel(generation_config, source),
                    tokenizer=tokenizer, device=device, dtype=getattr(torch, engine_info["dtype"]),
                    vocab_size=engine_info["vocab_size"], gamma=engine_info["gamma"],
                    fallbacks=engine_info.get("fallbacks", []),
                    compile_seconds=time.perf_counter() - start,  # no build: the load
                    gammas=tuple(sorted(k.tokens - 1 for k in models["target"].steps
                                        if k.name == "verify")) if "draft" in models else ())
    # One bucket (the saved max_batch_size); its whole-step CUDA graphs and, with
    # gamma="auto", its measured costs, as at build time.
    costs = {int(g): float(s) for g, s in engine_info.get("step_costs", {}).items()}
    engine.prepare(progress=say, known_costs={config.max_batch_size: costs} if costs else None)
    engine.compile_seconds = time.perf_counter() - start
    engine.load_seconds = engine.compile_seconds
    engine.manifest = manifest
    say(f"loaded in {engine.load_seconds:.1f} s")
    return engine


__all__ = ["DetachedModel", "EngineFileError", "load", "save"]
