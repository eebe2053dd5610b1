"""Gated MLP activation, act(gate) * up, read from the merged gate/up GEMM output.

    gated_act(gate_up, activation) = act(g) * u        with g, u = gate_up.chunk(2, dim=-1)

    activation "silu":       act(x) = x * sigmoid(x)                                 (SwiGLU)
    activation "gelu_tanh":  act(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GeGLU)

gate_up: [..., 2I], gate first then up (Llama-style gate/up merged by passes/projections.py, and
Phi-3's own gate_up_proj, which chunks in that order) -> [..., I] in gate_up's dtype.

Rounding is Hugging Face eager's: `act_fn(gate) * up` runs act in fp32 inside PyTorch's kernel
and rounds once to the input dtype, then multiplies in the input dtype. The kernel does the same:
act in fp32, rounded to the input dtype, times up in fp32 (exact for two bf16/fp16 values),
rounded once more.

Cost per row (s = element size in bytes): bytes = 3I * s (read 2I, write I); FLOPs ~ 6I for silu,
~ 10I for gelu_tanh (one exp per element either way).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# The activation is a key, not a copy of the kernel: the Triton kernel takes it as a constexpr.
ACTIVATIONS = ("silu", "gelu_tanh")

# Columns per program. At decode a row is one token: I/BLOCK programs per row (14 for Llama-3-8B's
# I = 14336), so one row is still spread over several SMs; 1024 columns at 4 warps are 8 per
# thread: one 16-byte vector load of bf16 (two of fp32) from each half.
BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def act_times_up(g, u, ACTIVATION: tl.constexpr, out_dtype: tl.constexpr):
    """act(g) * u in fp32, rounded as Hugging Face eager rounds it, for g, u in fp32 that hold
    values of out_dtype: act in fp32, rounded to out_dtype (HF's act_fn(gate)), times u in fp32
    (exact for two bf16/fp16 values). The caller rounds the result to out_dtype once more.

    Shared by every kernel that computes a gated activation (this file's, fuser/ops/fp8_quant.py's
    gated_act_quant, and fuser/ops/linear.py's gated GEMV epilogue), so they round alike.
    """
    if ACTIVATION == "silu":
        a = g / (1.0 + tl.exp(-g))  # PyTorch's formula; exp(-g) = inf gives -0, as there
    else:
        # gelu_tanh as g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3): the same function
        # without PyTorch's cancellation in 1 + tanh(y) for g below about -3 (there PyTorch's
        # fp32 result carries an absolute error of up to about |g| * 2^-25, half an ulp of tanh
        # near -1 times g; this form stays accurate to a few ulps of the result).
        # 2 sqrt(2/pi) as a literal: a global constexpr gave the kernels that read it a cache
        # key that differed from process to process under Triton 3.6, so a load compiled them
        # again (tests/test_engine_load_compiles_nothing.py)
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 1 + tanh(y) = 2 sigmoid(2y)
        a = g / (1.0 + tl.exp(-z))
    a = a.to(out_dtype).to(tl.float32)  # act rounded to the input dtype, as HF's act_fn(gate)
    return a * u


@triton.jit
def _gated_epilogue(acc, HALF: tl.constexpr, BLOCK_M: tl.constexpr, ACTIVATION: tl.constexpr,
                    out_dtype: tl.constexpr):
    """The gated GEMVs' epilogue (fuser/ops/linear.py, fuser/ops/gemv_stream.py): act(gate) * up
    from an accumulator whose tile columns are HALF gate columns, then the HALF matching up
    columns ([BLOCK_N] at one row, [BLOCK_M, BLOCK_N] else): each half rounded to the output
    dtype as the GEMV's output would be, then exactly as fuser::gated_act."""
    if BLOCK_M == 1:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [2, HALF]), [1, 0]))
    else:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
    return act_times_up(gate.to(out_dtype).to(tl.float32), up.to(out_dtype).to(tl.float32),
                        ACTIVATION, out_dtype)


@triton.jit
def _gated_act_kernel(
    gate_up_ptr,      # gate_up: [rows, 2I], row stride row_stride, column stride 1
    out_ptr,          # out: [rows, I], contiguous, gate_up's dtype
    row_stride,
    I,
    ACTIVATION: tl.constexpr,  # one of ACTIVATIONS
    BLOCK: tl.constexpr,
):
    # Program (row, block): columns [block * BLOCK, (block + 1) * BLOCK) of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_row = gate_up_ptr + row * row_stride
    g = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * I + cols, act_times_up(g, u, ACTIVATION, out_dtype).to(out_dtype),
             mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def gated_act_triton(gate_up: Tensor, activation: str) -> Tensor:
    """gate_up: [..., 2I] -> act(gate) * up: [..., I], contiguous, in gate_up's dtype."""
    _check(gate_up, activation)
    two_i = gate_up.shape[-1]
    I = two_i // 2
    out = torch.empty((*gate_up.shape[:-1], I), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = gate_up.reshape(-1, two_i)                # [rows, 2I], a view when the layout allows
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(BLOCK, triton.next_power_of_2(I))
    grid = (rows.shape[0], triton.cdiv(I, block))    # rows on axis 0: up to 2^31 - 1 of them
    _gated_act_kernel[grid](
        rows, out, rows.stride(0), I,
        ACTIVATION=activation, BLOCK=block,
        num_warps=4 if block >= 512 else 1,  # narrow rows (tiny models): one warp suffices
    )
    return out


def _check(gate_up: Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must end in an even dimension (gate, up), got {tuple(gate_up.shape)}")


# ---------------------------------------------------------------------------------------------
# Custom op: CPU (and any other device) runs the reference, CUDA runs the Triton kernel. The
# output is contiguous on every device, so one fake implementation describes both.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::gated_act", mutates_args=())
def gated_act(gate_up: Tensor, activation: str) -> Tensor:
    return gated_act_reference(gate_up, activation).contiguous()


@gated_act.register_fake
def _gated_act_fake(gate_up: Tensor, activation: str) -> Tensor:
    _check(gate_up, activation)
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)


gated_act.register_kernel("cuda")(gated_act_triton)


# ---------------------------------------------------------------------------------------------
# Reference: exactly Hugging Face's eager MLP, `act_fn(gate) * up` in the input dtype. What the
# CPU path runs and what tests compare against.
# ---------------------------------------------------------------------------------------------


def gated_act_reference(gate_up: Tensor, activation: str) -> Tensor:
    _check(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    return act * up
