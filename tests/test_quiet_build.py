"""A build says only what fuser says: its progress and results lines, no warning of torch.fx,
torch.export or transformers' progress bars. The warnings fuser silences are silenced at the call
that triggers them, by message, and only there: any other warning still shows."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fuser
from fuser import capture
from tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab=160, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
             init_range=0.3, bos=None, eos=None, pad=None)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama target and a one-layer draft, as model directories."""
    root = tmp_path_factory.mktemp("quiet")
    target, draft = root / "target", root / "draft"
    tiny_model("llama", seed=0, **SHAPE).save_pretrained(target)
    tiny_model("llama", seed=1, **dict(SHAPE, layers=1)).save_pretrained(draft)
    return target, draft


def test_fuser_build_prints_only_its_own_lines(pair_dirs: tuple[Path, Path],
                                               tmp_path: Path) -> None:
    """`fuser build` of a target and draft (every step kind: prefill, decode, verify, and the
    draft's): stderr holds only `fuser: ...` progress lines, stdout only the engine's path,
    with Python showing every warning (-W always)."""
    target, draft = pair_dirs
    out = tmp_path / "engine"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-m", "fuser.cli", "build", str(target), "--draft",
         str(draft), "--gamma", "2", "--max-seq-len", "64", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    foreign = [line for line in done.stderr.splitlines() if not line.startswith("fuser: ")]
    assert not foreign, "\n".join(foreign[:20])
    assert done.stdout.splitlines() == [str(out)]
    assert any("built in" in line for line in done.stderr.splitlines())


def test_an_optimize_warns_nothing() -> None:
    """In-process too: fuser.optimize of a target and draft records no warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fuser.optimize(tiny_model("llama", seed=0, **SHAPE),
                       draft=tiny_model("llama", seed=1, **dict(SHAPE, layers=1)),
                       config=fuser.FuserConfig(max_batch_size=1, max_seq_len=32, gamma=2,
                                                compile="fx"))
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("silencer, silenced, category", [
    (capture._absent_attribute_silenced, "Failed to fetch module model.norm!", UserWarning),
    (capture._absent_attribute_silenced, "Attempted to insert a get_attr Node with no "
                                         "underlying reference in the owning GraphModule!",
     UserWarning),
    (capture._treespec_deprecation_silenced, "`isinstance(treespec, LeafSpec)` is deprecated, "
                                             "use something else", FutureWarning),
])
def test_silencing_is_by_message_and_only_at_the_call(silencer, silenced: str,
                                                      category: type[Warning]) -> None:
    """Inside the silencer only its warning is dropped (another message, or the same message
    as another category, still shows); outside it, the silenced warning shows again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with silencer():
            warnings.warn(silenced, category)
            warnings.warn("something else went wrong", category)
            other = DeprecationWarning if category is not DeprecationWarning else UserWarning
            warnings.warn(silenced, other)
        warnings.warn(silenced, category)
    assert [(str(w.message), w.category) for w in caught] == [
        ("something else went wrong", category), (silenced, other), (silenced, category)]


def test_a_model_load_shows_no_progress_bar_and_restores_it(pair_dirs: tuple[Path, Path],
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    from transformers.utils import logging as hf_logging

    from fuser.pipeline import load_model

    assert hf_logging.is_progress_bar_enabled()
    model, _ = load_model(str(pair_dirs[0]), "MODEL")
    assert isinstance(model, torch.nn.Module)
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
