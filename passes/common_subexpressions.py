"""Common subexpressions of the steps that run uncompiled: each layer's copy of one index
computation becomes one.

Capture computes a step's cache indices in every layer (`cache_attention` in fuser/capture.py):
the slots seq_lens[:, None] + arange(T), and over a paged cache each slot's (block, offset)
through the block table (fuser/ops/paged.py `paged_slots`: a gather of the table, div, clamp,
lt, where, remainder, _to_copy). Every layer's values are the same. Inductor merges them in the
fixed-T steps it compiles; prefill and the chunk step (dynamic T) run as FX graphs, where each
copy is a kernel of its own: ~10 a layer over a paged cache, ~300 nodes of a 32-layer chunk
graph's CUDA graph, each one launched and each a node the graph's launch pays for on the host.

This pass keeps the first node of each set of identical ones (the same aten op over the same
arguments, theirs merged first) and points the others' users at it. Only values that cannot
change while the graph runs are merged:
- the op is an aten op that writes nothing (`_schema.is_mutable` false), draws no random numbers
  (no `nondeterministic_seeded` tag) and is not an allocation of uninitialized memory;
- no input depends on a tensor that some node writes: the arguments an op's schema marks
  written (`index_put_`'s and `copy_`'s self, a custom op's `mutates_args`), followed back
  through views to what they view, and every argument of a call that is not an op with a
  schema (but getitem and the arithmetic of symbolic sizes, `SIZE_ARITHMETIC`). A written
  tensor's sizes (`SIZES`) stay clean: no write changes them. A read of a cache before its write and one after it
  differ, so nothing derived from a written tensor is ever merged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from fuser.passes.base import GraphPass, PassContext, uncompiled

aten = torch.ops.aten

# Python functions on a graph's symbolic sizes (they write no tensor): B * T and the like.
SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
                   operator.mod, operator.pow, operator.neg, operator.eq, operator.ne,
                   operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
                   torch.sym_max, torch.sym_min, torch.sym_int, torch.sym_float, torch.sym_not}

# A tensor's sizes, which no write changes: clean even where the tensor is written (a batch
# size read from the cache the graph writes).
SIZES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
         aten.sym_storage_offset.default}

# Allocations whose contents are undefined: two of them are two buffers, never one.
UNINITIALIZED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                 aten.new_empty.default, aten.new_empty_strided.default}


def _nodes(value: Any) -> list[Node]:
    """The nodes inside an argument (a node, or lists and tuples of them)."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes(v)]
    return []


def _viewed(node: Node) -> list[Node]:
    """node and every node it is a view of (following ops whose first output aliases their
    first argument: view, permute, slice, expand, ...)."""
    chain = [node]
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        if not returns or returns[0].alias_info is None or not node.args \
                or not isinstance(node.args[0], Node):
            break
        node = node.args[0]
        chain.append(node)
    return chain


def written(graph: Graph) -> set[Node]:
    """The nodes whose tensors some node of `graph` may write (module docstring)."""
    out: set[Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target in SIZE_ARITHMETIC:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):  # unknown: it may write any input
            args = _nodes(list(node.args)) + _nodes(list(node.kwargs.values()))
        else:
            args = []
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                    args += _nodes(value)
        for arg in args:
            out.update(_viewed(arg))
    return out


def _mergeable(node: Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "aten" and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags
            and target not in UNINITIALIZED)


class _Unhashable(Exception):
    pass


def _freeze(value: Any) -> Any:
    """A hashable key of an argument; scalars keep their type (add(x, 1) is not add(x, 1.0))."""
    if isinstance(value, Node):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        raise _Unhashable from None
    return (type(value).__name__, value)


def merge_common_subexpressions(gm: GraphModule, context: PassContext) -> int:
    """Merge every set of identical mergeable nodes of `gm` into its first; returns how many
    nodes were removed."""
    graph = gm.graph
    dirty = written(graph)          # grows: everything computed from a written tensor
    first: dict[Any, Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.target not in SIZES and (
                node in dirty or any(i in dirty for i in node.all_input_nodes)):
            dirty.add(node)
            continue
        if not _mergeable(node):
            continue
        try:  # (arguments already point at the kept nodes: earlier duplicates are gone)
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
        except _Unhashable:
            continue
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            merged += 1
    return merged


COMMON_SUBEXPRESSIONS = GraphPass("common_subexpressions", merge_common_subexpressions,
                                  when=uncompiled)
