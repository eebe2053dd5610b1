"""What `fuser export --format onnx` and `fuser generate --runtime onnxruntime` do (fuser/cli.py
parses their arguments)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fuser.config import FuserConfig
from fuser.onnx.export import MANIFEST, export_engine_dir, export_models
from fuser.onnx.translate import OnnxExportError


def is_onnx_dir(path: str | None) -> bool:
    """Whether `path` is a fuser ONNX export (has its manifest)."""
    return path is not None and (Path(path) / MANIFEST).is_file()


def export(model: str, draft: str | None, out: str, *, precision: str = "auto",
           gamma: int | str = "auto", max_seq_len: int = 2048, overwrite: bool = False) -> dict:
    """Export a model directory (with an optional draft directory) or an engine directory."""
    from fuser.launch import is_engine_dir
    from fuser.pipeline import load_model

    if is_engine_dir(model):
        if draft is not None:
            raise OnnxExportError(f"{model} is an engine directory: its draft is its own "
                                  "(--draft applies to model directories)")
        return export_engine_dir(model, out, overwrite=overwrite,
                                 precision=None if precision == "auto" else precision)
    target, tokenizer = load_model(model, "MODEL")
    draft_model = load_model(draft, "--draft")[0] if draft else None
    config = FuserConfig(precision=precision, gamma=gamma, max_seq_len=max_seq_len)
    return export_models(target, draft_model, out,
                         dtype=config.dtype_for(next(target.parameters()).dtype),
                         max_seq_len=max_seq_len, precision=precision, gamma=gamma,
                         tokenizer=tokenizer, overwrite=overwrite)


def summary(manifest: dict) -> list[str]:
    """One line per exported graph: its onnxruntime fused operators and node count."""
    lines = []
    for role, info in manifest["roles"].items():
        for file, graph in info["graphs"].items():
            ops = graph["ops"]
            fused = ", ".join(f"{op.removeprefix('com.microsoft.')} {n}" for op, n in ops.items()
                              if op.startswith("com.microsoft.") or "Simplified" in op)
            lines.append(f"{role}/{file}.onnx: {sum(ops.values())} nodes; {fused}")
    return lines


@contextmanager
def onnx_engine(model: str, draft: str | None, max_seq_len: int,
                threads: int | None = None) -> Iterator[object]:
    """An Engine over onnxruntime for MODEL_OR_ENGINE: an ONNX export directory is loaded as it
    is; a model or engine directory is exported to a temporary directory first."""
    from fuser.runtime.onnx_steps import load

    threads = threads or torch.get_num_threads()
    if is_onnx_dir(model):
        if draft is not None:
            raise OnnxExportError(f"{model} is an ONNX export: its draft is its own")
        yield load(model, threads=threads)
        return
    with tempfile.TemporaryDirectory(prefix="fuser-onnx-") as scratch:
        # fp32, as fuser's own CPU engines run (the runtime takes fp32 and fp16 exports).
        export(model, draft, scratch, precision="fp32", max_seq_len=max_seq_len, overwrite=True)
        yield load(scratch, threads=threads)
