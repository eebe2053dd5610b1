"""FuserConfig: every knob of `fuser.optimize`, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["auto", "fp32", "bf16", "fp16", "fp8"]
CompileMode = Literal["auto", "inductor", "fx"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's own dtype
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": None,  # FP8 weights; activations in the model's own dtype
}
MAX_GAMMA = 15
AUTO_GAMMA = 4  # what "auto" means until adaptive draft length exists


@dataclass(frozen=True)
class FuserConfig:
    """How `fuser.optimize` builds an engine.

    Attributes:
        precision: "auto" (the model's own dtype), "fp32", "bf16", "fp16", or "fp8": every
            linear reads float8 e4m3fn weights with per-output-channel scales computed once from
            the model's weights (passes/fp8.py); activations stay in the model's dtype (decode)
            or are quantized per token (prefill); embeddings and norms are not quantized.
        gamma: draft tokens per speculative step, 0..15, or "auto" (4 for now); 0 = no speculation.
        max_batch_size: most sequences per call.
        max_seq_len: most tokens per sequence, prompt plus generated. The KV cache keeps
            gamma + 1 slots of headroom beyond this itself.
        cuda_graphs: capture decode steps in CUDA graphs (ignored on CPU).
        device: where the engine runs; default is the target model's device.
        compile: "fx" runs the rewritten FX graph as is, "inductor" compiles it with Inductor,
            "auto" picks Inductor on CUDA and "fx" on CPU (where it is a correctness target).
        dump_graphs: a directory to write every graph before and after every pass (also set by
            the FUSER_DUMP_GRAPHS environment variable).
        fused_attention: decode and verification steps attend through the split-K Triton op
            `fuser::cache_attention_read` (validated and timed on an H200: benchmarks/RESULTS.md)
            instead of ATen ops over every cache slot. False keeps the ATen path (its CPU path
            is the same math either way).
        fp8_lm_head: with precision="fp8", quantize the LM head too (False keeps it in the
            model's dtype).
    """

    precision: Precision = "auto"
    gamma: int | Literal["auto"] = "auto"
    max_batch_size: int = 1
    max_seq_len: int = 2048
    cuda_graphs: bool = True
    device: str | torch.device | None = None
    compile: CompileMode = "auto"
    dump_graphs: str | None = None
    fused_attention: bool = True
    fp8_lm_head: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not one of {sorted(PRECISIONS)}"
            )
        if not isinstance(self.fp8_lm_head, bool):
            raise ValueError(f"fp8_lm_head={self.fp8_lm_head!r} must be True or False")
        if self.gamma != "auto":
            if isinstance(self.gamma, bool) or not isinstance(self.gamma, int):
                raise ValueError(f"gamma={self.gamma!r} must be an int in 0..{MAX_GAMMA} or 'auto'")
            if not 0 <= self.gamma <= MAX_GAMMA:
                raise ValueError(f"gamma={self.gamma} is outside 0..{MAX_GAMMA}")
        _check_positive_int("max_batch_size", self.max_batch_size)
        _check_positive_int("max_seq_len", self.max_seq_len)
        if self.compile not in ("auto", "inductor", "fx"):
            raise ValueError(f"compile={self.compile!r} is not one of 'auto', 'inductor', 'fx'")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device={self.device!r} is not a torch device: {e}") from None

    @property
    def resolved_gamma(self) -> int:
        """The draft length the engine uses now."""
        return AUTO_GAMMA if self.gamma == "auto" else int(self.gamma)

    def dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the engine computes in, for a model whose parameters are `model_dtype`."""
        return PRECISIONS[self.precision] or model_dtype


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
