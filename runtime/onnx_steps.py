"""Exported ONNX steps (fuser/onnx/) run by onnxruntime as an Engine's model steps.

    step(tokens[B, T], positions[B, T], seq_lens[B], starts[B]) -> logits[B, T, V]

`OrtStep` is a step function like any built one: it runs the exported graph with the KV cache
bound as input and, to the same memory, as output (onnxruntime's GroupQueryAttention writes the
new tokens' keys and values into the cache in place). `load` wraps an export directory's graphs
in `ModelSteps` and an `Engine`, so generation (greedy, sampling, speculative, streaming) is
the engine's own decoding loop (runtime/generate.py), not a copy of it.

The cache is held in GroupQueryAttention's layout, [B, kv_heads, S, D] per layer; the engine's
`KVCache` sees it through transposed views ([B, S, kv_heads, D]), so its lengths and rows work
as for any engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fuser.config import FuserConfig
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import (PREFILL, ModelSteps, StepGraph, StepKind, draft_steps,
                                 target_steps, verify)

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


class OrtStep:
    """One exported graph (prefill or decode) over one model's cache buffers."""

    def __init__(self, session: object, buffers: list[torch.Tensor], vocab_size: int,
                 dtype: torch.dtype, logits_dtype: torch.dtype) -> None:
        """buffers: per layer key then value, [B, kv_heads, S, D] contiguous (the graph's
        past_* inputs and present_* outputs, in `translate.cache_names` order)."""
        self.session = session
        self.buffers = buffers
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.logits_dtype = logits_dtype
        layers = len(buffers) // 2
        self.names = [(f"past_{kv}_{i}", f"present_{kv}_{i}")
                      for i in range(layers) for kv in ("key", "value")]
        self.runs = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        binding = self.session.io_binding()
        held = []  # the int inputs' contiguous copies live until the run ends
        for name, tensor in (("tokens", tokens), ("positions", positions),
                             ("seq_lens", seq_lens), ("starts", starts)):
            t = tensor.to(torch.int64).contiguous()
            held.append(t)
            binding.bind_input(name, "cpu", 0, np.int64, list(t.shape), t.data_ptr())
        element = _NUMPY[self.dtype]
        for (past, present), buffer in zip(self.names, self.buffers):
            rows = buffer[:B]  # a bucket's rows: a contiguous prefix
            shape = list(rows.shape)
            binding.bind_input(past, "cpu", 0, element, shape, rows.data_ptr())
            binding.bind_output(present, "cpu", 0, element, shape, rows.data_ptr())
        logits = torch.empty(B, T, self.vocab_size, dtype=self.logits_dtype)
        binding.bind_output("logits", "cpu", 0, _NUMPY[self.logits_dtype], list(logits.shape),
                            logits.data_ptr())
        self.session.run_with_iobinding(binding)
        self.runs += 1
        return logits


def allocate(layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> tuple[KVCache, list[torch.Tensor]]:
    """A KVCache whose k/v are transposed views of [B, kv_heads, S, D] buffers; -> (cache,
    the buffers, key then value per layer)."""
    buffers = [torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype)
               for _ in range(2 * layers)]
    zeros = torch.zeros(batch, dtype=torch.long)
    cache = KVCache([b.transpose(1, 2) for b in buffers[0::2]],
                    [b.transpose(1, 2) for b in buffers[1::2]],
                    seq_lens=zeros.clone(), starts=zeros.clone())
    return cache, buffers


def session(path: Path, threads: int | None = None) -> object:
    """An onnxruntime CPU session of one exported graph."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def model_steps(role: str, directory: Path, info: dict, kinds: list[StepKind], batch: int,
                slots: int, dtype: torch.dtype, threads: int | None = None) -> ModelSteps:
    """`role`'s steps over a fresh cache: prefill runs prefill.onnx, every fixed-T kind
    (decode, verify, catch-up, resync) decode.onnx."""
    cache, buffers = allocate(info["layers"], batch, slots, info["kv_heads"], info["head_dim"],
                              dtype)
    vocab = info["vocab_size"]
    runners = {file: OrtStep(session(directory / f"{file}.onnx", threads), buffers, vocab, dtype,
                             dtype) for file in ("prefill", "decode")}
    steps = ModelSteps(role, cache, vocab)
    for kind in kinds:
        file = "prefill" if kind == PREFILL else "decode"
        graph = StepGraph(f"{role}.{kind.name}", kind, eager=runners[file])
        graph.matches = dict(info["graphs"][file]["matches"])
        graph.fused_ops = {op: n for op, n in info["graphs"][file]["ops"].items()
                           if op.startswith("com.microsoft.") or op.startswith("Simplified")}
        steps.steps[kind] = graph
    return steps


def load(path: str | Path, *, max_batch_size: int = 1, gamma: int | str | None = None,
         threads: int | None = None) -> object:
    """An Engine whose target (and draft) run the ONNX export at `path` through onnxruntime.

    gamma: the draft length (default: the export's); max_batch_size: rows of its cache.
    Refuses a directory that is not a fuser ONNX export, naming what is wrong.
    """
    from fuser.engine import Engine
    from fuser.engine_io import DetachedModel, load_extras
    from fuser.onnx.export import FORMAT, MANIFEST, slots_for
    from fuser.onnx.translate import OnnxExportError

    directory = Path(path)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise OnnxExportError(f"{directory} is not a fuser ONNX export (no {MANIFEST})")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise OnnxExportError(f"{directory}: format {manifest.get('format')!r} is not {FORMAT!r}")
    dtype = getattr(torch, manifest["dtype"])
    if dtype not in (torch.float32, torch.float16):
        raise OnnxExportError(f"{directory}: the onnxruntime runtime runs fp32 and fp16 exports, "
                              f"not {manifest['dtype']}")
    max_seq_len = manifest["max_seq_len"]
    gamma = manifest.get("gamma", "auto") if gamma is None else gamma
    roles = manifest["roles"]
    config = FuserConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         gamma=gamma if "draft" in roles else 0, device="cpu")
    gammas = config.gammas if "draft" in roles else ()
    slots = slots_for(max_seq_len)
    target = model_steps("target", directory / "target", roles["target"],
                         target_steps(0) + [verify(g) for g in gammas], max_batch_size, slots,
                         dtype, threads)
    draft = None
    if gammas:
        draft = model_steps("draft", directory / "draft", roles["draft"], draft_steps(slots),
                            max_batch_size, slots, dtype, threads)
        vocab_size = min(roles["target"]["vocab_size"], roles["draft"]["vocab_size"])
    else:
        vocab_size = roles["target"]["vocab_size"]
    tokenizer, generation_config = load_extras(directory)
    engine = Engine(target, draft, config=config,
                    user_target=DetachedModel(generation_config, str(directory)),
                    tokenizer=tokenizer, device=torch.device("cpu"), dtype=dtype,
                    vocab_size=vocab_size, gamma=max(gammas, default=0), gammas=gammas)
    engine.prepare()
    engine.manifest = manifest
    return engine
