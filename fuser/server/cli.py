"""`fuser serve PATH [...]`: the OpenAI-compatible server (API.md, Serving).

The order of a launch: bind the port (a port in use is one line, before any loading), answer
/health 503 while the engine loads (an engine directory: `fuser.load`, no compiling) or builds
(a model directory, with progress), start the scheduler, warm it up with one greedy and one
sampled request, then serve: /health 200 and `fuser serve: ready at URL (model NAME)` on
stdout. SIGTERM (or Ctrl-C) drains: /health and new requests answer 503, the running and
waiting requests finish within --drain-timeout seconds (those still running then are aborted),
and the process exits 0. A second signal aborts what still runs at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from fuser.bytecode import uncached_modules

DEFAULT_MODEL_BATCH = 8  # --max-batch-size for a model directory
PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16", "fp8")  # FuserConfig.precision
DEFAULT_BLOCK_SIZE = 16  # --block-size: slots per KV block (vLLM's default)
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # --gpu-memory-fraction (vLLM's gpu_memory_utilization)
# --max-num-batched-tokens: decode and prompt tokens an iteration of a paged server runs. The
# prompt chunk runs as a graph of its own beside the decode step (queued ahead of the read-back
# with it, as steps are), so the chunk's length is what an iteration's time (the running rows'
# ITL) grows by: 512 would bound it to a few ms on an 8B model and still take 4 prompts of 128
# tokens at once beside 64 decoding rows. Off (0) until a GPU run shows it pays against
# whole-prompt admission (docs/paged-kv.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 0
WARM_UP_SECONDS = 600.0
# --precapture-seconds: after /health, idle time spent capturing the likeliest prefill and
# chunk graphs (runtime/idle_capture.py; 120-250 ms each at the 8B shape, the likeliest first).
DEFAULT_PRECAPTURE_SECONDS = 30.0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `fuser` command's subparsers."""
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serve PATH over HTTP: POST /v1/completions and /v1/chat/completions "
                    "(OpenAI's shapes, streaming by server-sent events), GET /v1/models, "
                    "/health and /metrics (Prometheus). Needs the serve extra: "
                    "pip install 'fuser[serve]'.")
    serve.add_argument("path", help="an engine directory (loaded, no compiling: the fast start) "
                                    "or a model directory (built first, with progress)")
    serve.add_argument("--draft", default=None,
                       help="a draft model directory for speculative decoding; with a model "
                            "directory only (an engine directory has its draft built in)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default: %(default)s, this machine only; "
                            "0.0.0.0 listens on every interface)")
    serve.add_argument("--port", type=int, default=8000,
                       help="the TCP port (default: %(default)s; 0 picks a free one, printed)")
    serve.add_argument("--max-batch-size", type=int, default=None,
                       help="requests decoded together (the engine's KV-cache rows) when building "
                            f"from a model directory (default: {DEFAULT_MODEL_BATCH}); an engine "
                            "directory keeps the size it was built for")
    serve.add_argument("--max-seq-len", type=int, default=2048,
                       help="most tokens per request, prompt plus completion, when building from "
                            "a model directory (default: %(default)s)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests that may wait for a free row; beyond it requests answer "
                            "429 (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (401 without it); "
                            "/health and /metrics stay open (default: no key)")
    serve.add_argument("--precision", default=None, choices=list(PRECISION_CHOICES),
                       help="the weights' precision when building from a model directory: auto "
                            "(the model's dtype), fp32, bf16, fp16 or fp8 (FP8 weights, "
                            "per-channel scales) (default: auto); an engine directory has its "
                            "own, and a different one is refused")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: PATH's directory name)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds the running requests get to finish before they "
                            "are aborted (default: %(default)s)")
    serve.add_argument("--adapt-draft", dest="adapt_draft", action="store_true", default=False,
                       help="turn adaptive speculation on: suffix proposals from the requests' "
                            "own context and recent outputs, and online distillation of the "
                            "draft on the served traffic (default: off, plain continuous "
                            "batching with the engine's speculation)")
    serve.add_argument("--no-adapt-draft", dest="adapt_draft", action="store_false",
                       help="adaptive speculation off: the default (kept so that older "
                            "command lines still work)")
    serve.add_argument("--distill-every", type=int, default=None,
                       help="with --adapt-draft: finished requests between two draft updates "
                            f"(default: {_config_default('distill_every')})")
    serve.add_argument("--distill-budget-s", type=float, default=None,
                       help="with --adapt-draft: at most this many seconds of work per "
                            "draft update (labelling, fine-tuning, held-out evaluation), at "
                            "5%% of the wall clock while requests run "
                            f"(default: {_config_default('distill_budget_s')})")
    add_kv_cache_arguments(serve)
    serve.add_argument("--tokenizer", default=None,
                       help="a tokenizer directory for an engine saved without one")
    serve.add_argument("--log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: %(default)s)")
    serve.add_argument("--threads", type=int, default=None,
                       help="intra-op CPU threads (default without CUDA: 1, or OMP_NUM_THREADS "
                            "when set)")
    serve.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="processes (one per GPU; gloo processes on the CPU) the target is "
                            "sharded over, rank 0 serving (default: 1, or the engine "
                            "directory's own)")
    serve.set_defaults(fn=run_serve)
    return serve


def add_kv_cache_arguments(serve: argparse.ArgumentParser) -> None:
    """The paged KV cache's flags (a model directory's build; an engine directory keeps the
    cache it was built with)."""
    serve.add_argument("--block-size", type=int, default=None,
                       help=f"slots per block of the paged KV cache (default: "
                            f"{DEFAULT_BLOCK_SIZE}; with --tensor-parallel-size above 1: 0, "
                            "until a paged cache under tensor parallelism has run on GPUs); "
                            "0: a contiguous cache of max-batch-size x max-seq-len slots")
    serve.add_argument("--gpu-memory-fraction", type=float, default=None,
                       help="on CUDA, the fraction of the GPU memory free once the weights are "
                            "loaded that the paged KV cache takes (default: "
                            f"{DEFAULT_GPU_MEMORY_FRACTION}); on the CPU the pool holds every "
                            "row at max-seq-len")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       default=True,
                       help="do not share the KV blocks of common prompt prefixes between "
                            "requests (default: shared, on a paged cache)")
    serve.add_argument("--max-num-batched-tokens", type=int,
                       default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                       help="on a paged cache, prefill new prompts in chunks between decode "
                            "steps, each iteration at most this many decode and prompt tokens, "
                            "so running requests get a token every iteration (e.g. 512); 0 "
                            "(default, until measured on a GPU): each prompt whole at "
                            "admission while running requests wait (a contiguous cache, "
                            "always)")
    serve.add_argument("--admission-wait-ms", type=float, default=None,
                       help="the longest a waiting request is held back so that requests "
                            "arriving close together share one prefill (default: two decode "
                            "steps, as measured; a quarter of the rows waiting, or the rows "
                            "filled on an idle server, admits at once); 0: at once")
    serve.add_argument("--admission-quiet-ms", type=float, default=None,
                       help="on an idle server, the pause in arrivals that ends a burst of "
                            "requests admitted together (default: 2; while requests arrive "
                            "one at a time, each is admitted at once)")
    serve.add_argument("--precapture-seconds", type=float, default=DEFAULT_PRECAPTURE_SECONDS,
                       help="after /health, spend at most this many seconds of idle time "
                            "capturing the likeliest prefill and chunk CUDA graphs (prompts "
                            "up to 512 tokens, alone and in bursts); a request that arrives "
                            "waits for at most the capture under way. Shapes requests meet "
                            "are captured in idle time anyway, never on a request's path "
                            f"(default: {DEFAULT_PRECAPTURE_SECONDS:g}; 0: off)")


def kv_cache_config(args: argparse.Namespace) -> dict[str, object]:
    """FuserConfig fields of the KV cache flags (a model directory's build)."""
    block = block_size(args)
    if not block:
        return {}
    fraction = getattr(args, "gpu_memory_fraction", None)
    return dict(kv_block_size=block, kv_memory_fraction=DEFAULT_GPU_MEMORY_FRACTION
                if fraction is None else fraction)


def block_size(args: argparse.Namespace) -> int:
    """--block-size, or its default: 16, contiguous (0) under tensor parallelism (a paged cache
    is sharded too, with --block-size; it becomes the default once it has run on GPUs)."""
    block = getattr(args, "block_size", None)
    if block is None:
        return 0 if (getattr(args, "tensor_parallel_size", None) or 1) > 1 else \
            DEFAULT_BLOCK_SIZE
    return block


def _config_default(name: str) -> object:
    """FuserConfig's default of one field (the flags' defaults are the config's)."""
    import dataclasses

    from fuser.config import FuserConfig

    return next(f.default for f in dataclasses.fields(FuserConfig) if f.name == name)


def say(message: str) -> None:
    print(message, flush=True)


def progress(message: str) -> None:
    print(f"fuser serve: {message}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> None:
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            raise ValueError(f"fuser serve needs {module}: pip install 'fuser[serve]'") from None
    if not Path(args.path).is_dir():
        raise ValueError(f"{args.path}: no such directory (expected an engine directory or a "
                         "model directory)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 0..65535")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size {args.max_batch_size} must be at least 1")
    if args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len {args.max_seq_len} must be at least 2")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting} must be at least 0")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout} must be at least 0")
    tensor_parallel = getattr(args, "tensor_parallel_size", None)
    if tensor_parallel is not None and tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel} must be at least 1")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if block_size(args) < 0:
        raise ValueError(f"--block-size {args.block_size} must be at least 0 (0: contiguous)")
    for flag in ("admission_wait_ms", "admission_quiet_ms", "precapture_seconds"):
        value = getattr(args, flag, None)
        if value is not None and not value >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value:g} must be at least 0")
    if getattr(args, "max_num_batched_tokens", 0) < 0:
        raise ValueError(f"--max-num-batched-tokens {args.max_num_batched_tokens} must be at "
                         "least 0 (0: whole prompts)")
    fraction = getattr(args, "gpu_memory_fraction", None)
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction {fraction:g} must be in (0, 1]")
    if fraction is not None and not block_size(args):
        raise ValueError("--gpu-memory-fraction sizes the paged KV cache: not with "
                         "--block-size 0")
    for flag, value in (("--distill-every", args.distill_every),
                        ("--distill-budget-s", args.distill_budget_s)):
        if value is None:
            continue
        if not args.adapt_draft:
            raise ValueError(f"{flag} applies with --adapt-draft only (adaptation is off by "
                             "default)")
        if not value > 0:
            raise ValueError(f"{flag} {value:g} must be greater than 0")


def open_engine(args: argparse.Namespace, cold: ColdStart | None = None) -> Any:
    """The engine of PATH: loaded from an engine directory, or built from a model directory.
    `cold` gets the imports, and the load's parts (or the build) marked."""
    import fuser
    from fuser.launch import build_engine_from_args, command_line_buckets, is_engine_dir

    cold = cold or ColdStart()
    cold.mark("imports")
    if is_engine_dir(args.path):
        if args.draft is not None:
            raise ValueError(f"{args.path} is an engine directory: its draft is built in "
                             "(--draft applies to model directories)")
        check_engine_precision(args.path, getattr(args, "precision", None))
        progress(f"loading the engine {args.path} ...")
        engine = load_engine_dir(args)
        behind = [s for s, status in engine.graphs_status.items() if status != "ready"]
        parts = {("capture (bucket 1)" if k == "capture" and behind else LOAD_PARTS[k]): v
                 for k, v in engine.load_timings.items() if k in LOAD_PARTS}
        cold.split("load", parts)
        if behind:
            cold.note(f"batch buckets {behind} capture in the background (a line says when they "
                      "are done); until then their steps run in a captured larger bucket or "
                      "uncaptured")
        rows = engine.config.max_batch_size
        if args.max_batch_size is not None and args.max_batch_size != rows:
            plural = "" if rows == 1 else "s"
            raise ValueError(f"--max-batch-size {args.max_batch_size}: the engine {args.path} was "
                             f"built for {rows} row{plural} (rebuild it with fuser build "
                             f"--max-batch-size {args.max_batch_size})")
        if 1 not in engine.buckets:
            raise ValueError(f"the engine {args.path} holds batch bucket(s) "
                             f"{sorted(engine.buckets)} but the scheduler prefills through a "
                             "bucket of 1: rebuild it with fuser build (which keeps a bucket of "
                             "1), or serve the model directory it was built from (fuser serve "
                             f"MODEL_DIR --max-batch-size {rows})")
        return engine
    if not (Path(args.path) / "config.json").is_file():
        raise ValueError(f"{args.path} is neither an engine directory (manifest.json) nor a "
                         "model directory (config.json + safetensors)")
    rows = args.max_batch_size or DEFAULT_MODEL_BATCH
    # --adapt-draft: the target's verify steps for suffix proposals are built with the engine
    # (and its KV cache gets their headroom): without a draft at the gamma candidates, with
    # one at the long suffix gammas (FuserConfig.long_suffix_gammas).
    suffix = bool(getattr(args, "adapt_draft", False))
    config = fuser.FuserConfig(max_batch_size=rows, max_seq_len=args.max_seq_len,
                               batch_buckets=command_line_buckets(), suffix_speculation=suffix,
                               precision=getattr(args, "precision", None) or "auto",
                               tensor_parallel=getattr(args, "tensor_parallel_size", None) or 1,
                               **kv_cache_config(args))
    engine, _, _ = build_engine_from_args(args.path, args.draft, config)
    cold.mark("build")
    return engine


def load_engine_dir(args: argparse.Namespace) -> Any:
    """`fuser.load` of the engine directory PATH. A --tokenizer for an engine saved without one
    loads on the load's thread while the weights are read (transformers' tokenizer import and
    its files take seconds, which after the load would delay /health): kept as
    `args.loaded_tokenizer` for `load_tokenizer`, the engine keeping none, as saved."""
    import fuser
    from fuser.engine_file import MANIFEST
    from fuser.engine_io import TOKENIZER_DIR, TokenizerError

    path = Path(args.path)
    tokenizer = getattr(args, "tokenizer", None)
    beside = tokenizer is not None and (path / MANIFEST).is_file() \
        and not (path / TOKENIZER_DIR).is_dir()  # one rank's directory, no tokenizer of its own
    try:
        engine = fuser.load(args.path, log=progress,
                            tensor_parallel=getattr(args, "tensor_parallel_size", None),
                            **({"tokenizer": tokenizer} if beside else {}))
    except TokenizerError as e:
        raise ValueError(f"--tokenizer {e}") from None
    if beside:
        args.loaded_tokenizer, engine.tokenizer = engine.tokenizer, None
    return engine


def check_engine_precision(path: str, precision: str | None) -> None:
    """Refuse `--precision` for the engine directory `path` unless it names the precision the
    engine was built with: the one its config records, or, for a non-FP8 engine, the dtype
    that resolved to (an engine built with auto from a bf16 model is a bf16 engine). None: no
    --precision given. Read from the manifest, before anything is loaded."""
    if precision is None:
        return
    from fuser.config import PRECISIONS
    from fuser.engine_file import read_manifest

    manifest = read_manifest(Path(path))
    built = str(manifest["config"].get("precision", "auto"))
    dtype = str(manifest["info"]["engine"]["dtype"])
    resolved = PRECISIONS.get(precision)
    if precision == built or (built != "fp8" and resolved is not None
                              and str(resolved).removeprefix("torch.") == dtype):
        return
    raise ValueError(f"--precision {precision}: the engine {path} was built with precision "
                     f"{built} ({dtype} activations); an engine directory keeps its precision "
                     f"(rebuild it with fuser build MODEL_DIR --precision {precision}, or serve "
                     f"the model directory with --precision {precision})")


def load_tokenizer(args: argparse.Namespace, engine: Any) -> Any:
    """The tokenizer to serve with: --tokenizer (which an engine directory's load may have
    loaded already, `load_engine_dir`), else the engine's own."""
    if getattr(args, "loaded_tokenizer", None) is not None:
        return args.loaded_tokenizer
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {args.tokenizer}: cannot load a tokenizer ({e})") \
                from None
    if engine.tokenizer is None:
        raise ValueError(f"{args.path} has no tokenizer files: pass --tokenizer DIR (the model "
                         "directory it was built from)")
    return engine.tokenizer


def warm_up(scheduler: Any, tokenizer: Any) -> None:
    """One greedy and one sampled request through every path a first request takes (prefill,
    the step, detokenization), so the first client does not pay for it."""
    from fuser.runtime.scheduler import SamplingParams

    ids = list(tokenizer("def")["input_ids"]) or [0]
    for params in (SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=2, temperature=1.0, seed=0, ignore_eos=True)):
        out = scheduler.submit(ids, params).result(WARM_UP_SECONDS)
        tokenizer.decode(out)
    # The prefill graphs these requests ran uncaptured are captured in idle time
    # (runtime/idle_capture.py): before /health, not while the first client waits.
    wait = getattr(scheduler, "wait_captures", None)
    if wait is not None:
        wait(WARM_UP_SECONDS)


def precapture(scheduler: Any, args: argparse.Namespace, wait: bool = False) -> int:
    """Plan --precapture-seconds of idle-time captures of the likeliest prefill and chunk
    shapes (`Scheduler.precapture`); wait: until they are done (the benchmark's in-process
    server, before its levels). Returns how many shapes were planned."""
    seconds = getattr(args, "precapture_seconds", DEFAULT_PRECAPTURE_SECONDS)
    plan = getattr(scheduler, "precapture", None)
    if plan is None or not seconds:
        return 0
    count = plan(seconds)
    if count and wait:
        scheduler.wait_captures(seconds + WARM_UP_SECONDS, planned=True)
    return count


def settle_heap() -> None:
    """Collect the garbage the load left (a full collection of a heap of millions of objects:
    the fx graphs, their JSON, the imports) now, before /health, rather than in whichever
    request would trigger it, and freeze what survives: the engine's objects live as long as
    the server, and the collections while serving need not walk them again."""
    import gc

    gc.collect()
    gc.freeze()


def warm_up_http(server: Any, model: str, api_key: str | None, tokenizer: Any) -> str | None:
    """A streamed completion of token ids (usage included) and a whole one of text, sampled,
    through the HTTP server itself: its request parsing, routes, JSON, server-sent events and
    streamed detokenization run once before /health answers 200, so the first client's request
    pays none of their first-call costs (a cold first request's TTFT was 2.2x a warm one's).
    -> None, or what failed."""
    import http.client
    import json

    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(server.host, server.host)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    ids = list(tokenizer("def")["input_ids"]) or [0]
    bodies = [{"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
              {"model": model, "prompt": "def", "max_tokens": 2, "temperature": 1.0, "seed": 0,
               "ignore_eos": True}]
    for body in bodies:
        connection = http.client.HTTPConnection(host, server.port, timeout=WARM_UP_SECONDS)
        try:
            connection.request("POST", "/v1/completions", json.dumps(body), headers)
            response = connection.getresponse()
            data = response.read()
            if response.status != 200:
                return f"HTTP {response.status}: {data[:200]!r}"
        except (OSError, http.client.HTTPException) as e:  # (a malformed answer: the latter)
            return f"{type(e).__name__}: {e}"
        finally:
            connection.close()
    return None


def make_scheduler(engine: Any, args: argparse.Namespace) -> Any:
    """The scheduler `fuser serve` runs: plain continuous batching (with the engine's own
    speculation) by default; with --adapt-draft, adaptive speculation (suffix proposals, and the
    draft distilled online every --distill-every finished requests for --distill-budget-s
    seconds, where the engine has a draft), unless the engine cannot take it (then plain
    continuous batching, said on stderr)."""
    import dataclasses

    from fuser.runtime.scheduler import Scheduler

    if getattr(args, "adapt_draft", False):
        from fuser.runtime.adaptive_scheduler import AdaptiveScheduler

        every = getattr(args, "distill_every", None)
        budget = getattr(args, "distill_budget_s", None)
        # AdaptiveScheduler reads both from the engine's config.
        engine.config = dataclasses.replace(
            engine.config,
            distill_every=engine.config.distill_every if every is None else every,
            distill_budget_s=engine.config.distill_budget_s if budget is None else budget)
        try:
            module = adapted_draft_module(engine, args.path) if engine.gammas else None
            scheduler = AdaptiveScheduler(engine, max_waiting=args.max_waiting, suffix=True,
                                          adapt_draft=bool(engine.gammas), module=module,
                                          prefix_caching=getattr(args, "prefix_caching", True),
                                          max_num_batched_tokens=_chunk_budget(engine, args),
                                          **_admission(args))
        except (ValueError, RuntimeError, NotImplementedError) as e:
            hint = "; rebuild it with fuser build --suffix-steps" \
                if "no verify step for gamma" in str(e) else ""
            progress(f"adaptive speculation off ({e}{hint}); continuous batching without it")
        else:
            distiller = scheduler.distiller
            if distiller is not None and not distiller.labels_from_target:
                from fuser.runtime.distill import rebuild_target  # a loaded engine's target

                distiller.label_with(rebuild_target(engine, args.path))
            progress("adaptive speculation on (suffix proposals"
                     + (f"; the draft distilled every {engine.config.distill_every} requests "
                        f"for {engine.config.distill_budget_s:g} s on the target's "
                        + ("top-k" if distiller.labels_from_target else "tokens")
                        if distiller is not None else "") + ")")
            return scheduler
    return Scheduler(engine, max_waiting=args.max_waiting,
                     prefix_caching=getattr(args, "prefix_caching", True),
                     max_num_batched_tokens=_chunk_budget(engine, args), **_admission(args))


def _admission(args: argparse.Namespace) -> dict[str, float]:
    """The scheduler's admission times (seconds) that --admission-wait-ms and
    --admission-quiet-ms set (those left out: the scheduler's defaults)."""
    times = {"admission_wait": getattr(args, "admission_wait_ms", None),
             "admission_quiet": getattr(args, "admission_quiet_ms", None)}
    return {name: ms / 1e3 for name, ms in times.items() if ms is not None}


def _chunk_budget(engine: Any, args: argparse.Namespace) -> int | None:
    """The scheduler's max_num_batched_tokens: --max-num-batched-tokens on a paged cache (0:
    whole prompts), None on a contiguous one."""
    paged = engine.target is not None and engine.target.cache.paged
    return getattr(args, "max_num_batched_tokens", 0) if paged else None


def show_draft_updates() -> logging.Handler:
    """Print each draft update the distiller logs (runtime/distill.py: steps, loss, held-out
    agreement and KL before and after, accepted or rejected and why) on stderr, with the
    "fuser" logger's warnings; returns the handler (to remove)."""
    logger = logging.getLogger("fuser")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fuser serve: %(message)s"))
    handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.module == "distill")
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def adapted_draft_module(engine: Any, path: str) -> Any:
    """The draft module to distil: the engine's own copy (a model directory's build), or,
    for an engine loaded from the directory `path`, one rebuilt from its draft config and
    the loaded draft's tensors."""
    from fuser.runtime.distill import draft_module, rebuild_draft

    try:
        return draft_module(engine)
    except ValueError:  # a loaded engine: its steps keep no module
        return rebuild_draft(engine, path)


def save_adapted(engine: Any, scheduler: Any, path: str) -> bool:
    """After the drain: an engine directory whose draft took distilled weights is written back
    in place (atomically: engine.save writes the live draft tensors), so that the next
    `fuser serve` starts from them. A model directory is left alone (said on stderr). True
    when saved."""
    from fuser.launch import is_engine_dir

    swap = getattr(scheduler, "swap", None)
    if swap is None or swap.swaps == 0:
        return False
    if not is_engine_dir(path):
        progress("the distilled draft is not saved (a model directory: fuser build an engine "
                 "directory to keep it)")
        return False
    start = time.perf_counter()
    engine.save(path, overwrite=True)
    progress(f"saved the distilled draft into {path} in {time.perf_counter() - start:.1f} s")
    return True
def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since this module's
    import, which comes after the interpreter's start and torch's import)."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class ColdStart:
    """Where the time from launch to ready went, printed as one table when ready."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.notes: list[str] = []
        self._last = 0.0

    def mark(self, name: str) -> None:
        """`name` took the time since the previous mark (the first: since the launch)."""
        now = process_age()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._last
        self._last = now

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Like mark(name), with the measured `parts` of it listed on their own lines (the
        rest stays under `name`)."""
        self.mark(name)
        total = self.parts.pop(name)
        for part, seconds in parts.items():
            self.parts[part] = self.parts.get(part, 0.0) + seconds
        self.parts[f"{name}, other"] = max(0.0, total - sum(parts.values()))

    def note(self, line: str) -> None:
        """A line printed under the table (what goes on after ready)."""
        self.notes.append(line)

    def table(self) -> str:
        width = max(len(n) for n in [*self.parts, "total"])
        lines = ["cold start, launch to ready (seconds):"]
        lines += [f"  {name:<{width}} {seconds:7.2f}" for name, seconds in self.parts.items()]
        lines.append(f"  {'total':<{width}} {self._last:7.2f}")
        lines += [f"  {line}" for line in self.notes]
        return "\n".join(lines)


# Imported modules without cached bytecode from which the cold-start table says so (each
# costs its compile at every start: fuser/bytecode.py).
UNCACHED_NOTE = 50
LOAD_PARTS = {"read": "read", "code": "code load", "first_run": "first run",
              "capture": "capture"}


class _Stop(Exception):
    """A signal before the server was ready: stop loading and exit."""


def run_serve(args: argparse.Namespace) -> int:
    _check_args(args)
    from fuser.server.app import create_app
    from fuser.server.runner import ServerThread, bind

    name = args.served_model_name or Path(args.path).resolve().name
    sock = bind(args.host, args.port)
    app = create_app(None, None, name, api_key=args.api_key)
    serving = app.state.serving
    serving.adapt_draft = args.adapt_draft
    server = ServerThread(app, sock=sock, log_level=args.log_level,
                          graceful_seconds=min(5.0, args.drain_timeout + 1.0))
    signals = {"count": 0}
    stop = threading.Event()
    scheduler = None
    engine = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["count"] += 1
        stop.set()
        if scheduler is None:
            raise _Stop  # still loading: give up at once
        if signals["count"] > 1:  # a second signal while draining: abort what runs
            threading.Thread(target=scheduler.close, daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    shown = show_draft_updates() if args.adapt_draft else None
    try:
        server.start()
        progress(f"listening on {server.url}; /health answers 503 until the model is ready")
        cold = ColdStart()
        engine = open_engine(args, cold)
        tokenizer = load_tokenizer(args, engine)
        cold.mark("tokenizer")  # ~0 where the load read it (an engine directory's own, or
        # --tokenizer for one saved without: `load_engine_dir`)
        started = make_scheduler(engine, args)
        started.start()
        scheduler = started
        cold.mark("scheduler")
        progress("warming up ...")
        warm_up(scheduler, tokenizer)
        settle_heap()
        # /v1 serves from here, /health only after the server's own requests went through it
        serving.attach(scheduler, tokenizer, engine, hold=True)
        failed = warm_up_http(server, name, args.api_key, tokenizer)
        if failed is not None:
            progress(f"the HTTP warm-up failed ({failed}); the first request may be slower")
        serving.release()
        cold.mark("warm-up")
        uncached = uncached_modules()
        if uncached.total >= UNCACHED_NOTE:
            cold.note(uncached.note())
        for line in cold.table().splitlines():
            progress(line)
        say(f"fuser serve: ready at {server.url} (model {name})")
        planned = precapture(scheduler, args)
        if planned:
            progress(f"capturing up to {planned} likely prefill and chunk graphs in idle time "
                     f"(at most {args.precapture_seconds:g} s; --precapture-seconds)")
        while not stop.wait(0.5):
            if not server.alive:
                raise RuntimeError(f"the HTTP server stopped ({server.error!r})")
        code = drain(serving, scheduler, server, args.drain_timeout)
        if getattr(scheduler, "wait_update", None) is not None:
            scheduler.wait_update(max(args.drain_timeout, 1.0))  # an update still running
        save_adapted(engine, scheduler, args.path)
        return code
    except _Stop:
        progress("stopped before the model was ready")
        return 0
    finally:
        server.stop(timeout=10.0)
        if scheduler is not None:
            scheduler.close()
        if getattr(engine, "close", None) is not None:
            engine.close()  # a background capture still running stops (its thread joined)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if shown is not None:
            logging.getLogger("fuser").removeHandler(shown)


def drain(serving: Any, scheduler: Any, server: Any, timeout: float) -> int:
    """Answer 503 to new requests and /health, let the running ones finish (at most `timeout`
    seconds, then abort them), stop the HTTP server. Exit status 0."""
    serving.drain()
    progress(f"draining: {scheduler.num_running} running, {scheduler.num_waiting} waiting "
             f"(at most {timeout:g} s)")
    start = time.perf_counter()
    result: dict[str, bool] = {}
    worker = threading.Thread(target=lambda: result.update(done=scheduler.drain(timeout)),
                              name="fuser-serve-drain", daemon=True)
    worker.start()
    worker.join(timeout + 30.0)
    finished = result.get("done", False)
    server.stop(timeout=10.0)  # the finished streams have sent their last events
    progress(f"drained in {time.perf_counter() - start:.1f} s"
             + ("" if finished else ": requests still running at the timeout were aborted"))
    return 0
