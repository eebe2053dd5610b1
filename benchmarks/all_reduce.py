"""All-reduce latency on the GPUs of one host: NCCL against the one-shot peer-to-peer
all-reduce (fuser/ops/p2p_all_reduce.py), both as `fuser::all_reduce` inside a CUDA graph, the
way a tensor-parallel decoding step runs them.

    python benchmarks/all_reduce.py [--world-size 2] [--out all_reduce.json]
    python benchmarks/all_reduce.py --dry-run      # CPU, gloo, 2 processes, untimed

One process per GPU (NCCL, NVLink multicast off). Per message size (bf16; 8 KiB is the 8B
shape's [1, 4096] at batch 1, 8 MiB its 1,024-token prefill), a CUDA graph of REPEAT
all-reduces in a row is captured once with NCCL and once one-shot, replayed after warm-up, and
timed with CUDA events: the median of the replays over REPEAT is one all-reduce's latency.
The inputs are random (never all zeros) and the results are checked against each other. Rank 0
prints the table (µs per all-reduce, one-shot / NCCL) and writes JSON with --out. Needs a
machine with 2 or more GPUs (`nvidia-h200-x2`); exit status 2 with fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import replay_median_ms  # noqa: E402

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20]  # bytes
REPEAT, REPLAYS = 50, 20


def _graph_us(fn, x: torch.Tensor) -> float:
    """Median µs of one `fn(x)` from CUDA-graph replays of REPEAT calls in a row."""
    ms, _ = replay_median_ms(lambda: [fn(x) for _ in range(REPEAT)][-1], replays=REPLAYS)
    return ms * 1000 / REPEAT


def _rank(rank: int, world_size: int, port: int, out: str | None, dry_run: bool) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cpu") if dry_run else torch.device("cuda", rank)
    if not dry_run:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if dry_run else "nccl",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    import fuser.ops.collectives  # noqa: F401  (registers fuser::all_reduce)
    from fuser.ops import p2p_all_reduce

    sizes = SIZES[:2] if dry_run else SIZES
    p2p = p2p_all_reduce.install(device=device, max_bytes=max(SIZES))
    rows = []
    for size in sizes:
        gen = torch.Generator(device).manual_seed(rank * 7919 + size)
        x = torch.randn(size // 2, device=device, dtype=torch.bfloat16, generator=gen)
        row: dict[str, object] = {"bytes": size}
        results = {}
        for name, use_p2p in (("nccl", False), ("one_shot", True)):
            if use_p2p and p2p is None:
                continue
            if use_p2p:
                p2p_all_reduce._INSTALLED[device] = p2p
            else:
                p2p_all_reduce.uninstall(device)
            results[name] = torch.ops.fuser.all_reduce(x)
            if not dry_run:
                row[f"{name}_us"] = _graph_us(torch.ops.fuser.all_reduce, x)
        if len(results) == 2:  # both sums of the same inputs: equal up to rounding order
            row["max_abs_diff"] = float((results["nccl"].float()
                                         - results["one_shot"].float()).abs().max())
        rows.append(row)
    dist.barrier()
    if rank == 0:
        print(f"all-reduce, {world_size} ranks, bf16, in a CUDA graph ({REPEAT} in a row, "
              f"median of {REPLAYS} replays); one-shot: "
              f"{'installed' if p2p is not None else 'not available'}")
        print(f"{'bytes':>9} {'NCCL us':>9} {'one-shot us':>12} {'ratio':>6} {'max|diff|':>10}")
        for row in rows:
            nccl, one = row.get("nccl_us"), row.get("one_shot_us")
            ratio = f"{one / nccl:6.2f}" if nccl and one else "     -"
            print(f"{row['bytes']:>9} {nccl or float('nan'):>9.1f} "
                  f"{one or float('nan'):>12.1f} {ratio} {row.get('max_abs_diff', float('nan')):>10.3g}")
        if out:
            with open(out, "w") as f:
                json.dump({"world_size": world_size, "repeat": REPEAT, "rows": rows}, f, indent=1)
    # Both ranks leave together: a rank that tore its gloo group down while rank 0 still
    # printed aborted ("terminate called without an active exception") on a loaded CPU.
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes, one per GPU (default: every visible GPU)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true",
                        help="2 CPU processes over gloo, untimed (checks the script)")
    args = parser.parse_args()
    world_size = args.world_size or (2 if args.dry_run else torch.cuda.device_count())
    if not args.dry_run and (not torch.cuda.is_available() or world_size < 2
                             or torch.cuda.device_count() < world_size):
        print(f"all_reduce.py: needs {max(world_size, 2)} CUDA devices, this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.dry_run and sys.platform == "linux":  # gloo over loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world_size, port, args.out, args.dry_run), nprocs=world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
