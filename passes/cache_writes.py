"""KV-cache writes in place: a functional cache write and its copy back become one in-place write.

Export functionalizes the step's cache writes (`cache_attention` in fuser/capture.py), so a
graph that runs as it is, not compiled, keeps them functional:

    k_new = index_put(k_cache, indices, values)   # a new tensor the size of the whole cache
    ... attention reads k_new ...
    copy_(k_cache, k_new)                          # at the end of the graph

Prefill and the chunk step (dynamic T) run that way: Inductor compiles only fixed-T steps, and
`rotary_cache` rewrites only theirs. Every prefill then copied each layer's whole cache (or
paged pool) and held the copies until the graph's end, where they were copied back: twice the
cache's bytes read and written per prompt, and a second cache's worth of memory at once (an 8B
build's warm-up with a paged pool of half the free memory ran out of memory on the H200 in
`benchmarks/prefix_cache.py`, benchmarks/RESULTS.md "GPU tests"). This pass writes the T new
slots into the buffer itself:

    k_new = index_put_(k_cache, indices, values)  # in place; returns k_cache
    ... attention reads k_new ...

Conditions (anything else is left alone):
- the write is `index_put` without accumulate, and its result is copied back into the tensor it
  wrote (`copy_(cache, write)`), by a `copy_` whose result nothing reads;
- every other reader of the old cache comes before the write (after it, in place, it would read
  the new slots).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from fuser.passes.base import GraphPass, PassContext, uncompiled

aten = torch.ops.aten


def _call(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _copy_back(write: Node, position: dict[Node, int]) -> Node | None:
    """The `copy_(cache, write)` that puts `write`'s result back, when the write can happen in
    place (module docstring, "Conditions")."""
    if write.kwargs.get("accumulate", False) or write.args[3:] not in ((), (False,)):
        return None
    cache = write.args[0]
    copies = [u for u in write.users if _call(u, aten.copy_.default) and u.args[0] is cache]
    if not isinstance(cache, Node) or len(copies) != 1 or copies[0].users:
        return None
    later = [u for u in cache.users if u not in (write, copies[0]) and position[u] > position[write]]
    return None if later else copies[0]


def write_caches_in_place(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every functional cache write of `gm` that can happen in place; returns how many."""
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    count = 0
    for write in [n for n in graph.nodes if _call(n, aten.index_put.default)]:
        copy = _copy_back(write, position)
        if copy is None:
            continue
        cache, indices, values = write.args[:3]
        with graph.inserting_before(write):
            in_place = graph.call_function(aten.index_put_.default, (cache, indices, values))
        in_place.meta.update(write.meta)
        graph.erase_node(copy)
        write.replace_all_uses_with(in_place)
        graph.erase_node(write)
        count += 1
    return count


# (The fixed-T steps: Inductor reinplaces their writes, or rotary_cache's op does them.)
CACHE_WRITES = GraphPass("cache_writes", write_caches_in_place, when=uncompiled)
