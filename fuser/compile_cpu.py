"""A fixed-T step compiled for the CPU: Inductor's C++ backend over the rewritten graph.

On CUDA, `fuser.build.add_step` hands a step to `torch.compile`, and the fused ops stay opaque
calls of Triton kernels. On CPU two things differ, and this module does both:

- The fused ops' CPU kernels are their plain-PyTorch references. Left opaque, each would run
  eagerly, one ATen op at a time behind a Python call. `InlineReferences`, a post-grad pass of
  Inductor, replaces each call by its reference (`fuser.ops.CPU_INLINE`), so the C++ backend
  fuses norms, rotary, the gated activation and attention with the ops around them; GEMMs stay
  calls of the same ATen kernel as before.
- A fused op that writes the KV cache and attends (`fuser.ops.CPU_SPLIT`) becomes the ops it
  fused again (`lift_tensors`): the write stays opaque, the attention after it is inlined.
- The rewritten graph is already ATen (torch.export captured it), so it goes to Inductor
  directly (`compile_graph`, as `torch._inductor.standalone_compile` does) with every tensor
  it reads, weights and KV cache alike, as an input, not through Dynamo, which would trace it
  again for seconds: a loaded engine compiles from the saved compile cache in a fraction of
  that per graph, and a call evaluates no Dynamo guards. The cache writes become input
  mutations, done in place.

The compile cache keys on the graph, the input shapes and this pass's sources, so the build and
a later `fuser.load` (which compiles the same graph rebuilt from the engine file) share entries.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, \
    register_graph_pattern

from fuser.ops import CPU_INLINE, CPU_SPLIT

_SOURCES = tuple(str(p) for p in sorted((Path(__file__).parent / "ops").glob("*.py"))) + \
    (__file__,)


class InlineReferences(CustomGraphPass):
    """Inductor post-grad pass: every call of an op in `fuser.ops.CPU_INLINE` becomes the ATen
    graph of its reference, traced at the call's shapes."""

    def __init__(self) -> None:
        self.patterns = PatternMatcherPass()
        for op in CPU_INLINE:
            register_graph_pattern(CallFunctionVarArgs(op), pass_dict=self.patterns)(_inline)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.patterns.apply(graph)

    def uuid(self) -> bytes:
        """The sources of the ops and of this pass: an edit invalidates cached compiles."""
        return get_hash_for_files(_SOURCES)


def _inline(match: Match, *args: object, **kwargs: object) -> None:
    """Replace the matched op call by its reference, traced over the call's tensor arguments
    (scalars and strings, e.g. eps and the activation's name, are baked in)."""
    fn = CPU_INLINE[match.nodes[0].target]
    nodes = [a for a in args if isinstance(a, torch.fx.Node)]

    def reference(*tensors: torch.Tensor) -> object:
        it = iter(tensors)
        return fn(*(next(it) if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)

    match.replace_by_example(reference, nodes)


INLINE_REFERENCES = InlineReferences()


def lift_tensors(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """(a module whose graph takes every tensor `gm` reads through get_attr as a leading input,
    in graph order, then `gm`'s own inputs, and returns (logits,); those tensors). Calls of an
    op in `CPU_SPLIT` become the calls of its split function."""
    from torch.fx.proxy import GraphAppendingTracer
    from torch.utils._pytree import tree_map_only

    graph = torch.fx.Graph()
    tracer = GraphAppendingTracer(graph)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    tensors = []
    for node in gm.graph.find_nodes(op="get_attr"):
        env[node] = graph.placeholder(node.target.replace(".", "_"))
        tensors.append(_attr(gm, node.target))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            graph.output(tuple(env[o] for o in outputs))
        elif node.op == "call_function" and node.target in CPU_SPLIT:
            args, kwargs = tree_map_only(torch.fx.Node, lambda n: torch.fx.Proxy(env[n], tracer),
                                         (node.args, node.kwargs))
            env[node] = CPU_SPLIT[node.target](*args, **kwargs).node
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule({}, graph, class_name="CpuStep"), tensors


def _attr(root: torch.nn.Module, target: str) -> torch.Tensor:
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


class CpuStep:
    """A rewritten fixed-T step, compiled by Inductor for the CPU on its first call:
    (tokens, positions, seq_lens, starts) -> logits [B, T, V], writing the KV cache in place.

    Shapes, dtypes and strides are those of the first call (Inductor checks them on every
    call); the tensors `gm` reads are bound now and must keep their addresses.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.module, self.tensors = lift_tensors(gm)
        self.compiled = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        args = [*self.tensors, tokens, positions, seq_lens, starts]
        if self.compiled is None:
            self.compiled = compile_graph(self.module, args)
            self.module = None  # compile_fx owns it now
        return self.compiled(*args)[0]


def compile_graph(gm: torch.fx.GraphModule, args: list[torch.Tensor]) -> Callable:
    """Inductor over an ATen graph, specialized to the shapes of `args` (what
    `torch._inductor.standalone_compile` does, except that the compile-cache artifacts go to
    this process's collection, which `fuser.engine_file.compile_cache_bytes` saves)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        return compile_fx(gm, args, ignore_shape_env=True, config_patches=CONFIG)


# Inductor options of every CPU step. cpp.threads = 1: the generated kernels (norms, rotary,
# attention over decode-sized rows) are too small to share between threads, and a fixed count
# keeps the cache key independent of the loading process's torch.get_num_threads() (left at
# its default, Inductor specializes on it: an engine built with 2 threads and loaded with 1
# would recompile). GEMMs stay ATen calls with ATen's intra-op threads.
CONFIG = {"post_grad_custom_pre_pass": INLINE_REFERENCES, "cpp.threads": 1}
