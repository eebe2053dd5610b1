"""Matrix products over a contraction of length one, as the broadcast products they are.

    bmm(a [B, M, 1], b [B, 1, N])  ->  a * b          mm(a [M, 1], b [1, N])  ->  a * b

Hugging Face's rotary modules (transformers up to about 5.20) build the rotary angles as
`inv_freq[None, :, None].expand(B, -1, 1) @ positions[:, None, :].float()`: an outer product,
which export records as a bmm with K = 1. On CUDA that bmm is a cuBLAS SGEMM launch of its own
(2.3-2.9 us on an H200: docs/performance-notes.md) between two pointwise
kernels, in every step of both models. As a multiply, Inductor folds it into the cos/sin kernel
that follows.

Bit for bit the same: each output is one product of two numbers, rounded once, both ways (the
GEMM's sum of one term in fp32, the multiply in fp32 or in the inputs' dtype computed in fp32).
Newer transformers write the multiply themselves; the pass then finds nothing.
"""

from __future__ import annotations

import torch

from fuser.passes.base import GraphPass, PassContext

aten = torch.ops.aten


def _one(size: object) -> bool:
    # Imported here: symbolic_shapes imports sympy (seconds), loaded already while a build
    # rewrites graphs; a load imports the passes for their names only.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size == 1)  # type: ignore[operator]


def _is_outer_product(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (aten.bmm.default, aten.mm.default):
        return False
    a, b = (arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            for arg in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if not a.is_floating_point() or a.dtype != b.dtype:
        return False
    return _one(a.shape[-1]) and _one(b.shape[-2])


def rewrite_outer_products(gm: torch.fx.GraphModule, context: PassContext) -> int:
    """Replace every K = 1 bmm / mm of floating-point operands by aten.mul; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _is_outer_product(node):
            continue
        a, b = node.args[:2]
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.mul.Tensor, (a, b))
        product.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        count += 1
    return count


# First: nothing else matches a K = 1 product, and the rotary angles it feeds are pattern inputs.
OUTER_PRODUCT = GraphPass("outer_product", rewrite_outer_products)
