"""The multi-process tensor-parallel engine on the CPU (fuser/distributed.py): rank 0 in the
test's process, rank 1 a spawned follower, gloo between them.

One engine pair is built per module (a build costs tens of seconds on a 2-core CPU): the same
Llama target and draft (the target with 5% weight noise, gamma 3), buckets 1 and 2, built with
tensor_parallel=1 and =2. In fp32 the two give the same greedy tokens, target-only and
speculative, through generate and through the Scheduler. A process holds one tensor-parallel
engine at a time (its process group is torch.distributed's default), so the tests that close
the shared engine come last, in file order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import fuser
from engines import llama_target, perturbed
from fuser import SamplingParams, Scheduler
from fuser.distributed import TP_MANIFEST, FollowerError, TensorParallelGroup, check_devices

pytestmark = pytest.mark.xdist_group("tensor_parallel_engine")

CONFIG = dict(device="cpu", max_seq_len=64, max_batch_size=2, batch_buckets=(1, 2), gamma=3,
              compile="fx")
TIMEOUT = 120.0
VOCAB = 160


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """{"single": the engine at tensor_parallel=1, "parallel": at 2, "saved": the parallel
    engine's directory (saved once its steps have run)}."""
    target = llama_target()
    draft = perturbed(target, 0.05, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = fuser.optimize(target, draft, fuser.FuserConfig(**CONFIG))
        parallel = fuser.optimize(target, draft, fuser.FuserConfig(**CONFIG, tensor_parallel=2))
    saved = tmp_path_factory.mktemp("tp") / "engine"
    try:
        parallel.save(saved)
        yield {"single": single, "parallel": parallel, "saved": saved}
    finally:
        parallel.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_generate_equals_one_rank(pair: dict[str, object]) -> None:
    """Greedy tokens target-only and speculative, and seeded sampling, equal tensor_parallel=1's
    exactly (fp32); the logits within 1e-5; the draft ran (rank 0 only)."""
    single, parallel = pair["single"], pair["parallel"]
    assert parallel.report().fallbacks == [] and parallel.draft is not None
    ids = _ids(2, 9, seed=1)
    for gamma in (0, None):  # 0: target-only steps; None: the configured gamma 3
        single.fix_gamma(gamma)
        parallel.fix_gamma(gamma)
        before = parallel.stats.num_drafts
        assert torch.equal(parallel.generate(ids, 20), single.generate(ids, 20)), gamma
        assert (parallel.stats.num_drafts > before) == (gamma is None)
    sampled = [e.generate(ids, 12, do_sample=True, temperature=0.8, seed=7)
               for e in (single, parallel)]
    assert torch.equal(*sampled)
    torch.testing.assert_close(parallel.logits(ids), single.logits(ids), atol=1e-5, rtol=1e-5)


def test_scheduler_equals_one_rank(pair: dict[str, object]) -> None:
    """Requests of different lengths and budgets through the Scheduler (continuous batching
    over buckets 1 and 2, rows moved between them) return tensor_parallel=1's tokens."""
    requests = [(_ids(1, 3 + 5 * i % 11, seed=i)[0].tolist(),
                 SamplingParams(max_tokens=4 + 7 * i % 13, temperature=0.0 if i % 2 else 0.9,
                                seed=100 + i)) for i in range(6)]
    results = []
    for engine in (pair["single"], pair["parallel"]):
        scheduler = Scheduler(engine, max_waiting=16)
        scheduler.start()
        try:
            streams = [scheduler.submit(p, params) for p, params in requests]
            results.append([s.result(TIMEOUT) for s in streams])
        finally:
            scheduler.close()
    assert results[0] == results[1]


def test_refusals_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world size the heads do not divide, a second engine in one process, more ranks than
    CUDA devices: ValueErrors naming the problem, no process started."""
    target = llama_target()
    with pytest.raises(ValueError, match=r"attention heads 4, KV heads 2, .*not divisible by 3"):
        fuser.optimize(target, None, fuser.FuserConfig(**CONFIG, tensor_parallel=3))
    monkeypatch.setattr(TensorParallelGroup, "_open", object())
    with pytest.raises(ValueError, match="already running in this process"):
        fuser.optimize(target, None, fuser.FuserConfig(**CONFIG, tensor_parallel=2))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"ranks on cuda:0..cuda:1, but 1 CUDA device"):
        check_devices(2, torch.device("cuda", 0))


def test_save_close_load(pair: dict[str, object]) -> None:
    """The saved directory holds rank0/ and rank1/ with the world size; close() stops the
    follower (exit status 0); the load starts a follower on rank1/ and generates the same
    tokens; another world size, or a rank directory alone, is refused naming both sizes."""
    parallel, saved = pair["parallel"], pair["saved"]
    assert json.loads((saved / TP_MANIFEST).read_text())["world_size"] == 2
    for rank in (0, 1):
        manifest = json.loads((saved / f"rank{rank}" / "manifest.json").read_text())
        assert manifest["config"]["tensor_parallel"] == 2
    processes = parallel.tensor_parallel.processes
    parallel.close()
    assert [p.exitcode for p in processes] == [0]
    with pytest.raises(FollowerError, match="closed"):
        parallel.generate(_ids(1, 4, seed=0), 2)
    with pytest.raises(fuser.EngineFileError, match="world size 2; it cannot load at world "
                                                    "size 1"):
        fuser.load(saved, tensor_parallel=1)
    with pytest.raises(fuser.EngineFileError, match="one rank of a tensor-parallel engine of "
                                                    r"world size 2; .*\(world size 1\)"):
        fuser.load(saved / "rank0")
    loaded = fuser.load(saved)
    try:
        assert loaded.tensor_parallel is not None and loaded.draft is not None
        ids = _ids(2, 7, seed=3)
        assert torch.equal(loaded.generate(ids, 16), pair["single"].generate(ids, 16))
    finally:
        loaded.close()
    assert not any(_alive(p.pid) for p in loaded.tensor_parallel.processes)


def test_follower_crash_is_named(pair: dict[str, object]) -> None:
    """A follower killed mid-life: the next step raises FollowerError naming rank 1, and every
    later call too; close() then returns without hanging."""
    pair["parallel"].close()
    engine = fuser.load(pair["saved"])
    try:
        (pid,) = engine.tensor_parallel.pids
        os.kill(pid, 9)
        for _ in range(2):
            with pytest.raises(FollowerError, match="tensor-parallel rank 1 "):
                engine.generate(_ids(1, 5, seed=0), 4)
    finally:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 30


def test_a_follower_error_comes_back_with_its_rank(pair: dict[str, object],
                                                    tmp_path: Path) -> None:
    """A damaged rank directory: the follower's own error (EngineFileError, what it names)
    is raised on rank 0 as FollowerError naming rank 1; no follower is left running."""
    import shutil

    pair["parallel"].close()
    damaged = tmp_path / "engine"
    shutil.copytree(pair["saved"], damaged)
    weights = damaged / "rank1" / "target" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(FollowerError, match=r"(?s)tensor-parallel rank 1 failed:.*"
                                            r"EngineFileError.*weights\.safetensors"):
        fuser.load(damaged)
    assert TensorParallelGroup.running() is None


EXIT_SCRIPT = """
import sys, fuser
engine = fuser.load(sys.argv[1])
print(*engine.tensor_parallel.pids, flush=True)
engine.generate(__import__("torch").tensor([[5, 6, 7]]), 3)
"""  # and the interpreter exits without engine.close()


def test_interpreter_exit_stops_the_followers(pair: dict[str, object]) -> None:
    """A script that loads a tensor-parallel engine and exits without close(): it exits 0 and
    leaves no follower behind."""
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(pair["saved"])],
                            capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_serve_flag_reaches_the_config_and_the_load(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`fuser serve MODEL --tensor-parallel-size 2` builds with FuserConfig(tensor_parallel=2)
    (default 1); on an engine directory the flag is the world size the load must match; 0 is
    refused."""
    import fuser.launch
    from fuser.cli import build_parser
    from fuser.server.cli import _check_args, open_engine

    (tmp_path / "config.json").write_text("{}")
    built = []
    monkeypatch.setattr(fuser.launch, "build_engine_from_args",
                        lambda model, draft, config: (built.append(config), {}, ""))
    for flags, size in (([], 1), (["--tensor-parallel-size", "2"], 2)):
        open_engine(build_parser().parse_args(["serve", str(tmp_path), *flags]))
        assert built.pop().tensor_parallel == size
    with pytest.raises(ValueError, match="--tensor-parallel-size 0 must be at least 1"):
        _check_args(build_parser().parse_args(
            ["serve", str(tmp_path), "--tensor-parallel-size", "0"]))
    engine_dir = tmp_path / "engine"
    (engine_dir / "rank0").mkdir(parents=True)
    (engine_dir / TP_MANIFEST).write_text(json.dumps({"world_size": 2,
                                                      "ranks": ["rank0", "rank1"]}))
    with pytest.raises(fuser.EngineFileError, match="world size 2; it cannot load at world "
                                                    "size 4"):
        open_engine(build_parser().parse_args(
            ["serve", str(engine_dir), "--tensor-parallel-size", "4"]))


@pytest.mark.slow
def test_benchmark_dry_run(tmp_path: Path) -> None:
    """benchmarks/tensor_parallel.py's plumbing: tp=1 and tp=2 on gloo ranks, equal tokens."""
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "benchmarks/tensor_parallel.py", "--dry-run",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tensor_parallel"] for r in rows] == [1, 2]
    assert all(r["first_token_differing_from_tp1"] is None for r in rows)


@pytest.mark.slow
def test_fuser_serve_tensor_parallel(tmp_path: Path) -> None:
    """`fuser serve MODEL --tensor-parallel-size 2`: ready, a completion answered 200, SIGTERM
    exits 0 and leaves no process behind."""
    import signal
    import urllib.request

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fuser.models import TARGET_PATH

    if not (TARGET_PATH / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is not installed")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1, pad_token_id=2)).eval().save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(str(TARGET_PATH)).save_pretrained(tmp_path / "model")
    server = subprocess.Popen([sys.executable, "-m", "fuser.cli", "serve", str(tmp_path / "model"),
                               "--port", "0", "--tensor-parallel-size", "2",
                               "--max-seq-len", "256"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        deadline = time.monotonic() + 400
        while url is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line, "fuser serve exited before it was ready"
            if "ready at" in line:
                url = line.split("ready at ")[1].split()[0]
        assert url is not None
        children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True,
                                  text=True).stdout.split()
        body = json.dumps({"model": "model", "prompt": "def add(a, b):", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            assert response.status == 200
            assert json.loads(response.read())["usage"]["completion_tokens"] == 8
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    time.sleep(1)
    assert children and not any(_alive(int(pid)) for pid in children)
