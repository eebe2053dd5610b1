import importlib.util
import os
import pytest
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The server's tests need the `serve` and `test` extras (FastAPI, uvicorn, the openai client):
# where they are missing (a GPU machine with only torch, say) those modules are not collected.
_SERVER_TESTS = {"test_serve.py": ("fastapi", "uvicorn", "openai"),
                 "test_serve_cli.py": ("fastapi", "uvicorn"),
                 "test_serve_engine.py": ("fastapi", "uvicorn", "openai")}
collect_ignore = [name for name, needs in _SERVER_TESTS.items()
                  if any(importlib.util.find_spec(module) is None for module in needs)]


@pytest.fixture(scope="module")
def interpreter_rounds_bf16_like_gpu():
    """Make the Triton interpreter round fp32 -> bf16 to nearest even, as GPUs do.

    Triton 3.9's interpreter truncates that cast (triton/runtime/interpreter.py, cast_impl ->
    _convert_float with no rounding mode), while compiled Triton emits cvt.rn.bf16.f32 and
    PyTorch rounds to nearest even. Without this a bf16 kernel would be checked against a
    rounding no GPU performs. The kernel code is unchanged; only the interpreter's emulation of
    the cast is corrected. Use it from a test module with
    `pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")`.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    truncating_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.uint16).numpy()
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return truncating_cast(self, src, dst_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` (the README's test command) sends the tests of one `xdist_group` to one
    worker: pytest-xdist's workers suffix their node ids with "@group". Under pytest >= 9 that
    suffix (set on `_nodeid`, which pytest 9 no longer reads) never reaches the node id, so both
    workers built the bundled engine (~90 s each on a 2-core CPU). Add it where it is missing."""
    if not getattr(config.option, "loadgroup", False):  # not an xdist worker of --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId  # pytest >= 9
    except ImportError:  # older pytest: xdist's own suffix works
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(scope="session")
def bundled_engine(tmp_path_factory):
    """The demo's engine of the bundled pair (fp32 on CPU), built once in this process and
    saved: (directory, prompt ids, mask, greedy tokens of the in-process engine, build seconds).
    Shared by tests/test_engine_save_load.py and tests/test_cli_engine.py."""
    from engine_dirs import build_bundled_engine

    return build_bundled_engine(tmp_path_factory.mktemp("bundled") / "engine")


@pytest.fixture(scope="session")
def engines():
    """The generate tests' shared engines by name (tests/engines.py: "plain", "g1", "g4self",
    "g8"): `engines(name) -> (engine, HF target)`, each built on first use and then kept for the
    session (per xdist worker), whichever test file asks."""
    from engines import engine_and_target

    return engine_and_target


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny models: splitting each op over threads costs more than it saves (about 1.7x slower
    with 2 threads on a 2-core machine, worse when the cores are shared). Restored afterwards.
    Use it from a test module with `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pin_norm_stats(enabled: bool):
    from fuser.ops import gemv_tables
    from fuser.passes import norm_stats

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm_stats, "ENABLED", enabled)
        mp.setattr(gemv_tables, "ONE_ROW_NORM_AFTER", enabled)
        yield


@pytest.fixture
def norm_stats_on():
    """passes/norm_stats.py's pass and the one-row GEMVs in its arithmetic
    (gemv_tables.ONE_ROW_NORM_AFTER) pinned on for the test: the defaults, which it must not rely
    on."""
    yield from _pin_norm_stats(True)


@pytest.fixture
def norm_stats_off():
    """Both switched off for the test: the norm kernels' arithmetic at every row count."""
    yield from _pin_norm_stats(False)


@pytest.fixture(autouse=True)
def no_background_capture_outlives_its_test():
    """Every background bucket capture a test started is stopped when the test ends: while a
    CUDA graph is captured on any thread, PyTorch's default CUDA generator counts offsets for
    that capture only, and random numbers drawn outside it (a later test's Inductor autotuning
    inputs, on the same xdist worker) fail with "Offset increment outside graph capture
    encountered unexpectedly"."""
    yield
    if torch.cuda.is_available():
        from fuser.runtime import bucket_capture

        for job in list(bucket_capture._running):
            job.stop(timeout=120.0)
