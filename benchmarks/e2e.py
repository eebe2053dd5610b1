"""End-to-end speculative decoding: fuser's step graphs against Hugging Face, in one run.

    python benchmarks/e2e.py --out $OUT/e2e            # GPU (H200): ~6 minutes
    python benchmarks/e2e.py --dry-run --out /tmp/e2e  # CPU, tiny random models: the plumbing

(1) The bundled pair (fuser.models TARGET_PATH / DRAFT_PATH, bf16) on held-out prompts (one
    per held-out file, as models/evaluate.py draws them): HF eager, HF static cache +
    torch.compile, HF assisted generation with the same draft, fuser target-only, fuser at
    each gamma of --gammas and at gamma="auto" (choosing among --gammas, then on a second
    engine of FuserConfig's default candidates: what a user gets; auto's steps per gamma are
    traced): tok/s, acceptance, mean accepted length, and Leviathan's prediction from the
    measured iteration costs and the measured acceptance (E(alpha, g) / cost(g), alpha the same
    at every draft position, over the steps each gamma ran; reported as % of prediction),
    the graph bound (the tokens each step emitted in the run, over the step graph's
    measured cost: what the step graphs alone would give, without the host loop and the
    prefills; reported as % of it), plus the measured speculative step
    against the sum of its parts (draft catch-up + (g - 1) draft decodes + verify, each timed
    as its own CUDA graph).
(2) Llama-3-8B shape target with a Llama-3.2-1B shape draft, random bf16 weights (a draft
    that never agrees): iteration cost per gamma; gamma="auto" tok/s against target-only
    (must be >= 95%); a PROJECTED tok/s-vs-acceptance curve from the measured costs.
(3) Batch buckets: one prompt on a target-only engine built for max_batch_size=16 against one
    built for 1.
Writes e2e.json and e2e.png to --out; prints a short table last. `--plot-from A.json B.json`
merges runs made in parts (e.g. --skip-8b --skip-buckets, then --skip-bundled) into one JSON
and plot, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import fuser
from fuser.runtime.step_graphs import PLAIN
from fuser.runtime.steps import CATCHUP, DECODE, verify

RESULTS: dict = {"rows": []}


def log(message: str) -> None:
    print(message, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan: (1 - a^(g+1)) / (1 - a) tokens per step (g + 1 at a = 1)."""
    return gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_tok_s(steps: dict[int, int], alpha: float, costs: dict[int, float]) -> float:
    """Leviathan's prediction for a run whose steps ran at these gammas ({gamma: steps}; 0 =
    target-only): the steps' expected tokens at acceptance alpha over their measured costs
    (seconds per step). One gamma: E(alpha, g) / cost(g)."""
    seconds = sum(k * costs[g] for g, k in steps.items())
    return sum(k * expected_tokens(alpha, g) for g, k in steps.items()) / seconds


def timed(fn, runs: int, device: torch.device) -> tuple[float, int]:
    """(median seconds, new tokens) over `runs` calls of fn() -> new-token count."""
    times, count = [], 0
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        count = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], count


def row(part: str, system: str, seconds: float, tokens: int, **extra: object) -> dict:
    entry = {"part": part, "system": system, "tok_s": tokens / seconds, "tokens": tokens,
             "seconds": seconds, **extra}
    RESULTS["rows"].append(entry)
    log(f"[{part}] {system}: {entry['tok_s']:.1f} tok/s"
        + "".join(f", {k} {v:.3f}" if isinstance(v, float) else f", {k} {v}"
                  for k, v in extra.items()))
    return entry


def save(out: Path) -> None:
    (out / "e2e.json").write_text(json.dumps(RESULTS, indent=2))


def fuser_runs(engine: fuser.Engine, prompts: list[torch.Tensor], n: int, gamma: int | None,
               runs: int, trace: dict | None = None) -> tuple[float, int, fuser.SpecStats]:
    """Seconds and tokens of greedy generation over every prompt (median of runs), with gamma
    forced (None: the engine's own choice). trace: filled with the timed runs' steps per gamma
    and their tokens per row-step (`step_trace`)."""
    engine.fix_gamma(gamma)
    no_eos: dict = dict(eos_token_id=[])

    def go() -> int:
        return sum(engine.generate(p, n, **no_eos).shape[1] - p.shape[1] for p in prompts)

    engine.generate(prompts[0], 4, **no_eos)  # warm
    engine.stats.reset()
    if trace is not None:  # an instance attribute over the method, deleted below
        engine.record_step = step_trace(engine.record_step, trace)
    try:
        seconds, count = timed(go, runs, engine.device)
    finally:
        if trace is not None:
            del engine.record_step
    stats = engine.stats
    engine.fix_gamma(None)
    return seconds, count, stats


def step_trace(record: Callable, trace: dict) -> Callable:
    """engine.record_step, counting each step's gamma ("steps") and the tokens its active rows
    emitted ("tokens": accepted + 1 per row) per gamma into `trace`."""
    steps, tokens = trace.setdefault("steps", {}), trace.setdefault("tokens", {})

    def counted(controller, num_accepted, was_active, gamma, modes=None):
        live = [a + 1 for a, on in zip(num_accepted, was_active) if on]
        if live:
            steps[gamma] = steps.get(gamma, 0) + 1
            tokens[gamma] = tokens.get(gamma, 0) + sum(live)
        return record(controller, num_accepted, was_active, gamma, modes)
    return counted


def glue_step(engine: fuser.Engine, gamma: int) -> Callable[[], object]:
    """The greedy speculative step's kernels between its model graphs, on bucket 1, as the
    step graph runs them (runtime/speculative.py `speculative_step`, fused): the catch-up's
    inputs, argmax + advance after each draft step, the verify step's inputs, the target's
    argmax, and `finish_greedy_step`. On fixed random logits, with the row inactive so
    that each call leaves the state as it found it (finish then moves and writes nothing: the
    same loads and arithmetic, masked stores)."""
    from fuser.ops.argmax import argmax
    from fuser.runtime.draft_kernels import catchup_inputs, draft_advance, verify_inputs
    from fuser.runtime.step_kernels import finish_greedy_step

    bucket = engine.bucket(1)
    state, device, V = bucket.state, engine.device, engine.vocab_size
    state.active.zero_()
    target_cache, draft_cache = bucket.target.cache, bucket.draft.cache
    target_cache.set_lengths(128)
    gen = torch.Generator(device="cpu").manual_seed(0)
    draft_logits = torch.randn(1, V, generator=gen).to(device, torch.bfloat16)
    target_logits = torch.randn(1, gamma + 1, V, generator=gen).to(device, torch.bfloat16)
    drafted = torch.zeros(1, gamma, dtype=torch.long, device=device)

    def glue() -> torch.Tensor:
        catchup_inputs(draft_cache, target_cache.seq_lens, state.last, state.pending)
        for i in range(gamma):
            draft_advance(draft_logits, drafted, i, draft_cache, CATCHUP.tokens if i == 0 else 1)
        verify_inputs(target_cache, state.pending, drafted)
        return finish_greedy_step(state, target_cache.seq_lens, drafted, argmax(target_logits))
    return glue


def step_parts_ms(engine: fuser.Engine, gamma: int, draft_decodes: int | None = None
                  ) -> float | None:
    """Sum of the parts of a speculative iteration at gamma, each a CUDA graph of its own:
    draft catch-up + draft_decodes (default gamma - 1; an overlapped round runs gamma) draft
    decodes + verify(gamma), and for the standard step its glue kernels (`glue_step`)."""
    if engine.device.type != "cuda":
        return None
    from timing import time_us

    bucket = engine.bucket(1)
    total = 0.0
    parts = {}
    for name, steps, kind, times in (("draft catch-up", bucket.draft, CATCHUP, 1),
                                     ("draft decode", bucket.draft, DECODE,
                                      gamma - 1 if draft_decodes is None else draft_decodes),
                                     (f"target verify({gamma})", bucket.target, verify(gamma), 1),
                                     ("target decode", bucket.target, DECODE, 0)):
        if kind not in steps:
            continue
        T = kind.tokens
        tokens = torch.zeros(1, T, dtype=torch.long, device=engine.device)
        positions = torch.arange(T, device=engine.device)[None]
        fn = steps[kind].uncaptured
        cache = steps.cache
        cache.set_lengths(128)
        with torch.no_grad():
            us = time_us(lambda: fn(tokens, positions, cache.seq_lens, cache.starts)).us
        cache.reset()
        total += times * us
        parts[name] = us
    if draft_decodes is None:  # the standard step's glue kernels, timed together
        with torch.no_grad():
            us = time_us(glue_step(engine, gamma)).us
        bucket.draft.cache.reset()
        bucket.target.cache.reset()
        total += us
        parts["glue (inputs, argmax, finish)"] = us
    # each part alone (the target's decode step for scale, not a part): where a speculative
    # step's time goes beyond the target-only iteration's
    RESULTS.setdefault("bundled_parts_us", {})[str(gamma)] = parts
    log(f"  gamma {gamma} parts (us each, CUDA graph): "
        + ", ".join(f"{name} {us:.1f}" for name, us in parts.items()))
    return total / 1e3


def part_bundled(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 out: Path) -> None:
    """(1): the bundled pair on held-out prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fuser.models import DRAFT_PATH, TARGET_PATH
    from fuser.models.evaluate import heldout_files

    if args.dry_run:
        from tiny_models import tiny_pair

        target, draft, prompts = tiny_pair(device)
    else:
        target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=dtype).to(device).eval()
        draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
        prompts = []
        for text in heldout_files()[: args.prompts]:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : args.prompt_tokens]
            prompts.append(ids.to(device))
    n = args.new_tokens
    gammas = tuple(int(g) for g in args.gammas.split(","))
    runs = 1 if args.dry_run else 2  # the peers (HF assisted generation: ~25 s a run)
    # fuser's rows: ~0.1 s a run, so 5 (timed() takes the median; of 2 it is the slower run,
    # and host time between steps moved fuser's rows by up to 5% from run to run)
    fuser_repeats = 1 if args.dry_run else 5
    start = time.perf_counter()
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=max(p.shape[1] for p in prompts) + n + 8, gamma="auto",
        gamma_candidates=gammas, overlap=args.overlap))
    RESULTS["bundled_optimize_seconds"] = time.perf_counter() - start
    RESULTS["bundled_fallbacks"] = engine.report().fallbacks
    costs = engine.step_costs.get(1, {})
    RESULTS["bundled_iteration_ms"] = {g: 1e3 * s for g, s in costs.items()}
    log(f"bundled pair: optimize {RESULTS['bundled_optimize_seconds']:.0f} s; iteration ms "
        + ", ".join(f"g{g} {1e3 * s:.3f}" for g, s in costs.items()))

    if not args.skip_peers:
        peers(target, draft, prompts, n, device, runs)
    seconds, count, _ = fuser_runs(engine, prompts, n, PLAIN, fuser_repeats)
    extra = {"pct_of_graph_bound": 100 * count / seconds * costs[PLAIN]} if costs else {}
    plain = row("bundled", "fuser target-only", seconds, count, **extra)
    by_gamma = {g: speculative_row(engine, prompts, n, g, fuser_repeats, costs, out,
                                   label=f" of {','.join(map(str, gammas))}")
                for g in (*gammas, None)}
    RESULTS["bundled_by_gamma"] = {str(g): r["tok_s"] for g, r in by_gamma.items()}
    RESULTS["bundled_auto_over_target_only"] = by_gamma[None]["tok_s"] / plain["tok_s"]
    del engine
    # gamma="auto" as a user gets it: an engine of FuserConfig's default candidates (the one
    # above chose among --gammas, built for the fixed rows).
    defaults = fuser.FuserConfig().gamma_candidates
    if args.overlap or defaults == gammas:
        return
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=max(p.shape[1] for p in prompts) + n + 8, gamma="auto"))
    costs = engine.step_costs.get(1, {})
    log(f"bundled pair, default candidates {defaults}: iteration ms "
        + ", ".join(f"g{g} {1e3 * s:.3f}" for g, s in costs.items()))
    auto = speculative_row(engine, prompts, n, None, fuser_repeats, costs, out,
                           label=f" of {','.join(map(str, defaults))} (default)")
    RESULTS["bundled_default_auto_over_target_only"] = auto["tok_s"] / plain["tok_s"]
    del engine


def speculative_row(engine: fuser.Engine, prompts: list[torch.Tensor], n: int,
                    g: int | None, repeats: int, costs: dict, out: Path,
                    label: str = "") -> dict:
    """One speculative row of the bundled part: gamma g forced, or None: the engine's auto
    (its steps per gamma traced); tok/s, acceptance, Leviathan's prediction, the graph bound,
    the step against its parts."""
    overlapped = any(b.overlap for b in engine.buckets.values())  # (kept off on CUDA for now)
    fuser_name = "fuser overlap" if overlapped else "fuser"
    trace: dict = {}  # auto's steps: how often each gamma ran, what it emitted
    seconds, count, stats = fuser_runs(engine, prompts, n, g, repeats,
                                       trace=trace if g is None else None)
    extra: dict = dict(acceptance=stats.acceptance_rate,
                       mean_accepted_length=stats.mean_accepted_length)
    at = g if g is not None else stats.gamma
    # The steps each gamma ran: a fixed gamma's all, auto's from its trace (it mixes them;
    # target-only steps as gamma 0). Leviathan's prediction is then the expected tokens of
    # those steps at the run's own acceptance over their measured graph costs.
    mix = {g: 1} if g is not None else trace.get("steps", {})
    if at and costs and mix and all(k in costs for k in mix) and not overlapped:
        predicted = predicted_tok_s(mix, stats.acceptance_rate, costs)
        extra["predicted_tok_s"] = predicted
        extra["pct_of_prediction"] = 100 * count / seconds / predicted
        if stats.mean_accepted_length:  # tokens per step, the bonus token included
            tokens = stats.mean_accepted_length if g is not None else \
                sum(trace["tokens"].values())
            bound = tokens / sum(k * costs[gm] for gm, k in mix.items())
            extra["pct_of_graph_bound"] = 100 * count / seconds / bound
        parts = step_parts_ms(engine, at)
        if parts is not None:
            extra["step_ms"] = 1e3 * costs[at]
            extra["parts_ms"] = parts
    elif at and costs:  # overlapped rounds: their measured cost, the parts summed
        extra["step_ms"] = 1e3 * costs[at]
        parts = step_parts_ms(engine, at, draft_decodes=at)
        if parts is not None:
            extra["parts_ms"] = parts
    name = (f"{fuser_name} gamma={g}" if g is not None
            else f"{fuser_name} gamma=auto{label} ({engine.gamma_reason})")
    entry = row("bundled", name, seconds, count, **extra)
    if trace:
        entry["steps_by_gamma"] = trace
        log("  auto's steps by gamma (tokens per step): " + ", ".join(
            f"g{gm} {k} ({trace['tokens'][gm] / k:.2f})"
            for gm, k in sorted(trace["steps"].items())))
    save(out)
    return entry


def peers(target, draft, prompts: list[torch.Tensor], n: int, device: torch.device,
          runs: int) -> None:
    """HF eager, HF static cache + compile, HF assisted generation with the same draft."""
    sys.path.insert(0, str(Path(__file__).parent))
    from peers import make_hf_eager, make_hf_static_compile

    def assisted(model, prompt, count):
        def run() -> torch.Tensor:
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     assistant_model=draft, max_new_tokens=count,
                                     min_new_tokens=count, do_sample=False, pad_token_id=0)
            return out[:, prompt.shape[1]:]
        return run

    makers = [("HF eager", make_hf_eager), ("HF assisted (same draft)", assisted)]
    if device.type == "cuda":
        makers.insert(1, ("HF static cache + torch.compile", make_hf_static_compile))
    for name, make in makers:
        try:
            fns = [make(target, p, n) for p in prompts]
            fns[0]()  # warm up / compile
            seconds, count = timed(lambda: sum(f().shape[1] for f in fns), runs, device)
            row("bundled", name, seconds, count)
        except Exception as e:  # noqa: BLE001 -- a peer that breaks must not lose the rest
            RESULTS[f"error: {name}"] = f"{type(e).__name__}: {e}"[:1000]
            log(f"{name}: failed ({type(e).__name__}: {str(e)[:200]})")
        finally:
            torch._dynamo.reset()


def part_8b(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
            out: Path) -> None:
    """(2): 8B-shape target, 1B-shape random draft (never agrees)."""
    import transformers

    from fuser.models import PRESETS

    names = ("tiny-random-llama", "tiny-random-llama") if args.dry_run else \
        ("llama-3-8b", "llama-3.2-1b")
    models = []
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        with torch.device(device):
            models.append(transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**PRESETS[name])).to(dtype).eval())
    target, draft = models
    T, n = (8, 16) if args.dry_run else (128, 256)
    prompt = torch.randint(0, target.config.vocab_size, (1, T), device=device)
    start = time.perf_counter()
    candidates = {"gamma_candidates": (1, 2)} if args.dry_run else {}  # dry run: fewer exports
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=T + n + 8, **candidates))
    RESULTS["8b_optimize_seconds"] = time.perf_counter() - start
    costs = engine.step_costs[1]
    RESULTS["8b_iteration_ms"] = {g: 1e3 * s for g, s in costs.items()}
    log("8B-shape iteration ms: " + ", ".join(f"g{g} {1e3 * s:.3f}" for g, s in costs.items()))
    runs = 1 if args.dry_run else 3
    plain_s, plain_n, _ = fuser_runs(engine, [prompt], n, PLAIN, runs)
    plain = row("8b", "fuser target-only", plain_s, plain_n)
    auto_s, auto_n, stats = fuser_runs(engine, [prompt], n, None, runs)
    auto = row("8b", "fuser gamma=auto (non-agreeing draft)", auto_s, auto_n,
               acceptance=stats.acceptance_rate, speculative_steps=stats.num_drafts,
               reason=engine.gamma_reason)
    RESULTS["8b_auto_over_target_only"] = auto["tok_s"] / plain["tok_s"]
    RESULTS["8b_auto_at_least_95pct"] = auto["tok_s"] >= 0.95 * plain["tok_s"]
    # Projected (not measured): best gamma's E(alpha, g) / cost(g) at each acceptance rate.
    curve = []
    for i in range(21):
        alpha = i / 20
        best = max([(1.0 / costs[PLAIN], 0)] + [(expected_tokens(alpha, g) / costs[g], g)
                                                for g in engine.gammas])
        curve.append({"alpha": alpha, "projected_tok_s": best[0], "gamma": best[1]})
    RESULTS["8b_projected_curve"] = curve
    save(out)
    del engine


def part_buckets(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 out: Path) -> None:
    """(3): one prompt on engines built for max_batch_size 16 and 1 (target only)."""
    from transformers import AutoModelForCausalLM

    from fuser.models import TARGET_PATH

    if args.dry_run:
        from tiny_models import tiny_pair

        target, _, prompts = tiny_pair(device)
    else:
        target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=dtype).to(device).eval()
        prompts = [torch.randint(3, 1000, (1, args.prompt_tokens), device=device)]
    n = args.new_tokens
    engines = {}
    largest = 4 if args.dry_run else 16  # dry run: the plumbing, fewer buckets to build
    for size in (largest, 1):
        engines[size] = fuser.optimize(target, config=fuser.FuserConfig(
            max_seq_len=prompts[0].shape[1] + n + 8, max_batch_size=size, batch_buckets="auto"))
    # The tiny target's generate takes tens of milliseconds: time the two engines in
    # alternation (the machine's drift hits both alike) and take each one's median.
    runs = 1 if args.dry_run else 9
    times: dict[int, list[float]] = {size: [] for size in engines}
    counts = {}
    for _ in range(runs):
        for size, engine in engines.items():
            seconds, counts[size], _ = fuser_runs(engine, prompts[:1], n, None, 1)
            times[size].append(seconds)
    for size, engine in engines.items():
        seconds = sorted(times[size])[len(times[size]) // 2]
        row("buckets", f"one prompt, max_batch_size={size} (buckets {sorted(engine.buckets)})",
            seconds, counts[size], runs=runs)
    RESULTS["buckets_16_over_1"] = (sorted(times[1])[runs // 2] / sorted(times[largest])[runs // 2])
    del engines
    save(out)


def merge(paths: list[Path]) -> None:
    """RESULTS from several runs' e2e.json: rows concatenated in order, other keys of a later
    run over an earlier one's ("env" kept per run under "runs")."""
    for path in paths:
        run = json.loads(path.read_text())
        RESULTS["rows"].extend(run.pop("rows", []))
        RESULTS.setdefault("runs", []).append({"file": str(path), **run.pop("env", {})})
        RESULTS.update(run)


def plot(out: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine's image may lack it: the JSON has every figure
        log("no plot: matplotlib is not installed (pip install 'fuser[plots]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2))
    bundled = [r for r in RESULTS["rows"] if r["part"] == "bundled"]
    fixed = sorted((int(r["system"].rsplit("=", 1)[1]), r) for r in bundled
                   if r["system"].split(" gamma=")[-1].isdigit())
    plain = [r["tok_s"] for r in bundled if r["system"] == "fuser target-only"]
    autos = [r for r in bundled if "gamma=auto" in r["system"]]
    if fixed:
        left.plot([g for g, _ in fixed], [r["tok_s"] for _, r in fixed], "o-",
                  label="fixed gamma")
        middle.plot([r["acceptance"] for _, r in fixed], [r["tok_s"] for _, r in fixed], "o-",
                    label="fixed gamma (label: gamma)")
        for g, r in fixed:
            middle.annotate(str(g), (r["acceptance"], r["tok_s"]), textcoords="offset points",
                            xytext=(4, 4))
    for r, style in zip(autos, ("g--", "m-.")):
        label = r["system"].split(" (")[0].replace("fuser ", "")
        if label == "gamma=auto":  # (rows of e2e.json files written before the
            # default-candidates engine was added)
            label += " of --gammas"
        left.axhline(r["tok_s"], color=style[0], ls=style[1:], label=label)
        middle.plot([r["acceptance"]], [r["tok_s"]], style[0] + "s", label=label)
    for axis in (left, middle):
        if plain:
            axis.axhline(plain[0], color="k", ls=":", label="target-only")
    if bundled:
        left.set(xlabel="gamma", ylabel="tok/s", title="bundled pair: tok/s against gamma")
        middle.set(xlabel="acceptance rate (accepted / drafted)", ylabel="tok/s",
                   title="bundled pair: tok/s against acceptance")
        left.legend(fontsize=8)
        middle.legend(fontsize=8)
    curve = RESULTS.get("8b_projected_curve")
    if curve:
        right.plot([c["alpha"] for c in curve], [c["projected_tok_s"] for c in curve], "o-")
        right.set(xlabel="acceptance rate", ylabel="tok/s",
                  title="8B + 1B-shape draft: PROJECTED (measured costs)")
    fig.tight_layout()
    fig.savefig(out / "e2e.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="e2e-out")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny random models")
    parser.add_argument("--plot-from", nargs="+", type=Path, metavar="E2E_JSON",
                        help="measure nothing: merge these runs' e2e.json (rows in order) and "
                             "write the plot and the merged JSON to --out")
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--skip-buckets", action="store_true")
    parser.add_argument("--gammas", default="1,2,3,4,5,6,7,8",
                        help="fixed gammas to time on the bundled pair (each one more compiled "
                             "verify graph)")
    parser.add_argument("--overlap", action="store_true",
                        help="the bundled pair with FuserConfig(overlap=True): the draft drafts "
                             "the next round while the target verifies")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.plot_from:
        merge(args.plot_from)
        save(out)
        plot(out)
        log(f"merged {len(args.plot_from)} runs into {out / 'e2e.json'}, plot {out / 'e2e.png'}")
        return
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.prompts, args.prompt_tokens, args.new_tokens = 2, 8, 12
        args.gammas = ",".join(args.gammas.split(",")[:2])
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("benchmarks/e2e.py: no CUDA device; pass --dry-run for the CPU plumbing check",
              file=sys.stderr)
        raise SystemExit(2)
    RESULTS["env"] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "command": " ".join(sys.argv),
                      "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens}
    if not args.skip_bundled:
        part_bundled(args, device, dtype, out)
    if not args.skip_8b:
        part_8b(args, device, dtype, out)
    if not args.skip_buckets:
        part_buckets(args, device, dtype, out)
    save(out)
    plot(out)
    log(f"\n{'part':<8} {'system':<60} {'tok/s':>9} {'accept':>7} {'%pred':>6} {'%graph':>6}")
    for r in RESULTS["rows"]:
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
        pred = f"{r['pct_of_prediction']:.0f}" if "pct_of_prediction" in r else "-"
        bound = f"{r['pct_of_graph_bound']:.0f}" if "pct_of_graph_bound" in r else "-"
        log(f"{r['part']:<8} {r['system'][:60]:<60} {r['tok_s']:>9.1f} {acc:>7} {pred:>6} "
            f"{bound:>6}")


if __name__ == "__main__":
    main()
