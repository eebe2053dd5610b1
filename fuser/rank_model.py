"""One rank's share of a tensor-parallel model, built without the whole model in memory.

A rank of a tensor-parallel engine (fuser/distributed.py) holds only its slices of the sharded
weights (Megatron's layout, passes/tensor_parallel.py) and the replicated ones. It builds them
as a Hugging Face model of the same class at the per-rank counts (`rank_config`):

    q/k/v_proj, gate/up_proj   column slices: output rows [r*n/ws, (r+1)*n/ws) (and the bias's)
    o_proj, down_proj          row slices: input columns [r*n/ws, ...) (a bias whole: the step
                               adds it once, after the all-reduce)
    lm_head                    vocab rows [r*V/ws, ...) (tied embeddings: the embedding's rows)
    embedding, norms, rotary   whole

so that its step graph is the sharded one but for the collectives, which
`passes/tensor_parallel.py` `add_collectives` inserts. The model is made on the meta device
(no memory), given storage on the rank's device (`to_empty`: exactly the rank's share), and
then filled from a `WeightSource`, one tensor at a time:

- `ModuleWeights`: an in-memory model (the user's; the followers receive it by shared memory
  or CUDA IPC, never copied whole to another device);
- `DirectoryWeights`: a Hugging Face model directory; each slice is read from the safetensors
  files alone (`safe_open(...).get_slice(name)[rows]`), so a rank's peak memory is its share
  plus one tensor's slice;
- `RandomWeights`: Hugging Face's own random initialisation, made on the rank's device, for
  shapes that fit no single device (benchmarks of a 70B shape).

The rotary tables (buffers, not weights) are recomputed from the config on the rank's device.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Parameter-name suffixes (module paths) of the sharded linears.
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
          "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def split_dim(name: str) -> int | None:
    """The dim along which parameter `name` is split over the ranks (None: replicated)."""
    module, _, kind = name.rpartition(".")
    if module.endswith(COLUMN):
        return 0
    if module.endswith(ROW) and kind == "weight":
        return 1
    if name == LM_HEAD:
        return 0
    return None


def rank_config(config: object, world_size: int) -> object:
    """`config` at one rank's counts: heads, KV heads and intermediate size / world_size, the
    head dim kept, embeddings untied (the rank's head is its own vocab slice)."""
    from fuser.capture import model_geometry

    _, kv_heads, head_dim = model_geometry(config)
    out = copy.deepcopy(config)
    out.num_attention_heads = config.num_attention_heads // world_size
    out.num_key_value_heads = kv_heads // world_size
    out.intermediate_size = config.intermediate_size // world_size
    out.head_dim = head_dim
    out.tie_word_embeddings = False
    return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype `dtype` for the duration: the parameters a model makes take it,
    the buffers it makes in float32 on purpose (rotary tables) keep theirs."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class WeightSource:
    """Where a rank's weights come from: `fill` writes them into the rank's model."""

    def fill(self, model: nn.Module, rank: int, world_size: int) -> None:
        raise NotImplementedError


def _piece(tensor: torch.Tensor, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s chunk of `tensor` along `dim` (a view), or all of it (dim None)."""
    if dim is None:
        return tensor
    n = tensor.shape[dim] // world_size
    return tensor.narrow(dim, rank * n, n)


def _copy_in(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """param <- value (converted to its dtype and device), after checking the shapes agree."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"tensor parallel: weight {name} has shape {list(value.shape)} for this "
                         f"rank, expected {list(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


@dataclass
class ModuleWeights(WeightSource):
    """The weights of an in-memory causal LM (sliced where they are, copied slice by slice)."""

    model: nn.Module

    def fill(self, model: nn.Module, rank: int, world_size: int) -> None:
        full = dict(self.model.named_parameters(remove_duplicate=False))
        for name, param in model.named_parameters():
            source = full.get(name)
            if source is None and name == LM_HEAD:  # tied: the embedding is the head
                source = full.get(EMBEDDING)
            if source is None:
                raise ValueError(f"tensor parallel: the model has no parameter {name}")
            _copy_in(param, _piece(source.detach(), split_dim(name), rank, world_size), name)


@dataclass
class DirectoryWeights(WeightSource):
    """The safetensors weights of a Hugging Face model directory, each rank reading only its
    slices (`safe_open(...).get_slice`)."""

    path: str

    def files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        from safetensors import safe_open

        root = Path(self.path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: root / file for name, file in weight_map.items()}
        out = {}
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                out.update({name: file for name in f.keys()})
        if not out:
            raise ValueError(f"tensor parallel: {root} has no safetensors weights")
        return out

    def fill(self, model: nn.Module, rank: int, world_size: int) -> None:
        from safetensors import safe_open

        files = self.files()
        with contextlib.ExitStack() as stack:
            opened: dict[Path, object] = {}
            for name, param in model.named_parameters():
                stored = name if name in files or name != LM_HEAD else EMBEDDING
                if stored not in files:
                    raise ValueError(f"tensor parallel: {self.path} has no tensor {name}")
                file = files[stored]
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                part = opened[file].get_slice(stored)
                dim = split_dim(name)
                if dim is None:
                    value = part[:]
                else:
                    n = part.get_shape()[dim] // world_size
                    rows = slice(rank * n, (rank + 1) * n)
                    value = part[rows] if dim == 0 else part[:, rows]
                _copy_in(param, value, name)
                del value


@dataclass
class RandomWeights(WeightSource):
    """Hugging Face's random initialisation of the rank's share, on its device (seed + rank)."""

    seed: int = 0

    def fill(self, model: nn.Module, rank: int, world_size: int) -> None:
        device = next(model.parameters()).device
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # the caller's generators left as they were
            torch.manual_seed(self.seed + rank)  # (seeds the device's generator too)
            model.init_weights()


def rank_model(model_class: type, config: object, source: WeightSource, rank: int,
               world_size: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Rank `rank`'s share of a `model_class` (a transformers causal LM) of `config`, on
    `device` in `dtype`, its weights from `source`: a model of that class at `rank_config`'s
    counts with a vocab slice as its head. Holds only the rank's share."""
    shard = rank_config(config, world_size)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(shard)
        head = model.get_output_embeddings()
        model.set_output_embeddings(nn.Linear(head.in_features,
                                              config.vocab_size // world_size, bias=False))
    model.to_empty(device=device)
    for module in model.modules():  # the rotary tables, from the config (float32, as built)
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "inv_freq"):
            model._init_weights(module)
    source.fill(model, rank, world_size)
    return model.requires_grad_(False).eval()


def resident_bytes(tensors: Iterable[torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by several counts
    once), leaving out those of `exclude` (a KV cache)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
