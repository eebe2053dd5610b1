"""One rewritten step graph (ATen FX, after the ONNX subset of the passes) as an ONNX graph.

    (tokens[B, T], positions[B, T], seq_lens[B], starts[B], past_key_i[B, kv, S, D],
     past_value_i[B, kv, S, D] per layer) -> (logits[B, T, V], present_key_i, present_value_i)

Every fused op the passes found becomes onnxruntime's own operator (fuser/onnx/fused.py):

| fuser op (pass) | onnxruntime operator |
|---|---|
| `fuser::rms_norm` (rms_norm) | `SimplifiedLayerNormalization` (its contrib op, ONNX domain) |
| `fuser::add_rms_norm` (add_rms_norm) | `com.microsoft.SkipSimplifiedLayerNormalization` |
| `fuser::rotary` (rotary) | `com.microsoft.RotaryEmbedding`, one per rotated tensor |
| cache write + `fuser::cache_attention` | `com.microsoft.GroupQueryAttention` |
| cache write + `fuser::prefill_attention` | `com.microsoft.GroupQueryAttention` |

(the attention ops and the cache writes are capture's, fuser/capture.py).

The KV cache is explicit input and output, in GroupQueryAttention's BNSH layout over the whole
cache (past and present of one length S, so a runtime may bind both to one buffer); left
padding (`starts`) is GroupQueryAttention's `attention_bias`. The rotary angles become
RotaryEmbedding's cos/sin tables: the graph's own angle computation evaluated at every position
below S, and checked to be a per-position lookup. Every other node maps to standard ONNX, one
ATen op at a time; a node with no translation, or a fused op in a form the mapping does not
cover, raises `OnnxExportError` naming it. Nothing is approximated.
"""


from __future__ import annotations

import torch

from fuser.onnx import aten, fused  # noqa: F401  (register their translations)
from fuser.onnx.graph import (GraphTranslator, OnnxExportError, Translated, cache_names,
                              onnx_dtype, op_counts)

__all__ = ["OnnxExportError", "Translated", "cache_names", "onnx_dtype", "op_counts", "translate"]


def translate(gm: torch.fx.GraphModule, name: str, num_layers: int,
              rotary_positions: int) -> Translated:
    """The ONNX graph of a rewritten step graph `gm` (module docstring).

    name: "<role>.<kind>" for messages; num_layers: the model's layers (cache inputs);
    rotary_positions: the positions the rotary tables cover (the engine's max_seq_len).
    """
    return GraphTranslator(gm, name, num_layers, rotary_positions).run()

