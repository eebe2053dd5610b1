"""Compile recorded _linear_kernel launches for sm_90 without a GPU (tests/test_sm90_compile.py).

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every CPU test
and still fail to compile for the GPU (for example a helper returning a tensor in one constexpr
branch and a float in the other, which the interpreter accepts). Run as a
script on a JSON of launches (argument kinds and constexprs, recorded under the interpreter),
without TRITON_INTERPRET: each launch is compiled with the GPU's constexprs (FP32_DOTS and
EMULATE_CAST off) and reported as "ok" or "FAILED <error>"; "SKIP <why>" when this Triton cannot
compile for CUDA here at all.
"""

from __future__ import annotations

import json
import sys

DTYPES = {"torch.bfloat16": "*bf16", "torch.float32": "*fp32", "torch.float8_e4m3fn": "*fp8e4nv",
          "torch.int32": "*i32", "torch.float16": "*fp16"}
GPU_CONSTEXPRS = {"FP32_DOTS": False, "EMULATE_CAST": False}


def record_launches(kernel_owner, name: str, run, kernel_id: str | None = None,
                    run_kernels: bool = True) -> list[dict]:
    """Run `run()` with `kernel_owner.<name>` wrapped so that each launch's argument kinds and
    keyword arguments are recorded (the launch itself still runs, unless run_kernels is False).
    kernel_id: "module:name" of the kernel's definition (default: kernel_owner's module and
    name)."""
    import torch

    real = getattr(kernel_owner, name)
    records: list[dict] = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kinds = [["ptr", str(a.dtype)] if isinstance(a, torch.Tensor) else
                         ["fp32", a] if isinstance(a, float) else ["int", int(a)] for a in args]
                keywords = {k: ["ptr", str(v.dtype)] if isinstance(v, torch.Tensor) else v
                            for k, v in kwargs.items()}
                records.append({"kernel": kernel_id or f"{kernel_owner.__name__}:{name}",
                                "args": kinds, "kwargs": keywords})
                return real[grid](*args, **kwargs) if run_kernels else None
            return launch

    setattr(kernel_owner, name, Spy())
    try:
        run()
    finally:
        setattr(kernel_owner, name, real)
    return records


def compile_sm90(record: dict):
    """Triton's compiled kernel (asm: ptx, cubin) of one recorded launch for sm_90, with the
    GPU's constexprs (GPU_CONSTEXPRS). Raises triton's CompilationError where the compiler
    refuses it, another error where this Triton has no CUDA backend tools."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module, name = record["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    params = {p.name: p for p in kernel.params}
    signature, constexprs, options = {}, {}, {}
    for arg, (kind, value) in zip(kernel.arg_names, record["args"]):
        signature[arg] = DTYPES[value] if kind == "ptr" else "fp32" if kind == "fp32" else "i32"
    for key, value in record["kwargs"].items():
        if key in ("num_warps", "num_stages"):
            options[key] = value
        elif isinstance(value, list) and value and value[0] == "ptr":
            signature[key] = DTYPES[value[1]]
        elif key != "launch_pdl":
            signature[key], constexprs[key] = "constexpr", value
    for arg in kernel.arg_names:
        if arg not in signature:
            signature[arg], constexprs[arg] = "constexpr", params[arg].default
    constexprs.update({k: v for k, v in GPU_CONSTEXPRS.items() if k in signature})
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main(path: str) -> None:
    import triton

    for i, record in enumerate(json.load(open(path))):
        try:
            compile_sm90(record)
        except triton.compiler.errors.CompilationError as error:
            print(f"{i} FAILED {str(error)[-800:]}".replace("\n", " | "))
            continue
        except Exception as error:  # noqa: BLE001  (no CUDA backend tools here)
            print(f"SKIP {type(error).__name__}: {error}".replace("\n", " "))
            return
        print(f"{i} ok")


if __name__ == "__main__":
    main(sys.argv[1])
