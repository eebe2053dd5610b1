"""The real gpt-fast as a peer: its own model code and generate loop, timed like benchmarks/decode.py.

    python3 benchmarks/gpt_fast_peer.py --gpt-fast benchmarks/.gpt-fast --out $OUT/gpt_fast.json
    python3 benchmarks/gpt_fast_peer.py --gpt-fast benchmarks/.gpt-fast --dry-run   # CPU, tiny

gpt-fast (github.com/pytorch-labs/gpt-fast) is not a dependency and is not vendored: bring a
checkout into the git-ignored folder benchmarks/.gpt-fast (its model.py and generate.py are
all this script imports), and carry that folder to the GPU machine. This script is ours: it
builds gpt-fast's `Transformer` from its own `ModelArgs.from_name(preset)` with random weights
(normal, std 0.02; norm weights 1) in bf16, compiles `generate.decode_one_token` as gpt-fast's
`main` does (`mode="reduce-overhead", fullgraph=True`, coordinate-descent tuning on), and times
`generate.generate(...)` for one prompt of random token ids: new tokens / wall time of the call
(prefill included), the median of --runs calls after one warm-up call (the compile). Sampling
uses gpt-fast's defaults (temperature 0.8, top_k 200).

The same measure as benchmarks/decode.py's "fuser generate: N tokens in T s" and its
gpt-fast-style peer (which runs Hugging Face's model code the gpt-fast way: benchmarks/peers.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

PRESETS = {"llama-3-8b": "llama-3-8b", "llama-3.2-1b": None, "tiny": "stories15M"}


def load_gpt_fast(path: Path):
    """(model module, generate module) of the gpt-fast checkout at `path`."""
    if not (path / "model.py").is_file() or not (path / "generate.py").is_file():
        raise SystemExit(f"benchmarks/gpt_fast_peer.py: no gpt-fast checkout at {path} (model.py "
                         "and generate.py expected); fetch github:pytorch-labs/gpt-fast there")
    sys.path.insert(0, str(path))
    # generate.py imports its tokenizer module (sentencepiece, tiktoken) for main(); token ids
    # here are random, so a stand-in module keeps those packages off the GPU machine.
    stand_in = types.ModuleType("tokenizer")

    def get_tokenizer(*_args, **_kwargs):
        raise RuntimeError("benchmarks/gpt_fast_peer.py runs on token ids, without a tokenizer")

    stand_in.get_tokenizer = get_tokenizer
    sys.modules.setdefault("tokenizer", stand_in)
    import generate as gpt_generate  # noqa: PLC0415  (gpt-fast's modules, from the checkout)
    import model as gpt_model  # noqa: PLC0415
    return gpt_model, gpt_generate


def random_model(gpt_model, name: str, device: str, dtype: torch.dtype, seed: int = 0):
    config = gpt_model.ModelArgs.from_name(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = gpt_model.Transformer(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or ".attention_norm." in pname or ".ffn_norm." in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype=dtype).eval(), config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-fast", type=Path, default=Path(__file__).parent / ".gpt-fast")
    parser.add_argument("--preset", default="llama-3-8b", help="a name gpt-fast's ModelArgs knows")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, gpt-fast's stories15M, 8 new tokens, no compile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        device, dtype, name = "cpu", torch.float32, "stories15M"
        args.new_tokens, args.prompt_tokens, args.runs, args.no_compile = 8, 16, 1, True
    elif not torch.cuda.is_available():
        print("benchmarks/gpt_fast_peer.py: no CUDA device; pass --dry-run on CPU", file=sys.stderr)
        return 2
    else:
        device, dtype, name = "cuda", torch.bfloat16, args.preset
    gpt_model, gpt_generate = load_gpt_fast(args.gpt_fast.resolve())
    model, config = random_model(gpt_model, name, device, dtype)
    if not args.no_compile:  # as gpt-fast's main() does for its headline numbers
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        inductor_config.triton.unique_kernel_names = True
        inductor_config.fx_graph_cache = True
        gpt_generate.decode_one_token = torch.compile(
            gpt_generate.decode_one_token, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=g).to(device)

    def one_call() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            seq, _ = gpt_generate.generate(model, prompt, args.new_tokens, batch_size=1,
                                           interactive=False, draft_model=None,
                                           temperature=0.8, top_k=200)
        if device == "cuda":
            torch.cuda.synchronize()
        assert seq.shape[-1] == args.prompt_tokens + args.new_tokens, seq.shape
        return time.perf_counter() - start

    warmup = one_call()
    times = [one_call() for _ in range(args.runs)]
    seconds = statistics.median(times)
    tok_s = args.new_tokens / seconds
    print(f"gpt-fast ({args.gpt_fast.name}, {name}, {dtype}): {args.new_tokens} tokens in "
          f"{seconds:.3f} s = {tok_s:.1f} tok/s (median of {len(times)}; warm-up {warmup:.0f} s)",
          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": name, "dtype": str(dtype), "device": device,
                       "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                       "seconds": times, "tok_s": tok_s, "warmup_s": warmup,
                       "compiled": not args.no_compile}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
