"""fp8_linear: every linear over a parameter reads float8 e4m3fn weights (FuserConfig(precision="fp8")).

Weights are quantized here, once per model, from the model's own values (no calibration data):
per output channel, scale[n] = amax_k |W[n, k]| / 448, codes = e4m3fn(clamp(W / scale, +-448))
(fuser/ops/fp8.py). It runs after the merges, so a merged QKV or gate/up weight is quantized as
one matrix with one scale vector. The codes and scales are registered on the graph module as
buffers (`fuser_fp8__<weight>`, `fuser_fp8_scale__<weight>`); the bf16 weight is no longer read
by the graph (it stays the user's model's own storage).

Two forms, by the rows the linear sees:
    decode and verification (a fixed row count <= MAX_ROWS):
        mm(x, W^T)  ->  fuser::fp8_linear(x, codes, scale)
      a weight-streaming GEMV; x stays in the model dtype, the weights are widened in registers.
    prefill (symbolic or many rows): per-token FP8 activations and an FP8 tensor-core GEMM,
        mm(view(p), W^T)  ->  fuser::fp8_scaled_mm(view(codes_x), view(scale_x), codes, scale)
      where the activation's quantization is fused into the kernel that produces it:
        fuser::rms_norm(x)            -> fuser::rms_norm_quant
        fuser::add_rms_norm(x, r)[0]  -> fuser::add_rms_norm_quant   (the sum output kept)
        fuser::gated_act(gate_up)     -> fuser::gated_act_quant      (feeding down_proj)
      and anything else (the attention output feeding o_proj) goes through fuser::quantize_rows.
      A producer whose output has another user keeps its op; the linear then quantizes alone.

The LM head is quantized too unless FuserConfig(fp8_lm_head=False). A bias stays a separate add.
"""

from __future__ import annotations

import operator
from functools import reduce

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.fp8 import FP8_DTYPE, quantize_weight
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS, Linear, as_linear, fake_value, graph_fake_mode

aten = torch.ops.aten
fuser_ops = torch.ops.fuser

CODES_PREFIX = "fuser_fp8__"
SCALE_PREFIX = "fuser_fp8_scale__"
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The producer ops whose output a prefill linear can take already quantized: op -> (its
# quantizing twin, the index of the output the linear reads, or None for a single output).
FUSED_PRODUCERS: dict[object, tuple[object, int | None]] = {
    fuser_ops.rms_norm.default: (fuser_ops.rms_norm_quant.default, None),
    fuser_ops.add_rms_norm.default: (fuser_ops.add_rms_norm_quant.default, 0),
    fuser_ops.gated_act.default: (fuser_ops.gated_act_quant.default, None),
}


def _fp8_wanted(context: PassContext) -> bool:
    return context.config.precision == "fp8"


def _attr(gm: GraphModule, target: str) -> torch.Tensor:
    return reduce(getattr, target.split("."), gm)


def _is_lm_head(linear: Linear) -> bool:
    return "lm_head" in str(linear.weight.target)


def _quantized(gm: GraphModule, context: PassContext, weight: Node) -> tuple[str, str]:
    """Register (codes, scale) of `weight` on gm; quantize once per model (the graphs of one
    model share them through context.model_state, keyed by the weight's storage)."""
    w = _attr(gm, weight.target)
    key = ("fp8", w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride())
    cached = context.model_state.get(key)
    if cached is None:
        cached = quantize_weight(w.detach())
        context.model_state[key] = cached
    codes, scale = cached
    name = str(weight.target).replace(".", "__")
    for prefix, tensor in ((CODES_PREFIX, codes), (SCALE_PREFIX, scale)):
        if not hasattr(gm, prefix + name):
            gm.register_buffer(prefix + name, tensor, persistent=False)
    return CODES_PREFIX + name, SCALE_PREFIX + name


def _get_attr(gm: GraphModule, fake_mode: object, target: str) -> Node:
    node = gm.graph.get_attr(target)
    node.meta["val"] = fake_mode.from_tensor(_attr(gm, target), static_shapes=True)
    return node


def _call(gm: GraphModule, fake_mode: object, target: object, *args: object) -> Node:
    node = gm.graph.call_function(target, args)
    node.meta["val"] = fake_value(fake_mode, target, args)
    return node


def _decode_shaped(linear: Linear) -> bool:
    M = linear.x.meta["val"].shape[0]
    return isinstance(M, int) and 0 < M <= MAX_ROWS


def _quantized_activation(gm: GraphModule, fake_mode: object, linear: Linear
                          ) -> tuple[Node, Node]:
    """(codes [M, K], scale [M]) of the linear's input, fused into its producer where possible.
    Inserted before the linear's node."""
    x = linear.x
    graph = gm.graph
    # Walk up from the linear's 2-D input through reshapes (views, full slices) that nothing
    # else reads, to the op that produced the activation.
    source, chain_ok = x, x.op == "call_function" and x.target in VIEWS
    while chain_ok and _is_reshape(source) and len(source.users) == 1:
        source = source.args[0]
    producer, index = source, None
    if (source.op == "call_function" and source.target is operator.getitem
            and isinstance(source.args[0], Node)):
        producer, index = source.args[0], source.args[1]
    fused = FUSED_PRODUCERS.get(getattr(producer, "target", None))
    if chain_ok and fused is not None and fused[1] == index and len(source.users) == 1:
        twin, _ = fused
        view_args = x.args[1]  # [M, K]
        with graph.inserting_before(producer.next):  # in order, right after the producer
            q = _call(gm, fake_mode, twin, *producer.args)
            codes_nd = _call(gm, fake_mode, operator.getitem, q, 0)
            scale_nd = _call(gm, fake_mode, operator.getitem, q, 1)
        if twin is fuser_ops.add_rms_norm_quant.default:
            # The residual sum: every user of add_rms_norm's output 1 now reads the twin's 2.
            with graph.inserting_before(scale_nd.next):
                summed = _call(gm, fake_mode, operator.getitem, q, 2)
            for user in list(producer.users):
                if user is not source and user.target is operator.getitem and user.args[1] == 1:
                    user.replace_all_uses_with(summed)
        with graph.inserting_before(linear.node):
            codes = _call(gm, fake_mode, aten.view.default, codes_nd, view_args)
            scale = _call(gm, fake_mode, aten.view.default, scale_nd, list(view_args[:-1]))
        return codes, scale
    with graph.inserting_before(linear.node):
        q = _call(gm, fake_mode, fuser_ops.quantize_rows.default, x)
        return (_call(gm, fake_mode, operator.getitem, q, 0),
                _call(gm, fake_mode, operator.getitem, q, 1))


def _is_reshape(node: Node) -> bool:
    """A view, or a slice that keeps the whole dimension (HF's `hidden[:, slice(-0, None)]`)."""
    if node.op != "call_function":
        return False
    if node.target in VIEWS:
        return True
    if node.target is aten.slice.Tensor and len(node.args) >= 3:
        start = node.args[2]
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        return start == 0 and (end is None or end >= 2**62) and step == 1
    return False


def quantize_linears(gm: GraphModule, context: PassContext) -> int:
    fake_mode = graph_fake_mode(gm)
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        linear = as_linear(node)
        if linear is None or linear.weight.meta["val"].dtype not in QUANTIZED_DTYPES:
            continue
        if _is_lm_head(linear) and not context.config.fp8_lm_head:
            continue
        out_dtype = node.meta["val"].dtype
        codes_name, scale_name = _quantized(gm, context, linear.weight)
        decode = _decode_shaped(linear)
        if not decode:
            x_codes, x_scale = _quantized_activation(gm, fake_mode, linear)
        with graph.inserting_before(node):
            codes = _get_attr(gm, fake_mode, codes_name)
            scale = _get_attr(gm, fake_mode, scale_name)
            if decode:
                out = _call(gm, fake_mode, fuser_ops.fp8_linear.default, linear.x, codes, scale)
            else:
                out = _call(gm, fake_mode, fuser_ops.fp8_scaled_mm.default, x_codes, x_scale,
                            codes, scale, out_dtype)
            if linear.bias is not None:
                out = _call(gm, fake_mode, aten.add.Tensor, out, linear.bias)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    return count


FP8_LINEAR = GraphPass("fp8_linear", quantize_linears, when=_fp8_wanted)
__all__ = ["FP8_LINEAR", "FP8_DTYPE"]
