"""What compiling a fixed-T step for the CPU needs beyond the CUDA path (fuser/compile.py).

On CUDA the fused ops stay opaque calls of Triton kernels. On CPU their kernels are their
plain-PyTorch references, and two things differ:

- Left opaque, each reference would run eagerly, one ATen op at a time behind a Python call.
  `InlineReferences` (fuser/compile_inline.py), a post-grad pass of Inductor, replaces each
  call by its reference (`fuser.ops.CPU_INLINE`), so the C++ backend fuses norms, rotary, the
  gated activation and attention with the ops around them; GEMMs stay calls of the same ATen
  kernel as before.
- A fused op that writes the KV cache and attends (`fuser.ops.CPU_SPLIT`) becomes the ops it
  fused again (`lift_tensors(split=True)`): the write stays opaque, the attention after it is
  inlined.

`lift_tensors` itself is shared by both devices: Inductor compiles the step with every tensor it
reads (weights and KV cache alike) as an input. This module does not import Inductor (seconds of
imports a load of an engine directory does without): `config()` does, when a step compiles.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fuser.ops import CPU_SPLIT


def read_tensors(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Every tensor `gm` reads through get_attr, in graph order: the leading inputs of
    `lift_tensors`' module."""
    return [_attr(gm, node.target).detach() for node in gm.graph.find_nodes(op="get_attr")]


def lift_tensors(gm: torch.fx.GraphModule, split: bool = True
                 ) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """(a module whose graph takes every tensor `gm` reads through get_attr as a leading input,
    in graph order (`read_tensors`), then `gm`'s own inputs, and returns (logits,); those
    tensors). With `split` (the CPU), calls of an op in `CPU_SPLIT` become the calls of its
    split function."""
    from torch.fx.proxy import GraphAppendingTracer
    from torch.utils._pytree import tree_map_only

    graph = torch.fx.Graph()
    tracer = GraphAppendingTracer(graph)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    tensors = []
    for node in gm.graph.find_nodes(op="get_attr"):
        env[node] = graph.placeholder(node.target.replace(".", "_"))
        tensors.append(_attr(gm, node.target).detach())  # a Parameter as the plain tensor
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op == "call_module" and not node.users):
            continue  # (call_module: export's check of the input shapes; the engine owns them)
        if node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            graph.output(tuple(env[o] for o in outputs))
        elif split and node.op == "call_function" and node.target in CPU_SPLIT:
            args, kwargs = tree_map_only(torch.fx.Node, lambda n: torch.fx.Proxy(env[n], tracer),
                                         (node.args, node.kwargs))
            env[node] = CPU_SPLIT[node.target](*args, **kwargs).node
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule({}, graph, class_name="LiftedStep"), tensors


def _attr(root: torch.nn.Module, target: str) -> torch.Tensor:
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


@functools.cache
def config() -> dict[str, Any]:
    """Inductor options of every CPU step.

    cpp.threads = 1: the generated kernels (norms, rotary, attention over decode-sized rows)
    are too small to share between threads, and the code then does not depend on the building
    process's torch.get_num_threads() (left at its default, Inductor specializes on it). GEMMs
    stay ATen calls with ATen's intra-op threads.
    No precompiled header: the option is part of each kernel's compiler command line, hence of
    the key its library is cached under, and a load (fuser/kernel_store.py: `loading`) must
    ask for the same key without precompiling a header (a compiler run) first.
    """
    from fuser.compile_inline import INLINE_REFERENCES

    return {"post_grad_custom_pre_pass": INLINE_REFERENCES, "cpp.threads": 1,
            "cpp_cache_precompile_headers": False}
