"""A tensor-parallel rank holds only its share of the model (fuser/rank_model.py).

In one process: each rank's model is its slices of the weights, whichever the source (an
in-memory model, a model directory's safetensors read slice by slice, random per rank). With
gloo ranks (rank 0 here, rank 1 spawned): an engine built from a model directory at
tensor_parallel=2 holds, on every rank, the sharded weights' half plus the replicated ones
(measured as the bytes of the tensors its steps hold, reported back to rank 0), and decodes
the tensor_parallel=1 engine's greedy tokens (fp32, exact); a model on the meta device is built
per rank from random weights, nothing of it ever whole in one process.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import fuser
from engines import SHAPE, TP_CONFIG, llama_target, one_rank_engine
from fuser.distributed import rank_held_bytes
from fuser.pipeline import is_meta
from fuser.rank_model import (DirectoryWeights, ModuleWeights, RandomWeights, rank_model,
                              split_dim)
from tiny import FAMILIES, tiny_config, tiny_model

pytestmark = pytest.mark.xdist_group("tensor_parallel_engine")

CONFIG = TP_CONFIG
CPU = torch.device("cpu")


def _sharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters split over the ranks (a tied head counted as the embedding's
    slice: the rank's head is a tensor of its own)."""
    names = dict(model.named_parameters(remove_duplicate=False))
    if "lm_head.weight" not in names:
        names["lm_head.weight"] = model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for n, p in names.items()
               if split_dim(n) is not None)


@pytest.mark.parametrize("family, options", [("llama", {}), ("qwen2", {"tie": True}),
                                             ("mistral", {"sliding_window": 4})])
def test_rank_models_are_the_slices(tmp_path: Path, family: str,
                                    options: dict[str, object]) -> None:
    """Each rank's parameters are its chunk of the full model's (dim 0 for q/k/v, gate/up and
    the head, dim 1 for o/down, the rest whole), the same read from the saved directory (whose
    reads are each the rank's slice, never a whole sharded tensor) as from the module."""
    model = tiny_model(family, seed=0, heads=4, kv_heads=2, intermediate=72, **options)
    model.save_pretrained(tmp_path)
    full = dict(model.named_parameters(remove_duplicate=False))
    full.setdefault("lm_head.weight", model.get_output_embeddings().weight)
    ws, parts = 2, {}
    for rank in range(ws):
        reads = []
        source = DirectoryWeights(str(tmp_path))
        from_module = rank_model(type(model), model.config, ModuleWeights(model), rank, ws,
                                 torch.float32, CPU)
        with pytest.MonkeyPatch.context() as mp:
            import fuser.rank_model as rm

            copy_in = rm._copy_in
            mp.setattr(rm, "_copy_in", lambda p, v, name: (reads.append((name, v.numel())),
                                                          copy_in(p, v, name)))
            from_dir = rank_model(type(model), model.config, source, rank, ws, torch.float32,
                                  CPU)
        params = dict(from_dir.named_parameters())
        assert reads == [(name, p.numel()) for name, p in params.items()]
        for name, p in from_module.named_parameters():
            assert torch.equal(p, params[name]), name
            parts.setdefault(name, []).append(p)
        assert from_dir.config.num_key_value_heads == 1
        assert torch.equal(from_dir.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert set(parts) == set(full)
    for name, pieces in parts.items():
        dim = split_dim(name)
        whole = full[name]
        assert torch.equal(whole, pieces[0] if dim is None else torch.cat(pieces, dim)), name
        if dim is None:
            assert torch.equal(pieces[0], pieces[1])


def test_a_directory_without_a_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama", seed=0)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no tensor model\.layers\.1\.mlp\.down_proj"):
        rank_model(type(model), model.config, DirectoryWeights(str(tmp_path)), 0, 2,
                   torch.float32, CPU)


def test_random_weights_are_hugging_face_init_per_rank() -> None:
    """RandomWeights: norms 1, linears of std initializer_range, a different draw per rank."""
    config = tiny_config("llama", init_range=0.3, intermediate=256)
    ranks = [rank_model(FAMILIES["llama"][1], config, RandomWeights(seed=5), r, 2,
                        torch.float32, CPU) for r in range(2)]
    for model in ranks:
        assert torch.equal(model.model.norm.weight, torch.ones(config.hidden_size))
        assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.3) < 0.02
    up = [m.model.layers[0].mlp.up_proj.weight for m in ranks]
    assert not torch.equal(*up)


def test_a_model_directory_loads_sliced(tmp_path: Path) -> None:
    """fuser.optimize(DIR, tensor_parallel=2): rank 0's model is on the meta device, each
    rank's steps hold exactly the tensor_parallel=1 engine's bytes less half the sharded
    weights, and greedy tokens (and logits within 1e-5) equal tensor_parallel=1's."""
    target = llama_target()
    target.save_pretrained(tmp_path / "model")
    single = one_rank_engine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = fuser.optimize(tmp_path / "model", None,
                                  fuser.FuserConfig(**CONFIG, tensor_parallel=2))
    try:
        assert is_meta(parallel.user_target)
        (whole,) = rank_held_bytes(single)
        sharded = _sharded_bytes(target)
        assert sharded > whole // 2  # most of the model is split
        assert rank_held_bytes(parallel) == [whole - sharded // 2] * 2
        ids = torch.randint(3, SHAPE["vocab"], (2, 9),
                            generator=torch.Generator().manual_seed(1))
        assert torch.equal(parallel.generate(ids, 16), single.generate(ids, 16))
        torch.testing.assert_close(parallel.logits(ids), single.logits(ids), atol=1e-5,
                                   rtol=1e-5)
    finally:
        parallel.close()


def test_a_meta_model_is_built_per_rank_from_random_weights() -> None:
    """A target on the meta device (a 70B shape's path, tiny here): every rank makes its own
    share at random, holding what a sliced load holds; tensor_parallel=1 refuses it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fuser.models import PRESETS

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny-random-llama"])).eval()
    config = dict(CONFIG, batch_buckets=(1,), max_batch_size=1)
    with pytest.raises(ValueError, match="meta device: only a tensor-parallel build"):
        fuser.optimize(model, None, fuser.FuserConfig(**config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(model, None, fuser.FuserConfig(**config, tensor_parallel=2))
    try:
        weights = sum(p.numel() * 4 for p in model.parameters())
        rotary = 2 * model.model.rotary_emb.inv_freq.numel() * 4
        held = rank_held_bytes(engine)
        assert held == [weights - _sharded_bytes(model) // 2 + rotary] * 2
        out = engine.generate(torch.tensor([[5, 6, 7]]), 6)
        assert out.shape == (1, 9) and int(out.max()) < model.config.vocab_size
    finally:
        engine.close()


def test_fuser_build_writes_a_tensor_parallel_engine(tmp_path: Path) -> None:
    """`fuser build MODEL --tensor-parallel-size 2 --out OUT` (the target never loaded whole)
    writes rank0/, rank1/ and tensor_parallel.json, each rank's weights its share; fuser.load
    then decodes tensor_parallel=1's greedy tokens."""
    import json

    from fuser.cli import main
    from fuser.distributed import TP_MANIFEST

    target = llama_target()
    target.save_pretrained(tmp_path / "model")
    out = tmp_path / "engine"
    assert main(["build", str(tmp_path / "model"), "--tensor-parallel-size", "2",
                 "--max-seq-len", "64", "--out", str(out),
                 "--threads", str(torch.get_num_threads())]) == 0
    assert json.loads((out / TP_MANIFEST).read_text())["world_size"] == 2
    sizes = [(out / f"rank{r}" / "target" / "weights.safetensors").stat().st_size
             for r in range(2)]
    whole = sum(p.numel() * 4 for p in target.parameters())
    assert sizes[0] == sizes[1] and sizes[0] < whole - _sharded_bytes(target) // 3
    single = one_rank_engine()
    loaded = fuser.load(out)
    try:
        assert loaded.tensor_parallel is not None
        ids = torch.randint(3, SHAPE["vocab"], (1, 7),
                            generator=torch.Generator().manual_seed(2))
        assert torch.equal(loaded.generate(ids, 16), single.generate(ids, 16))
    finally:
        loaded.close()
