"""One rank of tests/test_p2p_all_reduce.py's CUDA case.

    python tests/p2p_all_reduce_worker.py RANK WORLD_SIZE PORT OUT

joins an NCCL group at 127.0.0.1:PORT on cuda:RANK, installs the one-shot all-reduce
(fuser/ops/p2p_all_reduce.py) and writes to OUT (torch.save), for messages below and above its
size limit: what `fuser::all_reduce` returned eagerly and from a CUDA graph replay, and what
NCCL returned for the same inputs.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# (numel, dtype): 8 KiB and 100 KiB go one-shot; 2 MiB is over the limit (NCCL).
CASES = [(4096, torch.bfloat16), (25_600, torch.float32), (1 << 20, torch.bfloat16)]


def main(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120),
                            device_id=device)
    import fuser.ops.collectives  # noqa: F401  (registers fuser::all_reduce)
    from fuser.ops import p2p_all_reduce

    p2p = p2p_all_reduce.install(device=device)
    results: dict[str, object] = {"installed": p2p is not None}
    for numel, dtype in CASES:
        gen = torch.Generator(device).manual_seed(1000 * rank + numel)
        x = torch.randn(numel, device=device, dtype=dtype, generator=gen)
        nccl = x.clone()
        dist.all_reduce(nccl)
        eager = torch.ops.fuser.all_reduce(x)
        static = x.clone()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # warm up off the capture
            torch.ops.fuser.all_reduce(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = torch.ops.fuser.all_reduce(static)
        static.copy_(x * 2)
        graph.replay()
        torch.cuda.synchronize()
        results[f"{numel}:{dtype}"] = {
            "one_shot": bool(p2p is not None and p2p.fits(x)),
            "eager": eager.cpu(), "graphed": graphed.cpu(), "nccl": nccl.cpu(),
            "x": x.cpu()}
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
