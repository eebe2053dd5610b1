"""Engine files: rewritten step graphs, their weights and a manifest, saved to and loaded from a
directory without running capture, the passes or code generation again.

Layout of an engine directory (every file is listed in the manifest with its size and hash):

    manifest.json                      versions, device, config, pass list + source hash, files
    <model>/weights.safetensors        every tensor the model's graphs read, each storage once
    <model>/graphs/<graph>.json        the FX graph, node by node (what load rebuilds)
    <model>/graphs/<graph>.py          the same graph as Python, for reading only (never executed)
    <extra files>                      tokenizer, generation config, compiled code ...

A graph is stored as data, not as code: loading builds an `fx.Graph` node by node and resolves
call targets only among `torch.ops.*` overloads and a few pure Python modules (`operator`,
`math`), so opening an engine never executes code from the directory. Tensors named in
`runtime_buffers` (the KV cache) are not saved: the loader attaches tensors the caller
allocated (or fresh zeros of the recorded shape), the same objects to every graph of a model, as
the graphs write them in place.

`save_engine` writes into a temporary sibling directory and renames it into place at the end,
so a reader never sees a half-written engine. `load_engine` refuses (`EngineFileError`, a
ValueError) a missing or altered file and any difference in the environment the engine was
built for, naming what differs; it never falls back to rebuilding.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from fuser.weight_reader import HASH_CHUNK, PHASES, digest_of_chunks, read_files

FORMAT = "fuser-engine"
FORMAT_VERSION = 2  # 2: every batch bucket's graphs, compiled code per graph
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
# Python modules whose functions a stored graph may call (besides torch.ops overloads).
SAFE_MODULES = ("operator", "_operator", "math")
CHUNK = HASH_CHUNK  # hashing unit: files are hashed as parallel 64 MiB chunks


class EngineFileError(ValueError):
    """An engine directory that cannot be loaded here: missing, altered, or built elsewhere."""


# ---------------------------------------------------------------------------------------------
# Graphs as JSON: one record per node
# ---------------------------------------------------------------------------------------------


def target_name(target: Any) -> str:
    """A call target as a string load can resolve: "aten::view.default", "operator.getitem"."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None)
    if module in SAFE_MODULES and name and getattr(importlib.import_module(module), name, None) is target:
        return f"{module}.{name}"
    raise EngineFileError(f"cannot store a graph that calls {target!r}: only torch.ops overloads "
                          f"and functions of {SAFE_MODULES} can be saved")


def resolve_target(name: str) -> Any:
    """The callable `target_name` described; refuses anything outside the allowed set."""
    if "::" in name:  # "namespace::op.overload"
        namespace, rest = name.split("::", 1)
        op, _, overload = rest.partition(".")
        try:
            return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
        except (AttributeError, RuntimeError):
            raise EngineFileError(f"the engine's graphs call {name}, which is not a registered "
                                  "op here (is the package that defines it imported?)") from None
    module, _, attr = name.rpartition(".")
    if module not in SAFE_MODULES or not hasattr(importlib.import_module(module), attr):
        raise EngineFileError(f"the engine's graphs call {name!r}, which load does not allow")
    return getattr(importlib.import_module(module), attr)


def encode_arg(value: Any) -> Any:
    """A node argument as JSON. Floats are tagged (keeps 1.0 apart from 1, and inf/nan)."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [encode_arg(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {k: encode_arg(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}  # the index is the load device's (see decode_arg)
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"enum": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [encode_arg(value.start), encode_arg(value.stop), encode_arg(value.step)]}
    raise EngineFileError(f"cannot store a graph argument of type {type(value).__name__}: {value!r}")


def decode_arg(value: Any, nodes: Mapping[str, fx.Node], device: torch.device) -> Any:
    """Inverse of `encode_arg`; devices of the saved type become `device`."""
    if not isinstance(value, dict):
        return value
    (kind, data), = value.items()
    if kind == "node":
        return nodes[data]
    if kind == "float":
        return float(data)
    if kind in ("list", "tuple"):
        items = [decode_arg(v, nodes, device) for v in data]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: decode_arg(v, nodes, device) for k, v in data.items()}
    if kind == "dtype":
        return getattr(torch, data)
    if kind == "device":
        return device if device.type == data else torch.device(data)
    if kind == "enum":
        return getattr(torch, data)
    if kind == "slice":
        return slice(*(decode_arg(v, nodes, device) for v in data))
    raise EngineFileError(f"unknown argument kind {kind!r} in a stored graph")


def codegen_to_json(graph: fx.Graph) -> dict[str, Any]:
    """How the graph's forward takes and returns values (plain, or pytree specs from export)."""
    codegen = graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        info = codegen.pytree_info
        return {"kind": "pytree", "orig_args": list(info.orig_args),
                "in_spec": pytree.treespec_dumps(info.in_spec) if info.in_spec else None,
                "out_spec": pytree.treespec_dumps(info.out_spec) if info.out_spec else None}
    if type(codegen) is not fx.graph.CodeGen:
        raise EngineFileError(f"cannot store a graph with code generator {type(codegen).__name__}")
    return {"kind": "plain"}


def codegen_from_json(data: Mapping[str, Any]) -> fx.graph.CodeGen:
    """Inverse of `codegen_to_json`."""
    if data["kind"] == "plain":
        return fx.graph.CodeGen()
    load = pytree.treespec_loads
    return fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(
        data["orig_args"], load(data["in_spec"]) if data["in_spec"] else None,
        load(data["out_spec"]) if data["out_spec"] else None))


def graph_to_json(graph: fx.Graph) -> dict[str, Any]:
    """`graph` as a JSON-able dict: its nodes in order, and its calling convention."""
    nodes = []
    for node in graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            continue  # export's input-shape guard (ep.module()): the engine owns input shapes
        if node.op in ("call_module", "call_method"):
            raise EngineFileError(f"cannot store node {node.name}: {node.op} nodes are not supported")
        target = target_name(node.target) if node.op == "call_function" else node.target
        nodes.append({"op": node.op, "name": node.name, "target": target,
                      "args": encode_arg(tuple(node.args)), "kwargs": encode_arg(dict(node.kwargs))})
    return {"nodes": nodes, "codegen": codegen_to_json(graph)}


def graph_from_json(data: Mapping[str, Any], device: torch.device) -> fx.Graph:
    """Rebuild the `fx.Graph` that `graph_to_json` stored (no tracing, no code execution)."""
    graph = fx.Graph()
    graph._codegen = codegen_from_json(data["codegen"])
    nodes: dict[str, fx.Node] = {}
    for record in data["nodes"]:
        target = record["target"]
        if record["op"] == "call_function":
            target = resolve_target(target)
        node = graph.create_node(record["op"], target,
                                 decode_arg(record["args"], nodes, device),
                                 decode_arg(record["kwargs"], nodes, device), name=record["name"])
        if node.name != record["name"]:
            raise EngineFileError(f"stored graph has a clashing node name {record['name']!r}")
        nodes[node.name] = node
    graph.lint()
    return graph


# ---------------------------------------------------------------------------------------------
# Weights: every storage once, each named tensor a view into one of them
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """A named tensor as a view of a stored base tensor (offset in elements)."""

    base: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "offset": self.offset, "shape": list(self.shape),
                "stride": list(self.stride)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> View:
        return View(data["base"], int(data["offset"]), tuple(data["shape"]), tuple(data["stride"]))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element offsets of `t` within its storage."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset(), last + 1


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
    """(bases to save, view of every name): tensors sharing a storage are saved once.

    A group whose storage span is exactly one contiguous tensor is saved under that tensor's
    name and shape (the common case: readable by any safetensors tool); otherwise the span is
    saved flat under the group's first name.
    """
    groups: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        key = (t.device, t.dtype, t.untyped_storage().data_ptr())
        groups.setdefault(key, []).append(name)
    bases: dict[str, torch.Tensor] = {}
    views: dict[str, View] = {}
    for names in groups.values():
        start = min(_span(tensors[n])[0] for n in names)
        end = max(_span(tensors[n])[1] for n in names)
        whole = [n for n in names if tensors[n].is_contiguous() and _span(tensors[n]) == (start, end)]
        base_name = whole[0] if whole else names[0]
        t0 = tensors[base_name].detach()
        base = t0 if whole else t0.as_strided((end - start,), (1,), start)
        bases[base_name] = base.contiguous()
        for n in names:
            t = tensors[n]
            views[n] = View(base_name, t.storage_offset() - start, tuple(t.shape), tuple(t.stride()))
    return bases, views


def unpack_tensors(bases: Mapping[str, torch.Tensor], views: Mapping[str, View]) -> dict[str, torch.Tensor]:
    """Inverse of `pack_tensors`: every name as a view into its loaded base."""
    out = {}
    for name, v in views.items():
        base = bases[v.base]
        out[name] = base.as_strided(v.shape, v.stride, base.storage_offset() + v.offset)
    return out


def graph_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor `gm`'s graph reads through get_attr, by target."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise EngineFileError(f"cannot store get_attr {node.target}: a {type(value).__name__}, "
                                      "not a tensor")
            out[node.target] = value
    return out


def _attr(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


# ---------------------------------------------------------------------------------------------
# Manifest: environment, sources, files
# ---------------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    """The installed version of `module`; from package metadata where the module is not
    imported yet (importing transformers only to read its version costs seconds), or not yet
    far enough to have a `__version__` (a load imports transformers on another thread while
    it checks the environment: fuser/engine_io.py)."""
    version = getattr(sys.modules.get(module), "__version__", None)
    if version is not None:
        return version
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_driver() -> str | None:
    """The NVIDIA kernel driver's version ("550.54.15"), None where it cannot be read: the
    Triton binaries an engine keeps were compiled by a toolchain this driver must accept."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = [w for w in first.split() if w.count(".") >= 1 and w.replace(".", "").isdigit()]
    return words[0] if words else first.strip()


def environment(device: torch.device) -> dict[str, Any]:
    """What an engine built on `device` depends on: versions, device type, GPU, its cc and
    driver (the kernel binaries in the engine directory are for these)."""
    env: dict[str, Any] = {
        # fuser's own version: read from the imported package (this module is part of it)
        "fuser": _version("fuser"), "torch": torch.__version__, "triton": _version("triton"),
        "transformers": _version("transformers"), "python": platform.python_version(),
        "device_type": device.type, "gpu_name": None, "compute_capability": None,
        "gpu_driver": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["gpu_driver"] = gpu_driver()
    return env


def source_dirs() -> list[Path]:
    """The directories whose sources decide what a build produces: the passes and the ops."""
    import fuser.ops
    import fuser.passes

    return [Path(fuser.passes.__file__).parent, Path(fuser.ops.__file__).parent]


def source_hash(directories: Iterable[Path]) -> str:
    """sha256 over every .py file under `directories` (relative name and bytes, sorted)."""
    digest = hashlib.sha256()
    for directory in directories:
        for path in sorted(Path(directory).rglob("*.py")):
            digest.update(f"{directory.name}/{path.relative_to(directory).as_posix()}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def _chunk_digest(path: Path, index: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(index * CHUNK)
        return hashlib.sha256(f.read(CHUNK)).digest()


def file_digest(path: Path) -> str:
    """sha256 of the per-64 MiB-chunk sha256s of `path`, chunks hashed in parallel.

    hashlib releases the GIL on large buffers, so a 16 GB weight file hashes at disk speed
    instead of one core's ~1.5 GB/s. (A load hashes the weights as it reads them:
    fuser/weight_reader.py gives the same digest.)
    """
    chunks = max(1, -(-path.stat().st_size // CHUNK))
    if chunks == 1:
        return digest_of_chunks([_chunk_digest(path, 0)])
    with ThreadPoolExecutor(min(chunks, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(lambda i: _chunk_digest(path, i), range(chunks)))
    return digest_of_chunks(parts)


def file_records(directory: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256}} for every file under `directory` but the manifest."""
    records = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            records[rel] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    return records


def check_environment(saved: Mapping[str, Any], here: Mapping[str, Any]) -> None:
    """Refuse an engine built for another environment, naming every difference."""
    labels = {"device_type": "device type", "gpu_name": "GPU", "compute_capability":
              "GPU compute capability", "gpu_driver": "GPU driver"}
    diffs = [f"{labels.get(k, k)}: engine built with {saved.get(k)!r}, this machine has {here[k]!r}"
             for k in here if k != "python" and saved.get(k) != here[k]]
    if diffs:
        raise EngineFileError("the engine was built for another environment; rebuild it here "
                              "(fuser build). Differences: " + "; ".join(diffs))


def check_sources(saved: Mapping[str, Any], passes: list[str], digest: str) -> None:
    """Refuse an engine built by other pass or kernel sources."""
    if saved.get("passes") != passes:
        raise EngineFileError(f"pass list differs: engine built with {saved.get('passes')}, "
                              f"this fuser has {passes}")
    if saved.get("hash") != digest:
        raise EngineFileError("pass or kernel sources differ (hash of passes/ and fuser/ops/: "
                              f"engine {str(saved.get('hash'))[:12]}, here {digest[:12]}); "
                              "rebuild the engine")


def check_files(directory: Path, records: Mapping[str, Mapping[str, Any]], verify_hash: bool = True) -> None:
    """Refuse a missing, truncated or altered file (sizes always, hashes when `verify_hash`)."""
    for rel, record in records.items():
        path = directory / rel
        if not path.is_file():
            raise EngineFileError(f"engine file {rel} is missing from {directory}")
        size = path.stat().st_size
        if size != record["size"]:
            raise EngineFileError(f"engine file {rel} has {size} bytes, the manifest says "
                                  f"{record['size']} (truncated or replaced)")
    if verify_hash:
        check_hashes(directory, records)


def check_hashes(directory: Path, records: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a file whose sha256 is not the manifest's (files hashed on several threads; the
    first corrupted one in the manifest's order is named)."""
    names = list(records)
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda rel: file_digest(directory / rel), names))
    for rel, digest in zip(names, digests):
        if digest != records[rel]["sha256"]:
            raise corrupted(rel)


def corrupted(rel: str) -> EngineFileError:
    """The refusal of engine file `rel`, whose sha256 is not the manifest's."""
    return EngineFileError(f"engine file {rel} is corrupted: its sha256 differs from the "
                           "manifest's")


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of engine `directory`, checked to be one this code can read."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise EngineFileError(f"{directory} is not a directory (an engine is a directory "
                              "written by engine.save or fuser build)")
    if not path.is_file():
        raise EngineFileError(f"{directory} has no {MANIFEST}: not an engine directory, or one "
                              "whose writing did not finish")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineFileError(f"{path} is not valid JSON (truncated or corrupted): {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise EngineFileError(f"{path}: format {manifest.get('format')!r} version "
                              f"{manifest.get('format_version')!r}, this fuser reads {FORMAT!r} "
                              f"version {FORMAT_VERSION}")
    return manifest


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


@dataclass
class LoadedEngine:
    """What `load_engine` returns: per model, its graphs (sharing tensors) and runtime buffers."""

    manifest: dict[str, Any]
    graphs: dict[str, dict[str, fx.GraphModule]]  # model -> graph name -> module
    buffers: dict[str, dict[str, torch.Tensor]]  # model -> runtime buffer name -> tensor
    extra: dict[str, Path]  # extra file name -> path inside the engine directory


def _tensor_spec(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _save_model(directory: Path, graphs: Mapping[str, fx.GraphModule],
                runtime_buffers: Collection[str]) -> dict[str, Any]:
    """Write one model's weights and graphs under `directory`; returns its manifest entry."""
    from safetensors.torch import save_file

    (directory / "graphs").mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    runtime: dict[str, torch.Tensor] = {}
    entry: dict[str, Any] = {"graphs": {}}
    for name, gm in graphs.items():
        for target, t in graph_tensors(gm).items():
            (runtime if target in runtime_buffers else tensors)[target] = t
        (directory / "graphs" / f"{name}.json").write_text(json.dumps(graph_to_json(gm.graph)))
        (directory / "graphs" / f"{name}.py").write_text(gm.code)
        entry["graphs"][name] = f"graphs/{name}.json"
    bases, views = pack_tensors(tensors)
    save_file({k: v.cpu() for k, v in bases.items()}, str(directory / WEIGHTS))
    entry["weights"] = WEIGHTS
    entry["views"] = {k: v.to_json() for k, v in views.items()}
    entry["runtime_buffers"] = {k: _tensor_spec(t) for k, t in runtime.items()}
    return entry


def save_engine(path: str | Path, models: Mapping[str, Mapping[str, fx.GraphModule]], *,
                config: Mapping[str, Any], device: torch.device, passes: list[str],
                runtime_buffers: Collection[str] = (), extra: Mapping[str, bytes | Path] = {},
                info: Mapping[str, Any] = {}, overwrite: bool = False) -> dict[str, Any]:
    """Write an engine directory at `path` atomically; returns the manifest written.

    models: model name ("target", "draft") -> graph name -> rewritten GraphModule. The graphs of
    one model may share tensors; each storage is written once.
    runtime_buffers: get_attr targets not to save (the KV cache); load re-attaches them.
    extra: more files to store (relative name -> bytes, or a file to copy): tokenizer,
    generation config, compiled code. info: free-form JSON (shapes compiled, ...).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise EngineFileError(f"{path} already exists (pass overwrite=True to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700; an engine is shared like a model directory
    try:
        manifest = _write(staging, models, config, device, passes, runtime_buffers, extra, info)
        _replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _write(staging: Path, models: Mapping[str, Mapping[str, fx.GraphModule]], config: Mapping[str, Any],
           device: torch.device, passes: list[str], runtime_buffers: Collection[str],
           extra: Mapping[str, bytes | Path], info: Mapping[str, Any]) -> dict[str, Any]:
    """Fill `staging` with the engine; the manifest is written last."""
    entries = {name: _save_model(staging / name, graphs, runtime_buffers) for name, graphs in models.items()}
    for rel, content in extra.items():
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            shutil.copyfile(content, target)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "environment": environment(device), "config": dict(config),
        "sources": {"passes": list(passes), "hash": source_hash(source_dirs())},
        "models": entries, "extra": sorted(extra), "info": dict(info),
        "files": file_records(staging),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _replace(staging: Path, path: Path) -> None:
    """Move the finished `staging` directory to `path` (an old engine there is removed after)."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(staging, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_engine(path: str | Path, device: torch.device | str | None = None, *, passes: list[str],
                buffers: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                verify_hash: bool = True, log: Callable[[str], None] | None = None
                ) -> LoadedEngine:
    """Open engine `path` on `device` (default: the device type it was built for).

    Checks the manifest against this environment and the files' sizes against the manifest
    before reading anything else; raises EngineFileError naming what differs. The weights are
    read by several threads (fuser/weight_reader.py) and hashed as they are read; the other
    files are hashed on threads meanwhile, and the graphs are parsed on this thread meanwhile;
    every hash is checked before anything is returned. buffers: model -> runtime buffer name
    -> tensor to attach (default: zeros of the recorded shape on `device`). `log` receives
    how long each part took.
    """
    say = log or (lambda message: None)
    start = time.perf_counter()
    directory = Path(path)
    manifest = read_manifest(directory)
    device = _load_device(manifest, device)
    check_environment(manifest["environment"], environment(device))
    check_sources(manifest["sources"], passes, source_hash(source_dirs()))
    check_files(directory, manifest["files"], verify_hash=False)
    models = manifest["models"]
    weights = {name: f"{name}/{entry['weights']}" for name, entry in models.items()}
    others = {rel: r for rel, r in manifest["files"].items() if rel not in weights.values()}
    background = ThreadPoolExecutor(2, thread_name_prefix="fuser-load")
    phases: dict[str, float] = {}
    reading = background.submit(read_files, [directory / rel for rel in weights.values()],
                                device, phases=phases)
    hashed = background.submit(check_hashes, directory, others) if verify_hash else None
    graphs, runtime = {}, {}
    try:
        parsing = time.perf_counter()
        shells = {name: _graph_modules(directory / name, entry, device)
                  for name, entry in models.items()}
        parsed = time.perf_counter()
        reads = dict(zip(weights, reading.result()))
        read = time.perf_counter()
        if verify_hash:
            for name, rel in weights.items():
                if reads[name].sha256 != manifest["files"][rel]["sha256"]:
                    raise corrupted(rel)
            hashed.result()
        checked = time.perf_counter()
        for name, entry in models.items():
            given = (buffers or {}).get(name)
            graphs[name], runtime[name] = _bind_model(directory / name, entry, shells[name],
                                                      reads[name].tensors, device, given)
    except EngineFileError:
        raise
    except Exception:
        if verify_hash:  # a corrupted file explains the failure better: raise that
            check_hashes(directory, manifest["files"])
        raise
    finally:
        background.shutdown(wait=True)  # nothing reads on once this returns or raises
    size = sum(r["size"] for r in manifest["files"].values())
    weight_bytes = sum(r.bytes for r in reads.values())
    say(f"read {size / 2**30:.2f} GiB of weights and graphs in {read - start:.1f} s, hashes "
        f"checked {checked - read:.1f} s later")
    per_file = ", ".join(f"{name} {r.bytes / 2**30:.2f} GiB by {r.seconds:.1f} s"
                         for name, r in reads.items())
    say(f"read: weights {weight_bytes / 2**30:.2f} GiB in {read - parsing:.1f} s "
        f"({weight_bytes / max(read - parsing, 1e-9) / 1e9:.1f} GB/s, hashed as read: "
        f"{per_file}); {sum(len(g) for g in shells.values())} graphs parsed in "
        f"{parsed - parsing:.1f} s beside the reading; checks before it "
        f"{parsing - start:.1f} s")
    if phases:
        spent = ", ".join(f"{phase} {phases.get(phase, 0.0):.1f}" for phase in PHASES)
        say(f"read: the {phases['threads']:.0f} reading threads' seconds: {spent}")
    extra = {rel: directory / rel for rel in manifest["extra"]}
    return LoadedEngine(manifest, graphs, runtime, extra)


def _load_device(manifest: Mapping[str, Any], device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    built = manifest["environment"]["device_type"]
    return torch.device("cuda", torch.cuda.current_device()) if built == "cuda" else torch.device(built)


_UNBOUND = torch.empty(0)  # what a get_attr of a graph module reads until its weights are read


def _graph_modules(directory: Path, entry: Mapping[str, Any], device: torch.device
                   ) -> dict[str, fx.GraphModule]:
    """One model's stored graphs as modules (their code generated), every get_attr bound to a
    stand-in tensor: what can be done before the weights are read (`_bind_model` binds them)."""
    out = {}
    for name, rel in entry["graphs"].items():
        graph = graph_from_json(json.loads((directory / rel).read_text()), device)
        unbound = {n.target: _UNBOUND for n in graph.nodes if n.op == "get_attr"}
        out[name] = fx.GraphModule(unbound, graph, class_name="LoadedStep")
    return out


def _bind_model(directory: Path, entry: Mapping[str, Any], modules: dict[str, fx.GraphModule],
                bases: dict[str, torch.Tensor], device: torch.device,
                given: Mapping[str, torch.Tensor] | None
                ) -> tuple[dict[str, fx.GraphModule], dict[str, torch.Tensor]]:
    """One model's graph modules over its read weights (`bases`) and its runtime buffers."""
    views = {k: View.from_json(v) for k, v in entry["views"].items()}
    missing = sorted({v.base for v in views.values()} - bases.keys())
    if missing:
        raise EngineFileError(f"{directory / entry['weights']} lacks tensors {missing[:5]}")
    tensors = unpack_tensors(bases, views)
    runtime = _runtime_buffers(entry["runtime_buffers"], given, device)
    tensors.update(runtime)
    for gm in modules.values():
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                if node.target not in tensors:
                    raise EngineFileError(f"{directory}: a stored graph reads {node.target}, "
                                          "which the weights and runtime buffers lack")
                owner, _, field = node.target.rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, field, tensors[node.target])
    return modules, runtime


def _runtime_buffers(specs: Mapping[str, Mapping[str, Any]], given: Mapping[str, torch.Tensor] | None,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """The caller's runtime buffers checked against the recorded specs, or fresh zeros."""
    out = {}
    for name, spec in specs.items():
        if given is None:
            out[name] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
            continue
        if name not in given:
            raise EngineFileError(f"runtime buffer {name} was not given")
        t = given[name]
        if _tensor_spec(t) != dict(spec):
            raise EngineFileError(f"runtime buffer {name}: engine compiled for {spec}, "
                                  f"given {_tensor_spec(t)}")
        out[name] = t
    return out


__all__ = [
    "EngineFileError", "LoadedEngine", "check_environment", "check_files", "check_hashes",
    "check_sources",
    "environment", "file_digest", "graph_from_json", "graph_to_json", "load_engine",
    "pack_tensors", "read_manifest",
    "save_engine", "source_hash", "unpack_tensors",
]
