"""The `fuser` command line: build, inspect, generate, bench, demo, export (API.md, command
line).

MODEL_OR_ENGINE arguments take a model directory or an engine directory (one with a
manifest.json). Results go to stdout, progress lines to stderr; a user error is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch's import: `fuser demo` reports time to first token

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

# Prompts end mid-line: a prompt that ends in "\n" splits the BPE's newline+indent tokens.
DEMO_PROMPTS = [
    "def read_json(path):\n    with open(path) as f:\n        data =",
    "class Stack:\n    def __init__(self):\n        self.items =",
    "def fibonacci(n):\n    if n <",
]


from fuser.launch import build_engine_from_args, command_line_buckets, is_engine_dir, \
    progress  # noqa: E402


def say(message: str) -> None:
    """Progress on stderr-free stdout, flushed (long steps must show progress)."""
    print(message, flush=True)


def _encode(tokenizer: object | None, prompts: list[str], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask for `prompts` (random ids when there is no tokenizer)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (len(prompts), 8), generator=g)
        return ids, torch.ones_like(ids)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _decode(tokenizer: object | None, ids: torch.Tensor) -> list[str]:
    if tokenizer is None:
        return [" ".join(str(int(t)) for t in row) for row in ids]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def _hf_generate_seconds(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                         new_tokens: int, eos: object, pad: object) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
    return out, time.perf_counter() - start


def demo_cache_dir() -> Path:
    """Where `fuser demo` keeps its engine: $XDG_CACHE_HOME/fuser, else ~/.cache/fuser."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fuser" / "demo-engine"


def _generation_ids(engine: object) -> tuple[object, int]:
    """(eos, pad) from the engine's generation config (pad falls back to eos, then 0)."""
    gen = getattr(engine.user_target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return eos, int(pad)


def cmd_build(args: argparse.Namespace) -> int:
    import fuser
    from fuser.engine_io import save

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ValueError(f"--out {out} already exists (pass --overwrite to replace it)")
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} must be at least 1")
    config = fuser.FuserConfig(precision=args.precision, gamma=gamma,
                               max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                               batch_buckets=command_line_buckets(),
                               suffix_speculation=args.suffix_steps,
                               tensor_parallel=args.tensor_parallel_size, **_paged_build(args))
    engine, source, _ = build_engine_from_args(args.model, args.draft, config)
    try:
        progress(f"saving to {out} ...")
        start = time.perf_counter()
        if engine.tensor_parallel is not None:  # out/rank0, rank1, ..., tensor_parallel.json
            with engine.generating():
                engine.tensor_parallel.save(engine, out, overwrite=args.overwrite,
                                            source=source)
        else:
            save(engine, out, overwrite=args.overwrite, source=source)
        progress(f"saved in {time.perf_counter() - start:.1f} s")
    finally:
        engine.close()
    say(str(out))
    return 0


def _paged_build(args: argparse.Namespace) -> dict[str, object]:
    """FuserConfig fields of `fuser build --block-size N [--gpu-memory-fraction F]`."""
    if args.block_size < 0:
        raise ValueError(f"--block-size {args.block_size} must be at least 0 (0: contiguous)")
    if args.gpu_memory_fraction is not None and not args.block_size:
        raise ValueError("--gpu-memory-fraction sizes a paged KV cache: give --block-size too")
    if not args.block_size:
        return {}
    return dict(kv_block_size=args.block_size, kv_memory_fraction=args.gpu_memory_fraction)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_inspect(args: argparse.Namespace) -> int:
    from fuser import engine_file as ef

    directory = Path(args.engine)
    manifest = ef.read_manifest(directory)
    env, info = manifest["environment"], manifest["info"]
    say(f"engine {directory}")
    say("built with: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None))
    say("config: " + ", ".join(f"{k}={v}" for k, v in manifest["config"].items()))
    engine = info["engine"]
    say(f"dtype {engine['dtype']}, gamma {engine['gamma']}, vocabulary {engine['vocab_size']}, "
        f"steps {engine['compile']}, build {engine['build_seconds']:.1f} s")
    say(f"passes ({manifest['sources']['hash'][:12]}): {', '.join(manifest['sources']['passes'])}")
    for role, m in info["models"].items():
        kinds = ", ".join(f"{k}(T={'any' if t is None else t})" for k, t in m["kinds"])
        paged = f", paged: {m['num_blocks']} blocks of {m['block_size']}" \
            if m.get("block_size") else ""
        say(f"{role}: {m['layers']} layers, KV cache [B={m['batch']}, slots={m['slots']}, "
            f"kv_heads={m['kv_heads']}, D={m['head_dim']}{paged}] {m['cache_dtype']}; "
            f"steps {kinds}")
        for name, g in m["graphs"].items():
            fired = ", ".join(f"{p} {n}" for p, n in g["matches"].items() if n) or "(none)"
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(g["fused_ops"].items())) or "(none)"
            say(f"  {role + '.' + name:<24} passes fired: {fired}")
            say(f"  {'':<24} fused ops: {ops}")
    say("files:")
    for rel, record in manifest["files"].items():
        say(f"  {rel:<48} {_size(record['size']):>10}")
    total = sum(r["size"] for r in manifest["files"].values())
    say(f"  {'total':<48} {_size(total):>10}")
    try:
        ef.check_environment(env, ef.environment(_inspect_device(env)))
        say("loadable here: yes")
    except ef.EngineFileError as e:
        say(f"loadable here: no ({e})")
    return 0


def _inspect_device(env: dict) -> torch.device:
    if env["device_type"] == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_engine(model: str | None, draft: str | None, config: object,
                wait_for_graphs: bool = False) -> tuple[object, dict[str, str]]:
    """(engine, source paths): loaded from an engine directory, or built from model ones.
    wait_for_graphs: every batch bucket's step graphs captured before returning (what timing
    needs; `fuser.load` otherwise captures all but bucket 1 in the background)."""
    import fuser

    if is_engine_dir(model):
        if draft is not None:
            raise ValueError(f"{model} is an engine directory: its draft is built in "
                             "(--draft applies to model directories)")
        engine = fuser.load(model, log=progress, wait_for_graphs=wait_for_graphs)
        return engine, dict(engine.manifest["info"].get("source", {}))
    engine, source, _ = build_engine_from_args(model, draft, config)
    return engine, source


def _onnx() -> object:
    """fuser.onnx.commands, or a user error saying what to install."""
    try:
        from fuser.onnx import commands
    except ImportError as e:
        raise ValueError(f"ONNX export and the onnxruntime runtime need onnx and onnxruntime "
                         f"({e}): pip install 'fuser[onnx]'") from None
    return commands


def cmd_export(args: argparse.Namespace) -> int:
    commands = _onnx()
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    progress(f"exporting {args.model} to ONNX ...")
    start = time.perf_counter()
    manifest = commands.export(args.model, args.draft, args.out, precision=args.precision,
                               gamma=gamma, max_seq_len=args.max_seq_len,
                               overwrite=args.overwrite)
    progress(f"exported in {time.perf_counter() - start:.1f} s")
    for line in commands.summary(manifest):
        say(line)
    say(str(args.out))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import fuser

    if args.runtime == "onnxruntime":
        with _onnx().onnx_engine(args.model, args.draft, args.max_seq_len,
                                 args.threads) as engine:
            return _generate(engine, args)
    engine, _ = open_engine(args.model, args.draft, fuser.FuserConfig(max_seq_len=args.max_seq_len))
    return _generate(engine, args)


def _generate(engine: object, args: argparse.Namespace) -> int:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer files: cannot encode --prompt")
    eos, pad = _generation_ids(engine)
    ids, mask = _encode(tokenizer, [args.prompt], engine.vocab_size)
    say(args.prompt)
    for column in engine.stream(ids, args.max_new_tokens, attention_mask=mask,
                                do_sample=args.sample, seed=args.seed, eos_token_id=eos,
                                pad_token_id=pad):
        sys.stdout.write(tokenizer.decode(column[:1]))
        sys.stdout.flush()
    say("")
    return 0


def _hf_model(source: dict[str, str], engine: object) -> torch.nn.Module | None:
    """The Hugging Face target for comparisons, in the engine's dtype and device, or None."""
    from fuser.pipeline import load_model

    path = source.get("target")
    if not path or not Path(path).is_dir():
        return None
    model = load_model(path, "target")[0]
    return model.to(device=engine.device, dtype=engine.dtype).eval()


def compare_systems(engine: object, hf: torch.nn.Module | None, ids: torch.Tensor,
                    mask: torch.Tensor, new_tokens: int, runs: int) -> tuple[list, list[str]]:
    """(rows, notes): fuser speculative, fuser target-only and HF generate, timed alike."""
    from fuser import compare

    eos, pad = _generation_ids(engine)
    device = engine.device
    ids, mask = ids.to(device), mask.to(device)
    T = ids.shape[1]
    systems: list[tuple[str, int | None]] = []
    if engine.draft is not None:
        gamma = "auto" if engine.adaptive else str(engine.gamma)
        systems.append((f"fuser speculative (gamma {gamma})", None))
    systems.append(("fuser target-only", 0))
    rows, outs = [], {}
    for name, gamma in systems:
        progress(f"timing {name} ({runs} runs after a warm-up) ...")
        row, outs[name] = compare.time_system(name, compare.engine_generate(engine, eos, pad, gamma),
                                              ids, mask, new_tokens, pad, runs, device)
        rows.append(row)
    if engine.draft is not None:
        rows[0].note = (f"mean accepted length {engine.stats.mean_accepted_length:.2f}")
    notes = [f"device {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
             + f", dtype {str(engine.dtype).removeprefix('torch.')}, batch {ids.shape[0]}, "
             f"{new_tokens} new tokens, median of {runs} runs"
             + (f", {torch.get_num_threads()} intra-op thread(s)" if device.type == "cpu" else "")]
    if hf is None:
        notes.append("Hugging Face generate: not run (the engine does not record a model "
                     "directory that exists here)")
        return rows, notes
    progress(f"timing Hugging Face generate ({runs} runs after a warm-up) ...")
    row, hf_out = compare.time_system("Hugging Face generate", compare.hf_generate(hf, eos, pad),
                                      ids, mask, new_tokens, pad, runs, device)
    rows.append(row)
    exact = engine.dtype == torch.float32
    for name, out in outs.items():
        where = compare.first_divergence(out, hf_out, T)
        if exact:
            notes.append(f"{name} vs Hugging Face (fp32, exactness promised): "
                         f"{'identical' if where is None else 'DIFFERENT at token ' + str(where)}")
        else:
            notes.append(f"{name} vs Hugging Face: {compare.describe_divergence(where)}")
    if not exact:
        hf_self = compare.hf_kernel_divergence(hf, ids, mask, new_tokens, eos, pad)
        notes.append("for scale, Hugging Face sdpa vs eager attention: "
                     + compare.describe_divergence(hf_self))
    return rows, notes


def cmd_bench(args: argparse.Namespace) -> int:
    import fuser
    from fuser import compare

    engine, source = open_engine(args.model, args.draft, fuser.FuserConfig(
        max_batch_size=1, max_seq_len=max(256, args.max_new_tokens + 64)), wait_for_graphs=True)
    hf = _hf_model(source, engine) if not args.no_hf else None
    ids, mask = _encode(engine.tokenizer, DEMO_PROMPTS[:1], engine.vocab_size)
    rows, notes = compare_systems(engine, hf, ids, mask, args.max_new_tokens, args.runs)
    say(compare.table(rows))
    for note in notes:
        say(note)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.as_dict() for r in rows],
                                               "notes": notes}, indent=2))
    return 0


def demo_engine(config: object) -> object:
    """The bundled pair's engine: loaded from the cache directory, else built and saved there."""
    import fuser
    from fuser.engine_io import save

    directory = demo_cache_dir()
    if is_engine_dir(str(directory)):
        try:
            return fuser.load(directory, log=progress, wait_for_graphs=True)  # it times
        except fuser.EngineFileError as e:
            progress(f"the cached engine in {directory} cannot be used ({e}); rebuilding it")
    else:
        progress(f"first run: building the demo engine (saved to {directory} for later runs)")
    engine, source, _ = build_engine_from_args(None, None, config)
    progress(f"saving to {directory} ...")
    save(engine, directory, overwrite=True, source=source)
    return engine


def cmd_demo(args: argparse.Namespace) -> int:
    import fuser
    from fuser import compare
    from fuser.models import bundled_pair

    say("fuser demo")
    prompts = DEMO_PROMPTS
    config = fuser.FuserConfig(max_batch_size=len(prompts), max_seq_len=256)
    if args.model is None and bundled_pair() is not None and not args.no_cache:
        engine = demo_engine(config)
        source = dict((engine.manifest or {}).get("info", {}).get("source", {})) or \
            {"target": str(bundled_pair()[0])}
    else:
        engine, source = open_engine(args.model, args.draft, config, wait_for_graphs=True)
    say(str(engine.report()))
    eos, pad = _generation_ids(engine)
    ids, mask = _encode(engine.tokenizer, prompts, engine.vocab_size)
    say("-" * 60)
    out = []
    for i, column in enumerate(engine.stream(ids, args.max_new_tokens, attention_mask=mask,
                                             eos_token_id=eos, pad_token_id=pad)):
        if i == 0:
            progress(f"first token {time.perf_counter() - STARTED:.1f} s after the command "
                     "started (imports included)")
        out.append(column)
    gen = torch.cat([ids, torch.stack(out, 1)], dim=1)
    for text in _decode(engine.tokenizer, gen):
        say(text + "\n" + "-" * 60)
    hf = _hf_model(source, engine)
    rows, notes = compare_systems(engine, hf, ids, mask, args.max_new_tokens, args.runs)
    say(compare.table(rows))
    for note in notes:
        say(note)
    return 0


def version_text() -> str:
    """`fuser --version`: fuser's version, then the versions of what it compiles with."""
    import importlib.metadata as metadata

    import fuser

    lines = [f"fuser {fuser.__version__}", f"torch {torch.__version__}"]
    for name in ("triton", "transformers"):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """Print version_text() and exit, importing fuser only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        say(version_text())
        parser.exit()


DRAFT_HELP = "a draft model directory for speculative decoding (default: none)"
MAX_NEW_TOKENS_HELP = "tokens to generate per prompt (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuser", description="A compiler for LLM decoding.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of fuser, torch, triton and transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the bundled default model pair, end to end")
    demo.add_argument("--model", default=None, help="a model directory instead of the bundled target")
    demo.add_argument("--draft", default=None, help=DRAFT_HELP + "; with --model only")
    demo.add_argument("--max-new-tokens", type=int, default=48, help=MAX_NEW_TOKENS_HELP)
    demo.add_argument("--runs", type=int, default=3,
                      help="timed runs per system, the median reported (default: %(default)s)")
    demo.add_argument("--no-cache", action="store_true", help="build, do not use the cached engine")
    demo.set_defaults(fn=cmd_demo)
    build = sub.add_parser("build", help="build an engine directory from model directories")
    build.add_argument("model", help="the target model directory (Hugging Face format)")
    build.add_argument("--draft", default=None, help=DRAFT_HELP)
    build.add_argument("--precision", default="auto",
                       help="auto (the model's dtype), fp32, bf16, fp16 or fp8 (FP8 weights, "
                            "per-channel scales) (default: %(default)s)")
    build.add_argument("--gamma", default="auto",
                       help="draft tokens per speculative step, 0 to 15, or auto (chosen from "
                            "measured step costs and acceptance) (default: %(default)s)")
    build.add_argument("--max-batch-size", type=int, default=1,
                       help="most sequences per call (default: %(default)s)")
    build.add_argument("--max-seq-len", type=int, default=2048,
                       help="most tokens per sequence, prompt plus generated "
                            "(default: %(default)s)")
    build.add_argument("--suffix-steps", action="store_true",
                       help="also build the target's verify steps that suffix speculation "
                            "needs (fuser serve ENGINE_DIR --adapt-draft): without --draft for "
                            "the gamma candidates, with one for the long suffix gammas 16 and "
                            "32 (the index's proposals verified alone)")
    build.add_argument("--block-size", type=int, default=0,
                       help="page the KV cache in blocks of this many slots (fuser serve "
                            "ENGINE_DIR then gives blocks as requests need them, with prefix "
                            "caching); 0: contiguous (default: %(default)s)")
    build.add_argument("--gpu-memory-fraction", type=float, default=None,
                       help="with --block-size on CUDA: the paged pools take this fraction of "
                            "the GPU memory free after the weights (default: every row at "
                            "max-seq-len)")
    build.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the target over this many processes (one per GPU on CUDA, "
                            "gloo processes on the CPU), each reading only its slices of the "
                            "weights; --out then holds rank0/, rank1/, ... and "
                            "tensor_parallel.json, which fuser serve and fuser.load read "
                            "(default: %(default)s)")
    build.add_argument("--out", required=True, help="the engine directory to write")
    build.add_argument("--overwrite", action="store_true",
                       help="replace --out if it exists")
    build.set_defaults(fn=cmd_build)
    inspect = sub.add_parser("inspect", help="manifest, passes fired, fused ops, shapes, files")
    inspect.add_argument("engine", help="an engine directory (written by fuser build)")
    inspect.set_defaults(fn=cmd_inspect)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("model", help="a model directory, an engine directory, or (with --runtime "
                                   "onnxruntime) an ONNX export directory")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help=MAX_NEW_TOKENS_HELP)
    gen.add_argument("--max-seq-len", type=int, default=1024,
                     help="most tokens per sequence when building from a model directory "
                          "(default: %(default)s)")
    gen.add_argument("--draft", default=None, help=DRAFT_HELP + "; model directories only")
    gen.add_argument("--sample", action="store_true",
                     help="sample from the model's distribution (default: greedy)")
    gen.add_argument("--seed", type=int, default=0,
                     help="random seed for --sample (default: %(default)s)")
    gen.add_argument("--runtime", choices=("fuser", "onnxruntime"), default="fuser",
                     help="run fuser's own steps, or the ONNX export of the model run by "
                          "onnxruntime on the CPU through the same decoding loop "
                          "(default: %(default)s)")
    gen.set_defaults(fn=cmd_generate)
    export = sub.add_parser("export", help="export a model's steps for another runtime (ONNX)")
    export.add_argument("model", help="a model directory or an engine directory")
    export.add_argument("--format", choices=("onnx",), required=True,
                        help="onnx: prefill and decode graphs with onnxruntime's fused operators, "
                             "the KV cache as inputs and outputs")
    export.add_argument("--out", required=True, help="the directory to write")
    export.add_argument("--draft", default=None, help=DRAFT_HELP + "; model directories only")
    export.add_argument("--precision", default="auto",
                        help="auto (the model's dtype), fp32, bf16 or fp16; fp8 is refused "
                             "(default: %(default)s)")
    export.add_argument("--gamma", default="auto",
                        help="the draft length the onnxruntime runtime uses, 0 to 15 or auto "
                             "(default: %(default)s)")
    export.add_argument("--max-seq-len", type=int, default=2048,
                        help="most tokens per sequence: the cache the runtime allocates and the "
                             "positions the rotary tables cover (default: %(default)s)")
    export.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    export.set_defaults(fn=cmd_export)
    bench = sub.add_parser("bench", help="time fuser (speculative, target-only) and HF generate")
    bench.add_argument("model", help="a model directory or an engine directory")
    bench.add_argument("--draft", default=None, help=DRAFT_HELP + "; model directories only")
    bench.add_argument("--max-new-tokens", type=int, default=128, help=MAX_NEW_TOKENS_HELP)
    bench.add_argument("--runs", type=int, default=3,
                       help="timed runs per system, the median reported (default: %(default)s)")
    bench.add_argument("--no-hf", action="store_true", help="skip the Hugging Face column")
    bench.add_argument("--json", default=None, metavar="FILE",
                       help="also write the table and notes to FILE as JSON")
    bench.set_defaults(fn=cmd_bench)
    for command in (demo, build, gen, bench):
        command.add_argument("--threads", type=int, default=None,
                             help="intra-op CPU threads (default without CUDA: 1, or "
                                  "OMP_NUM_THREADS when set)")
    from fuser.server.cli import add_serve_parser  # imports no server dependency

    add_serve_parser(sub)
    return parser


def set_threads(threads: int | None) -> None:
    """Intra-op threads for this process's CPU work (--threads): the number given; without one,
    1 on a machine without CUDA unless OMP_NUM_THREADS says otherwise.

    The bundled models are small enough that splitting each op between threads costs more than
    it saves, and when other processes share the cores, threads waiting on each other at every
    op slow decoding down many times over (measured on a shared CPU, 2026-11-30).
    Every system a command times runs under the same setting."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads} must be at least 1")
    if threads is None and (torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ):
        return
    torch.set_num_threads(threads or 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "threads"):
            set_threads(args.threads)
        return int(args.fn(args))
    except (ValueError, FileNotFoundError, NotImplementedError, torch.OutOfMemoryError) as e:
        print(f"fuser: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
