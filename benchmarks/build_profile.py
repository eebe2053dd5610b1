"""Where a multi-bucket build's time goes: per batch bucket and per graph kind.

Builds one engine (a random Llama of a given shape, optionally with a draft: the target itself
with noise) and times, by wrapping the build's functions, each export, retrace (`specialize`),
pass run, Inductor compile + first run, bucket warm-up, the eager self-check and
`Engine.prepare`; prints a table (seconds) and the build's total.

    python benchmarks/build_profile.py --layers 8 --max-batch-size 64 --compile fx
    python benchmarks/build_profile.py --layers 4 --max-batch-size 64 --compile inductor \\
        --draft --gamma auto
    python benchmarks/build_profile.py --preset llama-3-8b --device cuda --dtype bfloat16 \\
        --max-batch-size 256 --max-seq-len 512 --compile inductor      # on the GPU

Batch buckets: --buckets, else the engine's own (every power of two below --max-batch-size on
CUDA, only --max-batch-size on CPU). Runs on CPU or CUDA (`--device cuda`); `--json FILE`
writes the rows too. Inductor's on-disk caches make a second build of the same graphs faster:
compare builds under a fresh TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) each.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator

import torch


def _llama(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    """A random Llama of the requested shape (--preset, else the shape flags), built directly
    in --dtype on --device, in eval mode."""
    import transformers

    if args.preset:
        from fuser.models import PRESETS

        fields = dict(PRESETS[args.preset])
    else:
        fields = dict(
            vocab_size=args.vocab, hidden_size=args.heads * args.head_dim,
            intermediate_size=args.intermediate, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, max_position_embeddings=max(256, 2 * args.max_seq_len),
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    finally:
        torch.set_default_dtype(torch.float32)


class Timings:
    """Wall seconds and this process's CPU seconds per (phase, graph, rows), summed over calls,
    in first-seen order. CPU seconds hardly move when other processes share the cores (wall
    seconds do); they leave out the compile workers' processes."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str, str], float] = collections.OrderedDict()
        self.cpu: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def add(self, phase: str, graph: str, rows: str, seconds: float, cpu: float) -> None:
        key = (phase, graph, rows)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.cpu[key] += cpu
        self.calls[key] += 1

    def wrap(self, owner: object, name: str, phase: str,
             label: Callable[..., tuple[str, str]]) -> contextlib.AbstractContextManager:
        """Patch `owner.name` with a timed version labelled by label(*args, **kwargs)."""
        original = getattr(owner, name)

        def timed(*a, **k):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*a, **k)
            finally:
                graph, rows = label(*a, **k)
                self.add(phase, graph, rows, time.perf_counter() - start,
                         time.process_time() - cpu)

        @contextlib.contextmanager
        def patched() -> Iterator[None]:
            setattr(owner, name, timed)
            try:
                yield
            finally:
                setattr(owner, name, original)

        return patched()


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    """`owner.name` = value for the duration."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def profile(args: argparse.Namespace) -> tuple[Timings, float]:
    """Build the engine under the timers: (timings, total build seconds)."""
    import fuser
    import fuser.build as build
    import fuser.pipeline as pipeline
    from fuser.compile import CompiledStep
    from fuser.engine import Engine

    timings = Timings()
    target = _llama(args, 0)
    draft = None
    if args.draft:
        draft = _llama(args, 0)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.05 * torch.randn_like(p))
    gamma: int | str = args.gamma if args.gamma == "auto" else int(args.gamma)
    config = fuser.FuserConfig(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                               compile=args.compile, device=args.device, gamma=gamma,
                               batch_buckets="auto" if args.buckets is None else
                               tuple(int(b) for b in args.buckets.split(",")))

    def export_label(module, batch, tokens, **k):
        return ("prefill" if getattr(module, "prefill", False) else f"T={tokens}", str(batch))

    def specialize_label(gm, k, v, tokens):
        return (f"T={tokens}", str(k[0].shape[0] * tokens))

    def passes_label(gm, context, passes=None):
        rows = "?"
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.target == "tokens" and "val" in node.meta:
                rows = str(node.meta["val"].numel())
        return (context.graph_name + ("" if context.kind.tokens is None
                                      else str(context.kind.tokens)), rows)

    def compile_label(step, args):
        tokens = args[-4]
        return (f"T={tokens.shape[1]}", str(tokens.numel()))

    def warm_label(steps):
        return (steps.role, str(steps.cache.batch_size))

    def check_label(steps, *a, **k):
        return (steps.role, str(steps.cache.batch_size))

    def prepare_label(engine, *a, **k):
        return ("engine", "all")

    with contextlib.ExitStack() as stack:
        if args.baseline:  # the build as it ran before: each pass recompiling, a fresh
            import fuser.passes  # decomposition table per trace, Inductor's workers started
            import fuser.passes.base  # by its first kernel
            from torch._decomp import core_aten_decompositions

            stack.enter_context(_patched(fuser.passes, "deferred_recompile",
                                         contextlib.nullcontext))
            stack.enter_context(_patched(fuser.passes.base, "core_aten_table",
                                         core_aten_decompositions))
            stack.enter_context(_patched(pipeline, "start_compile_workers", lambda *a: False))
        stack.enter_context(timings.wrap(build, "export_step", "export", export_label))
        stack.enter_context(timings.wrap(build, "specialize", "specialize", specialize_label))
        stack.enter_context(timings.wrap(build, "run_passes", "passes", passes_label))
        stack.enter_context(timings.wrap(CompiledStep, "_first_call", "inductor", compile_label))
        stack.enter_context(timings.wrap(pipeline, "warm_up", "warm_up", warm_label))
        stack.enter_context(timings.wrap(pipeline, "check_against_eager", "self-check",
                                         check_label))
        stack.enter_context(timings.wrap(Engine, "prepare", "prepare", prepare_label))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = fuser.optimize(target, draft=draft, config=config)
        total = time.perf_counter() - start
    print(f"buckets {sorted(engine.buckets)}; fallbacks: {engine.report().fallbacks or 'none'}")
    return timings, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None,
                        help="a fuser.models preset shape (e.g. llama-3-8b) instead of the flags")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--buckets", default=None, help="comma-separated (default: auto)")
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--compile", default="fx", choices=("fx", "inductor"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft", action="store_true", help="speculative: target + noisy copy")
    parser.add_argument("--gamma", default="auto", help="an int or auto (with --draft)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--baseline", action="store_true",
                        help="A/B: build as before run_passes deferred its recompiles, the "
                             "passes kept one decomposition table and the build started "
                             "Inductor's workers early")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    timings, total = profile(args)
    phases: dict[str, float] = collections.defaultdict(float)
    phases_cpu: dict[str, float] = collections.defaultdict(float)
    print(f"{'phase':<11} {'graph':<18} {'rows':>5} {'calls':>5} {'seconds':>8} {'cpu s':>8}")
    for key, seconds in timings.seconds.items():
        phase, graph, rows = key
        phases[phase] += seconds
        phases_cpu[phase] += timings.cpu[key]
        print(f"{phase:<11} {graph:<18} {rows:>5} {timings.calls[key]:>5} {seconds:8.2f} "
              f"{timings.cpu[key]:8.2f}")
    print("totals: " + ", ".join(f"{p} {s:.1f} s" for p, s in phases.items()))
    print("cpu totals: " + ", ".join(f"{p} {s:.1f} s" for p, s in phases_cpu.items()))
    print(f"build {total:.1f} s{' (baseline)' if args.baseline else ''}")
    if args.json:
        rows = [dict(phase=p, graph=g, rows=r, calls=timings.calls[p, g, r], seconds=s,
                     cpu_seconds=timings.cpu[p, g, r])
                for (p, g, r), s in timings.seconds.items()]
        with open(args.json, "w") as f:
            json.dump(dict(build_seconds=total, rows=rows, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
