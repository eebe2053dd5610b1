"""Engine files at real size: build, save, load in a fresh process, and time both engines.

    python benchmarks/engine_files.py --out engine_files.json        # H200: 8B + 1B
    python benchmarks/engine_files.py --no-draft --max-batch-size 64 --max-seq-len 512 \
        --build-only                                                 # H200: the 64-row build
    python benchmarks/engine_files.py --load ENGINE_DIR              # one load, as JSON
    python benchmarks/engine_files.py --serve --engine-dir DIR       # H200: + fuser serve DIR
    python benchmarks/engine_files.py --dry-run --out dry.json       # CPU, tiny random models

Builds a random Llama-3-8B-shape target (bf16) with a random Llama-3.2-1B-shape draft
(models.PRESETS; --no-draft: the target alone), saves the engine, loads it in a new Python
process and reports: build seconds (every batch bucket up to --max-batch-size), save seconds,
load seconds (fuser.load alone, and with the interpreter's imports; the requirement is
load <= 8 s) and the load's own lines (FUSER_LOAD_PROFILE=1: where its first run and capture
spend their time, step by step and graph by graph), graphs traced or compiled in the loaded process (`fuser.compile.compile_count`:
0, a load runs the saved code), greedy tokens of loaded vs in-process engine, and tok/s of both
at one row (speculative and target-only; a random draft almost never agrees with a random
target, so speculation is slower here; the point is loaded == in-process). With --serve, then
`fuser serve DIR` in a new process (benchmarks/serve.py --cold-start): launch to /health 200
(requirement <= 15 s), the first request's TTFT against a warm one's (<= 2x), the server's
breakdown of its start, and its greedy tokens against the in-process engine's.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports: the loaded process reports them too

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import fuser  # noqa: E402
from fuser import compare  # noqa: E402
from fuser.compile import compile_count  # noqa: E402
from fuser.models import PRESETS  # noqa: E402

LOAD_LIMIT_SECONDS = 8.0  # fuser.load of the 8B + 1B engine (issue 46)
HEALTH_LIMIT_SECONDS = 15.0  # `fuser serve ENGINE_DIR` answers /health within 15 s
TTFT_LIMIT = 2.0  # the first request's TTFT, in warm TTFTs
DRY_TARGET = dict(PRESETS["tiny-random-llama"])
DRY_DRAFT = dict(DRY_TARGET, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)


def log(message: str) -> None:
    print(f"[engine_files] {message}", file=sys.stderr, flush=True)


def random_llama(shape: dict[str, object], dtype: torch.dtype, device: torch.device,
                 seed: int) -> torch.nn.Module:
    """A randomly initialised Llama of `shape`, built directly in `dtype` on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def prompt(vocab: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One random prompt [1, length] and its mask."""
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return ids.to(device), torch.ones_like(ids).to(device)


def time_engine(engine: fuser.Engine, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                runs: int) -> dict[str, object]:
    """tok/s (median of `runs` after a warm-up) speculative and target-only, and the tokens."""
    out: dict[str, object] = {}
    systems: list[tuple[str, int | None]] = [("target_only", 0)]
    if engine.draft is not None:
        systems.insert(0, ("speculative", None))
    for name, gamma in systems:
        # no eos: every run generates exactly new_tokens
        fn = compare.engine_generate(engine, [], 0, gamma)
        row, tokens = compare.time_system(name, fn, ids, mask, new_tokens, -1, runs, engine.device)
        out[name] = {"tokens_per_second": row.tokens_per_second, "seconds": row.seconds,
                     "tokens": tokens[0, ids.shape[1]:].tolist()}
    return out


def fresh_caches(scratch: Path) -> dict[str, str]:
    """This process's environment with Inductor's and Triton's caches in new empty directories
    under `scratch`: a process started with it finds no kernel but those the engine directory
    brings."""
    import os

    (scratch / "inductor").mkdir(parents=True, exist_ok=True)
    (scratch / "triton").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
            "TRITON_CACHE_DIR": str(scratch / "triton")}


def child(args: argparse.Namespace) -> None:
    """The fresh process: load the engine, time it, print one JSON line."""
    import triton

    lines: list[str] = []
    triton_compiles: list[str] = []  # kernels Triton had to compile (not in its cache)

    def listen(*, src: object, metadata: dict, metadata_group: dict, times: object,
               cache_hit: bool) -> None:
        if not cache_hit:
            triton_compiles.append(str(metadata.get("name")))

    triton.knobs.compilation.listener = listen
    engine = fuser.load(args.load, log=lines.append)
    import_and_load = time.perf_counter() - args.started
    # fuser.load returns once bucket 1's graphs are captured; the rest capture in the
    # background: wait for them before timing (and say how long they took).
    waited = time.perf_counter()
    all_captured = engine.wait_for_graphs(timeout=600.0)
    background = time.perf_counter() - waited
    compiles = compile_count()
    ids, mask = prompt(engine.vocab_size, args.prompt_tokens, engine.device)
    result = {"load_seconds": engine.load_seconds,
              "import_and_load_seconds": import_and_load,
              "background_capture_seconds": background, "all_captured": all_captured,
              "graphs_status": {str(k): v for k, v in engine.graphs_status.items()},
              "compiles": compiles, "triton_compiles_in_load": len(triton_compiles),
              "buckets": sorted(engine.buckets), "load_log": lines,
              "timing": time_engine(engine, ids, mask, args.new_tokens, args.runs)}
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny random models")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--engine-dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--compile", default="auto", choices=["auto", "inductor", "fx"])
    parser.add_argument("--gamma", type=lambda v: v if v == "auto" else int(v), default=4,
                        help="draft length, or auto (a verify graph per candidate)")
    parser.add_argument("--no-draft", action="store_true", help="the target alone")
    parser.add_argument("--max-batch-size", type=int, default=1,
                        help="rows of the engine (batch buckets 1, 2, 4, ... up to it on CUDA)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="default: prompt + new tokens + 16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve-runs", type=int, default=1,
                        help="with --serve: cold starts of `fuser serve`, each in a fresh "
                             "process with fresh kernel caches; the median one is reported "
                             "(its breakdown), every one's seconds to /health too")
    parser.add_argument("--serve", action="store_true",
                        help="then launch `fuser serve` over the saved engine: cold start, "
                             "first request, tokens (benchmarks/serve.py --cold-start)")
    parser.add_argument("--no-load-profile", dest="load_profile", action="store_false",
                        help="load without FUSER_LOAD_PROFILE=1 (which runs each step a second "
                             "time and counts the kernel work: where the load's time goes)")
    parser.add_argument("--python-profile", action="store_true",
                        help="the loading process also profiles its code load's Python "
                             "(FUSER_LOAD_PROFILE=python: the code load then runs alone before "
                             "the reading, under cProfile; the load's seconds are not its own)")
    parser.add_argument("--build-only", action="store_true",
                        help="print the build time and stop (no save, load or timing)")
    parser.add_argument("--load", default=None,
                        help="load this engine directory in this process and print one JSON "
                             "line (what the fresh process of a full run does)")
    parser.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        args.started = STARTED
        return child(args)
    if args.dry_run:
        device, dtype, shapes = torch.device("cpu"), torch.float32, (DRY_TARGET, DRY_DRAFT)
        args.prompt_tokens, args.new_tokens, args.runs = 8, 8, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --dry-run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = (PRESETS["llama-3-8b"], PRESETS["llama-3.2-1b"])
    log(f"random models on {device}, {dtype} ...")
    target = random_llama(shapes[0], dtype, device, seed=0)
    draft = None if args.no_draft else random_llama(shapes[1], dtype, device, seed=1)
    config = fuser.FuserConfig(gamma=args.gamma, compile=args.compile,
                               max_batch_size=args.max_batch_size,
                               max_seq_len=args.max_seq_len or
                               args.prompt_tokens + args.new_tokens + 16)
    log(f"building (export, passes, compile, warm-up, CUDA graphs), {args.max_batch_size} "
        "rows ...")
    logging.basicConfig(format="[engine_files] %(message)s")
    logging.getLogger("fuser").setLevel(logging.INFO)  # the build's progress lines
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=draft, config=config)
    build_seconds = time.perf_counter() - start
    if args.build_only:
        print(f"build {build_seconds:.1f} s: {args.max_batch_size} rows, batch buckets "
              f"{sorted(engine.buckets)}, {'with' if draft is not None else 'no'} draft, "
              f"max_seq_len {config.max_seq_len}")
        return
    log(f"built in {build_seconds:.1f} s; timing the in-process engine ...")
    ids, mask = prompt(engine.vocab_size, args.prompt_tokens, device)
    in_process = time_engine(engine, ids, mask, args.new_tokens, args.runs)
    from serve import COLD_PROMPT, COLD_TOKENS, cold_start

    cold_reference = engine.generate(torch.tensor([COLD_PROMPT], device=device),
                                     COLD_TOKENS)[0, len(COLD_PROMPT):].tolist()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.engine_dir or Path(scratch) / "engine")
        start = time.perf_counter()
        engine.save(path, overwrite=True)
        save_seconds = time.perf_counter() - start
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        log(f"saved {size / 2**30:.2f} GiB in {save_seconds:.1f} s; loading in a fresh process ...")
        child_args = [sys.executable, __file__, "--load", str(path), "--runs", str(args.runs),
                      "--prompt-tokens", str(args.prompt_tokens),
                      "--new-tokens", str(args.new_tokens)]
        # The loading process profiles its load (fuser/load_profile.py): each step's first run
        # and a second one, each graph's capture, and the kernel work behind them, in its log.
        env = fresh_caches(Path(scratch) / "load-caches")
        if args.load_profile:
            env["FUSER_LOAD_PROFILE"] = "python" if args.python_profile else "1"
        done = subprocess.run(child_args, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"the loading process failed:\n{done.stderr[-4000:]}")
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
        serve = None
        if args.serve:
            starts = []
            for i in range(max(1, args.serve_runs)):
                log(f"launching fuser serve over it ({i + 1} of {max(1, args.serve_runs)}) ...")
                one = cold_start(str(path), timeout=300.0,
                                 env=fresh_caches(Path(scratch) / f"serve-caches-{i}"))
                one["tokens_identical"] = one.get("tokens") == cold_reference
                starts.append(one)
            serve = median_start(starts)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "shapes": "tiny (dry run)" if args.dry_run else "llama-3-8b + llama-3.2-1b",
        "build_seconds": build_seconds, "save_seconds": save_seconds, "engine_bytes": size,
        "load_seconds": loaded["load_seconds"],
        "background_capture_seconds": loaded.get("background_capture_seconds"),
        "all_captured": loaded.get("all_captured"), "graphs_status": loaded.get("graphs_status"),
        "import_and_load_seconds": loaded["import_and_load_seconds"],
        "max_batch_size": args.max_batch_size, "draft": draft is not None,
        "compiles_in_loaded_process": loaded["compiles"], "loaded_buckets": loaded["buckets"],
        "triton_compiles_in_load": loaded["triton_compiles_in_load"],
        "load_log": loaded["load_log"],
        "in_process": in_process, "loaded": loaded["timing"],
        "serve": serve,
    }
    for mode in in_process:
        same = in_process[mode]["tokens"] == loaded["timing"][mode]["tokens"]
        results[f"{mode}_tokens_identical"] = same
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def median_start(starts: list[dict]) -> dict:
    """Of `fuser serve`'s cold starts, the median one by seconds to /health (of two, the
    slower), with every start's seconds under "runs_seconds_to_health_200"; a start that
    failed is reported as it is."""
    failed = [s for s in starts if "seconds_to_health_200" not in s]
    if failed:
        return failed[0]
    ordered = sorted(starts, key=lambda s: s["seconds_to_health_200"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs_seconds_to_health_200"] = [s["seconds_to_health_200"] for s in starts]
    return chosen


def report(r: dict[str, object]) -> str:
    """The results as lines of text; the last line is the verdict."""
    lines = [f"device {r['device']}, {r['dtype']}, {r['shapes']}",
             f"build {r['build_seconds']:.1f} s, save {r['save_seconds']:.1f} s "
             f"({r['engine_bytes'] / 2**30:.2f} GiB), load {r['load_seconds']:.1f} s "
             f"(with imports {r['import_and_load_seconds']:.1f} s)",
             f"{r['max_batch_size']} rows, buckets {r['loaded_buckets']}; graphs traced or "
             f"compiled by the load: {r['compiles_in_loaded_process']}; Triton kernels "
             f"compiled by the load (empty caches): {r['triton_compiles_in_load']}"]
    lines += [f"  load: {line}" for line in r["load_log"]]
    if r.get("graphs_status") and len(r["graphs_status"]) > 1:  # CUDA, more than bucket 1
        lines.append(f"  load returned with batch bucket 1 captured; the other buckets were "
                     f"captured {r['background_capture_seconds']:.1f} s later, in the background"
                     f" (all captured: {r.get('all_captured')}; {r.get('graphs_status')})")
    for mode, timing in r["in_process"].items():
        lines.append(f"{mode}: in-process {timing['tokens_per_second']:.1f} tok/s, loaded "
                     f"{r['loaded'][mode]['tokens_per_second']:.1f} tok/s, tokens identical: "
                     f"{r[f'{mode}_tokens_identical']}")
    serve = r.get("serve")
    if serve is not None:
        if "seconds_to_health_200" not in serve:
            lines.append(f"fuser serve: failed ({serve.get('error')})")
        else:
            runs = serve.get("runs_seconds_to_health_200", [])
            lines.append(f"fuser serve: launch -> /health 200 {serve['seconds_to_health_200']:.1f}"
                         f" s [limit {HEALTH_LIMIT_SECONDS:.0f} s]"
                         + (f" (the median of {len(runs)} cold starts: "
                            f"{', '.join(f'{t:.1f}' for t in runs)} s)" if len(runs) > 1 else ""))
            lines += [f"  {line}" for line in serve.get("breakdown", [])]
        if "first_ttft_over_warm" in serve:
            lines.append(f"fuser serve: first request TTFT "
                         f"{1e3 * serve['first_request']['ttft']:.1f} ms = "
                         f"{serve['first_ttft_over_warm']:.2f}x the warm "
                         f"{1e3 * serve['warm_ttft']:.1f} ms [limit {TTFT_LIMIT:.0f}x]; tokens "
                         f"identical to the in-process engine's: {serve['tokens_identical']}")
    fast = r["load_seconds"] <= LOAD_LIMIT_SECONDS
    compiles = r["compiles_in_loaded_process"]
    verdict = "dry run on CPU" if r["device"] == "cpu" else "H200 run"
    line = (f"{verdict}: load {r['load_seconds']:.1f} s {'<=' if fast else '>'} "
            f"{LOAD_LIMIT_SECONDS:.0f} s, {compiles} compiles in the load")
    if serve is not None and "seconds_to_health_200" in serve:
        healthy = serve["seconds_to_health_200"] <= HEALTH_LIMIT_SECONDS
        ttft = serve.get("first_ttft_over_warm", float("inf")) <= TTFT_LIMIT
        line += (f", serve {'<=' if healthy else '>'} {HEALTH_LIMIT_SECONDS:.0f} s to /health, "
                 f"first TTFT {'<=' if ttft else '>'} {TTFT_LIMIT:.0f}x warm, tokens "
                 f"{'identical' if serve.get('tokens_identical') else 'DIFFER'}")
    lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
