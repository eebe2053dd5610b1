"""Evaluate the bundled pair on the held-out sample shipped with it (CPU is enough).

    python -m fuser.models.evaluate [--slice-only] [--prompts 16 --new-tokens 64]

- perplexity of target and draft on a fixed slice of `heldout_sample.txt` (the slice the test
  `tests/test_models.py` checks against `SLICE_PERPLEXITY`);
- teacher-forced greedy agreement of draft and target on that slice;
- the mean accepted length at gamma = 4 of fuser's own speculative greedy `generate` on
  held-out prompts (one prompt per held-out file of the sample).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from fuser.models import DRAFT_PATH, HELDOUT_SAMPLE, TARGET_PATH

SLICE_ROWS, SLICE_TOKENS = 4, 256
# Target perplexity on heldout_slice(), recorded with the command in models/README.md.
SLICE_PERPLEXITY = 5.7020
FILE_MARKER = "# ---- file: "


def heldout_files() -> list[str]:
    """The held-out sample split back into its files' texts."""
    text = HELDOUT_SAMPLE.read_text(encoding="utf-8")
    parts = text.split(FILE_MARKER)[1:]
    return [p.split("\n", 1)[1] if "\n" in p else "" for p in parts]


def heldout_slice(tokenizer: object) -> torch.Tensor:
    """[SLICE_ROWS, SLICE_TOKENS] token ids: the sample's first files, bos-separated, chunked."""
    stream: list[int] = []
    for text in heldout_files():
        stream += tokenizer(text, verbose=False)["input_ids"]  # starts with <|bos|>
        if len(stream) >= SLICE_ROWS * SLICE_TOKENS:
            break
    ids = torch.tensor(stream[: SLICE_ROWS * SLICE_TOKENS])
    return ids.view(SLICE_ROWS, SLICE_TOKENS)


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over every position of every row."""
    logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return math.exp(float(loss))


@torch.no_grad()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, ids: torch.Tensor) -> float:
    """Fraction of positions where the draft's argmax equals the target's (teacher forced)."""
    t = target(input_ids=ids).logits.argmax(-1)
    d = draft(input_ids=ids).logits.argmax(-1)
    return float((t == d).float().mean())


def speculative_acceptance(prompts: int, prompt_tokens: int, new_tokens: int, gamma: int) -> dict:
    """Mean accepted length of fuser's speculative greedy generate on held-out prompts."""
    import fuser
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.float32)
    texts = [t for t in heldout_files() if len(t) > 400][:prompts]
    rows = [tokenizer(t, verbose=False)["input_ids"][:prompt_tokens] for t in texts]
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        gamma=gamma, max_seq_len=prompt_tokens + new_tokens))
    start = time.perf_counter()
    for row in rows:
        engine.generate(torch.tensor([row]), new_tokens)
    stats = engine.stats
    return {"prompts": len(rows), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "gamma": gamma, "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "accepted_per_position": list(stats.accepted_per_position),
            "seconds": time.perf_counter() - start}


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slice-only", action="store_true")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.float32).eval()
    ids = heldout_slice(tokenizer)
    result: dict = {
        "slice": f"{SLICE_ROWS}x{SLICE_TOKENS} tokens of heldout_sample.txt, fp32 on CPU",
        "slice_ppl_target": perplexity(target, ids),
        "slice_ppl_draft": perplexity(draft, ids),
        "slice_greedy_agreement": greedy_agreement(target, draft, ids),
    }
    if not args.slice_only:
        result["speculative"] = speculative_acceptance(args.prompts, args.prompt_tokens,
                                                       args.new_tokens, args.gamma)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
