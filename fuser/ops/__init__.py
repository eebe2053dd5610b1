"""Fused ops: importing this package registers every `torch.ops.fuser.*` op.

`CPU_INLINE` maps each op whose CPU kernel is its plain-PyTorch reference to a function that
computes exactly what that kernel computes (outputs contiguous, as the op's are). Where Inductor
compiles a step on CPU (fuser/build.py, `compilable`), calls of these ops are replaced by the
functions, so Inductor traces into the references and fuses them with the ATen ops around them
into C++ kernels; an opaque op would run its reference eagerly, one ATen op at a time, behind a
Python call. The FP8 ops stay opaque: their CPU path emulates FP8 for correctness only.

`CPU_SPLIT` maps each fused op that writes the KV cache and attends to a function calling the
ops it fused, which the CPU compile puts in its place before Inductor sees the graph: the cache
write stays an opaque op (a mutation is not inlined), and the attention after it is inlined.
"""

import torch

from fuser.ops import rmsnorm  # noqa: F401
from fuser.ops import rope  # noqa: F401
from fuser.ops import gated_act  # noqa: F401
from fuser.ops import attention  # noqa: F401
from fuser.ops import rotary_attention  # noqa: F401
from fuser.ops import linear  # noqa: F401
from fuser.ops import fp8_linear  # noqa: F401
from fuser.ops import norm_linear  # noqa: F401
from fuser.ops import norm_stats  # noqa: F401
from fuser.ops import fp8  # noqa: F401
from fuser.ops import fp8_quant  # noqa: F401
from fuser.ops import collectives  # noqa: F401


def rms_norm_cpu(x, weight, eps):
    return rmsnorm.rms_norm_reference(x, weight, eps).contiguous()


def add_rms_norm_cpu(x, residual, weight, eps):
    normed, summed = rmsnorm.add_rms_norm_reference(x, residual, weight, eps)
    return normed.contiguous(), summed.contiguous()


def rotary_cpu(q, k, cos, sin):
    q_embed, k_embed = rope.rotary_reference(q, k, cos, sin)
    return q_embed.contiguous(), k_embed.contiguous()


def gated_act_cpu(gate_up, activation):
    return gated_act.gated_act_reference(gate_up, activation).contiguous()


def _inline_linear(normed, weight, weight_scale, activation):
    # As the unfused graph compiled: fuser::linear inlined, the gated and FP8 GEMVs opaque.
    if weight_scale is None and activation is None:
        return linear.linear_reference(normed, weight)
    return norm_linear._linear_op(normed, weight, weight_scale, activation)


def rms_norm_linear_cpu(x, norm_weight, eps, weight, weight_scale, activation):
    return _inline_linear(rms_norm_cpu(x, norm_weight, eps), weight, weight_scale, activation)


def add_rms_norm_linear_cpu(x, residual, norm_weight, eps, weight, weight_scale, activation):
    normed, summed = add_rms_norm_cpu(x, residual, norm_weight, eps)
    return _inline_linear(normed, weight, weight_scale, activation), summed


def linear_residual_cpu(x, weight, weight_scale, residual, norm_weight):
    return norm_stats.residual_outputs(_inline_linear(x, weight, weight_scale, None), residual,
                                       norm_weight)


def stats_rms_norm_linear_cpu(summed, gh, squares, norm_weight, eps, weight, weight_scale,
                              activation):
    return rms_norm_linear_cpu(summed, norm_weight, eps, weight, weight_scale, activation)


CPU_INLINE = {
    torch.ops.fuser.rms_norm.default: rms_norm_cpu,
    torch.ops.fuser.add_rms_norm.default: add_rms_norm_cpu,
    torch.ops.fuser.rotary.default: rotary_cpu,
    torch.ops.fuser.gated_act.default: gated_act_cpu,
    torch.ops.fuser.linear.default: linear.linear_reference,
    # the norm inlined, the linear as its own op is (the norm + GEMV kernel is CUDA's)
    torch.ops.fuser.rms_norm_linear.default: rms_norm_linear_cpu,
    torch.ops.fuser.add_rms_norm_linear.default: add_rms_norm_linear_cpu,
    torch.ops.fuser.linear_residual.default: linear_residual_cpu,
    torch.ops.fuser.stats_rms_norm_linear.default: stats_rms_norm_linear_cpu,
    torch.ops.fuser.cache_attention.default: attention.cache_attention_grouped,
    torch.ops.fuser.cache_attention_read.default: attention.cache_attention_grouped,
    torch.ops.fuser.prefill_attention.default: attention.prefill_attention_reference,
}

CPU_SPLIT = {
    torch.ops.fuser.rotary_cache_attention.default: rotary_attention.rotary_cache_attention_split,
}
