"""Export a model's prefill and decode steps as ONNX models for onnxruntime.

Each step is captured as the engine captures it (`fuser.capture.export_step`: the same
attention function, the same KV-cache writes), rewritten by the passes whose fused ops
onnxruntime has operators for (`ONNX_PASSES`), and translated node by node
(`fuser.onnx.translate`). Prefill is dynamic in the batch and T; "decode" is the step over a
filled cache, dynamic in the batch and in T too, so one graph serves decode, verify (gamma + 1
tokens) and the draft's catch-up and resync steps.

An export directory:

    onnx_manifest.json                 format, dtype, max_seq_len, per role its geometry, the
                                       passes' matches and the ONNX op counts of each graph
    target/prefill.onnx, decode.onnx   the graphs; their weights in target/weights.bin,
    target/weights.bin                 one file both graphs read (ONNX external data)
    draft/...                          the same for the draft, where there is one
    generation_config.json, tokenizer/ when the source has them

FP8 engines are refused (`FP8_REFUSAL`) rather than exported as QuantizeLinear /
DequantizeLinear pairs: an FP8 engine's numerics are its own (e4m3 weights with per-output-channel
scales, bf16 activations at decode, per-token FP8 activations on the tensor cores at prefill);
a QDQ graph would either dequantize every weight back to full precision on onnxruntime's CPU
(the FP8 model's rounding without its speed) or quantize activations where the engine does not,
and neither would be checked against the engine by a test here. The model's bf16/fp16/fp32
export, quantized by onnxruntime's own tools where wanted, is the honest artifact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import torch
from torch import nn

from fuser.capture import (StepModule, engine_view, export_step, model_geometry,
                           supports_cache_attention)
from fuser.config import MAX_GAMMA, FuserConfig
from fuser.onnx.translate import OnnxExportError, Translated, onnx_dtype, translate
from fuser.passes import PassContext, run_passes
from fuser.passes.outer_product import OUTER_PRODUCT
from fuser.passes.rmsnorm import ADD_RMS_NORM, RMS_NORM
from fuser.passes.rope import ROTARY
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import DECODE, PREFILL, StepKind

FORMAT = "fuser-onnx/1"
MANIFEST = "onnx_manifest.json"
WEIGHTS = "weights.bin"
GRAPHS = {"prefill": PREFILL, "decode": DECODE}

# The passes whose fused ops map to onnxruntime operators, in PASSES' order. The others choose
# fuser's own kernels (GEMV, split-K attention, merged projections, FP8) and stay unrun: their
# ops would only be translated back into the ATen they replaced.
ONNX_PASSES = [OUTER_PRODUCT, ADD_RMS_NORM, RMS_NORM, ROTARY]

# The rows the export traces at: the graphs keep the batch symbolic, so any batch runs.
_TRACE_ROWS = 2


def slots_for(max_seq_len: int) -> int:
    """Cache slots per row (and positions the rotary tables cover) for `max_seq_len`: as an
    engine's, max_seq_len plus the most a verify step writes past it (MAX_GAMMA + 1)."""
    return max_seq_len + MAX_GAMMA + 1


FP8_REFUSAL = (
    "an FP8 engine is not exported to ONNX: its numerics (e4m3 weights with per-channel scales, "
    "W8A16 at decode, per-token FP8 activations at prefill) have no onnxruntime CPU kernels, and "
    "a QuantizeLinear/DequantizeLinear graph would run a different model than the engine does, "
    "one that no test here checks; export the bf16/fp16/fp32 model and quantize it with "
    "onnxruntime's own tools")


def export_model(role: str, model: nn.Module, out: Path, *, dtype: torch.dtype,
                 max_seq_len: int) -> dict:
    """Write `role`'s prefill and decode graphs and their weights under out/role; -> the role's
    manifest entry."""
    if not supports_cache_attention(model):
        raise OnnxExportError(f"{role}: {type(model).__name__} does not dispatch attention "
                              "through transformers' attention interface; the export cannot "
                              "capture its KV cache")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise OnnxExportError(f"{role}: dtype {dtype} is not exported (fp32, fp16 or bf16)")
    device = torch.device("cpu")
    view = engine_view(model, dtype, device)
    layers, kv_heads, head_dim = model_geometry(view.config)
    cache = KVCache.allocate(layers, _TRACE_ROWS, max_seq_len, kv_heads, head_dim, dtype, device)
    directory = out / role
    directory.mkdir(parents=True, exist_ok=True)
    graphs: dict[str, dict] = {}
    translated: dict[str, Translated] = {}
    for file, kind in GRAPHS.items():
        gm, matches = _captured(role, view, cache, kind, max_seq_len)
        result = translate(gm, f"{role}.{file}", layers, slots_for(max_seq_len))
        translated[file] = result
        graphs[file] = {"matches": matches, "ops": result.op_counts}
    _write(directory, translated)
    return {
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": view.config.vocab_size, "model_type": view.config.model_type,
        "graphs": graphs,
    }


def _captured(role: str, view: nn.Module, cache: KVCache, kind: StepKind, max_seq_len: int
              ) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """The step `kind` of `view` exported as the engine exports it (batch and T symbolic) and
    rewritten by ONNX_PASSES; -> (graph, matches per pass)."""
    module = StepModule(view, cache.k, cache.v, prefill=not kind.fixed)
    try:
        if kind.fixed:
            _, gm = export_step(module, _TRACE_ROWS, 2, max_tokens=max_seq_len,
                                dynamic_batch=True, token_range=(1, max_seq_len))
        else:
            _, gm = export_step(module, _TRACE_ROWS, None, max_tokens=max_seq_len,
                                dynamic_batch=True)
    except Exception as e:  # noqa: BLE001 -- named in the refusal
        raise OnnxExportError(f"{role}.{kind.name}: torch.export failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                              "there is no graph to translate") from e
    context = PassContext(f"{role}.{kind.name}", kind, FuserConfig(), role)
    result = run_passes(gm, context, passes=ONNX_PASSES)
    if result.errors:
        raise OnnxExportError(f"{role}.{kind.name}: {result.errors[0]}")
    return gm, {p.name: result.matches.get(p.name, 0) for p in ONNX_PASSES}


def _write(directory: Path, graphs: dict[str, Translated]) -> None:
    """Save the graphs with every weight in one shared external-data file."""
    offsets: dict[str, tuple[int, int]] = {}
    written: dict[str, torch.Tensor] = {}
    with open(directory / WEIGHTS, "wb") as f:
        for result in graphs.values():
            for name, tensor in result.weights.items():
                if name in offsets:  # the graphs share it: one copy, which must be the same
                    if not torch.equal(written[name], tensor):
                        raise OnnxExportError(f"the graphs hold two different tensors named "
                                              f"{name!r}")
                    continue
                written[name] = tensor
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                pad = -f.tell() % 64  # aligned, so that onnxruntime may map it
                f.write(b"\0" * pad)
                offsets[name] = (f.tell(), data.numel())
                f.write(data.numpy().tobytes())
    for file, result in graphs.items():
        model = result.model
        for name, tensor in result.weights.items():
            proto = onnx.TensorProto()
            proto.name = name
            proto.data_type = onnx_dtype(tensor.dtype)
            proto.dims.extend(tensor.shape)
            offset, length = offsets[name]
            proto.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", WEIGHTS), ("offset", offset), ("length", length)):
                entry = proto.external_data.add()
                entry.key, entry.value = key, str(value)
            model.graph.initializer.append(proto)
        onnx.save_model(model, str(directory / f"{file}.onnx"))


def export_models(target: nn.Module, draft: nn.Module | None, out: str | Path, *,
                  dtype: torch.dtype | None = None, max_seq_len: int = 2048,
                  precision: str | None = None, gamma: int | str = "auto",
                  tokenizer: object | None = None, overwrite: bool = False) -> dict:
    """Export `target` (and `draft`) to the directory `out` (module docstring); -> manifest.

    dtype: the graphs' (default: the target's own). max_seq_len: the cache length the runtime
    allocates and the positions the rotary tables cover. precision "fp8" is refused
    (FP8_REFUSAL). gamma: recorded for the runtime (a fixed draft length or "auto").
    """
    if precision == "fp8":
        raise OnnxExportError(FP8_REFUSAL)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise OnnxExportError(f"{out} exists and is not empty (pass overwrite=True)")
        shutil.rmtree(out)
    dtype = dtype or next(target.parameters()).dtype
    out.mkdir(parents=True, exist_ok=True)
    try:
        roles = {"target": export_model("target", target, out, dtype=dtype,
                                        max_seq_len=max_seq_len)}
        if draft is not None:
            roles["draft"] = export_model("draft", draft, out, dtype=dtype,
                                          max_seq_len=max_seq_len)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-written export is left behind
        raise
    generation_config = getattr(target, "generation_config", None)
    if generation_config is not None:
        (out / "generation_config.json").write_text(generation_config.to_json_string())
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out / "tokenizer"))
    manifest = {
        "format": FORMAT, "dtype": str(dtype).removeprefix("torch."),
        "max_seq_len": max_seq_len, "gamma": gamma, "roles": roles,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def engine_models(engine: object) -> tuple[nn.Module, nn.Module | None]:
    """The Hugging Face models an engine was built from: its steps' own modules, or for a
    loaded engine the model directories its manifest records."""
    def own(steps: object) -> nn.Module | None:
        if steps is None:
            return None
        for graph in steps.steps.values():
            if isinstance(graph.eager, StepModule):
                return graph.eager.model
        return None

    target, draft = own(engine.target), own(engine.draft)
    if engine.target is None and isinstance(engine.user_target, nn.Module):
        target = engine.user_target
    source = ((engine.manifest or {}).get("info") or {}).get("source", {})
    if target is None:
        target = _source_model(source, "target")
    if draft is None and engine.draft is not None:
        draft = _source_model(source, "draft")
    return target, draft


def _source_model(source: dict[str, str], role: str) -> nn.Module:
    """The model directory an engine directory records for `role`, loaded (by transformers
    directly: fuser.pipeline imports the engine, which exports through this module)."""
    from transformers import AutoModelForCausalLM

    path = source.get(role)
    if not path or not (Path(path) / "config.json").is_file():
        raise OnnxExportError(f"the engine holds no {role} model to export and its manifest "
                              f"records no {role} model directory that exists "
                              f"({path or 'none recorded'}): export the model directory instead")
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()


def export_engine(engine: object, path: str | Path, overwrite: bool = False) -> dict:
    """`engine.export_onnx(path)`: the engine's target (and draft) at its dtype and max_seq_len."""
    config = engine.config
    if config.precision == "fp8":
        raise OnnxExportError(FP8_REFUSAL)
    target, draft = engine_models(engine)
    return export_models(target, draft, path, dtype=engine.dtype, max_seq_len=config.max_seq_len,
                         gamma=config.gamma, tokenizer=engine.tokenizer, overwrite=overwrite)


def export_engine_dir(directory: str | Path, path: str | Path, overwrite: bool = False,
                      precision: str | None = None) -> dict:
    """An engine directory's models (the source directories its manifest records), exported
    at the engine's dtype (or `precision`'s), max_seq_len and gamma, without loading the
    engine (it may have been built for another device)."""
    from fuser.engine_file import MANIFEST as ENGINE_MANIFEST
    from fuser.engine_io import load_extras

    directory = Path(directory)
    manifest = json.loads((directory / ENGINE_MANIFEST).read_text())
    config = manifest.get("config", {})
    if config.get("precision") == "fp8":
        raise OnnxExportError(FP8_REFUSAL)
    info = manifest.get("info", {})
    source = info.get("source", {})
    target = _source_model(source, "target")
    draft = _source_model(source, "draft") if "draft" in manifest.get("models", {}) else None
    tokenizer, _ = load_extras(directory)
    dtype = getattr(torch, info["engine"]["dtype"])
    if precision is not None:
        dtype = FuserConfig(precision=precision).dtype_for(dtype)
    return export_models(target, draft, path, dtype=dtype,
                         max_seq_len=config.get("max_seq_len", 2048),
                         gamma=config.get("gamma", "auto"), tokenizer=tokenizer,
                         overwrite=overwrite)
