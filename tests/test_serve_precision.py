"""`fuser serve PATH --precision P`: a model directory is built with FuserConfig.precision P (FP8
on the CPU too: its ops run their references there, tests/test_fp8_pass.py); an engine directory
keeps its precision, and a different --precision is refused in one line before any loading.
--max-batch-size 256 on CUDA asks for every bucket up to 256."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

import fuser
from fuser.cli import build_parser, main
from fuser.server.cli import check_engine_precision, open_engine

pytestmark = [pytest.mark.xdist_group("serve_precision"),
              pytest.mark.usefixtures("one_intra_op_thread")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Llama (fp32) as a model directory, without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("serve_precision") / "tiny-llama"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine_dir(model_dir):
    """The tiny model's engine directory, built with precision auto (fp32 on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(str(model_dir), config=fuser.FuserConfig(
            max_batch_size=1, batch_buckets=(1,), max_seq_len=64, compile="fx"))
    path = model_dir.parent / "engine"
    engine.save(path)
    return path


def serve_args(path, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", str(path), *flags])


def test_the_flag_parses_and_defaults_to_none() -> None:
    assert serve_args("x").precision is None
    assert serve_args("x", "--precision", "fp8").precision == "fp8"
    with pytest.raises(SystemExit):
        serve_args("x", "--precision", "int4")


def test_a_model_directory_is_built_in_the_precision_asked(model_dir) -> None:
    args = serve_args(model_dir, "--precision", "fp8", "--max-batch-size", "1",
                      "--max-seq-len", "64")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine(args)
    assert engine.config.precision == "fp8"
    assert engine.report().passes.get("fp8_linear", 0) > 0  # the linears read FP8 weights
    ids = torch.tensor([[5, 6, 7, 8]])
    assert engine.generate(ids, 4, eos_token_id=[]).shape == (1, 8)


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_an_engine_directory_accepts_its_own_precision(engine_dir, precision: str) -> None:
    check_engine_precision(str(engine_dir), precision)  # built auto from fp32: both name it
    check_engine_precision(str(engine_dir), None)


@pytest.mark.parametrize("precision", ["fp8", "bf16", "fp16"])
def test_an_engine_directory_refuses_another_precision(engine_dir, precision: str,
                                                       capsys) -> None:
    code = main(["serve", str(engine_dir), "--port", "0", "--precision", precision])
    err = capsys.readouterr().err
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert f"--precision {precision}" in last and "built with precision auto" in last, err
    assert "float32" in last and "loading the engine" not in err  # refused before loading


def test_256_rows_on_cuda_build_every_bucket_up_to_256(model_dir, monkeypatch) -> None:
    """`fuser serve MODEL --max-batch-size 256 --precision fp8` on a CUDA machine asks for the
    buckets 1, 2, 4, ..., 256 in FP8 (the build itself is stubbed: no GPU here)."""
    import fuser.launch

    seen = {}

    def build(path, draft, config):
        seen["config"] = config
        return "engine", {}, "name"

    monkeypatch.setattr(fuser.launch, "build_engine_from_args", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert open_engine(serve_args(model_dir, "--max-batch-size", "256", "--precision",
                                  "fp8")) == "engine"
    config = seen["config"]
    assert (config.max_batch_size, config.precision) == (256, "fp8")
    assert config.buckets_for(torch.device("cuda")) == tuple(2 ** i for i in range(9))
