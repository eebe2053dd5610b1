"""Rotary + KV-cache write: `fuser::rotary` and the two cache writes after it become one
`fuser::rotary_cache_write`, which writes the caches in place.

What capture leaves in a decode, verify or catch-up graph (fixed T), per layer, once the rotary
pass has run (`cache_attention` in fuser/capture.py, functionalized by export):

    q_rot, k_rot = fuser.rotary(q, k, cos, sin)          # (or k, q: the op is symmetric)
    slots = unsqueeze(seq_lens, 1) + arange(0, T)        # [B, T]
    rows  = expand(unsqueeze(arange(0, B), 1), [B, T])   # [B, T]
    k_new = index_put(k_cache, [rows, slots], permute(k_rot, [0, 2, 1, 3]))
    v_new = index_put(v_cache, [rows, slots], permute(v, [0, 2, 1, 3]))
    ... attention reads q_rot, k_new, v_new ...
    copy_(k_cache, k_new); copy_(v_cache, v_new)         # at the end of the graph

which becomes

    q_rot = fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens)

Over a paged cache (capture with a block table: fuser/ops/paged.py `paged_slots`) the writes'
indices are each slot's (block, offset) instead of (row, slot):

    blocks  = where(lt(slots, max_blocks * PAGE),
                    gather(_to_copy(block_table), 1, clamp(div(slots, PAGE, floor), 0,
                                                           max_blocks - 1)), 0)
    offsets = remainder(slots, PAGE)
    k_new = index_put(k_pool, [blocks, offsets], ...)    # likewise v

and the op takes the table too: fuser.rotary_cache_write(..., seq_lens, block_table).
    ... attention reads q_rot, k_cache, v_cache ...       # the caches, written above

The functional `index_put` (a new cache) and the `copy_` back are gone: the op writes the T new
slots of the buffers themselves, and every reader of `k_new`/`v_new` now reads the buffer, placed
after the op. Inductor sees a mutating custom op on a graph input and keeps it in place
(auto_functionalized, then reinplaced: no cache copy; tests/test_rotary_cache.py checks its code).

Conditions (anything else is left alone):
- k_rot's only user is the permute feeding the k write, and that permute's only user is it;
- both writes are `index_put` (no accumulate) at the same `[rows, slots]` above, with
  seq_lens a [B] int64 tensor, on two different caches whose only users are the write and the
  `copy_` of it back into them (no other read of the old cache);
- every reader of q_rot, k_new and v_new comes after both writes (the op takes their place);
- the step has a fixed T (the pass's `when`: decode, verify, catch-up). Prefill keeps its
  writes: there the new k also feeds attention among the new tokens directly, so k_rot's extra
  user would keep it out anyway, and its T is dynamic;
- the op accepts the shapes and dtypes (its fake implementation checks them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import fake_value, graph_fake_mode

aten = torch.ops.aten
TO_BTHD = [0, 2, 1, 3]  # [B, heads, T, D] <-> [B, T, heads, D]


@dataclass
class CacheWrite:
    """One layer's rotary and cache writes, as found in the graph."""

    rotary: Node
    q_rot: Node  # the rotary output attention reads (getitem)
    k_write: Node  # index_put into k_cache
    v_write: Node
    k_copy: Node  # copy_(k_cache, k_write)
    v_copy: Node
    args: tuple[Node, ...]  # q, k, v, cos, sin, k_cache, v_cache, seq_lens[, block_table]


def _call(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _is_arange(node: object, n: int) -> bool:
    """node is arange(0, n) with step 1."""
    if not _call(node, aten.arange.start_step):
        return False
    start, end, *rest = node.args
    return start == 0 and end == n and rest in ([], [1]) and node.kwargs.get("step", 1) == 1


def _seq_lens_of(indices: object, B: int, T: int) -> Node | None:
    """seq_lens when indices is [expand(unsqueeze(arange(0, B), 1), [B, T]),
    unsqueeze(seq_lens, 1) + arange(0, T)] (capture's rows and slots), else None."""
    if not isinstance(indices, (list, tuple)) or len(indices) != 2:
        return None
    rows, slots = indices
    if not (_call(rows, aten.expand.default) and list(rows.args[1]) == [B, T]):
        return None
    column = rows.args[0]
    if not (_call(column, aten.unsqueeze.default) and column.args[1] == 1
            and _is_arange(column.args[0], B)):
        return None
    return _lens_of_slots(slots, B, T)


def _paged_of(indices: object, B: int, T: int, page: int) -> tuple[Node, Node] | None:
    """(seq_lens, block_table) when indices are a paged write's [blocks, offsets] of the
    slots unsqueeze(seq_lens, 1) + arange(0, T) (module docstring), else None."""
    if not isinstance(indices, (list, tuple)) or len(indices) != 2:
        return None
    blocks, offsets = indices
    if not (_call(offsets, aten.remainder.Scalar) and offsets.args[1] == page):
        return None
    slots = offsets.args[0]
    if not (_call(blocks, aten.where.self) and _call(blocks.args[0], aten.lt.Scalar)
            and _call(blocks.args[1], aten.gather.default)
            and _call(blocks.args[2], aten.scalar_tensor.default) and blocks.args[2].args[0] == 0):
        return None
    below, gather = blocks.args[0], blocks.args[1]
    source, dim, index = gather.args[:3]
    if not (_call(source, aten._to_copy.default) and dim == 1 and _call(index, aten.clamp.default)
            and _call(index.args[0], aten.div.Tensor_mode) and index.args[0].args[1] == page
            and index.args[0].kwargs.get("rounding_mode") == "floor"):
        return None
    table = source.args[0]
    val = table.meta.get("val") if isinstance(table, Node) else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int32 and val.dim() == 2
            and val.shape[0] == B):
        return None
    max_blocks = val.shape[1]
    if not (below.args[0] is slots and below.args[1] == max_blocks * page
            and index.args[0].args[0] is slots and list(index.args[1:]) == [0, max_blocks - 1]):
        return None
    seq_lens = _lens_of_slots(slots, B, T)
    return None if seq_lens is None else (seq_lens, table)


def _lens_of_slots(slots: object, B: int, T: int) -> Node | None:
    """seq_lens when slots is unsqueeze(seq_lens, 1) + arange(0, T), seq_lens [B] int64."""
    if not (_call(slots, aten.add.Tensor) and len(slots.args) == 2 and not slots.kwargs):
        return None
    lens, offsets = slots.args
    if not (_call(lens, aten.unsqueeze.default) and lens.args[1] == 1 and _is_arange(offsets, T)):
        return None
    seq_lens = lens.args[0]
    val = seq_lens.meta.get("val") if isinstance(seq_lens, Node) else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int64 and tuple(val.shape) == (B,)):
        return None
    return seq_lens


def _write_of(values: Node) -> Node | None:
    """The cache write `index_put(cache, indices, values)` that is values' only user."""
    users = list(values.users)
    if len(users) != 1 or not _call(users[0], aten.index_put.default):
        return None
    write = users[0]
    if len(write.args) < 3 or write.args[2] is not values or write.args[3:] not in ((), (False,)):
        return None
    return None if write.kwargs.get("accumulate", False) else write


def _copy_back(write: Node) -> Node | None:
    """The `copy_(cache, write)` putting the written cache back, when the cache has no other
    user than the write and that copy (nothing reads the old contents)."""
    cache = write.args[0]
    copies = [u for u in write.users if _call(u, aten.copy_.default) and u.args[0] is cache]
    if not isinstance(cache, Node) or len(copies) != 1 or set(cache.users) != {write, copies[0]}:
        return None
    return copies[0]


def _is_permute_bthd(node: object) -> bool:
    return _call(node, aten.permute.default) and list(node.args[1]) == TO_BTHD


def find_cache_write(rotary: Node, position: dict[Node, int]) -> CacheWrite | None:
    """The cache writes fed by `rotary`'s k output, when they can become one op (module
    docstring, "Conditions")."""
    outputs = {u.args[1]: u for u in rotary.users if _call(u, operator.getitem)}
    if set(outputs) != {0, 1} or len(rotary.users) != 2:
        return None
    found = []
    for index, out in outputs.items():  # which output is k: the one written to a cache
        users = list(out.users)
        if len(users) == 1 and _is_permute_bthd(users[0]):
            write = _write_of(users[0])
            if write is not None:
                found.append((index, write))
    if len(found) != 1:
        return None
    k_index, k_write = found[0]
    q_rot = outputs[1 - k_index]
    k, q = rotary.args[k_index], rotary.args[1 - k_index]
    cos, sin = rotary.args[2], rotary.args[3]

    k_val = k.meta["val"]  # [B, KH, T, D]
    B, T = k_val.shape[0], k_val.shape[2]
    if not (isinstance(B, int) and isinstance(T, int)):
        return None  # a dynamic T: prefill, which keeps its own path
    indices = k_write.args[1]
    seq_lens, table = _seq_lens_of(indices, B, T), ()
    if seq_lens is None:  # a paged cache? (its pool's second dim is the block size)
        pool = k_write.args[0].meta.get("val") if isinstance(k_write.args[0], Node) else None
        paged = _paged_of(indices, B, T, pool.shape[1]) if isinstance(pool, torch.Tensor) else None
        if paged is None:
            return None
        seq_lens, table = paged[0], (paged[1],)
    v_writes = [u for u in indices[1].users if _call(u, aten.index_put.default)
                and u is not k_write and list(u.args[1]) == list(indices)]
    if len(v_writes) != 1 or v_writes[0].args[3:] not in ((), (False,)) \
            or v_writes[0].kwargs.get("accumulate", False):
        return None
    v_write = v_writes[0]
    if not _is_permute_bthd(v_write.args[2]):
        return None
    v = v_write.args[2].args[0]
    k_cache, v_cache = k_write.args[0], v_write.args[0]
    k_copy, v_copy = _copy_back(k_write), _copy_back(v_write)
    if k_cache is v_cache or k_copy is None or v_copy is None:
        return None

    # The op takes the place of the later write: everything reading its results must follow.
    last = max(position[k_write], position[v_write])
    readers = [*q_rot.users, *(u for u in k_write.users if u is not k_copy),
               *(u for u in v_write.users if u is not v_copy)]
    if any(position[r] <= last for r in readers):
        return None
    return CacheWrite(rotary, q_rot, k_write, v_write, k_copy, v_copy,
                      (q, k, v, cos, sin, k_cache, v_cache, seq_lens, *table))


def fuse_rotary_cache_write(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every rotary + cache-write group of `gm` (module docstring); returns how many."""
    graph: Graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    op = torch.ops.fuser.rotary_cache_write.default
    count = 0
    for rotary in [n for n in graph.nodes if _call(n, torch.ops.fuser.rotary.default)]:
        position = {n: i for i, n in enumerate(graph.nodes)}
        match = find_cache_write(rotary, position)
        if match is None:
            continue
        try:  # the op's fake implementation checks shapes and dtypes (e.g. cache dtype)
            val = fake_value(fake_mode, op, match.args)
        except (ValueError, RuntimeError):
            continue
        last = max(match.k_write, match.v_write, key=position.__getitem__)
        with graph.inserting_after(last):
            fused = graph.call_function(op, match.args)
        fused.meta["val"] = val
        match.q_rot.replace_all_uses_with(fused)
        for write, copy in ((match.k_write, match.k_copy), (match.v_write, match.v_copy)):
            graph.erase_node(copy)
            write.replace_all_uses_with(write.args[0])  # readers now read the written buffer
            graph.erase_node(write)
        count += 1
    return count


def _fixed_t(context: PassContext) -> bool:
    """Decode, verify and catch-up steps; prefill keeps its write (its k also feeds attention)."""
    return context.kind.fixed


# After `rotary` (it matches fuser::rotary) and before anything that could move the writes.
ROTARY_CACHE = GraphPass("rotary_cache", fuse_rotary_cache_write, when=_fixed_t)
