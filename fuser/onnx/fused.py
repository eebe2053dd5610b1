"""fuser's fused ops as onnxruntime's operators (the table in fuser/onnx/translate.py), and
what they need built once per graph: GroupQueryAttention's lengths and padding bias, and
RotaryEmbedding's cos/sin tables, evaluated from the graph's own angle computation."""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from fuser.onnx.graph import MS, CacheRef, GraphTranslator, handles, np_dtype

aten = torch.ops.aten


def attention_inputs(t: GraphTranslator, dtype: torch.dtype) -> tuple[str, str, str, str]:
    """(seqlens_k int32 [B], total_sequence_length int32 scalar, attention_bias [B, 1, T,
    total], query_seqlens int32 [B]) of GroupQueryAttention, built once per graph."""
    b = t.b

    def seqlens_k() -> str:
        T = t.tokens_T()
        last = b.op1("Sub", [b.op1("Add", ["seq_lens", T]), b.const([1], np.int64)])
        return b.op1("Cast", [last], to=TensorProto.INT32)

    def total64() -> str:
        longest = b.op1("ReduceMax", ["seq_lens"], keepdims=0)
        return b.op1("Add", [longest, b.op1("Squeeze", [t.tokens_T(),
                                                        b.const([0], np.int64)])])

    def total() -> str:
        return b.op1("Cast", [t.shared("total64", total64)], to=TensorProto.INT32)

    def bias() -> str:
        # Key slots before a row's start are its left padding: masked by a large finite
        # negative (a row of padding queries then averages finite values, never NaN).
        columns = b.op1("Range", [b.const(np.array(0, np.int64)),
                                  t.shared("total64", total64),
                                  b.const(np.array(1, np.int64))])
        starts = b.op1("Unsqueeze", ["starts", b.const([1], np.int64)])
        padding = b.op1("Less", [b.op1("Unsqueeze", [columns, b.const([0], np.int64)]),
                                 starts])  # [B, total]
        negative = float(torch.finfo(dtype).min) / 4
        mask = b.op1("Where", [padding, b.const(np.array(negative, np_dtype(dtype))),
                               b.const(np.array(0.0, np_dtype(dtype)))])
        mask = b.op1("Unsqueeze", [mask, b.const([1, 2], np.int64)])  # [B, 1, 1, total]
        rows = b.op1("Concat", [b.const([1, 1], np.int64), t.tokens_T(),
                                b.const([1], np.int64)], axis=0)
        return b.op1("Expand", [mask, rows])

    def query_seqlens() -> str:
        T = b.op1("Cast", [t.tokens_T()], to=TensorProto.INT32)
        zeros = b.op1("Cast", [b.op1("Mul", ["seq_lens", b.const([0], np.int64)])],
                      to=TensorProto.INT32)
        return b.op1("Add", [zeros, T])

    return (t.shared("seqlens_k", seqlens_k), t.shared("total", total),
            t.shared(f"bias_{dtype}", bias), t.shared("query_seqlens", query_seqlens))


def rotary_tables(t: GraphTranslator, node: torch.fx.Node, cos: torch.fx.Node,
                  sin: torch.fx.Node, head_dim: int) -> tuple[str, str]:
    """RotaryEmbedding's cos/sin caches [S, R/2] for the graph's angle tensors `cos`, `sin`
    ([B, T, R]): the subgraph computing them evaluated at positions 0..S-1, after checking
    that it reads nothing but `positions` and looks each position up on its own."""
    key = (cos, sin)
    if key in t.rotary:
        return t.rotary[key]
    table = evaluate_from_positions(t.gm, [cos, sin],
                                     torch.arange(t.rotary_positions)[None])
    probe = torch.tensor([[3, 0, 7], [1, 5, 2]]) % t.rotary_positions
    probed = evaluate_from_positions(t.gm, [cos, sin], probe)
    if table is None or probed is None:
        raise t.fail(node, "rotary angles computed from more than the positions")
    tables = []
    for full, check in zip(table, probed):
        full = full[0]  # [S, R]
        R = full.shape[-1]
        if R != head_dim:
            raise t.fail(node, f"partial rotary (rotating {R} of {head_dim} dims)")
        if not torch.equal(full[:, : R // 2], full[:, R // 2:]):
            raise t.fail(node, "a rotary table whose halves differ (not the rotate-half "
                            "layout RotaryEmbedding computes)")
        if not torch.equal(full[probe], check):
            raise t.fail(node, "rotary angles that are not a per-position lookup")
        tables.append(full[:, : R // 2].contiguous())
    names = []
    for which, table in zip(("cos", "sin"), tables):
        name = t.b.name(f"rotary_{which}_cache")
        t.weights[name] = table
        names.append(name)
    t.rotary[key] = (names[0], names[1])
    return names[0], names[1]


def evaluate_from_positions(gm: torch.fx.GraphModule, outputs: list[torch.fx.Node],
                             positions: torch.Tensor) -> list[torch.Tensor] | None:
    """The values of `outputs` with `positions` as the graph's positions input, evaluating only
    their ancestors; None if they depend on any other input or on the cache."""
    needed: set[torch.fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    env: dict[torch.fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node.target != "positions":
                return None
            env[node] = positions
        elif node.op == "get_attr":
            if "_cache_" in node.target:
                return None
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
        elif node.op == "call_function":
            args = torch.fx.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
            with torch.no_grad():
                env[node] = node.target(*args, **kwargs)
        else:
            return None
    return [env[n] for n in outputs]


@handles(aten.index_put)
def _index_put(t: GraphTranslator, node: torch.fx.Node) -> object:
    """A KV-cache write: checked to be the step's own write (rows, seq_lens + t), then left to
    the GroupQueryAttention that reads the cache (which writes it into its present output)."""
    cache, indices, values = node.args[:3]
    ref = t.env.get(cache)
    if not isinstance(ref, CacheRef):
        raise t.fail(node, "aten.index_put into a tensor that is not the KV cache")
    if len(node.args) > 3 and node.args[3]:
        raise t.fail(node, "an accumulating KV-cache write")
    if len(indices) != 2 or not _is_slots(indices[1]):
        raise t.fail(node, "a KV-cache write at slots other than seq_lens + t")
    t.writes[node] = ref.which
    return CacheRef(ref.which)


def _is_slots(node: object) -> bool:
    """Whether `node` is seq_lens[:, None] + arange(T), the new tokens' cache slots."""
    if not (isinstance(node, torch.fx.Node) and node.target == aten.add.Tensor):
        return False
    a, b = node.args[:2]
    return (isinstance(a, torch.fx.Node) and a.target == aten.unsqueeze.default and
            isinstance(a.args[0], torch.fx.Node) and a.args[0].target == "seq_lens" and
            a.args[1] == 1 and isinstance(b, torch.fx.Node) and
            b.target in (aten.arange.start_step, aten.arange.default) and
            (b.target == aten.arange.default or b.args[0] == 0))


@handles(aten.copy_)
def _copy(t: GraphTranslator, node: torch.fx.Node) -> None:
    """The graph's final write-back of a cache buffer: the written cache is the present output
    GroupQueryAttention produced."""
    dst, src = node.args[:2]
    if not isinstance(t.env.get(dst), CacheRef) or src not in t.writes:
        raise t.fail(node, "an in-place copy other than the KV cache's write-back")
    which = t.writes[src]
    if which not in t.presents:
        raise t.fail(node, f"layer {which[1]}'s {which[0]} cache written but never attended")
    return None


@handles(torch.ops.fuser.rms_norm.default)
def _rms_norm(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, weight, eps = node.args[:3]
    return t.b.op1("SimplifiedLayerNormalization", [t.value(x), t.value(weight)],
                   axis=-1, epsilon=float(eps), stash_type=1)


@handles(torch.ops.fuser.add_rms_norm.default)
def _add_rms_norm(t: GraphTranslator, node: torch.fx.Node) -> tuple[str, str]:
    x, residual, weight, eps = node.args[:4]
    normed, summed = t.b.name("skip_norm"), t.b.name("skip_sum")
    t.b.op("SkipSimplifiedLayerNormalization", [t.value(x), t.value(residual), t.value(weight)],
           [normed, "", "", summed], domain=MS, epsilon=float(eps))
    return normed, summed


@handles(torch.ops.fuser.rotary.default)
def _rotary(t: GraphTranslator, node: torch.fx.Node) -> tuple[str, str]:
    a, b_, cos, sin = node.args[:4]
    head_dim = t.meta(a).shape[-1]
    if t.meta(a).dim() != 4 or t.meta(b_).dim() != 4:
        raise t.fail(node, "rotary over tensors that are not [B, heads, T, D]")
    cos_cache, sin_cache = rotary_tables(t, node, cos, sin, int(head_dim))
    return tuple(t.b.op1("RotaryEmbedding", [t.value(x), "positions", cos_cache, sin_cache],
                         domain=MS, interleaved=0) for x in (a, b_))


def _gqa(t: GraphTranslator, node: torch.fx.Node, query: torch.fx.Node,
         k_write: torch.fx.Node, v_write: torch.fx.Node, scale: float, window: int,
         softcap: float) -> str:
    """GroupQueryAttention over the cache that `k_write`, `v_write` fill; -> [B, T, H, D]."""
    if softcap:
        raise t.fail(node, "attention logit soft-capping (not mapped to GroupQueryAttention)")
    (kk, layer), (vk, v_layer) = t.writes[k_write], t.writes[v_write]
    if (kk, vk) != ("key", "value") or layer != v_layer:
        raise t.fail(node, "an attention reading another layer's cache")
    qm = t.meta(query)
    B_, H, T_, D = qm.shape
    new_k, new_v = k_write.args[2], v_write.args[2]  # [B, T, kv_heads, D]
    kv_heads = int(t.meta(new_k).shape[2])
    dtype = qm.dtype
    b = t.b
    flat = b.const([0, 0, -1], np.int64)
    q3 = b.op1("Reshape", [b.op1("Transpose", [t.value(query)], perm=[0, 2, 1, 3]), flat])
    k3 = b.op1("Reshape", [t.value(new_k), flat])
    v3 = b.op1("Reshape", [t.value(new_v), flat])
    seqlens_k, total, bias, query_seqlens = attention_inputs(t, dtype)
    out = b.name(f"attention_{layer}")
    b.op("GroupQueryAttention",
         [q3, k3, v3, f"past_key_{layer}", f"past_value_{layer}", seqlens_k, total, "", "", "",
          bias, "", "", "", "", "", query_seqlens],
         [out, f"present_key_{layer}", f"present_value_{layer}"], domain=MS,
         num_heads=int(H), kv_num_heads=kv_heads, scale=float(scale),
         local_window_size=int(window) if window > 0 else -1)
    t.presents[("key", layer)] = f"present_key_{layer}"
    t.presents[("value", layer)] = f"present_value_{layer}"
    return b.op1("Reshape", [out, b.const([0, 0, int(H), int(D)], np.int64)])


@handles(torch.ops.fuser.cache_attention.default)
def _cache_attention(t: GraphTranslator, node: torch.fx.Node) -> str:
    query, k_cache, v_cache, seq_lens, starts, scale, window, softcap = node.args[:8]
    if k_cache not in t.writes or v_cache not in t.writes:
        raise t.fail(node, "attention over a cache this step does not write")
    if getattr(seq_lens, "target", None) != "seq_lens" or \
            getattr(starts, "target", None) != "starts":
        raise t.fail(node, "attention over lengths other than the step's seq_lens and starts")
    return _gqa(t, node, query, k_cache, v_cache, scale, window, softcap)


@handles(torch.ops.fuser.prefill_attention.default)
def _prefill_attention(t: GraphTranslator, node: torch.fx.Node) -> str:
    query, key, value, slots, starts, scale, window, softcap = node.args[:8]
    if not _is_slots(slots) or getattr(starts, "target", None) != "starts":
        raise t.fail(node, "prefill attention at slots other than seq_lens + t")

    def writer(source: object, which: str) -> torch.fx.Node:
        for write, (kind, _layer) in t.writes.items():
            written = write.args[2]
            if kind == which and isinstance(written, torch.fx.Node) and \
                    written.target == aten.permute.default and written.args[0] is source and \
                    list(written.args[1]) == [0, 2, 1, 3]:
                return write
        raise t.fail(node, f"prefill attention whose {which}s are not written to the cache")

    return _gqa(t, node, query, writer(key, "key"), writer(value, "value"), scale, window,
                softcap)


