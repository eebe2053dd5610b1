"""Replay gamma="auto" and fixed gammas over the bundled pair's real agreement, on the host.

    python benchmarks/controller_replay.py                      # e2e.py's 4 held-out prompts
    python benchmarks/controller_replay.py --prompts 40 --costs 0.117,0.154,0.191,...

Greedy speculative decoding is decided by one sequence per prompt: the target's greedy output
y_1..y_n and, at each position t, whether the draft's greedy guess given y_<t (the target's own
prefix: a draft token is only ever judged after every earlier one was accepted) equals y_t. A
step at gamma g from position p accepts the run of agreements starting at p, at most g, and
emits it plus the target's token. So one target generate and one draft forward per prompt give
every policy's steps exactly; this script replays them with step costs measured on the GPU
(e2e.py's "iteration ms", default: the H200's of the twenty-second session) and prints each
policy's tokens per step and its virtual throughput (tokens over the summed step costs: no host
time, no prefill), against target-only decoding.

The engine's loop runs one step ahead (runtime/generate.py): the gamma of step k + 1 is chosen
before step k's read-back reaches the controller. The replay keeps that lag.

CPU and float32 by default; `--device cuda --dtype bfloat16` takes the agreement from Hugging
Face's bf16 models on the GPU, nearer the engine's (its agreement can differ at near ties).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuser.runtime.adaptive import GammaController  # noqa: E402

# e2e.py on the H200, twenty-second session: iteration ms at gamma 0 (target-only) .. 8
H200_COSTS_MS = (0.117, 0.154, 0.191, 0.228, 0.258, 0.293, 0.328, 0.361, 0.393)


def agreement(prompts: Sequence[torch.Tensor], new_tokens: int, dtype: torch.dtype,
              device: str) -> list[list[bool]]:
    """Per prompt: agree[t] for t = 1..new_tokens - 1 (whether the draft's greedy guess for the
    target's t-th new token, given the target's tokens before it, is that token). Token 0 comes
    from the prefill."""
    from transformers import AutoModelForCausalLM

    from fuser.models import DRAFT_PATH, TARGET_PATH

    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            ids = ids.to(device)
            T = ids.shape[1]
            full = target.generate(ids, attention_mask=torch.ones_like(ids),  # (<|bos|> is 0)
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)
            guesses = draft(full).logits[0, T:-1].argmax(-1)   # guess for new token 1..n-1
            out.append((guesses == full[0, T + 1:]).tolist())
    return out


def replay(agree: list[bool], choose: Callable[[], int], update: Callable[[int, int], None],
           costs: Sequence[float]) -> tuple[int, int, float]:
    """(tokens, steps, seconds) of one prompt: steps until every new token is out, each step's
    gamma from `choose()` with the engine's one-step lag before `update(n, gamma)`."""
    n_tokens = len(agree) + 1
    p, tokens, steps, seconds = 1, 1, 0, 0.0   # the prefill emitted token 0
    pending: tuple[int, int] | None = None
    while p < n_tokens:
        gamma = choose()   # issued before the previous step's read-back is processed
        if pending is not None:
            update(*pending)
        n = 0
        while n < gamma and p + n < len(agree) + 1 and agree[p + n - 1]:
            n += 1
        emitted = min(n + 1, n_tokens - p)
        p += emitted
        tokens += emitted
        steps += 1
        seconds += costs[gamma]
        pending = (n, gamma)
    if pending is not None:  # the engine reads the last step back too
        update(*pending)
    return tokens, steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--first", type=int, default=0, help="first held-out file")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--costs", default=",".join(map(str, H200_COSTS_MS)),
                        help="ms per step at gamma 0, 1, ..., comma separated")
    parser.add_argument("--repeats", type=int, default=6,
                        help="passes over the prompts (e2e.py: a warm-up call, then 5 runs)")
    parser.add_argument("--auto-gammas", default="",
                        help="the candidates of auto (default: every gamma of --costs)")
    parser.add_argument("--controller", action="append", default=[],
                        help="also replay auto with these GammaController arguments, e.g. "
                             "memory=0.9,prior_weight=2 (repeatable)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from fuser.models import TARGET_PATH
    from fuser.models.evaluate import heldout_files

    costs = [float(c) / 1e3 for c in args.costs.split(",")]
    gammas = tuple(range(1, len(costs)))
    auto_gammas = tuple(int(g) for g in args.auto_gammas.split(",")) if args.auto_gammas \
        else gammas
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    texts = heldout_files()[args.first: args.first + args.prompts]
    prompts = [tokenizer(t, return_tensors="pt")["input_ids"][:, : args.prompt_tokens]
               for t in texts]
    agrees = agreement(prompts, args.new_tokens, getattr(torch, args.dtype), args.device)
    rate = sum(map(sum, agrees)) / sum(map(len, agrees))
    print(f"{len(agrees)} prompts x {args.new_tokens} new tokens; teacher-forced agreement "
          f"{rate:.3f}; step ms " + ", ".join(f"g{g} {1e3 * c:.3f}" for g, c in enumerate(costs)))

    plain = 1.0 / costs[0]  # target-only: one token per decode step (the prefill's aside)

    def run(name: str, make: Callable[[], tuple[Callable[[], int], Callable[[int, int], None]]]
            ) -> None:
        tokens = steps = 0
        seconds = 0.0
        choose, update = make()   # one controller per engine bucket, kept across calls
        for agree in agrees * args.repeats:
            t, s, sec = replay(agree, choose, update, costs)
            tokens, steps, seconds = tokens + t - 1, steps + s, seconds + sec
        speed = tokens / seconds
        print(f"{name:34s} {tokens / steps:5.3f} tokens/step  {speed / 1e3:7.2f} tokens/ms  "
              f"{speed / plain:5.3f}x target-only")

    for g in gammas:
        run(f"gamma={g}", lambda g=g: (lambda: g, lambda n, used: None))

    used: dict[str, list[int]] = {}

    def controller(name: str, **kwargs: float):
        def make():
            c = GammaController({g: costs[g] for g in auto_gammas}, costs[0], **kwargs)
            counts = used.setdefault(name, [0] * len(costs))

            def choose() -> int:
                counts[c.gamma] += 1
                return c.gamma
            return choose, (lambda n, g: c.update([n], g))
        return make

    variants = [("auto", {})]
    for text in args.controller:  # "memory=0.9,prior=0.8": GammaController keyword arguments
        kwargs = {k: float(v) for k, v in (item.split("=") for item in text.split(","))}
        variants.append((f"auto {text}", kwargs))
    for name, kwargs in variants:
        run(name, controller(name, **kwargs))
        print(f"{'':34s} steps at gamma 0..{len(costs) - 1}: {used[name]}")


if __name__ == "__main__":
    main()
