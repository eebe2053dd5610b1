"""fuser.load never traces or compiles: an engine whose fixed-T steps Inductor compiled loads
with every capture, pass, Dynamo and Inductor entry point made to raise, and runs every batch
bucket it was built with, as the built engine did."""

from __future__ import annotations

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

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

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
