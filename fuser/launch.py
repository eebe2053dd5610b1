"""Opening an engine from the command line's paths: model directories (or the bundled pair)
built into an engine, and engine directories told apart from model directories. Shared by
`fuser` (fuser/cli.py) and `fuser serve` (fuser/server/cli.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def progress(message: str) -> None:
    """A step line on stderr for long steps (build, save, load, timing)."""
    print(f"fuser: {message}", file=sys.stderr, flush=True)


def is_engine_dir(path: str | None) -> bool:
    """Whether `path` is an engine directory (has a manifest, or the tensor-parallel one of
    rank0/, rank1/, ...) rather than a model directory."""
    from fuser.distributed import TP_MANIFEST
    from fuser.engine_file import MANIFEST

    return path is not None and any((Path(path) / name).is_file()
                                    for name in (MANIFEST, TP_MANIFEST))


def command_line_buckets() -> tuple[int, ...] | str:
    """FuserConfig.batch_buckets for an engine the command line builds (`fuser build`,
    `fuser serve MODEL_DIR`): "auto" on CUDA (every power of two); on the CPU bucket 1 beside
    max_batch_size, which FuserConfig adds: the scheduler (`fuser serve`) prefills through a
    bucket of 1, so an engine directory built with --max-batch-size N serves."""
    return "auto" if torch.cuda.is_available() else (1,)


def load_pair(model: str | None, draft: str | None) -> tuple[torch.nn.Module, torch.nn.Module | None, object | None, str]:
    """(target, draft, tokenizer, description); the bundled pair or a random Llama by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fuser.pipeline import load_model
    from fuser.models import PRESETS, bundled_pair

    if model is None:
        pair = bundled_pair()
        if pair is None:
            torch.manual_seed(0)
            target = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny-random-llama"])).eval()
            return target, None, None, ("a small RANDOM Llama (the bundled trained pair is not "
                                        "installed yet): its text is noise, its numbers are real")
        model, draft = str(pair[0]), str(pair[1])
    target, tokenizer = load_model(model, "MODEL")
    draft_model = load_model(draft, "--draft")[0] if draft else None
    name = Path(model).name + (f" + draft {Path(draft).name}" if draft else "")
    if not torch.cuda.is_available():  # CPU: fp32 (bf16 matmuls are slow there, and fp32 is
        target = target.float()        # where the engine must match Hugging Face exactly)
        draft_model = draft_model.float() if draft_model is not None else None
        name += " (fp32 on CPU)"
    elif target.device.type != "cuda":
        target = target.cuda()
        draft_model = draft_model.cuda() if draft_model is not None else None
    return target.eval(), draft_model, tokenizer, name


def load_sliced(model: str, draft: str | None
                ) -> tuple[torch.nn.Module, torch.nn.Module | None, object | None, str, object]:
    """`load_pair` for a tensor-parallel build from model directory `model`: the target on the
    meta device (each rank reads its own slices of the weights: fuser/rank_model.py), the
    draft whole; -> (target, draft, tokenizer, description, the target's weight source)."""
    from fuser.pipeline import load_meta_model, load_model
    from fuser.rank_model import DirectoryWeights

    target, tokenizer = load_meta_model(model, "MODEL")
    draft_model = load_model(draft, "--draft")[0] if draft else None
    name = Path(model).name + (f" + draft {Path(draft).name}" if draft else "")
    if not torch.cuda.is_available():  # CPU: fp32, as load_pair
        target = target.float()
        draft_model = draft_model.float() if draft_model is not None else None
        name += " (fp32 on CPU)"
    elif draft_model is not None and draft_model.device.type != "cuda":
        draft_model = draft_model.cuda()
    return target, draft_model, tokenizer, name, DirectoryWeights(str(model))


def build_engine_from_args(model: str | None, draft: str | None, config: object) -> tuple[object, dict[str, str], str]:
    """(engine, source paths, description) built from model directories (or the bundled pair).
    With config.tensor_parallel > 1 the target is never loaded whole: each rank reads its own
    slices from the directory."""
    from fuser.models import bundled_pair
    from fuser.pipeline import build_engine

    if model is None and bundled_pair() is not None:
        model, draft = (str(p) for p in bundled_pair())
    for path, argument in ((model, "MODEL"), (draft, "--draft")):
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"{argument}={path!r} is neither a model directory (config.json + "
                             "safetensors) nor an engine directory (manifest.json)")
    progress("loading the Hugging Face models ...")
    weights = None
    if getattr(config, "tensor_parallel", 1) > 1 and model is not None:
        target, draft_model, tokenizer, name, weights = load_sliced(model, draft)
    else:
        target, draft_model, tokenizer, name = load_pair(model, draft)
    progress(f"capturing (torch.export), rewriting (passes) and compiling {name} ...")
    start = time.perf_counter()
    engine = build_engine(target, draft_model, config, tokenizer, weights=weights)
    progress(f"built in {time.perf_counter() - start:.1f} s")
    source = {"target": str(Path(model).resolve())} if model else {}
    if draft:
        source["draft"] = str(Path(draft).resolve())
    return engine, source, name
