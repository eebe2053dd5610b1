"""End-to-end decode at batch 1 on the GPU: fuser against Hugging Face, in one run.

    python benchmarks/decode.py --preset llama-3-8b --out $OUT/decode.json

Random bf16 weights of the preset's shape, a 128-token prompt, 256 new tokens (greedy). Peers in
the same process (benchmarks/peers.py): Hugging Face eager `generate`, Hugging Face static cache
+ torch.compile (reduce-overhead), and gpt-fast's approach in plain PyTorch. Also times the
target's captured decode step (T = 1) and verification step (T = 5) by CUDA events over graph
replays, breaks the decode step's kernel time down by op (benchmarks/breakdown.py), and measures
the HBM read bandwidth of this GPU, from which the weight-read ceiling follows: bytes a decode
step must read (every weight but the embedding table) / measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch
import triton
import transformers

import fuser
from breakdown import format_breakdown, kernel_breakdown
from fuser.build import add_step, capture_cuda_graphs, warm_up
from fuser.models import PRESETS
from fuser.runtime.step_graphs import PLAIN
from fuser.runtime.steps import DECODE, PREFILL, verify
from peers import make_gpt_fast_style, make_hf_eager, make_hf_static_compile
from timing import log, measure_read_bandwidth, replay_median_ms, step_bytes

RESULTS: dict = {}


def timed_generate(fn, runs: int) -> tuple[float, int]:
    """Median seconds over `runs` calls of fn() -> new tokens, and the new-token count."""
    times, count = [], 0
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        count = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], count


def event_time_ms(fn, iters: int = 100) -> float:
    """Median milliseconds of fn() by CUDA events, after warm-up."""
    for _ in range(10):
        fn()
    samples = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    samples.sort()
    return samples[len(samples) // 2]


def save(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3-8b",
                        help="a model shape of fuser.models.PRESETS, random bf16 weights")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run")
    parser.add_argument("--skip-hf-compile", action="store_true",
                        help="skip Hugging Face static cache + torch.compile")
    parser.add_argument("--skip-gpt-fast", action="store_true",
                        help="skip the gpt-fast-style peer (benchmarks/peers.py)")
    parser.add_argument("--skip-peers", action="store_true", help="fuser only")
    parser.add_argument("--profile", action="store_true",
                        help="break the decode step's kernel time down by op")
    parser.add_argument("--skip-verify", action="store_true",
                        help="skip timing the verification step (T = 5)")
    parser.add_argument("--fused-attention", choices=["default", "on", "off"], default="default",
                        help="FuserConfig.fused_attention: the split-K Triton op for decode/verify")
    parser.add_argument("--precisions", default="bf16,fp8",
                        help="fuser engines to time, comma-separated: bf16 (the model's own) and fp8")
    parser.add_argument("--prefill-tokens", type=int, default=2048,
                        help="prompt length of the prefill timing")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the preset's); fewer for a quick per-op "
                             "profile, whose per-layer rows do not depend on the layer count")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"benchmarks/decode.py: no CUDA device (torch {torch.__version__}); it times "
                 "the engines on a GPU: run it on the GPU machine")
    warnings.simplefilter("ignore")
    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "transformers": transformers.__version__,
                      "preset": args.preset, "prompt_tokens": args.prompt_tokens,
                      "new_tokens": args.new_tokens, "layers": args.layers,
                      "command": " ".join(sys.argv)}
    bandwidth = measure_read_bandwidth()
    log(f"HBM read bandwidth: {bandwidth / 1e12:.2f} TB/s")

    torch.manual_seed(0)
    preset = dict(PRESETS[args.preset])
    if args.layers is not None:
        preset["num_hidden_layers"] = args.layers
    config = transformers.LlamaConfig(**preset)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    nbytes = step_bytes(model)
    ceiling = bandwidth / nbytes
    RESULTS["bandwidth_TBps"] = bandwidth / 1e12
    RESULTS["step_GB"] = nbytes / 1e9
    RESULTS["ceiling_tok_s"] = ceiling
    log(f"decode step reads {nbytes / 1e9:.2f} GB: ceiling {ceiling:.0f} tok/s")
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device="cuda")
    rows: list[tuple[str, float, int]] = []
    steps: dict[str, dict] = {}
    for precision in args.precisions.split(","):
        steps[precision] = time_fuser(model, precision, prompt, args, rows, bandwidth)
        torch.cuda.empty_cache()
    save(args.out)
    if not args.skip_peers:
        hf_peers(model, prompt, args, rows, ceiling)
    summary(rows, ceiling, nbytes, bandwidth, steps, args.out)


def fp8_step_bytes(model: torch.nn.Module, lm_head: bool = True) -> int:
    """Bytes a decode step reads with FP8 linears: one byte per linear weight (plus a 4-byte
    scale per output channel), the model dtype for the rest (norms), embedding row excluded."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and (lm_head or module is not
                                                    model.get_output_embeddings()):
            total += module.weight.numel() + 4 * module.weight.shape[0]
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if p.dim() == 1)
    return total + norms


def time_fuser(model: torch.nn.Module, precision: str, prompt: torch.Tensor,
               args: argparse.Namespace, rows: list, bandwidth: float) -> dict:
    """Build a fuser engine at `precision`, time generate, the decode and verify steps, and a
    prefill of --prefill-tokens; returns the step figures."""
    n = args.new_tokens
    nbytes = step_bytes(model) if precision != "fp8" else fp8_step_bytes(model)
    ceiling = bandwidth / nbytes
    result: dict = {"step_GB": nbytes / 1e9, "ceiling_tok_s": ceiling}
    start = time.perf_counter()
    options = {} if args.fused_attention == "default" else {
        "fused_attention": args.fused_attention == "on"}
    if precision == "fp8":
        options["precision"] = "fp8"
    max_seq_len = max(args.prompt_tokens + n + 16, args.prefill_tokens + 1)
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_seq_len=max_seq_len, **options))
    result["config"] = repr(engine.config)
    result["optimize_seconds"] = time.perf_counter() - start
    report = engine.report()
    result["report"] = {"passes": report.passes, "fused_ops": report.fused_ops,
                        "fallbacks": report.fallbacks}
    log(f"[{precision}] fuser.optimize: {result['optimize_seconds']:.0f} s\n{report}")
    if engine.target is None:  # fell back to eager: nothing of fuser's to time
        log(f"[{precision}] the target fell back to eager PyTorch: {report.fallbacks}")
        RESULTS[f"fuser_{precision}"] = result
        return result
    no_eos = dict(eos_token_id=[model.config.vocab_size - 1])  # random weights: never emitted
    engine.generate(prompt, 8, **no_eos)
    seconds, count = timed_generate(
        lambda: engine.generate(prompt, n, **no_eos).shape[1] - args.prompt_tokens, runs=3)
    name = f"fuser.optimize(model), {precision}"
    rows.append((name, seconds, count))
    result["tok_s"] = count / seconds
    result["pct_ceiling"] = 100 * count / seconds / ceiling
    log(f"[{precision}] fuser generate: {count} tokens in {seconds:.3f} s = {count / seconds:.1f} "
        f"tok/s ({result['pct_ceiling']:.1f}% of its {ceiling:.0f} tok/s ceiling)")
    result["graph_replays"] = engine.report().graph_replays
    # What generate replays per token: the whole target-only iteration (the decode step, the
    # token's choice, the state update, the packed result) as one graph, at the context length
    # halfway through the timed run; its gap to the per-token time is the host loop's share.
    bucket = engine.buckets[min(engine.buckets)]
    result["iteration_ms"] = 1e3 * bucket.measure(PLAIN, args.prompt_tokens + n // 2, 20)
    log(f"[{precision}] per token: generate {1e3 * seconds / count:.3f} ms (prefill included), "
        f"target-only iteration graph {result['iteration_ms']:.3f} ms at "
        f"{args.prompt_tokens + n // 2} slots")
    # generate's time, taken apart: the call up to its first token (the prompt's prefill and
    # the host's set-up), and the iterations replayed back to back with no host loop between
    # them (the GPU never idles, as in generate, so clocks and power are as there).
    first_s, _ = timed_generate(lambda: engine.generate(prompt, 1, **no_eos).shape[1], runs=5)
    result["first_token_ms"] = 1e3 * first_s
    result["back_to_back_ms"] = 1e3 * back_to_back_seconds(bucket, args.prompt_tokens, n - 1) / (
        n - 1)
    log(f"[{precision}] generate's parts: first token (prefill of {args.prompt_tokens}) "
        f"{result['first_token_ms']:.2f} ms; {n - 1} iterations back to back "
        f"{result['back_to_back_ms']:.3f} ms each; sum "
        f"{result['first_token_ms'] + (n - 1) * result['back_to_back_ms']:.1f} ms against "
        f"generate's {1e3 * seconds:.1f} ms")

    one, at = prompt[:, :1], torch.zeros(1, 1, dtype=torch.long, device="cuda")
    capture_cuda_graphs(engine.target)  # the step alone as a CUDA graph (generate replays
    # whole iterations: step, choice and state update in one graph)
    decode_ms = event_time_ms(lambda: engine.target.run(DECODE, one, at))
    result["decode_step_ms"] = decode_ms
    log(f"[{precision}] target decode step (T=1): {decode_ms:.3f} ms = "
        f"{nbytes / (decode_ms * 1e-3) / 1e12:.2f} TB/s")
    if args.profile:
        step = engine.target[DECODE].uncaptured  # the kernels the CUDA graph replays
        cache = engine.target.cache
        cache.set_lengths(args.prompt_tokens)
        with torch.no_grad():  # as the engine runs it: a step with grad would recompile
            table = kernel_breakdown(lambda: step(one, at, cache.seq_lens, cache.starts))
        result["decode_breakdown"] = table
        log(format_breakdown(table, decode_ms))
        result["kernels_per_step"] = table.get("launches")
        try:
            result["iteration_breakdown"] = profile_iteration(
                bucket, args.prompt_tokens + n // 2, table)
        except Exception as error:  # noqa: BLE001  (new, never run on a GPU: the rest goes on)
            log(f"[{precision}] iteration profile failed: {error!r}"[:300])
    result["prefill_ms"] = time_prefill(engine, args.prefill_tokens, model.config.vocab_size)
    log(f"[{precision}] prefill of {args.prefill_tokens} tokens: {result['prefill_ms']:.1f} ms")
    if args.profile:
        table = profile_prefill(engine, args.prefill_tokens, model.config.vocab_size)
        result["prefill_breakdown"] = table
        log(f"[{precision}] prefill breakdown (host launch time {table['launch_ms']:.1f} ms)\n"
            f"{format_breakdown(table, result['prefill_ms'], host=True)}")
    if not args.skip_verify:
        result["verify5_ms"] = time_verify(engine, prompt, decode_ms)
        result["replayed_ms"] = time_steps_alike(engine, prompt)
        if args.profile:
            table = profile_verify(engine, prompt)
            result["verify5_breakdown"] = table
            log(f"[{precision}] verify breakdown\n{format_breakdown(table, result['verify5_ms'])}")
    engine.target.cache.reset()
    RESULTS[f"fuser_{precision}"] = result
    save(args.out)
    engine = None  # free its caches and graphs before the next engine
    torch._dynamo.reset()
    return result


def back_to_back_seconds(bucket, length: int, iterations: int) -> float:
    """Seconds of `iterations` target-only greedy iterations replayed back to back from
    `length` slots (CUDA events around them all; the host queues them without waiting)."""
    bucket.reset_for_timing(length)
    bucket.run(PLAIN, False)  # warm
    bucket.reset_for_timing(length)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iterations):
        bucket.run(PLAIN, False)
    end.record()
    end.synchronize()
    bucket.reset_for_timing(0)
    graph = bucket.graphs.get((PLAIN, False))
    if graph is not None:  # timing runs are not decoding (as in measure)
        graph.replays -= iterations + 1
    return begin.elapsed_time(end) * 1e-3


def profile_iteration(bucket, length: int, step_table: dict) -> dict:
    """The target-only iteration's kernels (run uncaptured, as it is captured) that the decode
    step does not launch: the token's choice, the state update, the packed result. Logs them
    with the iteration's kernel count; returns {"launches": ..., "extra": {kernel: us}}."""
    bucket.reset_for_timing(length)  # 25 iterations from here (kernel_breakdown's calls)
    with torch.no_grad():
        table = kernel_breakdown(bucket.function(PLAIN, False))
    bucket.reset_for_timing(0)
    extra = {name: us for name, us in table["kernels"].items()
             if name not in step_table["kernels"]}
    lines = [f"iteration: {table['launches']:.0f} kernels (the step's {step_table['launches']:.0f}"
             f" and these, us each):"]
    lines += [f"  {name[:70]:<70}{us:>8.1f}" for name, us in
              sorted(extra.items(), key=lambda kv: -kv[1])[:12]]
    log("\n".join(lines))
    return {"launches": table["launches"], "extra": extra}


def time_prefill(engine: fuser.Engine, tokens: int, vocab: int) -> float:
    """Median ms of the target's prefill step over `tokens` random tokens (one row)."""
    ids, positions = prefill_inputs(engine, tokens, vocab)
    cache = engine.target.cache
    B = cache.batch_size
    last = torch.full((B,), tokens - 1, dtype=torch.long, device="cuda")

    def prefill() -> None:  # as a request runs it: captured where the length is
        cache.begin(torch.zeros(B, dtype=torch.long, device="cuda"))
        engine.target.run_last(PREFILL, ids, positions, last)

    ms = event_time_ms(prefill, iters=10)
    cache.reset()
    return ms


def prefill_inputs(engine: fuser.Engine, tokens: int,
                   vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [B, tokens] (seeded) and their positions, B the cache's batch size."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), device="cuda", generator=g)
    positions = torch.arange(tokens, device="cuda")[None]
    B = engine.target.cache.batch_size
    return ids.expand(B, tokens).contiguous(), positions.expand(B, tokens).contiguous()


def profile_prefill(engine: fuser.Engine, tokens: int, vocab: int) -> dict:
    """The prefill's kernels by group and its ops by shape (benchmarks/breakdown.py), run
    uncaptured so that the profiler sees each kernel."""
    ids, positions = prefill_inputs(engine, tokens, vocab)
    cache = engine.target.cache
    step = engine.target[PREFILL].uncaptured

    def prefill() -> None:
        cache.begin(torch.zeros(ids.shape[0], dtype=torch.long, device="cuda"))
        step(ids, positions, cache.seq_lens, cache.starts)

    with torch.no_grad():
        table = kernel_breakdown(prefill, steps=3)
        launches = []
        for _ in range(3):  # the host's time to launch the prefill, without waiting for it
            torch.cuda.synchronize()
            start = time.perf_counter()
            prefill()
            launches.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    table["launch_ms"] = sorted(launches)[1] * 1e3
    cache.reset()
    return table


def profile_verify(engine: fuser.Engine, prompt: torch.Tensor) -> dict:
    """The verification step's (T = 5) kernels by group and its ops by shape, uncaptured."""
    cache = engine.target.cache
    step = engine.target[verify(4)].uncaptured
    cache.set_lengths(prompt.shape[1])
    positions = torch.arange(5, device="cuda")[None]
    with torch.no_grad():
        table = kernel_breakdown(lambda: step(prompt[:, :5], positions, cache.seq_lens,
                                              cache.starts))
    return table


def time_verify(engine: fuser.Engine, prompt: torch.Tensor, decode_ms: float) -> float:
    """Build, capture and time the target's verification step over 5 tokens."""
    steps, kind = engine.target, verify(4)
    add_step(steps, steps[DECODE].eager.model, kind, engine.config, engine.device)
    warm_up(steps)
    if engine.config.cuda_graphs:
        capture_cuda_graphs(steps)
    verify_ms = event_time_ms(lambda: steps.run(
        kind, prompt[:, :5], torch.arange(5, device="cuda")[None]))
    log(f"target verify step (T=5): {verify_ms:.3f} ms = {verify_ms / decode_ms:.3f} x decode")
    return verify_ms


def time_steps_alike(engine: fuser.Engine, prompt: torch.Tensor) -> dict[str, float]:
    """The decode (T = 1) and verify (T = 5) steps timed the same way at the same cache length
    (the prompt's): each captured alone and timed as benchmarks/timing.py's replay_median_ms,
    decode, verify, decode, verify, each figure the mean of its two runs (so drift between them
    falls on both). time_verify's ratio divides a step timed through the engine's graphs after a
    recapture by one timed before it; this one is like for like. Logs and returns the figures."""
    cache = engine.target.cache
    times: dict[str, list[float]] = {}
    for _ in range(2):
        for T, kind in ((1, DECODE), (5, verify(4))):
            step = engine.target[kind].uncaptured
            positions = torch.arange(T, device="cuda")[None]
            cache.set_lengths(prompt.shape[1])
            with torch.no_grad():
                ms, _ = replay_median_ms(
                    lambda: step(prompt[:, :T], positions, cache.seq_lens, cache.starts))
            times.setdefault(f"T{T}", []).append(ms)
    result = {key: sum(v) / len(v) for key, v in times.items()}
    result["ratio"] = result["T5"] / result["T1"]
    log(f"steps replayed alike (cache at {prompt.shape[1]} slots): decode {result['T1']:.3f} ms, "
        f"verify (T=5) {result['T5']:.3f} ms = {result['ratio']:.3f}x decode "
        f"(runs: decode {', '.join(f'{t:.3f}' for t in times['T1'])}; verify "
        f"{', '.join(f'{t:.3f}' for t in times['T5'])})")
    return result


def hf_peers(model: torch.nn.Module, prompt: torch.Tensor, args: argparse.Namespace,
             rows: list, ceiling: float) -> None:
    """The peers of benchmarks/peers.py in this process, each warmed up, then timed."""
    n = args.new_tokens
    peers = [("Hugging Face eager generate", make_hf_eager, 1, 2)]
    if not args.skip_hf_compile:
        peers.append(("Hugging Face static cache + torch.compile", make_hf_static_compile, 2, 3))
    if not args.skip_gpt_fast:
        peers.append(("gpt-fast style (static cache, compiled step)", make_gpt_fast_style, 2, 3))
    for name, make, warmups, runs in peers:
        try:
            run = make(model, prompt, n)
            start = time.perf_counter()
            for _ in range(warmups):
                run()
            RESULTS[f"warmup_seconds: {name}"] = time.perf_counter() - start
            seconds, count = timed_generate(lambda: run().shape[1], runs=runs)
        except Exception as e:  # a peer that breaks on this stack must not lose the others
            RESULTS[f"error: {name}"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"{name}: failed ({type(e).__name__}: {str(e)[:300]})")
            continue
        finally:
            torch._dynamo.reset()
        rows.append((name, seconds, count))
        log(f"{name}: {count / seconds:.1f} tok/s ({100 * count / seconds / ceiling:.1f}% of "
            f"the ceiling; warm-up {RESULTS[f'warmup_seconds: {name}']:.0f} s)")
        save(args.out)


def summary(rows: list, ceiling: float, nbytes: int, bandwidth: float, steps: dict,
            out: str | None) -> None:
    RESULTS["rows"] = [{"system": s, "seconds": t, "new_tokens": c, "tok_s": c / t,
                        "pct_bf16_ceiling": 100 * c / t / ceiling} for s, t, c in rows]
    save(out)
    log(f"\n{'system':<44}{'tok/s':>8}{'% bf16 ceiling':>16}")
    for r in RESULTS["rows"]:
        log(f"{r['system']:<44}{r['tok_s']:>8.1f}{r['pct_bf16_ceiling']:>15.1f}%")
    log(f"bf16 ceiling {ceiling:.0f} tok/s ({nbytes / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s)")
    for precision, r in steps.items():
        if "tok_s" not in r:
            log(f"[{precision}] fell back to eager: {r['report']['fallbacks']}")
            continue
        verify = r.get("verify5_ms", float("nan"))
        log(f"[{precision}] {r['tok_s']:.1f} tok/s = {r['pct_ceiling']:.1f}% of its "
            f"{r['ceiling_tok_s']:.0f} tok/s ceiling; decode step {r['decode_step_ms']:.3f} ms, "
            f"verify(T=5) {verify:.3f} ms ({verify / r['decode_step_ms']:.3f}x; replayed alike "
            f"{r.get('replayed_ms', {}).get('ratio', float('nan')):.3f}x), prefill "
            f"{r['prefill_ms']:.1f} ms, kernels/step {r.get('kernels_per_step')}")
    if all("tok_s" in steps.get(p, {}) for p in ("bf16", "fp8")):
        log(f"fp8 vs bf16: decode {steps['fp8']['tok_s'] / steps['bf16']['tok_s']:.2f}x, prefill "
            f"{steps['bf16']['prefill_ms'] / steps['fp8']['prefill_ms']:.2f}x faster")


if __name__ == "__main__":
    main()
