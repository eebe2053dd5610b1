"""linear: decode-shaped GEMMs over the model's weights -> fuser::linear (the decode GEMV kernel).

Matches every `mm(x, permute(W, [1, 0]))` / `addmm(b, x, permute(W, [1, 0]))` whose weight W is
a parameter of the graph (after merge_qkv / merge_gate_up: the merged weights too) and whose
activation x has a fixed row count M <= fuser.ops.gemv_tables.MAX_ROWS of W's dtype: the T = 1 decode
and small-T verification graphs at small batch. On CUDA, shapes where cuBLAS measured faster
(`fuser.ops.gemv_tables.prefers_cublas`) keep their GEMM. Prefill graphs (symbolic M) keep cuBLAS, as do
larger batches. A bias stays a separate add, which Inductor fuses with what follows.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from fuser.ops.gemv_tables import MAX_ROWS, prefers_cublas
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import as_linear, fake_value, graph_fake_mode

aten = torch.ops.aten


def _decode_shaped(x: torch.Tensor, w: torch.Tensor) -> bool:
    M, (N, K) = x.shape[0], w.shape
    return (isinstance(M, int) and 0 < M <= MAX_ROWS and x.dtype == w.dtype
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (w.is_cuda and prefers_cublas(M, N, K)))


def rewrite_linears(gm: GraphModule, context: PassContext) -> int:
    fake_mode = graph_fake_mode(gm)
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        linear = as_linear(node)
        if linear is None or not _decode_shaped(linear.x.meta["val"], linear.weight.meta["val"]):
            continue
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.fuser.linear.default, (linear.x, linear.weight))
            out.meta["val"] = fake_value(fake_mode, torch.ops.fuser.linear.default,
                                         (linear.x, linear.weight))
            if linear.bias is not None:
                with_bias = graph.call_function(aten.add.Tensor, (out, linear.bias))
                with_bias.meta["val"] = fake_value(fake_mode, aten.add.Tensor, (out, linear.bias))
                out = with_bias
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    return count


LINEAR = GraphPass("linear", rewrite_linears)
