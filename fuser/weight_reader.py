"""Reading safetensors files onto the device, hashed as they are read, the disk and the copies
overlapped.

safetensors' own `load_file(path, device="cuda")` reads one tensor after another and copies
each from pageable memory: the disk, the host copy and the transfer take turns, at one thread's
pace. And an engine file's hash (fuser/engine_file.py `file_digest`) read every byte a second
time after it. `read_files` instead:

- parses each file's header itself (8 bytes of little-endian header length, a JSON header of
  name -> dtype, shape, [begin, end) byte offsets into the data that follows);
- lays every tensor of a file out in one device buffer, each at a 256-byte aligned offset (what
  the caching allocator gives a tensor of its own: Triton specializes kernels on 16-byte aligned
  pointers, and a misaligned weight would compile a new variant at the first launch; CPU GEMMs
  pick another kernel for data off a 64-byte boundary);
- cuts every file into the hashing unit's chunks (`HASH_CHUNK` bytes of the file, the header
  included) and has `workers` threads take one chunk at a time: each reads its chunk in pieces
  of at most `piece` bytes into a staging buffer (`preadv`: the GIL is released while the disk
  reads), copies each piece's tensor bytes to the device on the thread's own CUDA stream, and
  hashes the piece meanwhile (hashlib releases the GIL on large buffers). Two staging buffers
  per thread, pinned on CUDA, so that one is read while the other is copied;
- returns each file's sha256 in `file_digest`'s form (the sha256 of its chunks' sha256s) with
  its tensors: the hash costs no second read.

The tensors returned are views of the file's one buffer. Off CUDA the same code runs, with
unpinned staging and plain copies.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

ALIGN = 256  # bytes: each tensor's offset in the device buffer
PIECE = 16 << 20  # bytes read and copied at a time
HASH_CHUNK = 64 << 20  # bytes of a file per hashed chunk (fuser/engine_file.py `file_digest`)
WORKERS = max(2, min(16, os.cpu_count() or 1))
# What a reading thread's time goes to: waiting for its staging buffer's previous copy, the
# disk (or page cache), issuing the copies (copying, off CUDA), hashing.
PHASES = ("wait for copies", "disk", "copies", "hash")

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: where its bytes are in the file and in the device buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # file offset of its first byte
    size: int  # bytes
    offset: int  # offset in the device buffer (a multiple of ALIGN)


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """(the JSON header without __metadata__, the file offset where the data begins)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def layout(header: dict[str, dict], data_start: int) -> tuple[list[Entry], int]:
    """Every tensor's Entry, in file order, and the device buffer's size."""
    entries, offset = [], 0
    for name, spec in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        if spec["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {spec['dtype']} is not supported")
        begin, end = spec["data_offsets"]
        entries.append(Entry(name, DTYPES[spec["dtype"]], tuple(spec["shape"]),
                             data_start + begin, end - begin, offset))
        offset += -(-(end - begin) // ALIGN) * ALIGN
    return entries, offset


def digest_of_chunks(chunk_digests: Sequence[bytes]) -> str:
    """A file's sha256 as engine files record it: over its chunks' sha256s, in order."""
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def segments(entries: list[Entry], begins: list[int], start: int, size: int
             ) -> Iterator[tuple[int, int, int]]:
    """(offset in the piece, offset in the device buffer, bytes) of every tensor's bytes
    within the file range [start, start + size); `begins`: the entries' `begin`s."""
    end = start + size
    i = max(0, bisect.bisect_right(begins, start) - 1)
    while i < len(entries) and entries[i].begin < end:
        e = entries[i]
        lo, hi = max(start, e.begin), min(end, e.begin + e.size)
        if hi > lo:
            yield lo - start, e.offset + lo - e.begin, hi - lo
        i += 1


@dataclass
class FileRead:
    """One file as `read_files` read it: its tensors, sha256 and how long it took."""

    path: Path
    tensors: dict[str, torch.Tensor]
    sha256: str
    bytes: int
    seconds: float = 0.0  # from the start of the reading to this file's last chunk


@dataclass
class _File:
    """A file under reading: its layout, device buffer, descriptor and chunk digests."""

    path: Path
    entries: list[Entry]
    begins: list[int]
    buffer: torch.Tensor
    size: int
    fd: int
    digests: list[bytes] = field(default_factory=list)
    finished: float = 0.0


class _Worker:
    """One reading thread's two staging buffers, its CUDA stream and an event per buffer.
    `home`: the stream the file buffers were allocated on (CUDA), whose queued work the copies
    follow: the caching allocator may have given them memory of tensors freed while kernels
    that write them were still queued there."""

    def __init__(self, piece: int, device: torch.device,
                 home: torch.cuda.Stream | None = None) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(piece, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.stream = torch.cuda.Stream(device) if cuda else None
        if self.stream is not None and home is not None:
            self.stream.wait_stream(home)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)


def read_files(paths: Sequence[str | Path], device: torch.device | str, *,
               workers: int = WORKERS, piece: int = PIECE, chunk: int = HASH_CHUNK,
               phases: dict[str, float] | None = None) -> list[FileRead]:
    """Every tensor of each safetensors file in `paths` on `device` (per file: views of one
    buffer, each at an ALIGN-byte aligned offset) and each file's sha256 over `chunk`-byte
    chunks, read by `workers` threads in pieces of at most `piece` bytes. `phases` receives
    the threads' seconds summed per phase (`PHASES`: where a slow read spends its time) and
    "threads"."""
    device = torch.device(device)
    piece = max(1, min(piece, chunk))
    home = torch.cuda.current_stream(device) if device.type == "cuda" else None
    start = time.perf_counter()
    files: list[_File] = []
    try:
        for p in paths:
            path = Path(p)
            header, data_start = read_header(path)
            entries, total = layout(header, data_start)
            size = path.stat().st_size
            if entries and entries[-1].begin + entries[-1].size > size:
                raise OSError(f"{path}: unexpected end of file: its header places data up to "
                              f"byte {entries[-1].begin + entries[-1].size}, the file has {size}")
            buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            files.append(_File(path, entries, [e.begin for e in entries], buffer, size,
                               os.open(path, os.O_RDONLY)))
        for f in files:
            f.digests = [b""] * max(1, -(-f.size // chunk))
        work = [(f, c) for f in files for c in range(len(f.digests))]
        left = {id(f): len(f.digests) for f in files}
        local = threading.local()
        made: list[_Worker] = []
        lock = threading.Lock()
        staging = min(piece, max(f.size for f in files) if files else 1)

        def read_chunk(item: tuple[_File, int]) -> None:
            f, c = item
            worker = getattr(local, "worker", None)
            if worker is None:
                worker = local.worker = _Worker(max(1, staging), device, home)
                with lock:
                    made.append(worker)
            digest = hashlib.sha256()
            first, last = c * chunk, min((c + 1) * chunk, f.size)
            for at in range(first, last, piece):
                size = min(piece, last - at)
                i = worker.turn
                worker.turn ^= 1
                seconds, began = worker.seconds, time.perf_counter()
                if worker.events[i] is not None:
                    worker.events[i].synchronize()  # its previous copy is done: it is free
                view = worker.views[i][:size]
                waited = time.perf_counter()
                seconds["wait for copies"] += waited - began
                done = 0
                while done < size:
                    n = os.preadv(f.fd, [view[done:]], at + done)
                    if n <= 0:
                        raise OSError(f"{f.path}: unexpected end of file at byte {at + done}")
                    done += n
                read = time.perf_counter()
                seconds["disk"] += read - waited
                source = worker.buffers[i]
                if worker.stream is None:
                    for s, t, n in segments(f.entries, f.begins, at, size):
                        f.buffer[t:t + n].copy_(source[s:s + n])
                else:
                    with torch.cuda.stream(worker.stream):
                        for s, t, n in segments(f.entries, f.begins, at, size):
                            f.buffer[t:t + n].copy_(source[s:s + n], non_blocking=True)
                        worker.events[i].record(worker.stream)
                copied = time.perf_counter()
                seconds["copies"] += copied - read
                digest.update(view)  # beside the copy: both only read the staging buffer
                seconds["hash"] += time.perf_counter() - copied
            f.digests[c] = digest.digest()
            with lock:
                left[id(f)] -= 1
                if not left[id(f)]:
                    f.finished = time.perf_counter()

        try:
            if work:
                with ThreadPoolExecutor(max(1, min(workers, len(work)))) as pool:
                    list(pool.map(read_chunk, work))
        finally:
            for worker in made:  # every copy done before the staging buffers may go
                if worker.stream is not None:
                    worker.stream.synchronize()
            if phases is not None:
                for worker in made:
                    for phase, spent in worker.seconds.items():
                        phases[phase] = phases.get(phase, 0.0) + spent
                phases["threads"] = float(len(made))
    finally:
        for f in files:
            os.close(f.fd)
    out = []
    for f in files:
        tensors = {e.name: f.buffer[e.offset:e.offset + e.size].view(e.dtype).view(e.shape)
                   for e in f.entries}
        out.append(FileRead(f.path, tensors, digest_of_chunks(f.digests), f.size,
                            (f.finished or time.perf_counter()) - start))
    return out


def read_to_device(path: str | Path, device: torch.device | str, *, workers: int = WORKERS,
                   piece: int = PIECE) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, on `device` (views of one buffer, each at
    an ALIGN-byte aligned offset), read by `workers` threads in pieces of `piece` bytes."""
    return read_files([path], device, workers=workers, piece=piece)[0].tensors


__all__ = ["ALIGN", "HASH_CHUNK", "PHASES", "FileRead", "digest_of_chunks", "read_files", "read_header",
           "read_to_device"]
