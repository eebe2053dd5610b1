"""Bundled models and model shapes.

- `TARGET_PATH`, `DRAFT_PATH`: the small real target/draft pair trained by `models/train.py`
  (Hugging Face model directories, loadable offline); `HELDOUT_SAMPLE`: held-out text shipped
  with them. `bundled_pair()` returns the two paths, or None where they are not present.
- `PRESETS`: real model shapes (for benchmarks with random weights).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_PATH = HERE / "fuser-code-target"
DRAFT_PATH = HERE / "fuser-code-draft"
HELDOUT_SAMPLE = HERE / "heldout_sample.txt"


def bundled_pair() -> tuple[Path, Path] | None:
    """(target, draft) directories of the bundled pair, or None if they are not installed."""
    if (TARGET_PATH / "config.json").is_file() and (DRAFT_PATH / "config.json").is_file():
        return TARGET_PATH, DRAFT_PATH
    return None


# transformers LlamaConfig keyword arguments for real shapes.
PRESETS: dict[str, dict[str, object]] = {
    "llama-3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # Llama-3.1-8B: the same shape and llama3 rope scaling, for 128K-token contexts.
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # Llama-3-70B: 140 GB in bf16, more than one GPU holds (tensor-parallel benchmarks).
    "llama-3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # What the demo runs until the bundled pair is present: a small random Llama.
    "tiny-random-llama": dict(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=1024, tie_word_embeddings=False,
    ),
}
