"""The `fuser` command line: demo, generate, bench (build and inspect come with engine files)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

# Prompts end mid-line: a prompt that ends in "\n" splits the BPE's newline+indent tokens.
DEMO_PROMPTS = [
    "def read_json(path):\n    with open(path) as f:\n        data =",
    "class Stack:\n    def __init__(self):\n        self.items =",
    "def fibonacci(n):\n    if n <",
]


def say(message: str) -> None:
    """Progress on stderr-free stdout, flushed (long steps must show progress)."""
    print(message, flush=True)


def _load_pair(model: str | None, draft: str | None) -> tuple[torch.nn.Module, torch.nn.Module | None, object | None, str]:
    """(target, draft, tokenizer, description); the bundled pair or a random Llama by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fuser.pipeline import load_model
    from fuser.models import PRESETS, bundled_pair

    if model is None:
        pair = bundled_pair()
        if pair is None:
            torch.manual_seed(0)
            target = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny-random-llama"])).eval()
            return target, None, None, ("a small RANDOM Llama (the bundled trained pair is not "
                                        "installed yet): its text is noise, its numbers are real")
        model, draft = str(pair[0]), str(pair[1])
    target, tokenizer = load_model(model, "MODEL")
    draft_model = load_model(draft, "--draft")[0] if draft else None
    name = Path(model).name + (f" + draft {Path(draft).name}" if draft else "")
    if not torch.cuda.is_available():  # CPU: fp32 (bf16 matmuls are slow there, and fp32 is
        target = target.float()        # where the engine must match Hugging Face exactly)
        draft_model = draft_model.float() if draft_model is not None else None
        name += " (fp32 on CPU)"
    elif target.device.type != "cuda":
        target = target.cuda()
        draft_model = draft_model.cuda() if draft_model is not None else None
    return target.eval(), draft_model, tokenizer, name


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


def cmd_demo(args: argparse.Namespace) -> int:
    import fuser

    say("fuser demo")
    target, draft, tokenizer, name = _load_pair(args.model, args.draft)
    say(f"model: {name}")
    prompts = DEMO_PROMPTS
    config = fuser.FuserConfig(max_batch_size=len(prompts), max_seq_len=256)
    say("capturing, rewriting and compiling the step graphs ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        engine = fuser.optimize(target, draft=draft, config=config)
    report = engine.report()
    say(str(report))

    ids, mask = _encode(tokenizer, prompts, target.config.vocab_size)
    device = next(target.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = target(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    out = engine.logits(ids, attention_mask=mask)
    real = mask.bool()
    error = float((out[real] - ref[real]).norm() / ref[real].norm())
    say(f"engine.logits vs eager PyTorch: relative error {error:.2e} "
        f"({'within' if error <= 1e-4 else 'OUTSIDE'} the fp32 bound 1e-4)")

    new_tokens = args.max_new_tokens
    gen = target.generation_config
    eos, pad = gen.eos_token_id, gen.pad_token_id if gen.pad_token_id is not None else 0
    engine.generate(ids, 4, attention_mask=mask, eos_token_id=eos, pad_token_id=pad)  # warm-up
    engine.stats.reset()
    start = time.perf_counter()
    out_ids = engine.generate(ids, new_tokens, attention_mask=mask, eos_token_id=eos,
                              pad_token_id=pad)
    fuser_seconds = time.perf_counter() - start
    hf_ids, hf_seconds = _hf_generate_seconds(target, ids, mask, new_tokens, eos, pad)
    T = ids.shape[1]
    for text in _decode(tokenizer, torch.cat([ids, out_ids[:, T:]], dim=1)):
        say("-" * 60 + "\n" + text)
    say("-" * 60)
    fuser_new = int((out_ids[:, T:] != pad).sum())
    hf_new = int((hf_ids[:, T:] != pad).sum())
    same = out_ids.shape == hf_ids.shape and bool((out_ids == hf_ids).all())
    say(f"greedy output identical to Hugging Face generate: {same}")
    stats = engine.stats
    if engine.draft is not None:
        say(f"speculation: gamma {engine.gamma}, acceptance {stats.acceptance_rate:.2f}, "
            f"mean accepted length {stats.mean_accepted_length:.2f}")
    say(f"tokens/s on {engine.device}: fuser {fuser_new / fuser_seconds:.1f}, "
        f"Hugging Face generate {hf_new / hf_seconds:.1f} "
        f"(CPU is a correctness target, not a speed target)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import fuser

    target, draft, tokenizer, _ = _load_pair(args.model, args.draft)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer files: cannot encode --prompt")
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(max_seq_len=args.max_seq_len))
    ids, mask = _encode(tokenizer, [args.prompt], target.config.vocab_size)
    say(args.prompt)
    for column in engine.stream(ids, args.max_new_tokens, attention_mask=mask,
                                do_sample=args.sample, seed=args.seed):
        sys.stdout.write(tokenizer.decode(column[:1]))
        sys.stdout.flush()
    say("")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import fuser

    target, draft, tokenizer, name = _load_pair(args.model, args.draft)
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(max_seq_len=512))
    ids, mask = _encode(tokenizer, DEMO_PROMPTS[:1], target.config.vocab_size)
    engine.generate(ids, 8, attention_mask=mask)
    engine.stats.reset()
    start = time.perf_counter()
    out = engine.generate(ids, args.max_new_tokens, attention_mask=mask)
    seconds = time.perf_counter() - start
    result = {"model": name, "device": str(engine.device), "new_tokens": out.shape[1] - ids.shape[1],
              "seconds": seconds, "tokens_per_second": (out.shape[1] - ids.shape[1]) / seconds,
              "mean_accepted_length": engine.stats.mean_accepted_length}
    say(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def cmd_not_yet(args: argparse.Namespace) -> int:
    raise ValueError(f"'fuser {args.command}' needs engine files, which this version does not "
                     "build yet; use 'fuser generate MODEL_DIR' or the Python API")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuser", description="A compiler for LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the bundled default model pair, end to end")
    demo.add_argument("--model", default=None, help="a model directory instead of the bundled target")
    demo.add_argument("--draft", default=None)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(fn=cmd_demo)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--max-seq-len", type=int, default=1024)
    gen.add_argument("--draft", default=None)
    gen.add_argument("--sample", action="store_true")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(fn=cmd_generate)
    bench = sub.add_parser("bench", help="time generation")
    bench.add_argument("model")
    bench.add_argument("--draft", default=None)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--json", default=None)
    bench.set_defaults(fn=cmd_bench)
    for name in ("build", "inspect"):
        p = sub.add_parser(name, help="(engine files: not in this version)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=cmd_not_yet)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"fuser: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
