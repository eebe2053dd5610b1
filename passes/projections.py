"""Merged projections: sibling linears that read the same input become one GEMM.

    q = x @ Wq^T (+ bq);  k = x @ Wk^T (+ bk);  v = x @ Wv^T (+ bv)
      ->  qkv = x @ [Wq; Wk; Wv]^T (+ [bq; bk; bv]);  q, k, v = column slices of qkv
    gate = x @ Wg^T;  up = x @ Wu^T   ->   gate_up = x @ [Wg; Wu]^T;  gate, up = its two halves

One GEMM reads the input once and launches once, and gate_up, gate first, is what
`fuser::gated_act` (passes/gated_mlp.py) consumes.

After export and core-ATen decomposition a linear is `mm(view(x, [M, K]), permute(W, [1, 0]))`,
or `addmm(b, ...)` with a bias; W and b are get_attr nodes holding the model's own parameters.
Siblings are linears whose 2-D input is the same node or the same view of one node (export gives
each linear its own view), with the same weight dtype, in-features and bias presence.

Weights are concatenated once, here, never in the step. Memory: the concatenation becomes the
storage of the original parameters (`p.data = merged[rows]`, same values), so no second copy
exists and the model (the user's, whose parameters the graph shares) computes exactly what it did.
A later graph of the same model (prefill, then decode, verify) finds its parameters already
adjacent rows of one storage and aliases it: no copy at all.

Two passes, counted apart:
    merge_gate_up   the two linears feeding act(gate) * up (one per layer)
    merge_qkv       every other group of siblings; in decoder layers, q, k and v (one per layer)
Models that ship merged projections (Phi-3's qkv_proj, gate_up_proj) have no siblings: nothing
to do, and their gate_up output is chunked in the form gated_act matches.

The merged GEMM's outputs are column slices of it, not contiguous tensors. Views that regroup
rows or split the last dim (all HF does: [M, N] -> [B, T, N] -> [B, T, heads, D]) work on them;
every view downstream is checked on fake tensors first, and a group is left alone if one fails.
"""

from __future__ import annotations

import re
from functools import reduce

import torch
from torch import nn
from torch.fx import GraphModule

from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS, Linear, as_linear, fake_value, gated_product, graph_fake_mode, strip_views

aten = torch.ops.aten

# Name prefix of the merged weights and biases registered on the graph module (non-persistent
# buffers: they alias the model's parameters, which hold the values).
MERGED_PREFIX = "fuser_merged__"


def sibling_groups(gm: GraphModule) -> list[list[Linear]]:
    """Groups of two or more linears with one sibling key, each in graph order."""
    groups: dict[tuple, list[Linear]] = {}
    for node in gm.graph.nodes:
        linear = as_linear(node)
        if linear is not None:
            groups.setdefault(linear.sibling_key, []).append(linear)
    return [g for g in groups.values() if len(g) > 1]


def gate_up_pairs(gm: GraphModule) -> list[list[Linear]]:
    """[gate, up] for every act(gate) * up whose factors are (views of) sibling linears."""
    pairs = []
    for node in gm.graph.nodes:
        product = gated_product(node)
        if product is None:
            continue
        gate, _ = strip_views(product.gate)
        up, _ = strip_views(product.up)
        gate_linear, up_linear = as_linear(gate), as_linear(up)
        if (gate_linear is not None and up_linear is not None
                and gate_linear.sibling_key == up_linear.sibling_key):
            pairs.append([gate_linear, up_linear])
    return pairs


# ---------------------------------------------------------------------------------------------
# Weights: concatenated once, the originals becoming views into the concatenation
# ---------------------------------------------------------------------------------------------


def _attr(gm: GraphModule, target: str) -> torch.Tensor:
    return reduce(getattr, target.split("."), gm)


def _plain(t: torch.Tensor) -> bool:
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
            and not t.is_meta and t.is_contiguous())


def _adjacent_rows(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are contiguous, consecutive row blocks of one storage, in order."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return False
        offset += t.numel()
    return True


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def concatenate_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors, 0), leaving every tensor a view into the result: one copy in all.

    Values do not change, so whatever reads the tensors computes the same. Tensors that are
    already adjacent rows of one storage (a second graph of the same model) are aliased, not
    copied.
    """
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *tensors[0].shape[1:])
    if _adjacent_rows(tensors):
        first = tensors[0].detach()
        return first.as_strided(shape, _contiguous_strides(shape), first.storage_offset())
    merged = torch.cat([t.detach() for t in tensors], dim=0)
    start = 0
    for t in tensors:
        t.data = merged[start:start + t.shape[0]]  # the parameter now lives in `merged`
        start += t.shape[0]
    return merged


def _register(gm: GraphModule, targets: list[str], tensor: torch.Tensor) -> str:
    """Register `tensor` on gm under a name made of the merged targets; returns the name.

    ["m.layers.0.attn.q_proj.weight", "m.layers.0.attn.k_proj.weight"] ->
    "fuser_merged__m_layers_0_attn__q_proj_k_proj__weight"
    """
    parts = [t.split(".") for t in targets]
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    leaves = ["_".join(p[head:-1]) or p[head] for p in parts]
    name = f"{MERGED_PREFIX}{'_'.join(parts[0][:head])}__{'_'.join(leaves)}__{parts[0][-1]}"
    name = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    unique, n = name, 1
    while hasattr(gm, unique):
        unique, n = f"{name}_{n}", n + 1
    gm.register_buffer(unique, tensor, persistent=False)
    return unique


# ---------------------------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------------------------


def _tensors_fit(gm: GraphModule, group: list[Linear]) -> bool:
    """Plain, distinct parameter tensors of one dtype and device (biases likewise)."""
    for role in ("weight", "bias"):
        nodes = [getattr(linear, role) for linear in group]
        if nodes[0] is None:
            continue
        tensors = [_attr(gm, n.target) for n in nodes]
        if not all(_plain(t) and t.dtype == tensors[0].dtype and t.device == tensors[0].device
                   for t in tensors):
            return False
        if len({n.target for n in nodes}) != len(nodes) or len({id(t) for t in tensors}) != len(nodes):
            return False  # one parameter twice (tied): cannot be two rows of one storage
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        if len(set(storages)) != len(storages) and not _adjacent_rows(tensors):
            return False  # overlapping or interleaved views of one storage
    return True


def _views_stay_valid(fake_mode: object, group: list[Linear], slices: list[torch.Tensor]) -> bool:
    """Whether every view reading a linear's output (through views) is valid on its slice."""
    for linear, value in zip(group, slices):
        pending = [(user, value) for user in linear.node.users]
        while pending:
            user, value = pending.pop()
            if user.op != "call_function" or user.target not in VIEWS:
                if user.op == "call_function" and user.target is aten.as_strided.default:
                    return False  # reinterprets storage: wrong on a strided slice
                continue
            try:
                out = fake_value(fake_mode, user.target, (value, *user.args[1:]), dict(user.kwargs))
            except RuntimeError:
                return False
            pending += [(u, out) for u in user.users]
    return True


def merge_linears(gm: GraphModule, group: list[Linear], fake_mode: object) -> bool:
    """Replace the linears of `group` (siblings, in graph order) by one GEMM and column slices.

    Returns False, with nothing changed, when the group cannot be merged.
    """
    if not _tensors_fit(gm, group):
        return False
    widths = [linear.weight.meta["val"].shape[0] for linear in group]  # N_i
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]  # column ranges in the output
    first = group[0]
    w_val = first.weight.meta["val"]
    with fake_mode:
        w_fake = torch.empty((bounds[-1], w_val.shape[1]), dtype=w_val.dtype, device=w_val.device)
        b_fake = None if first.bias is None else torch.empty(bounds[-1], dtype=w_val.dtype,
                                                             device=w_val.device)
    wt_fake = fake_value(fake_mode, aten.permute.default, (w_fake, [1, 0]))
    if first.bias is not None:
        out_fake = fake_value(fake_mode, aten.addmm.default, (b_fake, first.x, wt_fake))
    else:
        out_fake = fake_value(fake_mode, aten.mm.default, (first.x, wt_fake))
    slice_fakes = [fake_value(fake_mode, aten.slice.Tensor, (out_fake, 1, a, b))
                   for a, b in zip(bounds, bounds[1:])]
    if not _views_stay_valid(fake_mode, group, slice_fakes):
        return False

    # Nothing has changed so far; from here on the group is merged.
    graph = gm.graph
    weight_targets = [linear.weight.target for linear in group]
    merged_w = concatenate_rows([_attr(gm, t) for t in weight_targets])
    w_name = _register(gm, weight_targets, merged_w)
    with graph.inserting_before(first.node):
        w = graph.get_attr(w_name)
        w.meta["val"] = fake_mode.from_tensor(merged_w, static_shapes=True)
        wt = graph.call_function(aten.permute.default, (w, [1, 0]))
        wt.meta["val"] = wt_fake
        if first.bias is not None:
            bias_targets = [linear.bias.target for linear in group]
            merged_b = concatenate_rows([_attr(gm, t) for t in bias_targets])
            b = graph.get_attr(_register(gm, bias_targets, merged_b))
            b.meta["val"] = fake_mode.from_tensor(merged_b, static_shapes=True)
            out = graph.call_function(aten.addmm.default, (b, first.x, wt))  # [M, sum N_i]
        else:
            out = graph.call_function(aten.mm.default, (first.x, wt))  # [M, sum N_i]
        out.meta["val"] = out_fake
        parts = []
        for a, b, value in zip(bounds, bounds[1:], slice_fakes):
            parts.append(graph.call_function(aten.slice.Tensor, (out, 1, a, b)))  # [M, N_i]
            parts[-1].meta["val"] = value
    for linear, part in zip(group, parts):
        linear.node.replace_all_uses_with(part)
        graph.erase_node(linear.node)
    return True


def merge_gate_up(gm: GraphModule, context: PassContext) -> int:
    """Merge gate and up of every gated MLP; returns how many pairs were merged."""
    fake_mode = graph_fake_mode(gm)
    if fake_mode is None:  # not an exported graph: no shapes to check a merge against
        return 0
    return sum(merge_linears(gm, pair, fake_mode) for pair in gate_up_pairs(gm))


def merge_qkv(gm: GraphModule, context: PassContext) -> int:
    """Merge every other group of sibling linears (q, k, v); returns how many groups."""
    fake_mode = graph_fake_mode(gm)
    if fake_mode is None:
        return 0
    gate_up = {linear.node for pair in gate_up_pairs(gm) for linear in pair}
    count = 0
    for group in sibling_groups(gm):
        group = [linear for linear in group if linear.node not in gate_up]
        if len(group) > 1:
            count += merge_linears(gm, group, fake_mode)
    return count


MERGE_GATE_UP = GraphPass("merge_gate_up", merge_gate_up)
MERGE_QKV = GraphPass("merge_qkv", merge_qkv)
