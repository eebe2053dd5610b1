"""ONNX export of fuser's step graphs, with onnxruntime's fused operators, and the onnxruntime
runtime that drives them through fuser's own decoding loop (needs `pip install 'fuser[onnx]'`).

    fuser.onnx.export_models(target, draft, out)   # or engine.export_onnx(out)
    engine = fuser.onnx.load(out)                  # an Engine over onnxruntime sessions
"""

from fuser.onnx.translate import OnnxExportError

__all__ = ["OnnxExportError", "export_engine", "export_models", "load"]


def __getattr__(name: str) -> object:
    if name in ("export_engine", "export_models"):
        from fuser.onnx import export

        return getattr(export, name)
    if name == "load":
        from fuser.runtime.onnx_steps import load

        return load
    raise AttributeError(name)
