"""Capture: an unmodified Hugging Face causal LM becomes a step function over the engine's cache.

    step(tokens[B, T], positions[B, T], seq_lens[B], starts[B]) -> logits[B, T, V]

The KV cache lives in buffers of `StepModule`; the model reaches it through transformers' own
extension point: we register an attention function under the name "fuser" and set it on a
parameter-sharing copy of the model (the user's model is left as it was). Every extra keyword
argument given to the model's forward reaches that function, so `fuser_step` carries the cache
and the lengths. `torch.export` then records the cache writes as buffer mutations.

A prefill graph (`prefill=True`) starts every row from an empty cache and attends only among its
T new tokens; decode and verify graphs attend over every slot, masked by the lengths.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.paged import paged_slots

ATTENTION = "fuser"
# Families whose decode step is fully fused and checked against Hugging Face (API.md,
# "supported"); the tests take their list from here.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class StepContext:
    """What `cache_attention` needs from the step: the cache tensors and the row lengths."""

    k: list[torch.Tensor]  # per layer [B, S, kv_heads, D] (paged: [num_blocks, PAGE, kv_heads, D])
    v: list[torch.Tensor]
    seq_lens: torch.Tensor  # [B] slots written before this step
    starts: torch.Tensor  # [B] first real (non-padding) slot
    prefill: bool  # True: the cache is empty, attend among the new tokens only
    block_table: torch.Tensor | None = None  # paged: [B, max_blocks] int32 (runtime/blocks.py)


def cache_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    fuser_step: StepContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Write the new k/v into the engine's cache and attend; a transformers attention function.

    query: [B, H, T, D]; key, value: [B, kv_heads, T, D] (rotary already applied).
    Returns the attention output as [B, T, H, D].
    A key in slot j is visible to the query in slot i = seq_lens + t when
    starts <= j <= i (and i - j < sliding_window where the layer has one).
    A paged cache (the step's block_table) holds row b's slot j at
    (block_table[b, j // PAGE], j % PAGE) of its pools: writes and reads go through the table.
    """
    if fuser_step is None:
        raise RuntimeError("the 'fuser' attention function runs only inside a fuser step")
    step = fuser_step
    layer = module.layer_idx
    B, H, T, D = query.shape
    device = query.device

    slots = step.seq_lens[:, None] + torch.arange(T, device=device)  # [B, T] slot of each new token
    k_cache, v_cache = step.k[layer], step.v[layer]  # [B, S, kv_heads, D]
    if step.block_table is None:
        rows, cols = torch.arange(B, device=device)[:, None].expand(B, T), slots  # [B, T]
    else:  # [B, T] block and offset of each new token in the pools
        rows, cols = paged_slots(step.block_table, k_cache.shape[1], slots)
    k_cache.index_put_((rows, cols), key.transpose(1, 2).to(k_cache.dtype))  # [B, T, kv_heads, D]
    v_cache.index_put_((rows, cols), value.transpose(1, 2).to(v_cache.dtype))

    scale = scaling if scaling is not None else D**-0.5
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    if step.prefill:  # the cache was empty: attend among the T new tokens only
        return torch.ops.fuser.prefill_attention(
            query, key, value, slots, step.starts, scale, window, cap), None
    # One opaque op per layer: passes/attention.py chooses the kernel that computes it.
    if step.block_table is None:
        return torch.ops.fuser.cache_attention(
            query, k_cache, v_cache, step.seq_lens, step.starts, scale, window, cap), None
    return torch.ops.fuser.cache_attention(
        query, k_cache, v_cache, step.seq_lens, step.starts, scale, window, cap,
        step.block_table), None


def _no_mask(*args: object, **kwargs: object) -> None:
    """Mask function for the "fuser" attention: masking happens inside `cache_attention`."""
    return None


def register_attention() -> None:
    """Make "fuser" a valid attention implementation in transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, cache_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def supports_cache_attention(model: nn.Module) -> bool:
    """Whether the model dispatches attention through transformers' attention registry."""
    return bool(getattr(model, "_supports_attention_backend", False))


def engine_view(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A copy of `model` for the engine, attending through the "fuser" function.

    Parameters and buffers are shared with `model` when they already have the wanted dtype and
    device (no extra memory); otherwise the copy holds converted ones. Either way `model` itself
    is not modified.
    """
    register_attention()
    first = next(model.parameters())
    if first.dtype == dtype and first.device == device:
        shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        view = copy.deepcopy(model, memo=shared)
    else:
        view = copy.deepcopy(model).to(device=device, dtype=dtype)
    view.eval()
    view.config._attn_implementation = ATTENTION
    for sub in view.modules():  # submodules may hold sub-configs of their own
        cfg = getattr(sub, "config", None)
        if cfg is not None and cfg is not view.config:
            cfg._attn_implementation = ATTENTION
    return view


class StepModule(nn.Module):
    """The step function as a module: owns the cache as buffers, so export records the writes."""

    def __init__(self, model: nn.Module, k: list[torch.Tensor], v: list[torch.Tensor],
                 prefill: bool, block_table: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model = model
        self.num_layers = len(k)
        self.prefill = prefill
        for i, (kt, vt) in enumerate(zip(k, v)):
            self.register_buffer(f"k_cache_{i}", kt, persistent=False)
            self.register_buffer(f"v_cache_{i}", vt, persistent=False)
        # A paged cache: k, v are pools and the rows' block table is read where it lives.
        self.paged = block_table is not None
        if block_table is not None:
            self.register_buffer("block_table", block_table, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                starts: torch.Tensor) -> torch.Tensor:
        step = StepContext(
            k=[getattr(self, f"k_cache_{i}") for i in range(self.num_layers)],
            v=[getattr(self, f"v_cache_{i}") for i in range(self.num_layers)],
            seq_lens=seq_lens,
            starts=starts,
            prefill=self.prefill,
            block_table=self.block_table if self.paged else None,
        )
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=False,
                         fuser_step=step)
        return out.logits  # [B, T, V]


class CacheInputs(nn.Module):
    """`StepModule` with the KV cache as inputs instead of buffers (one list, k then v per
    layer): what `export_step` exports when the batch dimension is dynamic (export keeps a
    buffer's shape static; an input's may vary)."""

    def __init__(self, step: StepModule) -> None:
        super().__init__()
        self.model = step.model
        self.num_layers = step.num_layers
        self.prefill = step.prefill

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                starts: torch.Tensor, kv: list[torch.Tensor],
                block_table: torch.Tensor | None = None) -> torch.Tensor:
        """kv: k then v per layer; block_table: a paged cache's [B, max_blocks] table (kv are
        then pools, with no batch dimension)."""
        n = self.num_layers
        step = StepContext(k=list(kv[:n]), v=list(kv[n:]), seq_lens=seq_lens, starts=starts,
                           prefill=self.prefill, block_table=block_table)
        return self.model(input_ids=tokens, position_ids=positions, use_cache=False,
                          fuser_step=step).logits


def cache_names(num_layers: int) -> list[str]:
    """The KV cache's buffer names in a step graph, k then v per layer (`StepModule`'s)."""
    return [f"k_cache_{i}" for i in range(num_layers)] + [f"v_cache_{i}" for i in range(num_layers)]


def export_step(module: StepModule, batch: int, tokens_per_step: int | None,
                max_tokens: int, dynamic_batch: bool = False,
                token_range: tuple[int, int] | None = None
                ) -> tuple[torch.export.ExportedProgram, torch.fx.GraphModule]:
    """Export `module` to an ATen graph (decomposed to core ATen): (the exported program, a
    GraphModule of it that runs and that the passes rewrite).

    tokens_per_step: a fixed T, or None for a graph dynamic in T (2..max_tokens) used for prefill.
    Shared exports, each to be specialized (`specialize`) to the shapes of a step:
    dynamic_batch: the batch dimension dynamic too (1..batch, the rows of `module`'s cache),
        so that one export serves every batch bucket;
    token_range: (lo, hi): T dynamic in lo..hi, traced at `tokens_per_step` (at least 2), so
        that one export serves every fixed-T step (decode, verify, ...) of a model.
    The returned module reads and writes the very cache tensors `module` holds (through
    get_attr, as buffers) and runs at `batch` rows.
    """
    T = tokens_per_step or 4
    device = module.get_buffer("k_cache_0").device
    tokens = torch.zeros(batch, T, dtype=torch.long, device=device)
    positions = torch.arange(T, device=device)[None].expand(batch, T).contiguous()
    lens = torch.zeros(batch, dtype=torch.long, device=device)
    t_dim = {}
    if tokens_per_step is None:
        t_dim = {1: torch.export.Dim.DYNAMIC(min=2, max=max_tokens)}
    elif token_range is not None:
        t_dim = {1: torch.export.Dim("tokens", min=token_range[0], max=token_range[1])}
    if dynamic_batch or t_dim and tokens_per_step is not None:
        return _export_shared(module, (tokens, positions, lens, lens.clone()), t_dim,
                              dynamic_batch)
    dynamic_shapes = (t_dim, t_dim, None, None) if t_dim else None
    with torch.no_grad():
        ep = torch.export.export(module, (tokens, positions, lens, lens.clone()),
                                 dynamic_shapes=dynamic_shapes, strict=False)
        with _treespec_deprecation_silenced():
            ep = ep.run_decompositions()
    gm = ep.module()
    # ep.module() re-attaches the module's own tensors; check, since the cache must be shared.
    for i in range(module.num_layers):
        for name in (f"k_cache_{i}", f"v_cache_{i}"):
            if gm.get_buffer(name) is not module.get_buffer(name):
                setattr(gm, name, module.get_buffer(name))
    return ep, gm


def _export_shared(module: StepModule, args: tuple[torch.Tensor, ...],
                   t_dim: dict[int, object], dynamic_batch: bool
                   ) -> tuple[torch.export.ExportedProgram, torch.fx.GraphModule]:
    """`export_step` of a graph shared by several steps: the cache goes in as inputs
    (`CacheInputs`), whose batch dimension export may keep symbolic; the graph then reads it
    through get_attr again."""
    names = cache_names(module.num_layers)
    kv = [module.get_buffer(name) for name in names]
    rows = {0: torch.export.Dim("batch", min=1, max=args[0].shape[0])} if dynamic_batch else {}
    # A paged cache's pools have no batch dimension: only its block table has one.
    kv_rows = None if module.paged else dict(rows) or None
    dynamic_shapes = ({**rows, **t_dim}, {**rows, **t_dim}, dict(rows) or None,
                      dict(rows) or None, [kv_rows for _ in kv])
    inputs_in = (*args, kv)
    tensors = dict(zip(names, kv))
    if module.paged:
        dynamic_shapes += (dict(rows) or None,)
        inputs_in += (module.block_table,)
        tensors["block_table"] = module.block_table
    with torch.no_grad():
        ep = torch.export.export(CacheInputs(module), inputs_in,
                                 dynamic_shapes=dynamic_shapes, strict=False)
        with _treespec_deprecation_silenced():
            ep = ep.run_decompositions()
    gm = ep.module()
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in list(gm.graph.nodes):  # export's input check: it would read the cache inputs
        if node.op == "call_module" and not node.users:
            gm.graph.erase_node(node)
    return ep, _inputs_to_buffers(gm, inputs[4:], tensors)


@contextlib.contextmanager
def _treespec_deprecation_silenced() -> Iterator[None]:
    """torch.export's decompositions copy the exported program, whose pytree specs warn (a
    FutureWarning per copy) of a deprecated check inside torch itself: nothing fuser can act
    on. Only that warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        yield


@contextlib.contextmanager
def _absent_attribute_silenced() -> Iterator[None]:
    """`Graph.get_attr` of a name the module does not hold yet warns ("Failed to fetch module
    ...", "Attempted to insert a get_attr Node with no underlying reference"): the tensors are
    attached when the new GraphModule is made, just after (`_inputs_to_buffers`). Only those
    two warnings are silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"Failed to fetch module |Attempted to insert a "
                                        r"get_attr Node with no underlying reference")
        yield


def _inputs_to_buffers(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node],
                       tensors: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    """A module over `gm`'s graph whose `placeholders` became get_attr nodes of `tensors`
    (name -> tensor, in order); the other placeholders stay, under a plain calling convention
    (a single output returned as is). Every other get_attr keeps `gm`'s tensor."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node, name in zip(placeholders, tensors):
        with graph.inserting_before(first), _absent_attribute_silenced():
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)
    output = graph.output_node()
    values = output.args[0]
    if isinstance(values, (tuple, list)) and len(values) == 1:
        output.args = (values[0],)
    graph._codegen = torch.fx.graph.CodeGen()
    attributes = {node.target: tensors[node.target] if node.target in tensors
                  else _attr(gm, node.target) for node in graph.find_nodes(op="get_attr")}
    return torch.fx.GraphModule(attributes, graph)


def specialize(gm: torch.fx.GraphModule, k: list[torch.Tensor], v: list[torch.Tensor],
               tokens_per_step: int, block_table: torch.Tensor | None = None
               ) -> torch.fx.GraphModule:
    """A shared graph of `export_step` (dynamic batch or T) at the batch of the cache `k`, `v`
    (rows [:b] of the exported cache) and T = tokens_per_step, the cache bound under its usual
    names: what exporting at those shapes would give, for the passes to rewrite at concrete
    shapes (they choose kernels by row count). A paged cache: `k`, `v` are the pools as they
    are and `block_table` (rows [:b] of the exported table) gives the batch.

    Retraces the ATen graph on fake tensors (`make_fx`): no model code runs again, a fraction
    of an export's time.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    names = cache_names(len(k))
    cache = dict(zip(names, [*k, *v]))
    if block_table is not None:
        cache["block_table"] = block_table
    attrs = list(gm.graph.find_nodes(op="get_attr"))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Every tensor the graph reads becomes an input (the cache at the new batch), then the
    # retraced graph reads them through get_attr again, under the same names.
    lifted = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    tensors: dict[str, torch.Tensor] = {}
    for node in attrs:
        env[node] = lifted.placeholder(f"attr_{len(tensors)}")
        tensors[node.target] = cache[node.target] if node.target in cache else \
            _attr(gm, node.target)
    for node in inputs:
        env[node] = lifted.placeholder(node.name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            lifted.output(torch.fx.map_arg(node.args[0], env.__getitem__))
        else:
            env[node] = lifted.node_copy(node, env.__getitem__)
    batch = k[0].shape[0] if block_table is None else block_table.shape[0]
    device = k[0].device
    example = [t.detach() for t in tensors.values()]
    T = tokens_per_step
    example += [torch.zeros(batch, T, dtype=torch.long, device=device) for _ in range(2)]
    example += [torch.zeros(batch, dtype=torch.long, device=device) for _ in range(2)]
    with torch.no_grad():
        traced = make_fx(torch.fx.GraphModule({}, lifted), tracing_mode="fake")(*example)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders[len(tensors):], ("tokens", "positions", "seq_lens",
                                                        "starts")):
        node.target = name
        node._rename(name)
    return _inputs_to_buffers(traced, placeholders[:len(tensors)], tensors)


def _attr(root: nn.Module, target: str) -> torch.Tensor:
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def model_geometry(config: object) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim
