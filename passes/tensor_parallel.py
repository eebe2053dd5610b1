"""Tensor parallelism as a pass: one rank's share of a captured step graph.

`shard_graph(gm, rank, world_size)` takes the ATen graph of a step of a Llama, Mistral or Qwen2
model as `fuser.capture.export_step` (or `capture.specialize`) produces it, at concrete shapes
or with T symbolic (prefill's export), and BEFORE `run_passes` (the fusion passes find the projections by their weights' names and
the plain `mm`/`addmm` of each linear, which only the unfused graph has), and returns a new
GraphModule that computes rank `rank`'s part (Megatron's layout):

    q/k/v_proj, gate/up_proj   column-parallel: rank r keeps output rows [r*n/ws, (r+1)*n/ws)
                               of the weight (and bias); the heads and KV heads are split, rank r
                               attends with heads [r*H/ws, ...) over KV heads [r*KVH/ws, ...)
    KV cache                   rank r's slice of the KV-head dim: [B, S, KVH/ws, D] per layer
    o_proj, down_proj          row-parallel: rank r keeps input columns [r*n/ws, ...); the
                               partial product is summed over the ranks (`fuser::all_reduce`)
                               before a bias is added, so a bias counts once
    lm_head                    lm_head="vocab" (default): vocab-parallel, rank r keeps vocab rows
                               [r*V/ws, ...) and the logits are gathered (`fuser::all_gather`);
                               lm_head="replicated": every rank reads the whole head
    embedding, norms, rotary   replicated

Vocab-parallel is the default because at batch 1 a step reads every weight once: Llama-3 8B's
head is 1.05 GB of its 16 GB, and at TP=2 a replicated head would add 0.5 GB (~110 us at the
H200's bandwidth) to every rank's step, against one all-gather of B*T*V/ws logits (an NCCL
collective costs 16-20 us). Every rank gets the whole logits either way, so sampling stays the
same on every rank. With tied embeddings the head's slice is a tensor of its own (the embedding
keeps the whole table).

The engine does not shard the unsharded graph (whose weights would then have to exist on
every rank): each rank exports its own share of the model (fuser/rank_model.py, the same
slices) and `add_collectives` gives that graph the all-reduces and the logits' all-gather,
which makes the graph `shard_graph` makes, up to where the logits are gathered (after the
head's view to [B, T, V/ws], not before it). `shard_graph` is the reference both are tested
against (tests/test_tensor_parallel.py).

Reshapes that mention a head count or a projection width (`view [B, T, H*D]`, ...) are rewritten
to the per-rank counts: the graph's shapes are propagated again on fake tensors, and a view
whose input shrank has the one dim that holds the shrunk block divided by world_size. Every
rank's graph has the same nodes in the same order (rank only changes the slices), and its
output is the unsharded graph's logits [B, T, V].
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import has_free_symbols
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

import fuser.ops.collectives  # noqa: F401  (registers fuser::all_reduce, fuser::all_gather)
from fuser.passes.fx import prepare_graph

aten = torch.ops.aten

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
          "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
LM_HEAD_MODES = ("vocab", "replicated")
_CACHE = re.compile(r"^[kv]_cache_\d+$")
# meta key of a sliced weight's get_attr node: (the unsharded graph's target, the sliced dim);
# rank r holds the r-th of world_size equal chunks along that dim.
SOURCE = "tensor_parallel_source"
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclass(frozen=True)
class ShardShape:
    """What the sharding splits, read from the graph's weights and cache."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def check(self, world_size: int, lm_head: str) -> None:
        """Raise ValueError naming every count that world_size does not divide."""
        counts = {"attention heads": self.heads, "KV heads": self.kv_heads,
                  "intermediate size": self.intermediate}
        if lm_head == "vocab":
            counts["vocabulary size (lm_head='vocab'; lm_head='replicated' has no such "
                   "constraint)"] = self.vocab
        bad = [f"{name} {n}" for name, n in counts.items() if n % world_size]
        if bad:
            raise ValueError(f"tensor parallel over {world_size} ranks: the model's "
                             f"{', '.join(bad)} not divisible by {world_size}")


def shard_cache(cache: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s slice of one layer's cache [B, S, KVH, D] (paged: [N, PAGE, KVH, D]):
    its KV heads, contiguous: [B, S, KVH/ws, D]."""
    n = cache.shape[2] // world_size
    return cache[:, :, rank * n:(rank + 1) * n].contiguous()


def _weights(gm: GraphModule) -> dict[str, Node]:
    """The graph's get_attr nodes by target (module path + ".weight", cache names, ...)."""
    return {str(n.target): n for n in gm.graph.find_nodes(op="get_attr")}


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


def _linear_user(weight: Node) -> Node:
    """The mm/addmm that reads `weight` through its permute([1, 0]) (core ATen's linear)."""
    for p in weight.users:
        if p.op == "call_function" and p.target is aten.permute.default and \
                list(p.args[1]) == [1, 0]:
            for mm in p.users:
                if mm.target in (aten.mm.default, aten.addmm.default) and mm.args[-1] is p:
                    return mm
    raise ValueError(f"tensor parallel: no matmul reads {weight.target} as a linear's weight "
                     "(shard_graph expects the unfused graph of capture.export_step)")


def _shape_of(gm: GraphModule) -> ShardShape:
    attrs = _weights(gm)
    caches = sorted(t for t in attrs if t.startswith("k_cache_"))
    if not caches:
        raise ValueError("tensor parallel: the graph reads no KV cache (k_cache_<i>); "
                         "shard_graph expects a step graph of capture.export_step")
    kv_heads, head_dim = _attr(gm, caches[0]).shape[2:]
    q = [t for t in attrs if t.endswith("self_attn.q_proj.weight")]
    gate = [t for t in attrs if t.endswith("mlp.gate_proj.weight")]
    if not q or not gate:
        raise ValueError("tensor parallel: no q_proj/gate_proj weights in the graph (a Llama, "
                         "Mistral or Qwen2 step before the fusion passes is expected)")
    return ShardShape(heads=_attr(gm, q[0]).shape[0] // head_dim, kv_heads=kv_heads,
                      head_dim=head_dim, intermediate=_attr(gm, gate[0]).shape[0],
                      vocab=_lm_head(gm)[1].shape[0])


def _lm_head(gm: GraphModule) -> tuple[Node, torch.Tensor]:
    """The output's matmul (the LM head) and its weight [V, hidden]."""
    node = gm.graph.output_node().args[0]
    while isinstance(node, (tuple, list)):
        node = node[0]
    while node.target in _VIEWS or node.target is aten.alias.default:
        node = node.args[0]
    if node.target not in (aten.mm.default, aten.addmm.default):
        raise ValueError(f"tensor parallel: the logits come from {node.target}, not the LM "
                         "head's matmul (the unfused graph of capture.export_step is expected)")
    weight = node.args[-1].args[0]
    return node, _attr(gm, str(weight.target))


def _rows(t: torch.Tensor, rank: int, world_size: int, dim: int) -> torch.Tensor:
    n = t.shape[dim] // world_size
    return t.narrow(dim, rank * n, n).contiguous()


def shard_graph(gm: GraphModule, rank: int, world_size: int, *, lm_head: str = "vocab",
                cache: dict[str, torch.Tensor] | None = None,
                slices: dict[tuple[str, int], torch.Tensor] | None = None) -> GraphModule:
    """Rank `rank`'s share of the step graph `gm` (see the module docstring); `gm` is left as it
    was and its weights are shared where not sliced.

    cache: the rank's cache tensors by name (k_cache_<i>, v_cache_<i>, already of the per-rank
    shape), for graphs that share one cache (a prefill and a decode step); default: the rank's
    slice of `gm`'s own cache (`shard_cache`), copied.
    Raises ValueError for a world size that does not divide the heads, KV heads, intermediate
    size (or vocabulary, with lm_head="vocab"), and for graphs this pass does not know.
    """
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel: rank {rank} of world size {world_size}")
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"tensor parallel: lm_head={lm_head!r}, expected one of {LM_HEAD_MODES}")
    shape = _shape_of(gm)
    shape.check(world_size, lm_head)
    with warnings.catch_warnings():  # copying export's pytree specs warns of a check inside torch
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        out = GraphModule(gm, copy.deepcopy(gm.graph))
    prepare_graph(out)
    if world_size == 1:
        return out
    graph = out.graph
    attrs = _weights(out)
    sliced = 0
    made = slices if slices is not None else {}

    def piece(target: str, dim: int) -> torch.Tensor:
        """Rank `rank`'s chunk of the weight `target` along `dim` (made once per model)."""
        if (target, dim) not in made:
            made[(target, dim)] = _rows(_attr(gm, target), rank, world_size, dim)
        return made[(target, dim)]

    def bind(node: Node, tensor: torch.Tensor, dim: int) -> None:
        nonlocal sliced
        name = f"tp_{sliced}"
        sliced += 1
        out.register_buffer(name, tensor, persistent=False)
        with graph.inserting_before(node):
            new = graph.get_attr(name)
        new.meta = dict(node.meta)
        new.meta[SOURCE] = (str(node.target), dim)
        node.replace_all_uses_with(new)
        graph.erase_node(node)

    for target, node in list(attrs.items()):
        if _CACHE.match(target):  # cache names stay: the engine binds its cache by name
            tensor = cache[target] if cache is not None else \
                shard_cache(_attr(gm, target), rank, world_size)
            setattr(out, target, tensor)
            continue
        module, _, kind = target.rpartition(".")
        if module.endswith(COLUMN):
            bind(node, piece(target, 0), 0)
        elif module.endswith(ROW) and kind == "weight":
            _row_parallel(graph, _linear_user(node))
            bind(node, piece(target, 1), 1)
    if lm_head == "vocab":
        mm, weight = _lm_head(out)
        permute = mm.args[-1]
        out.register_buffer(f"tp_{sliced}", piece(str(permute.args[0].target), 0),
                            persistent=False)
        with graph.inserting_before(permute):
            head = graph.get_attr(f"tp_{sliced}")
        head.meta[SOURCE] = (str(permute.args[0].target), 0)
        permute.replace_input_with(permute.args[0], head)
        if mm.target is aten.addmm.default:  # the bias's slice too
            bias = mm.args[0]
            out.register_buffer(f"tp_{sliced}_bias", piece(str(bias.target), 0),
                                persistent=False)
            with graph.inserting_before(mm):
                b = graph.get_attr(f"tp_{sliced}_bias")
            b.meta[SOURCE] = (str(bias.target), 0)
            mm.replace_input_with(bias, b)
        with graph.inserting_after(mm):
            gathered = graph.call_function(torch.ops.fuser.all_gather.default, (mm, world_size))
        mm.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
    _propagate(out, world_size)
    graph.eliminate_dead_code()
    graph.lint()
    out.recompile()
    return out


def _row_parallel(graph: torch.fx.Graph, mm: Node) -> None:
    """mm(x, w) -> all_reduce(mm(x, w)); addmm(b, x, w) -> all_reduce(mm(x, w)) + b."""
    reduce = torch.ops.fuser.all_reduce.default
    if mm.target is aten.addmm.default:
        bias, x, w = mm.args
        with graph.inserting_before(mm):
            partial = graph.call_function(aten.mm.default, (x, w))
            total = graph.call_function(reduce, (partial,))
            summed = graph.call_function(aten.add.Tensor, (total, bias))
        mm.replace_all_uses_with(summed)
        graph.erase_node(mm)
        return
    with graph.inserting_after(mm):
        total = graph.call_function(reduce, (mm,))
    mm.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)


def _shrunk_dim(old_in: torch.Size, new_in: torch.Size, old_out: torch.Size,
                world_size: int) -> int:
    """The dim of a view's output [old_out] that holds the block its input lost: the input's
    shrunk dim i spans the flat positions after prod(old_in[:i]); the output's dim starting at
    the same flat position, whose size world_size divides, is the one."""
    changed = [i for i, (a, b) in enumerate(zip(old_in, new_in)) if a != b]
    if len(changed) != 1 or old_in[changed[0]] != new_in[changed[0]] * world_size:
        raise ValueError(f"tensor parallel: a view's input went from {list(old_in)} to "
                         f"{list(new_in)}, not one dim divided by {world_size}")
    before = 1
    for d in old_in[:changed[0]]:
        before *= d
    prefix = 1
    for j, d in enumerate(old_out):
        if prefix == before and d % world_size == 0 and d > 1:
            return j
        prefix *= d
    raise ValueError(f"tensor parallel: cannot map the view {list(old_in)} -> {list(old_out)} "
                     f"to the per-rank shapes")


def _propagate(gm: GraphModule, world_size: int) -> None:
    """Recompute every node's meta["val"] on fake tensors, rewriting the shapes of the views
    (and expands) whose input the sharding shrank."""
    before_sharding = {node: node.meta.get("val") for node in gm.graph.nodes}
    # A graph with symbolic shapes (prefill: T dynamic) propagates under the fake mode (and
    # shape environment) its export made; one at concrete shapes under a fresh one.
    mode = detect_fake_mode([v for v in before_sharding.values() if isinstance(v, torch.Tensor)
                             and has_free_symbols(v)]) or FakeTensorMode(
                                 allow_non_fake_inputs=False)
    env: dict[Node, object] = {}
    for node in gm.graph.nodes:
        old = before_sharding[node]
        if node.op == "placeholder":
            if has_free_symbols(old):  # the inputs keep their shapes: export's own fake input
                env[node] = old
            else:
                with mode:
                    env[node] = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype,
                                                    device=old.device)
        elif node.op == "get_attr":
            t = _attr(gm, str(node.target))
            with mode:  # static shapes (export's mode would give a tensor it saw symbolic dims)
                env[node] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                device=t.device)
        elif node.op == "call_function":
            args = torch.fx.map_arg(node.args, lambda n: env[n])
            kwargs = torch.fx.map_arg(node.kwargs, lambda n: env[n])
            if node.target in _VIEWS or node.target is aten.expand.default:
                src, before = node.args[0], before_sharding[node.args[0]]
                if isinstance(before, torch.Tensor) and before.shape != env[src].shape:
                    sizes = list(node.args[1])
                    if node.target is aten.expand.default:  # aligned at the right
                        lead = len(sizes) - env[src].dim()
                        for i, d in enumerate(env[src].shape):
                            if d != before.shape[i] and sizes[lead + i] != -1:
                                sizes[lead + i] = int(d)  # a head count: static
                    else:
                        j = _shrunk_dim(before.shape, env[src].shape, old.shape, world_size)
                        if sizes[j] != -1:
                            sizes[j] //= world_size
                    node.args = (src, sizes, *node.args[2:])
                    args = torch.fx.map_arg(node.args, lambda n: env[n])
            with mode:
                try:
                    env[node] = node.target(*args, **kwargs)
                except Exception as e:
                    raise ValueError(f"tensor parallel: node {node.name} ({node.target}) fails "
                                     f"at the per-rank shapes: {e}") from e
        elif node.op == "call_module":  # export's input guards: inputs keep their shapes
            env[node] = None
            continue
        else:
            continue
        node.meta["val"] = env[node]
        node.meta.pop("tensor_meta", None)


def add_collectives(gm: GraphModule, world_size: int) -> GraphModule:
    """The collectives of a rank's step graph exported from its share of the model
    (fuser/rank_model.py: a model at the per-rank counts, its head a vocab slice), in place:
    an all-reduce after every row-parallel matmul (o_proj, down_proj; a bias added after it)
    and the logits [B, T, V/ws] gathered into [B, T, V] at the output. Before `run_passes`,
    like `shard_graph`, whose graph this gives without ever holding the unsharded weights.
    Returns `gm`."""
    if world_size == 1:
        return gm
    prepare_graph(gm)
    graph = gm.graph
    for target, node in _weights(gm).items():
        module, _, kind = target.rpartition(".")
        if module.endswith(ROW) and kind == "weight":
            _row_parallel(graph, _linear_user(node))
    output = graph.output_node()
    logits = output.args[0]
    while isinstance(logits, (tuple, list)):
        logits = logits[0]
    _lm_head(gm)  # the logits come from the LM head's matmul: anything else is refused
    with graph.inserting_before(output):
        gathered = graph.call_function(torch.ops.fuser.all_gather.default, (logits, world_size))
    output.replace_input_with(logits, gathered)
    mode = detect_fake_mode([logits.meta["val"]])
    if mode is not None:
        with mode:
            gathered.meta["val"] = torch.ops.fuser.all_gather.default(logits.meta["val"],
                                                                      world_size)
    for node in graph.nodes:  # the new mm/add nodes of a biased row-parallel linear
        if node.op == "call_function" and "val" not in node.meta and mode is not None:
            args = torch.fx.map_arg(node.args, lambda n: n.meta["val"])
            kwargs = torch.fx.map_arg(node.kwargs, lambda n: n.meta["val"])
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)
    graph.lint()
    gm.recompile()
    return gm
