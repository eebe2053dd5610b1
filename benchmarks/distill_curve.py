"""The learning curve of one online draft update (runtime/distill.py `Distiller`) on issue 44's
shifted domain: how many optimizer steps, at which learning rate and batch size, move the
bundled draft's agreement with the target on documents never trained on, and whether the
update's own gate accepts them.

    python benchmarks/distill_curve.py --cache /tmp/curve.pt     # 2-core CPU: ~15 minutes
    python benchmarks/distill_curve.py --steps 5,10,20,50 --lr 1e-4,1e-3 --batch-tokens 1024,4096 --requests 200,800

Records as the adaptive scheduler gives them to the distiller: `benchmarks/adapt.py`'s
`shifted_prompts(R + H, H)` tokenized as adapt.py does (the last H prompts from files none of
the first R came from), each followed by the target's greedy --max-tokens continuation (HF
`generate`), with the target's top-k at every generated position (`topk_targets` of the
generation's logits: what a verify step reads back) -> `Distiller.add(prompt + output,
start=len(prompt), topk_ids, topk_probs)`. Per configuration (requests R, lr, batch_tokens) a
fresh Distiller gets the first R records and runs `update(max_steps=...)` until the steps
so far reach each of --steps in turn (the student trains on from one update to the next: an
accepted candidate and a rejected but no worse one keep training, a worse one is dropped, as
served). With --every N, as the adaptive scheduler does instead: N more requests before each
update, each update of the default max_steps. After each update: the update's gate decision
(on its own held-out share of the records given), and `Distiller.evaluate` of the student on
the H never-sent documents (shifted) and on --python held-out Python prompts
(models/heldout_sample.txt) with the target's continuations: greedy top-1 agreement
(speculation's acceptance per proposed token) and the tokens a greedy verify step at gamma
--gamma yields (`Distiller.tokens_per_step`).

Prints one row per update: requests, lr, batch_tokens, steps so far, the steps behind the
student (kept: a rejected, worse candidate is dropped), the update's gate (A accepted, C
carried on, R rejected and dropped; the gain and its lower bound), agreement shifted and
Python before -> after, tokens a step at gamma, the update's seconds; and the FLOPs of one
step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapt import python_prompts, shifted_prompts, tokenize  # noqa: E402


@dataclass
class Sample:
    """A served request: prompt then output token ids, the target's top-k at each output
    position."""

    tokens: list[int]
    start: int
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor


def log(message: str) -> None:
    print(message, flush=True)


@torch.no_grad()
def served(target: torch.nn.Module, prompts: Sequence[list[int]], new_tokens: int, topk: int,
           batch: int = 32) -> list[Sample]:
    """The target's greedy continuation of each prompt (left-padded batches of similar length,
    HF `generate`) with its top-k at each generated position."""
    from fuser.runtime.distill import topk_targets

    pad = target.config.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, Sample] = {}
    for first in range(0, len(order), batch):
        rows = order[first:first + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[j, width - len(prompts[i]):] = 1
        device = next(target.parameters()).device
        gen = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                              max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                              output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(gen.logits, dim=1)  # [rows, new_tokens, V]
        top_ids, top_probs = (t.cpu() for t in topk_targets(logits, topk))
        for j, i in enumerate(rows):
            output = gen.sequences[j, width:].tolist()
            out[i] = Sample(list(prompts[i]) + output, len(prompts[i]), top_ids[j], top_probs[j])
    return [out[i] for i in range(len(prompts))]


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(target, draft, tokenizer) of the bundled pair (fp32 on the CPU)."""
    from fuser.launch import load_pair
    from fuser.models import bundled_pair

    pair = bundled_pair()
    if pair is None:
        raise SystemExit("the bundled pair is not installed (fuser.models TARGET_PATH)")
    target, draft, tokenizer, name = load_pair(str(pair[0]), str(pair[1]))
    log(f"{name}")
    return target, draft, tokenizer


def samples(args: argparse.Namespace, target: torch.nn.Module, tokenizer: object, topk: int
            ) -> tuple[list[Sample], list[Sample], list[Sample]]:
    """(training stream, never-sent documents, Python held-out) samples, from --cache if it
    holds them for these arguments (a stream of at least max(--requests): the first R of a
    longer one, never-sent documents from files after all of it), else served by the target
    (and saved there)."""
    key = [args.heldout, args.python, args.max_tokens, topk]
    if args.cache and Path(args.cache).is_file():
        cached = torch.load(args.cache)
        if cached["key"] == key and len(cached["train"]) >= max(args.requests):
            return tuple([Sample(*fields) for fields in cached[part]]
                         for part in ("train", "held", "python"))
    texts, _ = shifted_prompts(max(args.requests) + args.heldout, args.heldout)
    prompts = tokenize(tokenizer, texts, 1024 - args.max_tokens)
    python = tokenize(tokenizer, python_prompts(args.python), 1024 - args.max_tokens)
    start = time.perf_counter()
    stream = served(target, prompts, args.max_tokens, topk)
    python_samples = served(target, python, args.max_tokens, topk)
    log(f"served {len(stream) + len(python_samples)} requests in "
        f"{time.perf_counter() - start:.0f} s")
    train, held = stream[:-args.heldout], stream[-args.heldout:]
    if args.cache:
        torch.save({"key": key, **{part: [astuple(s) for s in group] for part, group in
                                   (("train", train), ("held", held), ("python", python_samples))}},
                   args.cache)
    return train, held, python_samples


def step_flops(draft: torch.nn.Module, tokens: int) -> float:
    """FLOPs of one training step over `tokens` tokens: 6 x tokens x the parameters a token
    multiplies (every weight but the input embedding's lookup; a tied LM head counts once,
    as the head), attention's scores left out (short records)."""
    params = sum(p.numel() for n, p in draft.named_parameters() if "embed_tokens" not in n)
    head = draft.get_output_embeddings()
    if head is not None and any(head.weight is p for n, p in draft.named_parameters()
                                if "embed_tokens" in n):
        params += head.weight.numel()
    return 6.0 * tokens * params


def curve(args: argparse.Namespace, draft: torch.nn.Module, train: list[Sample],
          held: list[Sample], python: list[Sample], requests: int, lr: float,
          batch_tokens: int) -> list[dict]:
    """One configuration's rows (see the module docstring)."""
    from fuser.runtime.distill import DistillConfig, Distiller, Record

    torch.manual_seed(args.seed)
    options = {} if args.holdout_fraction is None else \
        {"holdout_fraction": args.holdout_fraction}
    distiller = Distiller(draft, config=DistillConfig(lr=lr, batch_tokens=batch_tokens,
                                                      seed=args.seed, topk=args.topk, **options))
    # (requests given so far, steps so far after the update; None: DistillConfig.max_steps more)
    plan: list[tuple[int, int | None]] = [(requests, steps) for steps in args.steps] \
        if not args.every else [(min(n + args.every, requests), None)
                                for n in range(0, requests, args.every)]

    def records(group: list[Sample]) -> list[Record]:
        return [Record(torch.tensor(s.tokens), s.start, s.topk_ids, s.topk_probs)
                for s in group]

    held_records, python_records = records(held), records(python)

    def measure() -> tuple[float, float, float]:
        shifted = distiller.evaluate(held_records).agreement
        return shifted, distiller.evaluate(python_records).agreement, \
            distiller.tokens_per_step(held_records, args.gamma)

    base = measure()
    rows, given, done, trained, accepted = [], 0, 0, 0, 0
    for seen, steps in plan:
        for s in train[given:seen]:
            distiller.add(s.tokens, s.start, s.topk_ids, s.topk_probs)
        given = seen
        result = distiller.update(1e9, max_steps=None if steps is None else steps - done)
        done += result.steps
        now = measure()
        gate = result.gate
        decision = "A" if result.accepted else ("C" if distiller.carried else "R")
        # the steps behind the student (a rejected, worse candidate is dropped: the student is
        # the accepted weights again)
        trained = accepted if decision == "R" else trained + result.steps
        accepted = trained if decision == "A" else accepted
        row = dict(requests=seen, lr=lr, batch_tokens=batch_tokens, steps=done,
                   trained=trained, decision=decision, gain=gate.gain if gate else None,
                   lower=gate.lower if gate else None, shifted_before=base[0],
                   shifted_after=now[0], python_before=base[1], python_after=now[1],
                   tokens_before=base[2], tokens_after=now[2], seconds=result.seconds)
        rows.append(row)
        log(line(row, args.gamma))
    return rows


HEADER = ("requests      lr  batch  steps  kept  gate                   shifted agreement     "
          "Python agreement      tokens/step@g     s")


def line(row: dict, gamma: int) -> str:
    gate = "-" if row["gain"] is None else f"{row['decision']} {row['gain']:+.4f} " \
        f"({row['lower']:+.4f})"
    return (f"{row['requests']:>8} {row['lr']:7.0e} {row['batch_tokens']:>6} {row['steps']:>6}"
            f" {row['trained']:>5}  {gate:<20}"
            f"  {row['shifted_before']:.4f} -> {row['shifted_after']:.4f}"
            f"    {row['python_before']:.4f} -> {row['python_after']:.4f}"
            f"    {row['tokens_before']:.3f} -> {row['tokens_after']:.3f}"
            f"  {row['seconds']:6.1f}")


def numbers(kind: type) -> object:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=numbers(int), default=[200, 400, 800],
                   help="training requests a configuration's distiller is given, comma-separated")
    p.add_argument("--lr", type=numbers(float), default=[1e-4],
                   help="learning rates, comma-separated")
    p.add_argument("--batch-tokens", type=numbers(int), default=[4096],
                   help="DistillConfig.batch_tokens, comma-separated")
    p.add_argument("--steps", type=numbers(int), default=[2, 5, 10, 20],
                   help="optimizer steps so far after each update, increasing, comma-separated")
    p.add_argument("--heldout", type=int, default=200,
                   help="never-sent shifted documents measured (adapt.py's last window)")
    p.add_argument("--python", type=int, default=64, help="held-out Python prompts measured")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--topk", type=int, default=8, help="DistillConfig.topk")
    p.add_argument("--holdout-fraction", type=float, default=None,
                   help="DistillConfig.holdout_fraction (default: DistillConfig's)")
    p.add_argument("--gamma", type=int, default=4,
                   help="the verify step's gamma for tokens a step (default: %(default)s)")
    p.add_argument("--every", type=int, default=0,
                   help="as served: this many more requests before each update (as "
                        "FuserConfig.distill_every), each of DistillConfig.max_steps steps, "
                        "until --requests are given (--steps unused; default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None,
                   help="a file keeping the served samples between runs (made if absent)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.steps != sorted(set(args.steps)) or args.steps[0] < 1:
        p.error("--steps must increase, from 1 up")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    target, draft, tokenizer = load(args)
    train, held, python = samples(args, target, tokenizer, args.topk)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"{len(train)} training requests, {len(held)} never-sent documents, {len(python)} "
        f"Python prompts; {args.max_tokens} new tokens each; {device}")
    for tokens in sorted(set(args.batch_tokens)):
        log(f"one step over {tokens} tokens: {step_flops(draft, tokens) / 1e9:.1f} GFLOP")
    log(HEADER)
    rows = []
    for requests in args.requests:
        for batch_tokens in args.batch_tokens:
            for lr in args.lr:
                rows += curve(args, draft, train, held, python, requests, lr, batch_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
