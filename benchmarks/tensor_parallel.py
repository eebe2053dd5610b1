"""Decode at batch 1 over 1, 2, ... GPUs: the tensor-parallel engine (fuser/distributed.py)
against one GPU, in one run.

    python benchmarks/tensor_parallel.py --preset llama-3-8b --sizes 1,2 --out $OUT/tp.json
    python benchmarks/tensor_parallel.py --preset llama-3-70b --sizes 2,4,8 --out $OUT/tp70.json

Random bf16 weights of the preset's shape, a 128-token prompt, 256 new tokens, greedy, target
only. Per world size N: `fuser.optimize` with FuserConfig(tensor_parallel=N), the median tok/s
of 3 `generate` calls, the bytes each rank's steps hold, and the per-rank weight-read ceiling:
HBM bandwidth / (bytes a decode step reads / N).

Where the sizes include 1, the model is made whole on cuda:0 and every rank copies its slices
from it (fuser/rank_model.py `ModuleWeights`); every size runs with and without CUDA graphs
(N > 1 captured: the followers capture with rank 0), each compared with N=1 alike, and the
greedy tokens of every N must equal N=1's up to bf16 rounding: the first differing position is
printed, never hidden. Where they do not (a shape no single GPU holds: 140 GB for the 70B
shape), or with --per-rank-weights, the model exists only on the meta device and each rank
makes its own share at random on its own GPU (`RandomWeights`): no process ever holds the
whole model, only the CUDA-graph rows run, and there are no tp=1 tokens to compare with.
--one-shot adds N > 1 with the peer-to-peer one-shot all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import transformers

import fuser
from fuser.distributed import rank_held_bytes
from fuser.models import PRESETS
from timing import log, measure_read_bandwidth, step_bytes

RESULTS: dict = {}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(model: torch.nn.Module, world_size: int, cuda_graphs: bool,
                prompt: torch.Tensor, args: argparse.Namespace
                ) -> tuple[float, torch.Tensor, list[int]]:
    """(median tok/s of `args.runs` generate calls, the greedy tokens, the bytes each rank's
    steps hold) of one engine."""
    config = fuser.FuserConfig(max_seq_len=args.prompt_tokens + args.new_tokens + 16,
                               device=args.device, tensor_parallel=world_size, gamma=0,
                               cuda_graphs=cuda_graphs)
    start = time.perf_counter()
    engine = fuser.optimize(model, config=config)
    log(f"tp={world_size} cuda_graphs={cuda_graphs}: built in {time.perf_counter() - start:.0f} s"
        f"; fallbacks: {engine.report().fallbacks}")
    try:
        held = rank_held_bytes(engine)
        log(f"tp={world_size}: each rank's steps hold "
            f"{', '.join(f'{b / 1e9:.2f}' for b in held)} GB (KV cache aside)")
        tokens = engine.generate(prompt, args.new_tokens)  # warm-up, and the tokens compared
        times = []
        for _ in range(args.runs):
            _sync()
            began = time.perf_counter()
            engine.generate(prompt, args.new_tokens)
            _sync()
            times.append(time.perf_counter() - began)
        times.sort()
        return args.new_tokens / times[len(times) // 2], tokens.cpu(), held
    finally:
        engine.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3-8b", help="a shape of fuser.models.PRESETS")
    parser.add_argument("--sizes", default="1,2", help="world sizes to time, comma-separated")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--one-shot", action="store_true",
                        help="the tp>1 rows again with FUSER_ONE_SHOT_ALL_REDUCE=1 (the "
                             "peer-to-peer one-shot all-reduce for small messages)")
    parser.add_argument("--per-rank-weights", action="store_true",
                        help="make each rank's share at random on its own device, the model "
                             "only on the meta device (the default where --sizes has no 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU (gloo ranks), a tiny random fp32 Llama, 8 new tokens")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    per_rank = args.per_rank_weights or 1 not in sizes
    if per_rank and 1 in sizes:
        sys.exit("benchmarks/tensor_parallel.py: --per-rank-weights makes no tp=1 model: "
                 "leave 1 out of --sizes")
    if args.dry_run:
        args.device, args.preset, args.new_tokens, args.prompt_tokens, args.runs = \
            "cpu", "tiny-random-llama", 8, 8, 1
        dtype, bandwidth, gpu, gpus = torch.float32, float("nan"), "dry run on CPU", 1
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/tensor_parallel.py: no CUDA device; run it on a machine with "
                     "GPUs (or --dry-run)")
        if max(sizes) > torch.cuda.device_count():
            sys.exit(f"benchmarks/tensor_parallel.py: --sizes {args.sizes} needs "
                     f"{max(sizes)} GPUs, {torch.cuda.device_count()} visible")
        args.device = "cuda:0"
        dtype, bandwidth = torch.bfloat16, measure_read_bandwidth()
        gpu, gpus = torch.cuda.get_device_name(), torch.cuda.device_count()
    warnings.simplefilter("ignore")
    preset = dict(PRESETS[args.preset])
    if args.layers is not None:
        preset["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    # On CUDA the followers receive a whole model by IPC (no /dev/shm); a meta one has no
    # weights to send: each rank makes its own.
    with torch.device("meta" if per_rank else args.device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**preset)).eval()
    torch.set_default_dtype(torch.float32)
    nbytes = step_bytes(model)
    prompt = torch.randint(0, preset["vocab_size"], (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(1)).to(args.device)
    RESULTS.update(env={"gpu": gpu, "gpus": gpus, "torch": torch.__version__,
                        "preset": args.preset, "command": " ".join(sys.argv)},
                   bandwidth_TBps=bandwidth / 1e12, step_GB=nbytes / 1e9, rows=[])
    # (world size, CUDA graphs, one-shot all-reduce)
    runs = ([(1, True, False)] if not args.dry_run and not per_rank else [])
    if not per_rank or args.dry_run:
        runs += [(n, False, False) for n in sizes]
    if not args.dry_run:  # tp > 1 captured too (followers capture with rank 0)
        runs += [(n, True, False) for n in sizes if n > 1]
    if args.one_shot:
        runs += [(n, True, True) for n in sizes if n > 1]
    reference = None
    for world_size, graphs, one_shot in runs:
        os.environ["FUSER_ONE_SHOT_ALL_REDUCE"] = "1" if one_shot else "0"  # ranks inherit it
        tok_s, tokens, held = time_engine(model, world_size, graphs, prompt, args)
        ceiling = bandwidth * world_size / nbytes
        if reference is None and not per_rank:
            reference = tokens
        first = None
        if reference is not None:
            differ = (tokens != reference).nonzero()
            first = None if differ.numel() == 0 else int(differ[0, 1]) - args.prompt_tokens
        row = {"tensor_parallel": world_size, "cuda_graphs": graphs, "one_shot": one_shot,
               "per_rank_weights": per_rank, "tok_s": tok_s,
               "ceiling_tok_s": ceiling, "of_ceiling": tok_s / ceiling,
               "held_GB_per_rank": [b / 1e9 for b in held],
               "first_token_differing_from_tp1": first}
        RESULTS["rows"].append(row)
        log(f"tp={world_size} cuda_graphs={graphs} one_shot={one_shot}: {tok_s:.1f} tok/s "
            f"({100 * tok_s / ceiling:.0f}% of its {ceiling:.0f} tok/s ceiling); "
            + ("random weights per rank: no tp=1 tokens to compare" if per_rank else
               f"tokens {'equal to tp=1' if first is None else f'differ from tp=1 at {first}'}"))
    base = {graphs: r["tok_s"] for r in RESULTS["rows"] for graphs in (r["cuda_graphs"],)
            if r["tensor_parallel"] == 1}
    print(f"system {RESULTS['env']['gpu']} x{RESULTS['env']['gpus']}, {args.preset}, batch 1, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {dtype}")
    for row in RESULTS["rows"]:  # against tp=1 with CUDA graphs alike
        speedup = row["tok_s"] / base.get(row["cuda_graphs"], float("nan"))
        print(f"tp={row['tensor_parallel']} graphs={'on ' if row['cuda_graphs'] else 'off'} "
              f"{'one-shot' if row['one_shot'] else 'nccl    '} {row['tok_s']:8.1f} tok/s  "
              f"{100 * row['of_ceiling']:5.1f}% of ceiling  "
              f"{max(row['held_GB_per_rank']):6.2f} GB/rank  "
              + (f"x{speedup:.2f} vs tp=1 (graphs {'on' if row['cuda_graphs'] else 'off'})"
                 if not per_rank else "(random weights per rank)"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=2)


if __name__ == "__main__":
    main()
