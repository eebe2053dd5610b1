"""FP8 accuracy of the bundled pair (issue #10): perplexity, greedy agreement, acceptance.

    python benchmarks/fp8_accuracy.py --out fp8_accuracy.json                  # CPU
    python benchmarks/fp8_accuracy.py --device cuda --out $OUT/fp8_accuracy.json
    python benchmarks/fp8_accuracy.py --dry-run --out /tmp/fp8_accuracy.json   # tiny random pair

Every engine is the bundled pair (models/README.md; bf16 weights, as shipped) optimized with a
fixed gamma, in these variants (--variants):
    bf16            FuserConfig(precision="bf16")                    the reference
    fp8             FuserConfig(precision="fp8")                     LM head in FP8 (the default)
    fp8-bf16-head   FuserConfig(precision="fp8", fp8_lm_head=False)
All text is held out (models/heldout_sample.txt: files of the held-out split, never trained on).

(1) Perplexity of the target and of the draft from each engine's own logits (`engine.logits`:
    the prefill step, which in FP8 quantizes activations per token as well as the weights), on
    --ppl-rows rows of --ppl-tokens tokens (files encoded as in training, <|bos|> text <|eos|>,
    concatenated and cut). From the same logits, teacher forced: the fraction of positions where
    a variant's target argmax equals the bf16 engine's, and where its draft's equals its target's.
(2) Greedy target-only `generate` on --prompts held-out prompts (the first --prompt-tokens of
    each held-out file, as models/evaluate.py draws them), --new-tokens each, eos off: the first
    generated position where a variant differs from the bf16 engine, next to where the bf16
    engine differs from Hugging Face `generate` on the bf16 model (eager PyTorch). For each
    divergence, the bf16 engine's top-2 logit gap there (its prefill logits over its own greedy
    sequence): a small gap is a near-tie that any rounding may flip.
(3) Speculative greedy `generate` at --gamma on the same prompts: acceptance rate from
    `engine.stats`, and where the speculative output first differs from the same engine's
    target-only output (the contract says it should not).
(4) Where the FP8 error comes from: perplexity of the Hugging Face target under FP8 emulation
    (fuser.ops.fp8.emulated_fp8: what the engine computes, in plain PyTorch) of all linears with
    per-token activations (the prefill recipe, i.e. what (1) measures) and weights only (the
    decode recipe), of all but the LM head, of the LM head alone, of each layer alone and of each
    projection kind alone, on the first --sensitivity-rows rows.

Prints a table per part and the checks last (bounds: target and draft perplexity within +1.5%
of bf16, acceptance within 0.02 of bf16's); writes everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

import fuser
from fuser import compare
from fuser.ops.fp8 import emulated_fp8

PPL_BOUND = 0.015          # fp8 perplexity at most +1.5% over bf16 (issue #10)
ACCEPTANCE_BOUND = 0.02    # fp8 pair's acceptance rate within 0.02 of the bf16 pair's
REFERENCE = "bf16"
VARIANTS: dict[str, dict[str, object]] = {
    "bf16": dict(precision="bf16"),
    "fp8": dict(precision="fp8"),
    "fp8-bf16-head": dict(precision="fp8", fp8_lm_head=False),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


# -- held-out data --------------------------------------------------------------------------------

def heldout_rows(tokenizer: object, rows: int, length: int) -> Tensor:
    """[rows, length] token ids: held-out files as <|bos|> text <|eos|>, concatenated, cut."""
    from fuser.models.evaluate import heldout_files

    stream: list[int] = []
    for text in heldout_files():
        stream += tokenizer(text, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= rows * length:
            break
    if len(stream) < rows * length:
        raise SystemExit(f"the held-out sample has {len(stream)} tokens, fewer than "
                         f"--ppl-rows x --ppl-tokens = {rows * length}")
    return torch.tensor(stream[: rows * length]).view(rows, length)


def heldout_prompts(tokenizer: object, count: int, length: int) -> list[Tensor]:
    """[1, length] prompts: the start of each held-out file longer than 400 characters."""
    from fuser.models.evaluate import heldout_files

    texts = [t for t in heldout_files() if len(t) > 400][:count]
    prompts = [torch.tensor([tokenizer(t, verbose=False)["input_ids"][:length]]) for t in texts]
    return [p for p in prompts if p.shape[1] == length]


def load_pair(args: argparse.Namespace, device: torch.device
              ) -> tuple[torch.nn.Module, torch.nn.Module, Tensor, list[Tensor], int]:
    """(target, draft, ppl rows [R, L], prompts, pad id): the bundled pair in bf16, or with
    --dry-run a tiny random pair (benchmarks/tiny_models.py) and random tokens."""
    if args.dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tiny_models import tiny_pair

        target, draft, _ = tiny_pair(device)
        generator = torch.Generator().manual_seed(2)
        vocab = target.config.vocab_size
        rows = torch.randint(3, vocab, (args.ppl_rows, args.ppl_tokens), generator=generator)
        prompts = [torch.randint(3, vocab, (1, args.prompt_tokens), generator=generator)
                   for _ in range(args.prompts)]
        pad = 0
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fuser.models import DRAFT_PATH, TARGET_PATH, bundled_pair

        if bundled_pair() is None:
            raise SystemExit(f"the bundled pair is not installed ({TARGET_PATH}, {DRAFT_PATH})")
        tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
        target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.bfloat16)
        draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.bfloat16)
        rows = heldout_rows(tokenizer, args.ppl_rows, args.ppl_tokens)
        prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_tokens)
        pad = tokenizer.pad_token_id
    target = target.to(device=device, dtype=torch.bfloat16).eval()
    draft = draft.to(device=device, dtype=torch.bfloat16).eval()
    return target, draft, rows.to(device), [p.to(device) for p in prompts], pad


# -- measurements ---------------------------------------------------------------------------------

def nll_sum(logits: Tensor, row: Tensor) -> float:
    """Summed next-token cross-entropy of row [L] under logits [L, V] (fp32)."""
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), row[1:], reduction="sum"))


def top2_gap(logits: Tensor) -> Tensor:
    """logits [..., V] -> [...]: top-1 minus top-2 logit."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.no_grad()
def hf_reference(target: torch.nn.Module, draft: torch.nn.Module, rows: Tensor,
                 prompts: list[Tensor], new_tokens: int, pad: int) -> dict:
    """Hugging Face on the bf16 models: perplexities, target argmax, greedy sequences."""
    t_nll = d_nll = 0.0
    for row in rows:
        t_nll += nll_sum(target(input_ids=row[None]).logits[0], row)
        d_nll += nll_sum(draft(input_ids=row[None]).logits[0], row)
    positions = rows.shape[0] * (rows.shape[1] - 1)
    greedy = [target.generate(input_ids=p, attention_mask=torch.ones_like(p),
                              max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                              pad_token_id=pad) for p in prompts]
    for p, g in zip(prompts, greedy):
        assert g.shape[1] == p.shape[1] + new_tokens, "HF generate stopped early"
    return {"target_ppl": math.exp(t_nll / positions), "draft_ppl": math.exp(d_nll / positions),
            "greedy": greedy}


@torch.no_grad()
def run_variant(name: str, target: torch.nn.Module, draft: torch.nn.Module, rows: Tensor,
                prompts: list[Tensor], pad: int, args: argparse.Namespace) -> dict:
    """Build the pair engine of `name` and measure (1)-(3) on it."""
    config = fuser.FuserConfig(**VARIANTS[name], gamma=args.gamma, max_batch_size=1,
                               max_seq_len=max(args.ppl_tokens,
                                               args.prompt_tokens + args.new_tokens),
                               compile=args.compile)
    log(f"[{name}] building the pair engine ({config.precision}, fp8_lm_head="
        f"{config.fp8_lm_head}, gamma {args.gamma}, compile {args.compile})")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are read from the report below
        engine = fuser.optimize(target, draft=draft, config=config)
    report = engine.report()
    result: dict = {"config": {k: str(v) for k, v in VARIANTS[name].items()},
                    "build_seconds": time.perf_counter() - start,
                    "fallbacks": report.fallbacks,
                    "fp8_linear_sites": report.passes.get("fp8_linear", 0)}
    log(f"[{name}] built in {result['build_seconds']:.0f} s; passes: "
        + ", ".join(f"{k} {v}" for k, v in report.passes.items() if v))
    for fallback in report.fallbacks:
        log(f"[{name}] FALLBACK (figures below are not all the engine's): {fallback}")
    drafts = compare.draft_only(engine, draft) if engine.draft is not None else None

    # (1) perplexity from the engines' own logits, and teacher-forced argmaxes
    t_nll = d_nll = 0.0
    argmax, draft_agrees = [], 0
    for row in rows:
        logits = engine.logits(row[None])[0]                    # [L, V] fp32
        t_nll += nll_sum(logits, row)
        argmax.append(logits.argmax(-1))
        if drafts is not None:
            d_logits = drafts.logits(row[None])[0]
            d_nll += nll_sum(d_logits, row)
            draft_agrees += int((d_logits.argmax(-1) == argmax[-1]).sum())
    positions = rows.shape[0] * (rows.shape[1] - 1)
    result["target_ppl"] = math.exp(t_nll / positions)
    result["draft_ppl"] = math.exp(d_nll / positions) if drafts is not None else None
    result["argmax"] = torch.stack(argmax)                    # [R, L], kept out of the JSON
    result["draft_target_agreement"] = (draft_agrees / rows.numel() if drafts is not None
                                         else None)
    log(f"[{name}] perplexity: target {result['target_ppl']:.4f}, draft "
        f"{result['draft_ppl'] or float('nan'):.4f} ({rows.shape[0]} x {rows.shape[1]} tokens)")

    # (2) greedy, target only (gamma 0: the engine's target-only iteration); the bf16
    # reference also keeps its top-2 gaps
    no_eos = dict(eos_token_id=[], pad_token_id=pad)
    engine.fix_gamma(0)
    result["greedy"] = [engine.generate(p, args.new_tokens, **no_eos) for p in prompts]
    engine.fix_gamma(None)
    if name == REFERENCE:
        T = args.prompt_tokens
        result["gaps"] = [top2_gap(engine.logits(g[:, :-1])[0, T - 1:]).cpu()   # [n]
                          for g in result["greedy"]]
    log(f"[{name}] greedy target-only: {len(prompts)} prompts x {args.new_tokens} tokens")

    # (3) speculative greedy at a fixed gamma
    if engine.draft is not None:
        engine.stats.reset()
        result["speculative"] = [engine.generate(p, args.new_tokens, **no_eos) for p in prompts]
        stats = engine.stats
        result["acceptance"] = {
            "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "accepted_per_position": list(stats.accepted_per_position)}
        log(f"[{name}] speculative gamma {args.gamma}: acceptance {stats.acceptance_rate:.4f} "
            f"({stats.num_accepted_tokens} of {stats.num_draft_tokens})")
    del drafts, engine
    gc.collect()
    return result


@torch.no_grad()
def sensitivity(target: torch.nn.Module, rows: Tensor) -> list[dict]:
    """Perplexity of the HF target with FP8 emulated on a subset of its linears (part 4)."""
    layers = target.model.layers

    def kind(name: str) -> torch.nn.ModuleList:
        return torch.nn.ModuleList(getattr(layer.self_attn if name in PROJECTIONS[:4] else
                                           layer.mlp, name) for layer in layers)

    cases: list[tuple[str, object]] = [
        ("none (bf16)", contextlib.nullcontext),
        ("all linears, weights + activations (prefill recipe)", lambda: emulated_fp8(target)),
        ("all linears, weights only (decode recipe)",
         lambda: emulated_fp8(target, prefill_tokens=0)),
        ("all but the LM head, weights + activations",
         lambda: emulated_fp8(target, lm_head=False)),
        ("LM head only, weight + activation", lambda: emulated_fp8(target.lm_head)),
        ("LM head only, weight only", lambda: emulated_fp8(target.lm_head, prefill_tokens=0)),
    ]
    cases += [(f"layer {i} only", lambda i=i: emulated_fp8(layers[i])) for i in range(len(layers))]
    cases += [(f"{p} only (every layer)", lambda p=p: emulated_fp8(kind(p))) for p in PROJECTIONS]
    out, base = [], None
    for label, context in cases:
        nll = 0.0
        with context():
            for row in rows:
                nll += nll_sum(target(input_ids=row[None]).logits[0], row)
        ppl = math.exp(nll / (rows.shape[0] * (rows.shape[1] - 1)))
        base = ppl if base is None else base
        out.append({"case": label, "ppl": ppl, "vs_bf16": ppl / base - 1})
    return out


# -- comparisons and output -----------------------------------------------------------------------

def divergences(a: list[Tensor], b: list[Tensor], prompt_tokens: int, new_tokens: int,
                gaps: list[Tensor] | None = None) -> dict:
    """Per prompt, the first generated position where a and b differ (None: identical), and
    the reference's top-2 gap there."""
    first = [compare.first_divergence(x, y, prompt_tokens) for x, y in zip(a, b)]
    reached = [new_tokens if p is None else p for p in first]
    out = {"first_divergence": first, "prompts": len(first),
           "identical": sum(p is None for p in first), "min": min(reached),
           "median": statistics.median(reached), "mean": statistics.fmean(reached)}
    if gaps is not None:
        at = [float(g[p]) for g, p in zip(gaps, first) if p is not None]
        out["gap_at_divergence"] = at
        out["median_gap_at_divergence"] = statistics.median(at) if at else None
    return out


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def print_tables(results: dict, args: argparse.Namespace) -> None:
    hf, variants = results["hf"], results["variants"]
    ref = variants[REFERENCE]
    R, L = args.ppl_rows, args.ppl_tokens
    print(f"\n(1) perplexity, {R} x {L} held-out tokens (engine.logits; HF: the model's forward)")
    print(f"{'system':<22}{'target ppl':>11}{'vs bf16':>9}{'draft ppl':>11}{'vs bf16':>9}"
          f"{'top-1 = bf16':>14}{'draft = target':>16}")
    print(f"{'HF bf16 (eager)':<22}{hf['target_ppl']:>11.4f}"
          f"{pct(hf['target_ppl'] / ref['target_ppl'] - 1):>9}{hf['draft_ppl']:>11.4f}"
          f"{pct(hf['draft_ppl'] / ref['draft_ppl'] - 1):>9}")
    for name, v in variants.items():
        d = v["draft_ppl"]
        print(f"{name:<22}{v['target_ppl']:>11.4f}{pct(v['target_ppl'] / ref['target_ppl'] - 1):>9}"
              f"{d:>11.4f}{pct(d / ref['draft_ppl'] - 1):>9}{v['top1_equals_bf16']:>14.4f}"
              f"{v['draft_target_agreement']:>16.4f}")

    n = args.new_tokens
    print(f"\n(2) greedy target-only, {len(ref['greedy'])} held-out prompts x {args.prompt_tokens} "
          f"tokens, {n} new: first generated position that differs ({n} = identical)")
    print(f"{'comparison':<34}{'identical':>10}{'min':>6}{'median':>8}{'mean':>7}"
          f"{'bf16 top-2 gap there (median)':>31}")
    for label, d in results["greedy"].items():
        gap = d.get("median_gap_at_divergence")
        print(f"{label:<34}{d['identical']:>6}/{d['prompts']:<3}{d['min']:>6}{d['median']:>8.1f}"
              f"{d['mean']:>7.1f}{'-' if gap is None else f'{gap:.4f}':>31}")
    allgaps = torch.cat(ref["gaps"]) if ref.get("gaps") else None
    if allgaps is not None:
        print(f"(bf16 top-2 gap over all {allgaps.numel()} generated positions: median "
              f"{float(allgaps.median()):.4f}, {int((allgaps < 0.25).sum())} below 0.25)")

    print(f"\n(3) speculative greedy, gamma {args.gamma}, same prompts")
    print(f"{'variant':<22}{'drafts':>7}{'draft tok':>10}{'accepted':>9}{'acceptance':>11}"
          f"{'vs bf16':>9}{'mean acc len':>13}  accepted per position")
    for name, v in variants.items():
        a = v.get("acceptance")
        if a is None:
            print(f"{name:<22}  (no speculation: the draft fell back)")
            continue
        diff = a["acceptance_rate"] - ref["acceptance"]["acceptance_rate"]
        print(f"{name:<22}{a['drafts']:>7}{a['draft_tokens']:>10}{a['accepted_tokens']:>9}"
              f"{a['acceptance_rate']:>11.4f}{diff:>+9.4f}{a['mean_accepted_length']:>13.3f}"
              f"  {a['accepted_per_position']}")

    if results.get("sensitivity"):
        rows = args.sensitivity_rows
        print(f"\n(4) HF target under FP8 emulation (fuser.ops.fp8.emulated_fp8), {rows} x {L} "
              "tokens")
        print(f"{'FP8 applied to':<54}{'ppl':>9}{'vs bf16':>9}")
        for s in results["sensitivity"]:
            print(f"{s['case']:<54}{s['ppl']:>9.4f}{pct(s['vs_bf16']):>9}")

    print("\nchecks")
    for line in results["checks"]:
        print(line)


def checks(results: dict) -> list[str]:
    """The issue's three requirements, one line each per FP8 variant."""
    variants, lines = results["variants"], []
    ref = variants[REFERENCE]
    bf16_hf = results["greedy"].get("bf16 engine vs HF bf16")
    for name, v in variants.items():
        if name == REFERENCE:
            continue
        tag = f"[{name}]" + (" (FALLBACK: not all the engine's)" if v["fallbacks"] else "")
        for model in ("target", "draft"):
            ratio = v[f"{model}_ppl"] / ref[f"{model}_ppl"] - 1
            ok = ratio <= PPL_BOUND
            v[f"{model}_ppl_met"] = ok
            lines.append(f"{tag} (1) {model} perplexity {v[f'{model}_ppl']:.4f} vs bf16 "
                         f"{ref[f'{model}_ppl']:.4f}: {pct(ratio)} (bound {pct(PPL_BOUND)}): "
                         + ("met" if ok else "NOT MET"))
        g = results["greedy"][f"{name} vs bf16 engine"]
        lines.append(f"{tag} (2) greedy vs the bf16 engine: {g['identical']}/{g['prompts']} "
                     f"identical, median first difference at token {g['median']:.1f}; the bf16 "
                     f"engine vs HF bf16: {bf16_hf['identical']}/{bf16_hf['prompts']} identical,"
                     f" median {bf16_hf['median']:.1f} (no bound: reported)")
        a, b = v.get("acceptance"), ref.get("acceptance")
        if a is None or b is None:
            lines.append(f"{tag} (3) acceptance: not measured (no speculation)")
            continue
        diff = a["acceptance_rate"] - b["acceptance_rate"]
        ok = abs(diff) <= ACCEPTANCE_BOUND
        v["acceptance_met"] = ok
        lines.append(f"{tag} (3) acceptance {a['acceptance_rate']:.4f} vs bf16 "
                     f"{b['acceptance_rate']:.4f}: {diff:+.4f} (bound +-{ACCEPTANCE_BOUND}): "
                     + ("met" if ok else "NOT MET"))
    return lines


def jsonable(value: object) -> object:
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# -- main -----------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {list(VARIANTS)}; bf16 is always run")
    parser.add_argument("--ppl-rows", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sensitivity-rows", type=int, default=None,
                        help="rows of part (4), the first of the perplexity rows (default: all "
                             "of them); 0 skips it")
    parser.add_argument("--compile", choices=["auto", "fx", "inductor"], default="auto",
                        help="FuserConfig.compile (auto: Inductor on CUDA; on CPU its C++ backend for models of "
                             ">= 1M parameters, the FX graph below)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny random pair, few tokens, bf16 and fp8 only: the plumbing")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.ppl_rows, args.ppl_tokens = 2, 24
        args.prompts, args.prompt_tokens, args.new_tokens = 2, 8, 8
        args.sensitivity_rows = 1 if args.sensitivity_rows is None else args.sensitivity_rows
        if args.variants == parser.get_default("variants"):
            args.variants = "bf16,fp8"
    if args.sensitivity_rows is None:
        args.sensitivity_rows = args.ppl_rows
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    args.variant_names = [REFERENCE] + [v for v in names if v != REFERENCE]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target, draft, rows, prompts, pad = load_pair(args, device)
    results: dict = {
        "machine": {"device": str(device), "platform": platform.platform(),
                    "processor": platform.processor(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "args": {k: v for k, v in vars(args).items() if k != "variant_names"},
        "ppl_tokens_total": rows.numel(), "prompts": len(prompts)}
    log(f"{'tiny random pair (dry run)' if args.dry_run else 'bundled pair'} on {device}: "
        f"{rows.shape[0]} x {rows.shape[1]} held-out tokens, {len(prompts)} prompts; "
        f"variants {args.variant_names}")

    log("Hugging Face bf16: perplexities and greedy generate")
    hf = hf_reference(target, draft, rows, prompts, args.new_tokens, pad)
    log(f"HF: target ppl {hf['target_ppl']:.4f}, draft ppl {hf['draft_ppl']:.4f}")
    variants = {name: run_variant(name, target, draft, rows, prompts, pad, args)
                for name in args.variant_names}
    ref = variants[REFERENCE]
    P, n = args.prompt_tokens, args.new_tokens
    greedy = {"bf16 engine vs HF bf16": divergences(ref["greedy"], hf["greedy"], P, n)}
    for name, v in variants.items():
        v["top1_equals_bf16"] = float((v["argmax"] == ref["argmax"]).float().mean())
        if name != REFERENCE:
            greedy[f"{name} vs bf16 engine"] = divergences(v["greedy"], ref["greedy"], P, n,
                                                           ref["gaps"])
    for name, v in variants.items():
        if "speculative" in v:
            greedy[f"{name}: speculative vs target-only"] = divergences(
                v["speculative"], v["greedy"], P, n)
    results.update(hf={k: v for k, v in hf.items() if k != "greedy"}, variants=variants,
                   greedy=greedy)
    if args.sensitivity_rows > 0:
        log(f"FP8 emulation on the HF target, {args.sensitivity_rows} rows per case")
        results["sensitivity"] = sensitivity(target, rows[: args.sensitivity_rows])
    results["checks"] = checks(results)
    results["seconds"] = time.perf_counter() - STARTED
    print_tables(results, args)
    if args.out:
        for v in variants.values():  # token tensors stay out of the JSON; divergences are in
            for key in ("argmax", "greedy", "speculative"):
                v.pop(key, None)
        Path(args.out).write_text(json.dumps(jsonable(results), indent=2))
        log(f"wrote {args.out}")
    if args.dry_run:
        print(f"dry run on {device}: tiny random pair, not the bundled pair's figures")
    return results


if __name__ == "__main__":
    main()
