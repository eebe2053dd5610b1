"""The decoding runtime: KV cache, prompts, sampling and the speculative step."""
