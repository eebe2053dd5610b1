"""fuser.load never traces or compiles: an engine whose fixed-T steps Inductor compiled loads
with every capture, pass, Dynamo and Inductor entry point made to raise, and runs every batch
bucket it was built with, as the built engine did."""

from __future__ import annotations

import json
import os
import platform
import warnings
from pathlib import Path

import pytest
import torch

import fuser
import fuser.build
import fuser.capture
import fuser.compile
import fuser.passes
from engines import prompts
from fuser.compile import CompiledStep, compile_count
from fuser.runtime.steps import DECODE
from tiny import tiny_model

# One xdist worker runs the module: the module-scoped saved engine is built once.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("engine_load_compiles_nothing")]

SHAPE = dict(vocab=160, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
             init_range=0.3, bos=None, eos=None, pad=None)


def forbidden(name: str):
    def call(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"fuser.load called {name}")
    return call


# What building runs and a load must not: capture, the passes, Dynamo, Inductor.
ENTRY_POINTS = [
    (torch.export, "export"), (fuser.capture, "export_step"), (fuser.build, "export_step"),
    (fuser.passes, "run_passes"), (fuser.build, "run_passes"),
    (torch, "compile"), (torch._dynamo, "optimize"),
    (fuser.compile, "compile_graph"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[fuser.Engine, Path]:
    """A target-only engine of two batch buckets, its decode steps compiled by Inductor (two C++
    compiles), saved."""
    config = fuser.FuserConfig(max_batch_size=2, batch_buckets=(1, 2), max_seq_len=40,
                               compile="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(tiny_model("llama", seed=0, **SHAPE), config=config)
    path = tmp_path_factory.mktemp("compiled") / "engine"
    engine.save(path)
    return engine, path


def test_load_traces_and_compiles_nothing(built, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, path = built
    import torch._inductor
    import torch._inductor.compile_fx

    for owner, name in [*ENTRY_POINTS, (torch._inductor, "standalone_compile"),
                        (torch._inductor.compile_fx, "compile_fx"),
                        (torch._inductor.compile_fx, "compile_fx_inner")]:
        monkeypatch.setattr(owner, name, forbidden(f"{owner.__name__}.{name}"))
    before = compile_count()
    loaded = fuser.load(path)
    assert compile_count() == before
    assert sorted(loaded.buckets) == [1, 2]
    for size, bucket in loaded.buckets.items():
        assert bucket.target.cache.batch_size == size
        compiled = [g for g in bucket.target.steps.values() if g.compiled is not None]
        assert compiled and all(isinstance(g.compiled, CompiledStep) for g in compiled)
    # every bucket runs, as the built engine's did
    for rows in (1, 2):
        ids, mask = prompts([5, 3][:rows], seed=rows)
        want = engine.generate(ids, 12, attention_mask=mask)
        assert torch.equal(loaded.generate(ids, 12, attention_mask=mask), want)
    assert compile_count() == before


def test_compile_count_sees_a_compile(built) -> None:
    """The counter the load test relies on moves when a step compiles."""
    engine, _ = built
    step = engine.target[DECODE]
    before = compile_count()
    fresh = CompiledStep(step.rewritten, torch.device("cpu"))
    cache = engine.target.cache
    tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long)
    fresh(tokens, tokens.clone(), cache.seq_lens, cache.starts)
    cache.reset()
    assert compile_count() > before


def _without_hash_check(path: Path, rel: str, content: bytes | None) -> None:
    """Replace (None: delete) engine file `rel` and make the manifest agree, so that only the
    compiled code's own check can refuse it."""
    import json

    from fuser import engine_file as ef

    manifest = json.loads((path / ef.MANIFEST).read_text())
    if content is None:
        (path / rel).unlink()
        del manifest["files"][rel]
    else:
        (path / rel).write_bytes(content)
        manifest["files"][rel] = {"size": len(content), "sha256": ef.file_digest(path / rel)}
    (path / ef.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, message", [
    (None, r"compiled code of target decode1\.b1 .* is missing"),
    (b"not an artifact", r"compiled code of target decode1\.b1 cannot be loaded"),
])
def test_unloadable_compiled_code_is_refused_not_recompiled(built, tmp_path: Path, damage,
                                                             message: str) -> None:
    import shutil

    _, path = built
    copy = tmp_path / "engine"
    shutil.copytree(path, copy)
    _without_hash_check(copy, "target/compiled/decode1.b1.bin", damage)
    before = compile_count()
    with pytest.raises(fuser.EngineFileError, match=message):
        fuser.load(copy)
    assert compile_count() == before


def test_a_corrupted_compiled_step_is_refused_as_corrupted(built, tmp_path: Path) -> None:
    """The compiled code loads on a thread beside the weights' reading, before the hashes are
    all checked; a byte flipped in it is still refused by its hash, before the engine exists."""
    import shutil

    _, path = built
    copy = tmp_path / "engine"
    shutil.copytree(path, copy)
    artifact = copy / "target" / "compiled" / "decode1.b1.bin"
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with pytest.raises(fuser.EngineFileError,
                       match=r"target/compiled/decode1\.b1\.bin is corrupted"):
        fuser.load(copy)


def test_the_compiled_code_loads_beside_the_weights(built, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    """Every compiled step's code loads on another thread than the load's, while the weights
    are read there (it needs none of them), and the steps bind it without loading it again."""
    import threading

    from fuser import engine_file, engine_io

    engine, path = built
    events: list[tuple[str, str]] = []
    load_code, read_files = engine_io.load_code, engine_file.read_files

    code_began = threading.Event()

    def loading_code(*args: object, **kwargs: object) -> object:
        events.append(("code", threading.current_thread().name))
        code_began.set()
        return load_code(*args, **kwargs)

    def reading(*args: object, **kwargs: object) -> object:
        events.append(("read start", threading.current_thread().name))
        out = read_files(*args, **kwargs)
        code_began.wait(30)  # a read slower than the code's start: it must start meanwhile
        events.append(("read end", threading.current_thread().name))
        return out

    monkeypatch.setattr(engine_io, "load_code", loading_code)
    monkeypatch.setattr(engine_file, "read_files", reading)
    main = threading.current_thread().name
    loaded = fuser.load(path)
    kinds = [kind for kind, _ in events]
    compiled = [g for b in loaded.buckets.values() for g in b.target.steps.values()
                if g.compiled is not None]
    assert kinds.count("code") == len(compiled) > 0  # once each, none again in model_steps
    assert kinds.index("code") < kinds.index("read end")
    assert all(thread != main for kind, thread in events if kind == "code")
    ids, mask = prompts([5, 3], seed=2)
    assert torch.equal(loaded.generate(ids, 12, attention_mask=mask),
                       engine.generate(ids, 12, attention_mask=mask))


def test_the_code_load_profiled_for_its_python_runs_alone_before_the_reading(
        built, monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSER_LOAD_PROFILE=python: the code load runs before the weights' reading, with nothing
    beside it (cProfile hears every thread from Python 3.12), and the log names where its
    Python seconds went and that it ran alone."""
    import threading

    from fuser import engine_file, engine_io, load_profile

    engine, path = built
    events: list[tuple[str, str]] = []
    load_code, read_files = engine_io.load_code, engine_file.read_files

    def loading_code(*args: object, **kwargs: object) -> object:
        events.append(("code", threading.current_thread().name))
        return load_code(*args, **kwargs)

    def reading(*args: object, **kwargs: object) -> object:
        events.append(("read start", threading.current_thread().name))
        return read_files(*args, **kwargs)

    monkeypatch.setattr(engine_io, "load_code", loading_code)
    monkeypatch.setattr(engine_file, "read_files", reading)
    monkeypatch.setenv(load_profile.ENV, "python")
    lines: list[str] = []
    loaded = fuser.load(path, log=lines.append)
    kinds = [kind for kind, _ in events]
    assert "code" in kinds and max(i for i, k in enumerate(kinds) if k == "code") \
        < kinds.index("read start")
    text = "\n".join(lines)
    assert "before the reading, alone to profile it" in text
    assert "code load, Python: cumulative: " in text and "(load_code)" in text
    ids, mask = prompts([5, 3], seed=2)
    assert torch.equal(loaded.generate(ids, 12, attention_mask=mask),
                       engine.generate(ids, 12, attention_mask=mask))


def _without_kernels(path: Path, copy: Path) -> None:
    """A copy of engine `path` whose kernels/ directory (and its manifest entries) is gone."""
    import json
    import shutil

    from fuser import engine_file as ef

    shutil.copytree(path, copy)
    shutil.rmtree(copy / "kernels")
    manifest = json.loads((copy / ef.MANIFEST).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("kernels/")}
    manifest["extra"] = [k for k in manifest["extra"] if not k.startswith("kernels/")]
    (copy / ef.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("kernels", ["kept", "removed"])
def test_fresh_process_with_empty_caches_compiles_nothing(built, tmp_path: Path,
                                                          kernels: str) -> None:
    """In a new process whose Inductor cache is empty, with the C++ builder, Inductor, Dynamo,
    export and Triton's compile made to raise, the engine loads and generates what the built one
    did: the C++ kernels' libraries (and Inductor's ISA probes') come from the engine
    directory. Without them the load compiles (and the guard catches it)."""
    from engine_dirs import load_compiling_nothing

    engine, path = built
    assert any(name.startswith("kernels/inductor/") for name in
               json.loads((path / "manifest.json").read_text())["extra"])
    if kernels == "removed":
        _without_kernels(path, tmp_path / "engine")
        path = tmp_path / "engine"
    ids, mask = prompts([5, 3], seed=7)
    want = engine.generate(ids, 12, attention_mask=mask)
    if kernels == "removed":
        # (a raising C++ builder fails Inductor's ISA probes first: no ISA to compile for)
        with pytest.raises(AssertionError, match="the load called|vector ISA, this CPU's is "
                                                 "INVALID"):
            load_compiling_nothing(path, ids, mask, 12, tmp_path)
        return
    got = load_compiling_nothing(path, ids, mask, 12, tmp_path)
    assert got["tokens"] == want.tolist()
    assert got["compile_count"] == 0


@pytest.mark.slow
def test_bundled_pair_loads_compiling_nothing(tmp_path: Path) -> None:
    """The bundled pair, its steps compiled by Inductor (C++ on CPU, Triton on CUDA): a new
    process with empty caches and every compiler entry point raising loads it and generates
    the in-process engine's tokens."""
    import dataclasses

    from engine_dirs import build_bundled_engine, demo_config, load_compiling_nothing

    built = build_bundled_engine(tmp_path / "engine",
                                 dataclasses.replace(demo_config(), compile="inductor"))
    got = load_compiling_nothing(built.path, built.ids, built.mask, 16, tmp_path)
    assert got["tokens"] == built.tokens.tolist()
    assert got["compile_count"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_loads_compiling_nothing(tmp_path: Path) -> None:
    """CUDA: fuser's Triton kernels and Inductor's, with Inductor's autotuning choices, come
    from the engine directory: a new process with empty Inductor and Triton caches loads the
    engine with every Triton compile a cache hit, no autotuning benchmark and no Inductor
    compile, and generates the built engine's tokens."""
    from engine_dirs import load_compiling_nothing

    want = build_saved_cuda_engine(tmp_path / "engine")
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert any(name.startswith("kernels/triton/") for name in manifest["extra"])
    ids, mask = prompts([5, 3], seed=7)
    got = load_compiling_nothing(tmp_path / "engine", ids, mask, 12, tmp_path / "fresh")
    assert got["tokens"] == want
    assert got["compile_count"] == 0


def build_saved_cuda_engine(path: Path) -> list[list[int]]:
    """The CUDA load tests' engine: the tiny Llama in bf16, two batch buckets, its fixed-T
    steps compiled by Inductor, saved at `path`; its greedy tokens for two prompts."""
    config = fuser.FuserConfig(max_batch_size=2, batch_buckets=(1, 2), max_seq_len=64,
                               compile="inductor")
    model = tiny_model("llama", seed=0, **SHAPE).to(torch.bfloat16).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(model, config=config)
    engine.save(path)
    ids, mask = prompts([5, 3], seed=7)
    return engine.generate(ids.cuda(), 12, attention_mask=mask.cuda()).tolist()


BUILD_AFTER_AN_OP = """
import json, sys, torch
sys.path.insert(0, "tests")
from fuser.ops.rmsnorm import rms_norm_triton
x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
rms_norm_triton(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)  # Triton's ptxas
torch.cuda.synchronize()
from pathlib import Path
from test_engine_load_compiles_nothing import build_saved_cuda_engine
print(json.dumps(build_saved_cuda_engine(Path(sys.argv[1]))))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_built_after_an_unsettled_kernel_loads_compiling_nothing(
        tmp_path: Path) -> None:
    """A build in a process that launched one of fuser's Triton kernels before the toolchain
    was settled (no TRITON_PTXAS_PATH yet: Triton's own ptxas), as a test process that ran
    the ops first does: a fresh process still loads its engine with every Triton compile a
    cache hit (`kernel_store._ptxas_version_stale`)."""
    import os
    import subprocess
    import sys

    from engine_dirs import ROOT, load_compiling_nothing

    env = {k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", BUILD_AFTER_AN_OP, str(tmp_path / "engine")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    ids, mask = prompts([5, 3], seed=7)
    got = load_compiling_nothing(tmp_path / "engine", ids, mask, 12, tmp_path / "fresh")
    assert got["tokens"] == want
    assert got["compile_count"] == 0

def test_seeded_triton_kernels_are_found_by_tritons_own_lookup(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A kernel's files seeded from an engine directory are a cache hit for Triton's own lookup
    (`FileCacheManager.get_group`, what `triton.compile` asks first): Triton finds them through
    a group file that names them where they are now, which the engine directory does not keep."""
    from triton.runtime.cache import FileCacheManager

    from fuser import kernel_store

    key = "a" * 52
    engine_dir = tmp_path / "engine"
    files = ["_k.json", "_k.cubin", "_k.ptx"]
    for name in files:
        path = engine_dir / kernel_store.KERNELS_DIR / kernel_store.TRITON / key / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    names = [f"{kernel_store.KERNELS_DIR}/{kernel_store.TRITON}/{key}/{n}" for n in files]
    assert FileCacheManager(key).get_group("_k.json") is None  # empty cache: a miss
    assert kernel_store.seed(engine_dir, names, torch.device("cuda")) == len(files)
    group = FileCacheManager(key).get_group("_k.json")
    assert group == {n: str(tmp_path / "triton" / key / n) for n in files}
    assert all(Path(p).read_bytes() == n.encode() for n, p in group.items())


# A C extension module as Triton builds its launchers and driver utilities from C source.
TRITON_MODULE_SOURCE = """
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "__triton_launcher", NULL, -1, NULL};
PyMODINIT_FUNC PyInit___triton_launcher(void) { return PyModule_Create(&module); }
"""


def test_tritons_c_modules_are_kept_and_load_without_the_c_compiler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C modules Triton compiles into its cache (a launcher per kernel signature up to
    Triton 3.6, its driver's utilities) are found among the process's live modules, kept as
    engine-directory files, and, seeded into a fresh cache, load through Triton's own
    `compile_module_from_src` with its C compiler made to raise."""
    import triton.runtime.build as build

    from fuser import kernel_store

    built_cache, fresh_cache = tmp_path / "built", tmp_path / "fresh"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(built_cache))
    module = build.compile_module_from_src(TRITON_MODULE_SOURCE, "__triton_launcher")
    files = kernel_store.triton_module_files([built_cache])
    assert files == [Path(module.__file__).resolve()]
    assert kernel_store.triton_module_files([fresh_cache]) == []  # another cache's: not kept
    key = files[0].parent.name
    name = f"{kernel_store.KERNELS_DIR}/{kernel_store.TRITON}/{key}/{files[0].name}"
    engine_dir = tmp_path / "engine"
    (engine_dir / name).parent.mkdir(parents=True)
    (engine_dir / name).write_bytes(files[0].read_bytes())

    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh_cache))
    monkeypatch.setattr(build, "_build", forbidden("triton.runtime.build._build"))
    with pytest.raises(AssertionError, match="_build"):  # a fresh cache compiles it
        build.compile_module_from_src(TRITON_MODULE_SOURCE, "__triton_launcher")
    assert kernel_store.seed(engine_dir, [name], torch.device("cuda")) == 1
    again = build.compile_module_from_src(TRITON_MODULE_SOURCE, "__triton_launcher")
    assert Path(again.__file__).resolve() == (fresh_cache / key / files[0].name).resolve()


def launcher_source(value: int) -> str:
    """A launcher-like C module named as Triton names every launcher, whose `launch` returns
    `value`."""
    return (
        "#include <Python.h>\n"
        f"static PyObject* launch(PyObject* self, PyObject* args) {{ return PyLong_FromLong({value}); }}\n"
        "static PyMethodDef methods[] = {{\"launch\", launch, METH_VARARGS, \"\"}, {NULL, NULL, 0, NULL}};\n"
        "static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, \"__triton_launcher\", NULL, -1, methods};\n"
        "PyMODINIT_FUNC PyInit___triton_launcher(void) { return PyModule_Create(&module); }\n")


def test_a_launcher_loaded_again_is_kept_by_the_file_triton_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kernel's launcher file is the one Triton loads it from. Launchers built at the
    kernels' first launches load a second time when the save makes them again; CPython loads a
    single-phase C module again into the module of its name in `sys.modules` (the launcher
    loaded last), rewriting that module's `__file__`, so a launcher function's `__self__` can
    name another launcher's file: taken from there, the engine directory held other kernels'
    launchers (an H100 load built two). Here: three launchers built, then the save makes the
    first two again, a new one, and the third."""
    import types

    import triton.runtime.build as build

    from fuser import kernel_store

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    values = [1, 2, 3]
    first = {v: Path(build.compile_module_from_src(launcher_source(v), "__triton_launcher")
                     .__file__).resolve() for v in values}  # the build's first launches
    assert len(set(first.values())) == len(values)

    class Launcher:  # as Triton's CUDA launcher: its module from source, then its function
        def __init__(self, src: int, metadata: object) -> None:
            module = build.compile_module_from_src(launcher_source(src), "__triton_launcher")
            self.launch = module.launch

    monkeypatch.setattr(kernel_store, "_launcher_cls", lambda: Launcher)
    kernels = [types.SimpleNamespace(src=v, metadata=None) for v in (1, 2, 4, 3)]
    files = kernel_store.triton_launcher_files(torch.device("cuda"), kernels)
    assert len(files) == 4 and set(first.values()) < set(files)


def test_every_launcher_loaded_is_kept_after_reloads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`triton_module_files` keeps every C module this process loaded from the cache, also one
    whose module object's `__file__` a later load of another launcher rewrote (CPython loads a
    single-phase module again into `sys.modules`' module of its name): the files mapped into
    the process name them all. Here: three launchers, the first two again, a new one, the
    third again."""
    import triton.runtime.build as build

    from fuser import kernel_store

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    files = set()
    for value in (1, 2, 3, 1, 2, 4, 3):
        module = build.compile_module_from_src(launcher_source(value), "__triton_launcher")
        files.add(Path(module.__file__).resolve())
    assert len(files) == 4
    assert set(kernel_store.triton_module_files([tmp_path / "cache"])) == files


def test_tritons_c_modules_loaded_before_inductor_moved_its_cache_are_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build process started without TRITON_CACHE_DIR loads Triton's driver utilities (at
    Inductor's code generation, which asks the driver for the GPU target) from Triton's default
    cache directory; Inductor's first kernel object then points TRITON_CACHE_DIR at its own
    directory (`CachingAutotuner.__init__`). The modules loaded before are still kept."""
    import triton.runtime.build as build

    from fuser import kernel_store

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))  # the default: <home>/.triton/cache
    module = build.compile_module_from_src(TRITON_MODULE_SOURCE, "__triton_launcher")
    assert Path(module.__file__).resolve().is_relative_to((tmp_path / "home").resolve())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor" / "triton" / "0"))
    kept = kernel_store.kernel_files([], torch.device("cuda")).values()
    assert Path(module.__file__).resolve() in kept


# A launcher module as Triton (up to 3.6) builds one per kernel signature: a `launch` function.
LAUNCHER_SOURCE = """
#include <Python.h>
static PyObject *launch(PyObject *self, PyObject *args) { Py_RETURN_NONE; }
static PyMethodDef methods[] = {{"launch", launch, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "__triton_launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit___triton_launcher(void) { return PyModule_Create(&module); }
"""


class FakeLauncher:
    """Triton's CUDA launcher as far as the engine directory sees it: built from the kernel's
    source and metadata, it builds (or finds in Triton's cache) its C module and keeps its
    `launch` function; `made` counts the launchers made."""

    made = 0

    def __init__(self, src: object, metadata: object) -> None:
        import triton.runtime.build as build

        FakeLauncher.made += 1
        self.launch = build.compile_module_from_src(LAUNCHER_SOURCE + f"// {src}\n",
                                                    "__triton_launcher").launch


def test_the_launcher_of_a_kernel_never_launched_in_the_build_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compiled kernel's launcher goes into the engine directory, made for the kernel
    where the build never launched it (its C module then built into Triton's cache as it is
    now) or launched it while Triton's cache pointed at a directory since removed: an H100 load
    built the launchers of two kernels whose binaries the engine directory held."""
    import shutil
    import types

    from fuser import kernel_store

    old_cache, cache = tmp_path / "old", tmp_path / "now"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(old_cache))
    launched = FakeLauncher("launched", None)  # its module in a cache directory since removed
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    shutil.rmtree(old_cache)
    kernels = [types.SimpleNamespace(src=name, metadata=None, metadata_group={})
               for name in ("launched", "never launched")]
    monkeypatch.setattr(kernel_store, "_compiled_triton_kernels", lambda device: kernels)
    monkeypatch.setattr(kernel_store, "_launcher_cls", lambda: FakeLauncher)
    FakeLauncher.made = 0
    kept = kernel_store.kernel_files([], torch.device("cuda"))
    launchers = sorted(p for p in kept.values() if p.name.startswith("__triton_launcher"))
    assert FakeLauncher.made == 2 and len(launchers) == 2
    assert all(p.is_file() and p.parent.parent == cache.resolve() for p in launchers)
    assert all(name == f"{kernel_store.KERNELS_DIR}/{kernel_store.TRITON}/{p.parent.name}/{p.name}"
               for name, p in kept.items() if p in launchers)
    del launched  # (loaded until here, as a launched kernel's launcher stays)


def test_triton_toolchain_is_settled_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`settle_triton_toolchain` applies Inductor's ptxas and libdevice settings for a CUDA
    device (a build and a load both call it before their first kernel, so that every kernel is
    keyed alike in both) and leaves a CPU process as it is."""
    from torch._inductor.runtime import compile_tasks

    from fuser import kernel_store

    calls = []
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        monkeypatch.setattr(compile_tasks, name, lambda name=name: calls.append(name),
                            raising=False)
    kernel_store.settle_triton_toolchain(torch.device("cpu"))
    assert calls == []
    kernel_store.settle_triton_toolchain(torch.device("cuda", 0))
    assert calls == ["_set_triton_ptxas_path", "_set_triton_libdevice_path"]



def _kernel_for_the_stale_check(x_ptr):  # (a Triton kernel of a stand-in fuser module)
    pass


@pytest.mark.parametrize("ptxas_changed", [True, False])
def test_kernels_keyed_under_another_ptxas_are_compiled_again(
        monkeypatch: pytest.MonkeyPatch, ptxas_changed: bool) -> None:
    """A process that compiled fuser's Triton kernels before the toolchain was settled (a test
    process that ran fuser's ops first) had them keyed under the first ptxas Triton asked; a
    fresh process loading the engine, settled first, would find none of them (on the H100 it
    compiled every kernel again). Settling then forgets Triton's cached ptxas version and
    fuser's compiled kernels, keeping them alive (CUDA graphs may launch them), so that the
    engine's kernels compile under the settled key; where ptxas is unchanged nothing is
    dropped."""
    import functools
    import sys
    import types

    from torch._inductor.runtime import compile_tasks
    from triton.backends.nvidia import compiler
    from triton.runtime.jit import JITFunction

    from fuser import kernel_store

    ptxas = {"version": "ptxas 12.8"}

    @functools.lru_cache
    def get_ptxas_version(arch: int = 80) -> str:
        return f"{ptxas['version']} sm_{arch}"

    monkeypatch.setattr(compiler, "get_ptxas_version", get_ptxas_version)
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        monkeypatch.setattr(compile_tasks, name, lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    module = types.ModuleType("fuser.stand_in_ops")
    module.kernel = JITFunction(_kernel_for_the_stale_check)  # (compiled, not interpreted)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    compiled = {"kernel": "compiled under the first ptxas"}
    module.kernel.device_caches[0] = compiled
    assert get_ptxas_version(90) == "ptxas 12.8 sm_90"  # keyed in this process
    retired = len(kernel_store._RETIRED)
    if ptxas_changed:
        ptxas["version"] = "ptxas 13.0"  # settling points Triton at another ptxas
    kernel_store.settle_triton_toolchain(torch.device("cuda", 0))
    if ptxas_changed:
        assert get_ptxas_version(90) == "ptxas 13.0 sm_90"  # asked again
        assert 0 not in module.kernel.device_caches  # compiled again at the next launch
        assert kernel_store._RETIRED[retired:] == [{0: compiled}]  # and the old kept alive
    else:
        assert module.kernel.device_caches[0] is compiled
        assert len(kernel_store._RETIRED) == retired


NO_GLOBAL_CONSTEXPR = """
import importlib, json, pkgutil, sys
import fuser, fuser.ops
from triton.language.core import constexpr
from triton.runtime.jit import JITFunction
for info in pkgutil.walk_packages(fuser.ops.__path__, "fuser.ops."):
    importlib.import_module(info.name)
found = []
for name, module in sorted(sys.modules.items()):
    if not name.startswith("fuser.") or module is None:
        continue
    for value in vars(module).values():
        while value is not None and not isinstance(value, JITFunction) and hasattr(value, "fn"):
            value = value.fn
        if isinstance(value, JITFunction):
            value.cache_key  # noqa: B018 (fills used_global_vals)
            found += [f"{value.__name__} reads {g}" for (g, _), (v, _) in
                      value.used_global_vals.items() if isinstance(v, constexpr)]
print(json.dumps(sorted(set(found))))
"""


def test_no_triton_kernel_reads_a_global_constexpr() -> None:
    """No Triton kernel of fuser's reads a module-level `tl.constexpr`: under Triton 3.6 such a
    kernel's cache key differed from process to process (on the H200, `_linear_kernel` and
    `_stream_kernel`, which read gated_act's `_GELU_SCALE`, were compiled again by every load with
    the same constants, attributes, signature and options as the build's), so an engine
    directory's binaries of it were never found. Compiled kernels, not the interpreter's: run
    in a process without TRITON_INTERPRET (importing them needs no GPU)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", NO_GLOBAL_CONSTEXPR], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


ISA_CHECK = """
import json, sys
from pathlib import Path
from torch._inductor import cpu_vec_isa
from fuser import kernel_store
from fuser.engine_file import EngineFileError
probes = []
check_build = cpu_vec_isa.VecISA.check_build
def probe(self, code):
    probes.append(str(self))
    return check_build(self, code)
cpu_vec_isa.VecISA.check_build = probe
try:
    kernel_store.check_isa(sys.argv[1], Path("engine"))
    refused = None
except EngineFileError as e:
    refused = str(e)
print(json.dumps({"probes": probes, "refused": refused, "here": kernel_store.vector_isa()}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISAs")
def test_the_isa_of_a_cpu_engine_is_checked_without_probes_where_the_flags_give_it(
        tmp_path: Path) -> None:
    """A CPU load checks the vector ISA its C++ kernels were built for against Inductor's pick:
    where this CPU's flags alone give that ISA, Inductor's probe of each ISA's common code (a
    compile and a new Python process that loads it) does not run, only the extra checks of its
    AMX and AVX512-VNNI variants; where they give another, the probes decide as before, and
    the load is refused with the ISA they picked. Fresh processes: Inductor keeps its pick."""
    import subprocess
    import sys

    from engine_dirs import ROOT

    def run(built: str, mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", ISA_CHECK, built, mode], capture_output=True,
                              text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    probed = run("(none)", "allow")  # an ISA no build records: the probes pick
    assert probed["probes"] and probed["refused"] is not None
    here = probed["here"]
    assert here in probed["refused"]
    trusted = run(here, "allow")
    assert trusted["refused"] is None and trusted["here"] == here
    assert len(trusted["probes"]) < len(probed["probes"]), (trusted, probed)


def test_a_kernel_held_outside_its_jit_cache_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fuser kernel a compiled step launches is compiled by Inductor (a user-defined kernel
    of its graph) and held by its generated code, not by the JIT function's cache: it is found
    among the live objects by its name, beside those of the JIT caches, and another kernel's
    name is not taken (an H100 load built the launchers of two such kernels)."""
    import types

    from triton.compiler.compiler import CompiledKernel

    from fuser import kernel_store

    cached, held, other = (CompiledKernel.__new__(CompiledKernel) for _ in range(3))
    cached.name, held.name, other.name = "_eager_kernel", "_combine_kernel", "triton_poi_add_0"
    for kernel in (cached, held, other):
        kernel.module = None  # (never loaded: nothing for Triton to unload)
    functions = [types.SimpleNamespace(__name__=name, device_caches={0: (cache, None)})
                 for name, cache in (("_eager_kernel", {"key": cached}), ("_combine_kernel", {}))]
    monkeypatch.setattr(kernel_store, "_triton_functions", lambda modules: functions)
    found = kernel_store._compiled_triton_kernels(torch.device("cuda"))
    assert sum(kernel is cached for kernel in found) == 1
    assert any(kernel is held for kernel in found)
    assert not any(kernel is other for kernel in found)
    assert kernel_store._compiled_triton_kernels(torch.device("cpu")) == []
