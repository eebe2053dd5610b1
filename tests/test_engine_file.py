"""fuser.engine_file: a round trip of rewritten step graphs, and every refusal of load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fuser import engine_file as ef
from fuser.capture import StepModule, engine_view, export_step
from fuser.config import FuserConfig
from fuser.passes import PASSES, PassContext, run_passes
from fuser.passes.fx import count_targets
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.steps import StepKind
from tiny import tiny_model

PASS_NAMES = [p.name for p in PASSES]
CPU = torch.device("cpu")
BATCH, SLOTS = 2, 16
STEPS = {"decode": 1, "verify": 3}  # graph name -> tokens per step


def step_inputs(T: int, seed: int) -> tuple[torch.Tensor, ...]:
    """tokens, positions [B, T] and seq_lens, starts [B] of a step after 4 cached tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 160, (BATCH, T), generator=g)
    seq_lens = torch.full((BATCH,), 4, dtype=torch.long)
    positions = (seq_lens[:, None] + torch.arange(T)).contiguous()
    return tokens, positions, seq_lens, torch.zeros(BATCH, dtype=torch.long)


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    """Two rewritten graphs of a tiny Llama (merged projections, fuser ops, cache writes)
    sharing one cache, with the outputs and cache contents each gives from a seeded cache."""
    model = engine_view(tiny_model("llama"), torch.float32, CPU)
    cache = KVCache.allocate(2, BATCH, SLOTS, 2, 16, torch.float32, CPU)
    graphs = {}
    for name, T in STEPS.items():
        _, gm = export_step(StepModule(model, cache.k, cache.v, prefill=False), BATCH, T,
                            max_tokens=SLOTS)
        run_passes(gm, PassContext(f"target.{name}", StepKind(name, T), FuserConfig(), "target"))
        graphs[name] = gm
    buffers = {f"{kv}_cache_{i}": getattr(cache, kv)[i] for kv in "kv" for i in range(2)}
    return {"graphs": graphs, "buffers": buffers, "expected": run_graphs(graphs, buffers)}


def run_graphs(graphs: dict[str, torch.fx.GraphModule], buffers: dict[str, torch.Tensor]
               ) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each graph's logits and the cache it leaves, starting from the same seeded cache."""
    out = {}
    for name, gm in graphs.items():
        for i, b in enumerate(buffers.values()):
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(i)))
        with torch.no_grad():
            logits = gm(*step_inputs(STEPS[name], seed=len(name)))
        out[name] = (logits.clone(), {k: b.clone() for k, b in buffers.items()})
    return out


def save(built: dict[str, object], path: Path, **kwargs: object) -> dict[str, object]:
    return ef.save_engine(path, {"target": built["graphs"]}, config={"max_seq_len": SLOTS},
                          device=CPU, passes=PASS_NAMES, runtime_buffers=set(built["buffers"]),
                          extra={"tokenizer/tokenizer.json": b"{}"}, **kwargs)


def edit_manifest(path: Path, edit: object) -> None:
    manifest = json.loads((path / ef.MANIFEST).read_text())
    edit(manifest)
    (path / ef.MANIFEST).write_text(json.dumps(manifest))


def test_round_trip_is_exact_and_shares_tensors(built: dict[str, object], tmp_path: Path) -> None:
    path = tmp_path / "engine"
    manifest = save(built, path)
    assert manifest["sources"]["passes"] == PASS_NAMES
    graph = built["graphs"]["decode"]
    assert any(str(n.target).startswith("fuser.") for n in graph.graph.nodes)  # a fuser op
    assert any(n.op == "get_attr" and "fuser_merged" in n.target for n in graph.graph.nodes)

    loaded = ef.load_engine(path, CPU, passes=PASS_NAMES)
    graphs, buffers = loaded.graphs["target"], loaded.buffers["target"]
    for gm in graphs.values():  # the cache written in place by a fuser op (2 layers)
        assert count_targets(gm, torch.ops.fuser.rotary_cache_attention.default) == 2
    got = run_graphs(graphs, buffers)
    for name, (logits, cache) in built["expected"].items():
        assert torch.equal(got[name][0], logits)
        for key in cache:  # the cache writes happen in the attached buffers
            assert torch.equal(got[name][1][key], cache[key])
    # One cache and one copy of each weight for all graphs of the model.
    assert graphs["decode"].k_cache_0 is graphs["verify"].k_cache_0 is buffers["k_cache_0"]
    decode_w = {n.target: ef._attr(graphs["decode"], n.target) for n in graphs["decode"].graph.nodes
                if n.op == "get_attr"}
    assert all(ef._attr(graphs["verify"], k).data_ptr() == t.data_ptr() for k, t in decode_w.items())
    assert loaded.extra["tokenizer/tokenizer.json"].read_bytes() == b"{}"


def test_caller_buffers_are_attached(built: dict[str, object], tmp_path: Path) -> None:
    save(built, tmp_path / "e")
    mine = {k: torch.zeros_like(b) for k, b in built["buffers"].items()}
    loaded = ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES, buffers={"target": mine})
    assert loaded.graphs["target"]["decode"].v_cache_1 is mine["v_cache_1"]
    wrong = dict(mine, k_cache_0=torch.zeros(1, 3))
    with pytest.raises(ef.EngineFileError, match="runtime buffer k_cache_0"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES, buffers={"target": wrong})


def test_weights_stored_once(built: dict[str, object], tmp_path: Path) -> None:
    from safetensors import safe_open

    save(built, tmp_path / "e")
    with safe_open(str(tmp_path / "e" / "target" / ef.WEIGHTS), "pt") as f:
        stored = sum(f.get_tensor(k).numel() for k in f.keys())
    unique = {}
    for gm in built["graphs"].values():
        for name, t in ef.graph_tensors(gm).items():
            if name not in built["buffers"]:
                unique[(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape)] = t.numel()
    assert stored == sum(unique.values())


@pytest.mark.parametrize("key, value, words", [
    ("torch", "0.0.1", "torch: engine built with '0.0.1'"),
    ("fuser", "9.9", "fuser: engine built with '9.9'"),
    ("triton", "1.0", "triton"),
    ("transformers", "1.0", "transformers"),
    ("device_type", "cuda", "device type: engine built with 'cuda'"),
    ("gpu_name", "NVIDIA H200", "GPU: engine built with 'NVIDIA H200'"),
    ("compute_capability", "9.0", "GPU compute capability"),
])
def test_environment_mismatch_is_refused(built: dict[str, object], tmp_path: Path, key: str,
                                         value: str, words: str) -> None:
    save(built, tmp_path / "e")
    edit_manifest(tmp_path / "e", lambda m: m["environment"].__setitem__(key, value))
    with pytest.raises(ef.EngineFileError, match=words):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


def test_source_and_pass_mismatch_is_refused(built: dict[str, object], tmp_path: Path) -> None:
    save(built, tmp_path / "e")
    with pytest.raises(ef.EngineFileError, match="pass list differs"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES[:-1])
    edit_manifest(tmp_path / "e", lambda m: m["sources"].__setitem__("hash", "0" * 64))
    with pytest.raises(ef.EngineFileError, match="pass or kernel sources differ"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


def test_source_hash_follows_the_sources(tmp_path: Path) -> None:
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "a.py").write_text("x = 1\n")
    before = ef.source_hash([tmp_path / "ops"])
    (tmp_path / "ops" / "a.py").write_text("x = 2\n")
    assert ef.source_hash([tmp_path / "ops"]) != before


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupted"])
@pytest.mark.parametrize("rel", ["target/weights.safetensors", "target/graphs/decode.json",
                                 "tokenizer/tokenizer.json"])
def test_damaged_file_is_refused(built: dict[str, object], tmp_path: Path, damage: str,
                                 rel: str) -> None:
    save(built, tmp_path / "e")
    path = tmp_path / "e" / rel
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # same size, one byte flipped
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    words = {"missing": "is missing", "truncated": "truncated", "corrupted": "corrupted"}[damage]
    with pytest.raises(ef.EngineFileError, match=f"{rel}.*{words}"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


@pytest.mark.parametrize("where", ["header", "middle"])
def test_corrupted_weights_are_refused_before_use(built: dict[str, object], tmp_path: Path,
                                                   where: str) -> None:
    """The weights are hashed as they are read: a byte flipped in their JSON header (which the
    reader cannot parse) or among the tensors is refused as corrupted, naming the file."""
    save(built, tmp_path / "e")
    path = tmp_path / "e" / "target" / ef.WEIGHTS
    data = bytearray(path.read_bytes())
    at = 8 + 2 if where == "header" else len(data) // 2  # the header's opening '{"'
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ef.EngineFileError, match=r"target/weights\.safetensors is corrupted"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


def test_the_weights_are_read_once(built: dict[str, object], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A load hashes the weights as it reads them (fuser/weight_reader.py): no second pass of
    `file_digest` over them, while every other file is still hashed."""
    save(built, tmp_path / "e")
    hashed: list[str] = []
    digest = ef.file_digest

    def recording(path: Path) -> str:
        hashed.append(path.relative_to(tmp_path / "e").as_posix())
        return digest(path)

    monkeypatch.setattr(ef, "file_digest", recording)
    ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)
    files = json.loads((tmp_path / "e" / ef.MANIFEST).read_text())["files"]
    assert sorted(hashed) == sorted(rel for rel in files if not rel.endswith(ef.WEIGHTS))


def test_manifest_problems_are_refused(built: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ef.EngineFileError, match="not a directory"):
        ef.load_engine(tmp_path / "nothing", CPU, passes=PASS_NAMES)
    save(built, tmp_path / "e")
    manifest = tmp_path / "e" / ef.MANIFEST
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(ef.EngineFileError, match="not valid JSON"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)
    manifest.unlink()
    with pytest.raises(ef.EngineFileError, match="no manifest.json"):
        ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


def test_failed_save_leaves_nothing(built: dict[str, object], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(directory: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ef, "file_records", fail)
    with pytest.raises(OSError):
        save(built, tmp_path / "e")
    assert list(tmp_path.iterdir()) == []  # neither the engine nor its staging directory


def test_save_refuses_to_overwrite_unless_asked(built: dict[str, object], tmp_path: Path) -> None:
    save(built, tmp_path / "e")
    with pytest.raises(ef.EngineFileError, match="already exists"):
        save(built, tmp_path / "e")
    save(built, tmp_path / "e", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]
    ef.load_engine(tmp_path / "e", CPU, passes=PASS_NAMES)


def test_graph_json_refuses_unknown_targets() -> None:
    with pytest.raises(ef.EngineFileError, match="which load does not allow"):
        ef.resolve_target("os.system")
    with pytest.raises(ef.EngineFileError, match="not a registered op"):
        ef.resolve_target("fuser::no_such_op.default")


def test_pack_keeps_views_of_one_storage() -> None:
    merged = torch.arange(24.0).reshape(6, 4)
    tensors = {"merged": merged, "q": merged[:2], "k": merged[2:4], "tied": merged,
               "other": torch.ones(3)}
    bases, views = ef.pack_tensors(tensors)
    assert sorted(bases) == ["merged", "other"]
    out = ef.unpack_tensors(bases, views)
    for name, t in tensors.items():
        assert torch.equal(out[name], t)
    assert out["k"].untyped_storage().data_ptr() == out["merged"].untyped_storage().data_ptr()


def test_a_module_still_being_imported_has_its_installed_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment check reads transformers' version while a load may still be importing
    it on another thread: a module in sys.modules without `__version__` yet gives the
    installed version from its metadata, not None (which refused every engine as built for
    another environment)."""
    import importlib.metadata
    import sys
    import types

    installed = importlib.metadata.version("transformers")
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    assert ef.environment(torch.device("cpu"))["transformers"] == installed
