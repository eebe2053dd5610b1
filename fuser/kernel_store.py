"""The machine code of an engine's kernels, kept in its engine directory and put back at load.

A compiled step's artifact (fuser/compile.py) holds Inductor's generated code, and on CUDA the
binaries of Inductor's own Triton kernels (Inductor bundles them). What it does not hold, and
what a load in a fresh process would otherwise compile again:

- CPU: the shared libraries of the C++ kernels the generated code calls. Inductor looks each up
  in its cache directory under the hash of its source and compiler command line; absent, it runs
  the C++ compiler (about a second per kernel, and a precompiled header first).
- CUDA: the binaries of fuser's own Triton kernels (fuser/ops/, runtime/), compiled by Triton
  on their first launch and looked up in Triton's cache directory under the hash of source,
  options and GPU target. Inductor's autotuning choices (which launch configuration of a
  kernel won) come with the compiled step (`CompiledStep.tuning`), so a load does not
  benchmark them again.
- CUDA: the C extension modules Triton builds with the host's C compiler and keeps in the same
  cache: its driver's utilities (`cuda_utils`, once per cache directory) and, up to Triton 3.6,
  a launcher per kernel signature (`__triton_launcher`, on a kernel's first launch). In a fresh
  cache each is a `gcc -O3` run of about half a second, in the first run of the steps
  (`triton_module_files`).

An engine directory keeps both under `kernels/` (`kernels/inductor/<path in Inductor's cache>`,
`kernels/triton/<cache key>/<file>`); `seed` copies them into this process's caches before the
compiled steps load, so that every lookup hits. The cache keys include the compiler, ISA, GPU
target and versions, and the manifest refuses another torch, Triton, GPU or driver before any of
it is used (`fuser.engine_file.environment`). On CPU the libraries of Inductor's vector ISA
probes are kept too (Inductor test-compiles a function per candidate ISA before it picks one),
and the ISA picked at load is checked against the one the kernels were built for (`check_isa`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fuser.engine_file import EngineFileError

KERNELS_DIR = "kernels"
INDUCTOR = "inductor"
TRITON = "triton"
LAUNCHER_MODULE = "__triton_launcher"  # the name of every launcher module Triton builds


# -- what to keep --------------------------------------------------------------------------


def _compiled_graphs(root: object, limit: int = 10) -> list[Any]:
    """Inductor's `CompiledFxGraph`s reachable from `root` (a compiled artifact's callable)
    through closures, attributes and sequences, breadth first, at most `limit` levels deep."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, level = [], set(), [root]
    for _ in range(limit):
        following = []
        for obj in level:
            if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float,
                                                                  torch.Tensor, ModuleType)):
                continue
            seen.add(id(obj))
            if isinstance(obj, CompiledFxGraph):
                found.append(obj)
                continue
            for cell in getattr(obj, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    following.append(cell.cell_contents)
            if isinstance(obj, (list, tuple)):
                following.extend(obj)
            elif isinstance(obj, dict):
                following.extend(obj.values())
            elif not callable(obj) or hasattr(obj, "__dict__"):
                following.extend(getattr(obj, "__dict__", {}).values())
        level = following
        if not level:
            break
    return found


def cpp_kernel_files(artifact: object) -> list[Path]:
    """The shared libraries of the C++ kernels a compiled step's generated code calls (each a
    Python extension module Inductor built in its cache directory)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir()).resolve()
    files = []
    for graph in _compiled_graphs(artifact):
        call = graph.current_callable
        for value in getattr(call, "__globals__", {}).values():
            owner = getattr(value, "__self__", None)
            path = getattr(owner, "__file__", None) if isinstance(owner, ModuleType) else None
            if path and path.endswith(".so") and Path(path).resolve().is_relative_to(root):
                files.append(Path(path).resolve())
    return sorted(set(files))


def _triton_functions(modules: Iterable[ModuleType]) -> list[Any]:
    """Every Triton JIT function defined in `modules` (unwrapping autotuners/heuristics)."""
    from triton.runtime.jit import JITFunction

    out = []
    for module in modules:
        for value in vars(module).values():
            while value is not None and not isinstance(value, JITFunction) and hasattr(value, "fn"):
                value = value.fn
            if isinstance(value, JITFunction) and value not in out:
                out.append(value)
    return out


def _compiled_triton_kernels(device: torch.device) -> list[Any]:
    """Every Triton kernel of fuser's (its ops', and the runtime's per-iteration kernels)
    compiled in this process (Triton's `CompiledKernel`s): the kernels an engine built here
    launches (possibly a few more, of another engine built in the same process). CUDA only.

    Those launched eagerly sit in their JIT functions' caches; those a compiled step launches
    were compiled by Inductor (a user-defined kernel of its graph) and are held by its
    generated code, so the live objects are searched for kernels of fuser's names too."""
    if device.type != "cuda":
        return []
    from triton.compiler.compiler import CompiledKernel

    ops = [m for name, m in sorted(sys.modules.items())
           if name.startswith("fuser.") and m is not None]  # fuser.ops, fuser.runtime, ...
    kernels, names = {}, set()
    for fn in _triton_functions(ops):
        names.add(fn.__name__)
        for kernel_cache, *_ in list(fn.device_caches.values()):
            kernels.update((id(kernel), kernel) for kernel in kernel_cache.values())
    for obj in gc.get_objects():  # (by type: no object's own `__class__` is asked)
        if issubclass(type(obj), CompiledKernel) and getattr(obj, "name", None) in names:
            kernels.setdefault(id(obj), obj)
    return list(kernels.values())


def triton_kernel_files(device: torch.device, kernels: list[Any] | None = None) -> list[Path]:
    """The cache files (binary, metadata) of every Triton kernel of fuser's compiled in this
    process for `device`'s GPU (`kernels`, default `_compiled_triton_kernels`)."""
    kernels = _compiled_triton_kernels(device) if kernels is None else kernels
    files = [Path(p) for kernel in kernels for p in getattr(kernel, "metadata_group", {}).values()]
    return sorted({p for p in files if p.is_file()})


@contextlib.contextmanager
def _recording_module_loads() -> Iterator[list[Path]]:
    """The files Triton loads its C modules from while the block runs (`_load_module_from_path`,
    called by `compile_module_from_src` on a cache hit and after a build alike; Triton 3.6 to
    3.9 at least). A Triton without it records none."""
    import triton.runtime.build as build

    loaded: list[Path] = []
    original = getattr(build, "_load_module_from_path", None)
    if original is None:
        yield loaded
        return

    def recording(name: str, path: str) -> ModuleType:
        loaded.append(Path(path))
        return original(name, path)

    build._load_module_from_path = recording
    try:
        yield loaded
    finally:
        build._load_module_from_path = original


def _launcher_cls() -> Any:
    """The class Triton's active driver launches a compiled kernel through."""
    from triton.runtime import driver

    return driver.active.launcher_cls


def triton_launcher_files(device: torch.device, kernels: list[Any] | None = None) -> list[Path]:
    """The C launcher module (`__triton_launcher`, Triton up to 3.6: one per kernel signature,
    built from C with the host's compiler) of every Triton kernel of fuser's compiled in this
    process (`kernels`, default `_compiled_triton_kernels`), each looked up in Triton's cache
    as it is now, and built there where absent.

    Made for each kernel here rather than found among the launchers this process loaded
    (`triton_module_files`): a kernel compiled but never launched in the build has none, and
    one launched while Triton's cache pointed elsewhere (a test's directory since removed)
    has its module there. The file is the one Triton loads the module from, not the owner of
    the launcher's `launch` function: a single-phase C module loaded a second time in a process
    (every launcher is named `__triton_launcher`) hands out functions whose `__self__` may be
    another launcher module (measured on an H100: the engine directory then held other
    kernels' launchers in place of those of `_rotary_split_kernel` and attention's
    `_combine_kernel`, which the load built; recorded in benchmarks/RESULTS.md). A Triton
    whose launchers are not C modules gives none."""
    files = set()
    kernels = _compiled_triton_kernels(device) if kernels is None else kernels
    launcher_cls = _launcher_cls() if kernels else None
    for kernel in kernels:
        with _recording_module_loads() as loaded:
            try:
                launcher_cls(kernel.src, kernel.metadata)
            except Exception:  # noqa: BLE001 -- a kernel Triton cannot launch here: nothing
                continue       # to keep
        files.update(path.resolve() for path in loaded
                     if path.name.startswith(LAUNCHER_MODULE) and path.is_file())
    return sorted(files)


def triton_module_files(cache_dirs: Iterable[Path]) -> list[Path]:
    """The C extension modules this process loaded from Triton's cache directories `cache_dirs`
    (each `<dir>/<cache key>/<name><EXT_SUFFIX>`): the driver's utilities and the kernels'
    launchers, which Triton compiles from C on first use where its cache lacks them and keeps
    loaded while a kernel can launch, so every launcher of this process is kept, fuser's
    kernels' and any of Inductor's that do not use its static launcher.

    Found among the files mapped into the process (`/proc/self/maps`, where there is one) and
    the live module objects' `__file__` (Triton loads them without `sys.modules`). The mapped
    files are needed because a launcher loaded a second time rewrites the `__file__` of another
    launcher's module object (`triton_launcher_files`): after that no module object names it."""
    roots = [Path(d).resolve() for d in cache_dirs]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    paths = _mapped_files()
    for obj in gc.get_objects():
        if type(obj) is ModuleType and isinstance(getattr(obj, "__file__", None), str):
            paths.add(obj.__file__)
    files = set()
    for path in paths:
        if path.endswith(suffix):
            resolved = Path(path).resolve()
            if resolved.parent.parent in roots and resolved.is_file():
                files.add(resolved)
    return sorted(files)


def _mapped_files() -> set[str]:
    """The paths of the files mapped into this process (Linux: `/proc/self/maps`; elsewhere
    none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    paths = set()
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address perms offset dev inode [path]
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(")"):
            paths.add(fields[5])  # (a deleted file's path ends in " (deleted)")
    return paths


ISA_PROBE_MARK = "_chk_kernel"


def isa_probe_files() -> list[Path]:
    """The libraries of Inductor's vector ISA probes in its cache directory: before it picks an
    ISA, Inductor compiles a small function with each candidate's flags (once per cache
    directory) and loads it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    out = []
    for library in Path(cache_dir()).resolve().glob("*/*.so"):
        source = library.with_suffix(".cpp")
        if source.is_file() and ISA_PROBE_MARK in source.read_text(errors="replace"):
            out.append(library)
    return sorted(out)


def kernel_files(artifacts: Iterable[object], device: torch.device) -> dict[str, Path]:
    """Engine-directory name (`kernels/...`) -> file, for every kernel binary a load would
    otherwise compile: C++ kernels of the compiled steps' `artifacts` (CPU); fuser's Triton
    kernels and the C modules Triton launches them through (CUDA)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir()).resolve()
    out = {}
    libraries = [path for artifact in artifacts for path in cpp_kernel_files(artifact)]
    if libraries:
        libraries += isa_probe_files()
    for path in libraries:
        out[f"{KERNELS_DIR}/{INDUCTOR}/{path.relative_to(root).as_posix()}"] = path
    kernels = _compiled_triton_kernels(device)  # (once: it searches the live objects)
    triton_files = triton_kernel_files(device, kernels)
    if device.type == "cuda":
        triton_files += triton_module_files(triton_module_dirs(device))
        triton_files += triton_launcher_files(device, kernels)
    for path in triton_files:
        out[f"{KERNELS_DIR}/{TRITON}/{path.parent.name}/{path.name}"] = path
    return out


def vector_isa() -> str:
    """The CPU vector ISA Inductor compiles C++ kernels for in this process ("avx512", ...)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


# -- putting it back -----------------------------------------------------------------------


def _copy_absent(source: Path, target: Path) -> bool:
    """Copy `source` to `target` unless a file is there (atomically: another process may be
    reading the cache); whether it copied."""
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)
    return True


def triton_cache_dirs(device: torch.device) -> list[Path]:
    """Where Triton looks kernels up in this process: its own cache directory, and Inductor's
    per-device one (which Inductor's kernels use where TRITON_CACHE_DIR is not set)."""
    import triton

    dirs = [Path(triton.knobs.cache.dir)]
    if device.type == "cuda" and os.environ.get("TRITON_CACHE_DIR") is None:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        dirs.append(Path(triton_cache_dir(device.index or 0)))
    return list(dict.fromkeys(dirs))


def triton_module_dirs(device: torch.device) -> list[Path]:
    """Where this process's Triton may have put the C modules it loaded: where it looks now
    (`triton_cache_dirs`) and its default directory (<TRITON_HOME>/.triton/cache). A process
    started without TRITON_CACHE_DIR loads its driver's utilities there (Inductor's code
    generation asks the driver for the GPU target), and the launchers of the kernels it
    launches before Inductor makes its first kernel object, which points TRITON_CACHE_DIR at
    Inductor's own directory (`CachingAutotuner.__init__`): `triton_cache_dirs` then names
    only that one."""
    import triton

    default = Path(triton.knobs.cache.get_triton_dir("cache"))
    return list(dict.fromkeys([*triton_cache_dirs(device), default]))


def settle_triton_toolchain(device: torch.device) -> None:
    """Apply now, before this process compiles any Triton kernel for `device`, the toolchain
    settings Inductor applies the first time it compiles (or loads) a Triton kernel in a
    process: its bundled ptxas (`TRITON_PTXAS_PATH`) and, where its config asks for it, the CUDA
    toolkit's libdevice.

    Triton's cache key of a kernel includes the ptxas version its backend sees and the hash of
    the libdevice file in its options, so a switch part-way through a process could key one
    kernel two ways in a build and a load. Settled first in both, it cannot; where this process
    already compiled fuser's kernels under another ptxas, they are compiled again under the
    settled one at their next launch (`_ptxas_version_stale`). CUDA only; a torch without
    these hooks changes nothing."""
    if device.type != "cuda":
        return
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:  # pragma: no cover - a torch without Inductor's runtime
        return
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        hook = getattr(compile_tasks, name, None)
        if hook is not None:
            hook()
    if _ptxas_version_stale(device):
        _recompile_fuser_kernels()


def prime_triton_key(device: torch.device) -> None:
    """Compute Triton's own key now (a hash of its sources and its 500 MB compiler library,
    ~0.4 s; computed once a process, by the first kernel looked up in its cache), on the thread
    that calls this: a load runs it beside the weights' reading rather than in the first run.
    CUDA only; a Triton without it is left alone."""
    if device.type != "cuda":
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # pragma: no cover - another Triton
        return
    triton_key()


# Kernels compiled in this process under another toolchain than the settled one: kept alive
# (a CUDA graph captured with one still launches its module, which Triton unloads when the
# kernel object goes), never launched again.
_RETIRED: list[object] = []


def _ptxas_version_stale(device: torch.device) -> bool:
    """Whether Triton already keyed kernels in this process with the version of another ptxas
    than the one it finds now. Triton asks ptxas for its version once a process
    (`get_ptxas_version`, cached) and puts it in every kernel's cache key: a process that
    compiled a Triton kernel before the toolchain was settled (a test process that ran fuser's
    ops first) would key the engine's kernels under that first ptxas, and a fresh process
    loading the engine, settled first, would find none of them. Where it is stale the cached
    version is forgotten, and the backend's hash with it."""
    try:
        from triton.backends.nvidia import compiler
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    version = getattr(compiler, "get_ptxas_version", None)
    fresh = getattr(version, "__wrapped__", None)
    if fresh is None or not hasattr(version, "cache_info") or version.cache_info().currsize == 0:
        return False  # nothing keyed yet: every kernel will be keyed with the settled ptxas
    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    try:
        stale = _for_arch(version, arch) != _for_arch(fresh, arch)
    except (OSError, subprocess.SubprocessError, RuntimeError):  # no ptxas to ask
        return False
    if stale:
        version.cache_clear()
        backend_hash = getattr(getattr(compiler, "CUDABackend", None), "hash", None)
        if hasattr(backend_hash, "cache_clear"):
            backend_hash.cache_clear()
    return stale


def _for_arch(get_version: Any, arch: int) -> str:
    """`get_version(arch)`, or `get_version()` where Triton's takes no architecture."""
    try:
        return get_version(arch)
    except TypeError:
        return get_version()


def _recompile_fuser_kernels() -> None:
    """Forget fuser's compiled Triton kernels in this process, so that each compiles (or is
    found in Triton's cache) again under the settled toolchain's key at its next launch: the
    binaries an engine directory keeps are then found by a load (`triton_kernel_files`)."""
    modules = [m for name, m in sorted(sys.modules.items())
               if name.startswith("fuser.") and m is not None]
    for fn in _triton_functions(modules):
        caches = getattr(fn, "device_caches", None)
        if caches:
            _RETIRED.append(dict(caches))
            caches.clear()


def seed(directory: Path, names: Iterable[str], device: torch.device) -> int:
    """Copy the kernels among engine `directory`'s files `names` into Inductor's and Triton's
    caches (files already there are kept); returns how many were copied."""
    names = [name for name in names if name.startswith(f"{KERNELS_DIR}/")]
    if not names:  # (an engine of FX graphs: nothing to seed, and no Inductor to import)
        return 0
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    copied = 0
    inductor_root = Path(cache_dir())
    triton_groups: dict[str, list[str]] = {}  # Triton cache key -> its files' names
    for name in names:
        parts = name.split("/")
        if parts[0] != KERNELS_DIR or len(parts) < 3:
            continue
        rest = Path(*parts[2:])
        if parts[1] == INDUCTOR:
            copied += _copy_absent(directory / name, inductor_root / rest)
        elif parts[1] == TRITON:
            triton_groups.setdefault(parts[2], []).append(parts[-1])
            for root in triton_cache_dirs(device):
                copied += _copy_absent(directory / name, root / rest)
    for root in triton_cache_dirs(device) if triton_groups else ():
        for key, files in triton_groups.items():
            _write_triton_groups(root / key, files)
    return copied


def _write_triton_groups(key_dir: Path, files: list[str]) -> None:
    """Triton finds a compiled kernel through its group file, `__grp__<kernel>.json` beside the
    kernel's files, which lists them by absolute path; without it a lookup misses even with
    every file in place. Write one per kernel metadata file (`<kernel>.json`) naming the files
    where they are now (the build's paths are another machine's)."""
    import json

    for meta in (f for f in files if f.endswith(".json") and not f.startswith("__grp__")):
        group = key_dir / f"__grp__{meta}"
        if group.exists():
            continue
        children = {f: str(key_dir / f) for f in files}
        partial = group.with_name(f".{group.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"child_paths": children}))
        os.replace(partial, group)


@contextlib.contextmanager
def loading(device: torch.device, compiled: bool = True) -> Iterator[None]:
    """While compiled steps load on `device`: Inductor loads its kernels in this process (its
    pool of compile workers would only start, at a cost of seconds, to find every binary in the
    cache), and on CPU precompiles no header (a compiler run), as at build time
    (fuser.compile_cpu.config), so that each kernel is looked up under the key it was built
    under. Without `compiled` steps it does nothing (and imports no Inductor)."""
    if not compiled:
        yield
        return
    from torch._inductor import config

    patches: dict[str, object] = {"compile_threads": 1}
    if device.type == "cpu":
        patches["cpp_cache_precompile_headers"] = False
    with config.patch(patches):
        yield


def check_isa(built: str | None, directory: Path) -> None:
    """Refuse CPU kernels built for another vector ISA than the one Inductor picks here (its
    probes' libraries come from the engine directory: picking compiles nothing;
    `_flags_pick` spares the probes' runs where it can)."""
    here = _flags_pick(built) if built is not None else None
    if here is None:
        here = vector_isa()
    if built is not None and built != here:
        raise EngineFileError(f"{directory}: its C++ kernels were built for the {built} vector "
                              f"ISA, this CPU's is {here}; rebuild the engine here (fuser build)")


def _flags_pick(built: str) -> str | None:
    """Inductor's ISA pick from the CPU's flags alone, kept for the process where it is
    `built` (the ISA the engine's kernels were built for); None where it is not, or where
    this process picked before or was told what to pick (then `vector_isa` decides).

    Inductor picks the widest ISA whose flags the CPU has and whose probe passes: a small
    function compiled with the ISA's flags (its library comes from the engine directory) and
    loaded in a new Python process, one per ISA (its AMX and AVX512-VNNI variants add quick
    checks of their own, which still run). A load compiles nothing, and kernels built for an
    ISA whose flags the CPU has run on it: where the flags give the engine's ISA, the probes
    are not needed. On the 2-core CI machine the pick took 1.36 s with the probes and 0.30 s
    without, and the bundled pair's load 4.0-4.5 s against 3.1-3.3 s. Inductor keeps the
    pick's list for the process: a later compile in it trusts the flags too."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    listing = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if inductor_config.cpp.vec_isa_ok is not None or listing is None \
            or not hasattr(listing, "cache_info") or listing.cache_info().currsize:
        return None
    inductor_config.cpp.vec_isa_ok = True  # every ISA's probe passes
    try:
        picked = str(cpu_vec_isa.pick_vec_isa())
    finally:
        inductor_config.cpp.vec_isa_ok = None
    if picked != built:  # the probes decide, as without this: nothing kept of the flags' pick
        listing.cache_clear()
        for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", ()):
            for cls in type(isa).__mro__:  # (the variants' own checks, cached per instance)
                clear = getattr(vars(cls).get("__bool__"), "cache_clear", None)
                if clear is not None:
                    clear()
        return None
    return picked


__all__ = ["KERNELS_DIR", "check_isa", "cpp_kernel_files", "kernel_files", "loading",
           "prime_triton_key", "seed", "settle_triton_toolchain", "triton_kernel_files",
           "triton_module_dirs", "triton_module_files", "vector_isa"]
