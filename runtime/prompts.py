"""Checking and laying out a batch of prompts: left padding becomes per-row start slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prompts:
    """A batch of prompts laid out for the engine's cache.

    Attributes:
        tokens: [B, T] int64 on the engine's device (padding slots hold token 0).
        starts: [B] int64, left-padding count per row (first real slot).
        batch: B, the caller's rows (the engine may pad up to its fixed batch).
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    batch: int

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def positions(self) -> torch.Tensor:
        """[B, T] rotary positions: 0 at each row's first real token (as Hugging Face counts)."""
        T = self.tokens.shape[1]
        index = torch.arange(T, device=self.tokens.device)[None]  # [1, T]
        return (index - self.starts[:, None]).clamp(min=0)


def check_prompts(input_ids: object, attention_mask: object, *, vocab_size: int,
                  max_batch_size: int, max_tokens: int, device: torch.device) -> Prompts:
    """Validate `input_ids`/`attention_mask` as API.md states them; ValueError names the argument.

    Rows shorter than the longest are left-padded and marked with 0 in attention_mask.
    max_tokens: the most prompt tokens a row may have.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, tokens], got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): give at least one token")
    if B > max_batch_size:
        raise ValueError(f"input_ids has batch {B}, above max_batch_size={max_batch_size} "
                         "(set FuserConfig(max_batch_size=...))")
    if T > max_tokens:
        raise ValueError(f"input_ids has {T} tokens, above the {max_tokens} this engine allows "
                         "(max_seq_len)")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids holds ids outside [0, {vocab_size}): min {lo}, max {hi}")

    if attention_mask is None:
        starts = torch.zeros(B, dtype=torch.long)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError("attention_mask must be a torch.Tensor")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                             f"input_ids {(B, T)}: they must match")
        mask = attention_mask.to("cpu", torch.long)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        starts = (mask == 0).sum(dim=1)
        # left padding: every row is zeros then ones
        expected = torch.arange(T)[None] >= starts[:, None]
        if not bool((expected.long() == mask).all()):
            raise ValueError("attention_mask must mark left padding (zeros, then ones in every "
                             "row); right padding is not supported")
        if bool((starts == T).any()):
            raise ValueError("attention_mask has a row with no tokens: every prompt needs at least one")
    tokens = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is not None:
        pad = torch.arange(T, device=device)[None] < starts.to(device)[:, None]
        tokens = tokens.masked_fill(pad, 0)
    return Prompts(tokens=tokens, starts=starts.to(device), batch=B)


def pad_batch(prompts: Prompts, batch: int, min_length: int = 1) -> Prompts:
    """Pad rows up to `batch` (dummy rows of token 0) and tokens on the right up to `min_length`.

    Right padding only adds slots past a row's end: they are written, then overwritten.
    """
    tokens, starts = prompts.tokens, prompts.starts
    B, T = tokens.shape
    if T < min_length:
        tokens = torch.nn.functional.pad(tokens, (0, min_length - T))
    if B < batch:
        tokens = torch.cat([tokens, tokens.new_zeros(batch - B, tokens.shape[1])])
        starts = torch.cat([starts, starts.new_zeros(batch - B)])
    return Prompts(tokens=tokens, starts=starts, batch=prompts.batch)
