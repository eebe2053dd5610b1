"""Tiny random stand-ins for benchmarks' `--dry-run` on CPU: the plumbing, not the numbers."""

from __future__ import annotations

import copy

import torch
import transformers


def tiny_pair(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.Tensor]]:
    """(target, draft = the target with 20% weight noise, two prompts [1, 8] and [1, 5])."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = transformers.LlamaForCausalLM(config).eval().to(device)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_((torch.randn(p.shape, generator=generator) * 0.2 * p.std()).to(device))
    prompts = [torch.randint(3, 160, (1, t), generator=generator).to(device) for t in (8, 5)]
    return target, draft, prompts
