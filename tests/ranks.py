"""Multi-process test plumbing: one process per rank, awaited with a timeout, never left
behind (tests/test_tensor_parallel.py, tests/test_p2p_all_reduce.py)."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[str]:
    """Run one command per rank at once; -> their outputs. Asserts every rank exited 0 (the
    message holds the failed rank's output); a rank still running at the timeout (waiting on
    a dead peer) is killed."""
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for command in commands]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return logs
