"""fuser/weight_reader.py: a safetensors file read in pieces by several threads into one aligned
buffer gives the tensors safetensors' own loader gives (CPU here; the CUDA path, pinned staging
on per-thread streams, in the gpu test)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fuser.engine_file import file_digest
from fuser.weight_reader import (ALIGN, PHASES, digest_of_chunks, read_files, read_header,
                                 read_to_device)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.float8_e4m3fn]


def _tensors(seed: int, count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=generator))]
        shape = tuple(int(n) for n in torch.randint(0, 9, (int(torch.randint(1, 4, (1,),
                                                                       generator=generator)),),
                                                   generator=generator))
        values = torch.randn(shape, generator=generator) * 4
        out[f"t{i}"] = values.to(dtype) if dtype is not torch.bool else values > 0
    return out


def _check(path: Path, device: str, piece: int, workers: int) -> None:
    want = load_file(str(path))
    got = read_to_device(path, device, piece=piece, workers=workers)
    assert sorted(got) == sorted(want)
    base = min((t.data_ptr() for t in got.values() if t.numel()), default=0)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
        assert not t.numel() or (got[name].data_ptr() - base) % ALIGN == 0, name
        assert got[name].device.type == torch.device(device).type


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 12),
       piece=st.sampled_from([1, 7, 64, 1 << 20]), workers=st.integers(1, 4))
def test_read_equals_safetensors(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                 count: int, piece: int, workers: int) -> None:
    """Mixed dtypes (1- to 8-byte, odd byte counts, empty tensors) and pieces that split
    tensors anywhere: every tensor's bytes, dtype and shape as safetensors loads them, each at an
    aligned offset."""
    path = tmp_path_factory.mktemp("weights") / "w.safetensors"
    save_file(_tensors(seed, count), str(path))
    _check(path, "cpu", piece, workers)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 8),
       chunk=st.sampled_from([64, 1000, 4096, 1 << 26]), piece=st.sampled_from([1, 100, 1 << 20]),
       workers=st.integers(1, 3))
def test_the_digest_is_the_files(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                 count: int, chunk: int, piece: int, workers: int) -> None:
    """The digest made while reading is the sha256 over the file's `chunk`-byte chunks'
    sha256s, whatever the pieces and threads; at the default chunk, `file_digest`'s (what the
    manifest records). Two files in one call: each its own tensors and digest."""
    root = tmp_path_factory.mktemp("weights")
    paths = [root / "a.safetensors", root / "b.safetensors"]
    for i, path in enumerate(paths):
        save_file(_tensors(seed + i, count), str(path))
    phases: dict[str, float] = {}
    reads = read_files(paths, "cpu", workers=workers, piece=piece, chunk=chunk, phases=phases)
    assert set(phases) == {*PHASES, "threads"} and 1 <= phases["threads"] <= workers
    assert all(seconds >= 0 for seconds in phases.values())
    for path, read in zip(paths, reads):
        data = path.read_bytes()
        parts = [hashlib.sha256(data[i:i + chunk]).digest() for i in range(0, len(data), chunk)]
        assert read.sha256 == digest_of_chunks(parts)
        assert read.bytes == len(data)
        want = load_file(str(path))
        assert sorted(read.tensors) == sorted(want)
        for name, t in want.items():
            assert torch.equal(read.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    assert read_files(paths[:1], "cpu")[0].sha256 == file_digest(paths[0])


def test_a_truncated_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(1000)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(OSError, match="unexpected end of file"):
        read_to_device(path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_to_cuda_equals_safetensors(tmp_path: Path) -> None:
    """CUDA: pinned staging, a stream per thread, pieces smaller than the tensors."""
    path = tmp_path / "w.safetensors"
    tensors = _tensors(7, 40)
    tensors["big"] = torch.randn(3 << 20)  # 12 MiB: many pieces of 1 MiB
    save_file(tensors, str(path))
    _check(path, "cuda", 1 << 20, 4)
    phases: dict[str, float] = {}
    read = read_files([path], "cuda", workers=4, piece=1 << 20, chunk=4 << 20,
                      phases=phases)[0]
    data = path.read_bytes()
    parts = [hashlib.sha256(data[i:i + (4 << 20)]).digest() for i in range(0, len(data), 4 << 20)]
    assert read.sha256 == digest_of_chunks(parts)  # hashed from the pinned staging buffers
    assert read_files([path], "cuda")[0].sha256 == file_digest(path)
    assert phases["threads"] >= 1


def _staged_file(path: Path, mib: int) -> dict[str, torch.Tensor]:
    """A file of `mib` MiB of random fp32 tensors (odd sizes: pieces split them anywhere)
    besides the mixed small ones; its tensors as saved."""
    tensors = _tensors(11, 12)
    generator = torch.Generator().manual_seed(3)
    for i in range(4):
        tensors[f"w{i}"] = torch.randn((mib << 18) // 4 + 37 * i, generator=generator)
    save_file(tensors, str(path))
    return load_file(str(path))


def _equal_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8)), \
            f"{name}: the bytes read differ from the file's"


SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: ~0.5 s of a GPU's clock, far beyond the reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_refilled_only_after_its_copy(tmp_path: Path) -> None:
    """The default stream busy while the file is read (its copies queue behind that work,
    which their buffer's memory may still owe): each thread's two staging buffers take many
    pieces in turn, and a buffer refilled before its queued copy ran would put the next
    piece's bytes in the previous piece's place. Every byte is the file's."""
    path = tmp_path / "w.safetensors"
    want = _staged_file(path, 8)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    reads = read_files([path], "cuda", workers=2, piece=64 << 10, chunk=1 << 20)
    _equal_bits(reads[0].tensors, want)
    data = path.read_bytes()
    parts = [hashlib.sha256(data[i:i + (1 << 20)]).digest() for i in range(0, len(data), 1 << 20)]
    assert reads[0].sha256 == digest_of_chunks(parts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_read_follows_queued_work_on_reused_memory(tmp_path: Path) -> None:
    """The file's device buffer may be memory the caching allocator took back from a tensor
    whose kernels are still queued on the current stream (here: a fill behind a long sleep,
    the tensor freed before it ran; the same size asked next gets that block back). The
    copies, on the reading threads' own streams, must follow that work: the read returns only
    after it (the current stream is idle then), and the late fill overwrites no weight."""
    from fuser.weight_reader import layout

    path = tmp_path / "w.safetensors"
    want = _staged_file(path, 6)
    header, data_start = read_header(path)
    _, total = layout(header, data_start)
    torch.cuda.synchronize()
    doomed = torch.empty(total, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    doomed.fill_(0xA5)  # queued behind the sleep
    del doomed  # its memory back in the allocator's pool, the fill still queued
    reads = read_files([path], "cuda", workers=2, piece=1 << 20, chunk=4 << 20)
    assert torch.cuda.current_stream().query(), "the read returned before the queued work ran"
    torch.cuda.synchronize()
    _equal_bits(reads[0].tensors, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_load_in_many_chunks_reads_every_weight(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """An engine (target and draft) whose weight files span several hashing chunks and many
    pieces (1 MiB chunks, 64 KiB pieces, made small here as 64 MiB and 16 MiB are for 8B
    weights) loads through `fuser.load`: every tensor read is the saved file's, bit for bit,
    each file's digest is the manifest's (the load refuses otherwise), and the loaded engine
    generates the built engine's tokens."""
    import warnings

    import fuser
    from fuser import engine_file, weight_reader
    from tiny import tiny_model

    monkeypatch.setattr(engine_file, "CHUNK", 1 << 20)  # the save's digests, and the load's
    reads: list = []

    def small_pieces(paths, device, **kwargs):  # noqa: ANN001, ANN003, ANN202
        kwargs.update(workers=3, piece=64 << 10, chunk=1 << 20)
        out = weight_reader.read_files(paths, device, **kwargs)
        reads.extend(out)
        return out

    monkeypatch.setattr(engine_file, "read_files", small_pieces)
    shape = dict(vocab=4096, heads=4, kv_heads=2, head_dim=32, intermediate=256, init_range=0.3,
                 bos=None, eos=None, pad=None)
    target = tiny_model("llama", seed=0, layers=2, **shape).cuda()
    draft = tiny_model("llama", seed=1, layers=1, **shape).cuda()
    config = fuser.FuserConfig(max_batch_size=2, batch_buckets=(1, 2), max_seq_len=64,
                               compile="fx", gamma=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft, config=config)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 4096, (2, 6), generator=generator).cuda()
    want_tokens = engine.generate(ids, 10).tolist()
    engine.save(tmp_path / "engine")
    engine.close()
    loaded = fuser.load(tmp_path / "engine", wait_for_graphs=True)
    assert len(reads) == 2 and all(r.bytes > 3 << 20 for r in reads)  # target's and draft's
    for read in reads:
        _equal_bits(read.tensors, load_file(str(read.path)))
    assert loaded.generate(ids, 10).tolist() == want_tokens
    loaded.close()
