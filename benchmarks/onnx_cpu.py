"""fuser's ONNX export against a plain `torch.onnx.export` + onnxruntime's own optimizer, and
tok/s on the CPU through onnxruntime beside fuser's CPU engine and Hugging Face generate.

    python benchmarks/onnx_cpu.py --out /tmp/onnx_cpu.json          # ~5 minutes, 2-core CPU

The bundled pair (models/fuser-code-target and -draft) in fp32, batch 1, greedy:
(1) fusions: onnxruntime's fused operators in fuser's export of the target (prefill and decode
    graphs, fuser/onnx/), in a plain `torch.onnx.export(dynamo=True)` of the same model (one
    cache-free forward, the usual starting point), and in that plain graph after
    `onnxruntime.transformers.optimizer.optimize_model` (model_type gpt2, the type onnxruntime
    uses for decoder-only models); node counts per op type of each graph.
(2) tok/s on one prompt: fuser's export run by onnxruntime (runtime/onnx_steps.py: the
    engine's own decoding loop), speculative (gamma="auto") and target-only; fuser's own CPU
    engine (fuser.optimize, Inductor's C++ backend), the same two ways; HF `generate`. Every
    system runs under --threads intra-op threads and is checked token for token against HF
    (fp32: exactness is promised).
Writes the JSON to --out; prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

LLAMA_FUSIONS = ["SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                 "RotaryEmbedding", "GroupQueryAttention", "MultiHeadAttention", "Attention"]


def log(message: str) -> None:
    print(message, flush=True)


def op_counts(model: object) -> dict[str, int]:
    """Nodes per op type of an onnx ModelProto (contrib ops without their domain)."""
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def plain_export(model: torch.nn.Module, directory: Path) -> tuple[dict, dict, dict, float]:
    """(plain graph's op counts, optimized graph's op counts, the optimizer's fusion
    statistics, export seconds) for a plain torch.onnx.export of `model`'s forward."""
    import onnx
    from onnxruntime.transformers import optimizer

    class Forward(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    start = time.perf_counter()
    program = torch.onnx.export(Forward(model), (ids,), dynamo=True,
                                dynamic_shapes=({1: torch.export.Dim("T", min=2, max=512)},))
    seconds = time.perf_counter() - start
    path = directory / "plain.onnx"
    program.save(str(path), external_data=True)
    plain = op_counts(onnx.load(str(path)))
    optimized = optimizer.optimize_model(str(path), model_type="gpt2",
                                         num_heads=model.config.num_attention_heads,
                                         hidden_size=model.config.hidden_size, opt_level=0)
    stats = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    return plain, op_counts(optimized.model), stats, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per system (median)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of torch and onnxruntime (default: 1, as fuser's "
                             "CLI on a CPU)")
    parser.add_argument("--skip-fuser-engine", action="store_true",
                        help="leave out fuser's own CPU engine (its Inductor build takes minutes)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)

    import fuser
    from fuser import compare
    from fuser.cli import DEMO_PROMPTS, _encode, _generation_ids
    from fuser.launch import load_pair
    from fuser.onnx.export import export_models
    from fuser.runtime.onnx_steps import load

    target, draft, tokenizer, name = load_pair(None, None)  # fp32 on a CPU
    assert next(target.parameters()).dtype == torch.float32, name
    max_seq_len = 256
    results: dict = {"model": name, "threads": args.threads, "new_tokens": args.new_tokens,
                     "runs": args.runs}
    scratch = Path(tempfile.mkdtemp(prefix="onnx_cpu."))

    # (1) fusions and node counts
    log("exporting through fuser (prefill and decode of the target and the draft) ...")
    start = time.perf_counter()
    manifest = export_models(target, draft, scratch / "fuser", max_seq_len=max_seq_len,
                             tokenizer=tokenizer)
    results["fuser_export_seconds"] = time.perf_counter() - start
    graphs = manifest["roles"]["target"]["graphs"]
    results["fuser_graphs"] = {file: g["ops"] for file, g in graphs.items()}
    log("exporting with torch.onnx.export(dynamo=True) and running onnxruntime's optimizer ...")
    plain, optimized, stats, seconds = plain_export(target, scratch)
    results.update(plain_graph=plain, optimized_graph=optimized, optimizer_fusions=stats,
                   plain_export_seconds=seconds)

    # (2) tok/s
    rows = []
    eos = target.generation_config.eos_token_id
    pad = target.generation_config.pad_token_id
    pad = int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos or 0))
    ids, mask = _encode(tokenizer, DEMO_PROMPTS[:1], target.config.vocab_size)
    hf_row, hf_out = compare.time_system("HF generate", compare.hf_generate(target, eos, pad),
                                         ids, mask, args.new_tokens, pad, args.runs,
                                         torch.device("cpu"))
    outputs = {}
    for gamma, label in (("auto", "speculative (auto)"), (0, "target-only")):
        engine = load(scratch / "fuser", gamma=gamma, threads=args.threads)
        eos_e, pad_e = _generation_ids(engine)
        row, out = compare.time_system(f"ORT {label}",
                                       compare.engine_generate(engine, eos_e, pad_e), ids, mask,
                                       args.new_tokens, pad, args.runs, torch.device("cpu"))
        rows.append(row)
        outputs[row.system] = out
        del engine
    if not args.skip_fuser_engine:
        log("building fuser's own CPU engine (Inductor) ...")
        start = time.perf_counter()
        engine = fuser.optimize(target, draft=draft,
                                config=fuser.FuserConfig(max_batch_size=1, max_seq_len=max_seq_len))
        results["fuser_engine_build_seconds"] = time.perf_counter() - start
        for gamma, label in ((None, "speculative (auto)"), (0, "target-only")):
            row, out = compare.time_system(f"fuser CPU {label}",
                                           compare.engine_generate(engine, eos, pad, gamma), ids,
                                           mask, args.new_tokens, pad, args.runs,
                                           torch.device("cpu"))
            rows.append(row)
            outputs[row.system] = out
    rows.append(hf_row)
    for row in rows:
        if row.system in outputs:
            where = compare.first_divergence(outputs[row.system], hf_out, ids.shape[1])
            row.note = "tokens = HF's" if where is None else f"DIFFERS from HF at token {where}"
    results["rows"] = [r.as_dict() for r in rows]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))

    # Tables last.
    log("")
    log(f"{name}, fp32, batch 1, {args.threads} thread(s); export: fuser "
        f"{results['fuser_export_seconds']:.1f} s (4 graphs), plain "
        f"{results['plain_export_seconds']:.1f} s (1 graph)")
    log(f"{'fused operator':<34} {'fuser prefill':>13} {'fuser decode':>12} {'plain':>6} "
        f"{'plain+ORT opt':>13}")
    for op in LLAMA_FUSIONS:
        counts = [graphs["prefill"]["ops"].get(f"com.microsoft.{op}",
                                               graphs["prefill"]["ops"].get(op, 0)),
                  graphs["decode"]["ops"].get(f"com.microsoft.{op}",
                                              graphs["decode"]["ops"].get(op, 0)),
                  plain.get(op, 0), optimized.get(op, 0)]
        log(f"{op:<34} {counts[0]:>13} {counts[1]:>12} {counts[2]:>6} {counts[3]:>13}")
    totals = [sum(graphs["prefill"]["ops"].values()), sum(graphs["decode"]["ops"].values()),
              sum(plain.values()), sum(optimized.values())]
    log(f"{'nodes in all':<34} {totals[0]:>13} {totals[1]:>12} {totals[2]:>6} {totals[3]:>13}")
    log("")
    log(f"{'nodes by op type':<34} {'fuser decode':>12} {'plain':>6} {'plain+ORT opt':>13}")
    decode_ops = {op.removeprefix("com.microsoft."): n for op, n in graphs["decode"]["ops"].items()}
    for op in sorted(set(decode_ops) | set(plain) | set(optimized)):
        log(f"{op:<34} {decode_ops.get(op, 0):>12} {plain.get(op, 0):>6} "
            f"{optimized.get(op, 0):>13}")
    log("KV cache: fuser's graphs take and return it (GroupQueryAttention); the plain graph "
        "has none (full forward per token)")
    log("")
    log("ORT: fuser's export run by onnxruntime through the engine's decoding loop; fuser CPU: "
        "fuser.optimize (Inductor C++)")
    log(compare.table(rows))


if __name__ == "__main__":
    main()
