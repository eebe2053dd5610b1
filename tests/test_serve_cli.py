"""The `fuser serve` command: SIGTERM drains and exits 0 (a subprocess serving an engine
directory), a model directory is built with the batch bucket the scheduler needs, the drain
timeout aborts what still runs, and user mistakes are one line and exit status 2.

A tiny random Llama (vocabulary of the bundled tokenizer, so the server has a tokenizer) keeps
the build and the subprocess's start to seconds."""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import httpx
import pytest
import torch

import fuser
from fuser.cli import build_parser, main
from fuser.models import TARGET_PATH
from serve_util import TIMEOUT, wait_for


pytestmark = [pytest.mark.xdist_group("serve_cli"),  # one tiny build per run, not per worker
              pytest.mark.usefixtures("one_intra_op_thread")]

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama over the bundled tokenizer's 4096 ids, as a model directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not (TARGET_PATH / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is not installed")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    path = tmp_path_factory.mktemp("serve_cli") / "tiny-llama"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(TARGET_PATH)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_engine_dir(tiny_model_dir):
    """The tiny model's engine directory: 2 rows, batch buckets 1 (the scheduler prefills
    through it) and 2."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(str(tiny_model_dir), config=fuser.FuserConfig(
            max_batch_size=2, batch_buckets=(1, 2), max_seq_len=1024, compile="fx"))
    path = tiny_model_dir.parent / "engine"
    engine.save(path)
    return path


def _ready_url(process: subprocess.Popen, seconds: float) -> str:
    """The URL in `fuser serve: ready at URL (model NAME)`, read from stdout within `seconds`."""
    deadline = time.monotonic() + seconds
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"fuser serve exited with {process.returncode} before ready")
        if selector.select(timeout=1.0):
            line = process.stdout.readline()
            if line.startswith("fuser serve: ready at "):
                assert line.rstrip().endswith(f"(model {MODEL})"), line
                return line.split()[4]
    raise AssertionError(f"fuser serve was not ready within {seconds} s")


def test_sigterm_drains_and_exits_0(tiny_engine_dir, tmp_path):
    """A streaming request runs; SIGTERM: /health and a new request answer 503 while the running
    one finishes whole; then the process exits 0."""
    stderr = open(tmp_path / "stderr.txt", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "fuser.server", str(tiny_engine_dir), "--port", "0",
         "--served-model-name", MODEL, "--drain-timeout", "120", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _ready_url(process, 240)
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503, 30,
                     "/health to answer 503")
            refused = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            events = [line[6:] for line in [first, *lines] if line.startswith("data: ")]
        assert process.poll() is None or process.returncode == 0
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "length"  # it ran to the end, not aborted
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        stderr.seek(0)
        log = stderr.read()
        stderr.close()
    assert "drained in" in log, log[-2000:]
    # the cold start's breakdown, one line per part, adding up to the total
    table = dict(re.findall(r"^fuser serve:   (\S[^\n]*?) +(\d+\.\d\d)$", log, re.M))
    for part in ("imports", "read", "code load", "capture", "load, other", "scheduler",
                 "warm-up", "total"):
        assert part in table, log[-3000:]
    total = float(table.pop("total"))
    assert abs(sum(map(float, table.values())) - total) < 0.01 * len(table) + 1e-9, table
    assert 0 < float(table["imports"]) < total


def test_a_model_directory_is_built_with_a_bucket_of_1(tiny_model_dir):
    """... and, with --adapt-draft and no draft, with the target's verify steps for suffix
    proposals (and their headroom in the KV cache)."""
    from fuser.runtime.steps import verify
    from fuser.server.cli import open_engine

    args = argparse.Namespace(path=str(tiny_model_dir), draft=None, max_batch_size=2,
                              max_seq_len=128, adapt_draft=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine(args)
    assert engine.config.max_batch_size == 2 and 1 in engine.buckets
    assert engine.tokenizer is not None
    gammas = engine.config.gammas
    for bucket in engine.buckets.values():
        assert all(verify(g) in bucket.target for g in gammas)
        assert bucket.target.cache.slots >= 128 + max(gammas) + 1


def test_the_drain_timeout_aborts_what_still_runs(tmp_path):
    from serve_fake import FakeScheduler
    from transformers import AutoTokenizer

    from fuser.server.app import create_app
    from fuser.server.cli import drain
    from serve_util import serving

    scheduler = FakeScheduler(step_seconds=0.05)
    scheduler.start()
    tokenizer = AutoTokenizer.from_pretrained(str(TARGET_PATH))
    try:
        app = create_app(scheduler, tokenizer, MODEL)
        with serving(app) as running:
            result = {}

            def client() -> None:
                r = httpx.post(f"{running.url}/v1/completions", timeout=TIMEOUT, json={
                    "model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True})
                result["response"] = r

            thread = threading.Thread(target=client)
            thread.start()
            wait_for(lambda: scheduler.num_running == 1, 10, "the request to run")
            start = time.perf_counter()
            assert drain(app.state.serving, scheduler, running, timeout=0.5) == 0
            assert time.perf_counter() - start < 10
            thread.join(30)
            r = result["response"]
            assert r.status_code == 200
            assert r.json()["choices"][0]["finish_reason"] == "abort"
    finally:
        scheduler.close()


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_user_mistakes_are_one_line(tiny_model_dir, tiny_engine_dir, capsys):
    code, err = _run(["serve", str(tiny_model_dir / "missing")], capsys)
    assert code == 2 and err.count("\n") == 1 and "no such directory" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = _run(["serve", str(tiny_model_dir), "--port", str(port)], capsys)
    assert code == 2 and err.count("\n") == 1 and "already in use" in err
    code, err = _run(["serve", str(tiny_engine_dir), "--port", "0", "--draft",
                      str(tiny_model_dir)], capsys)
    assert code == 2 and "its draft is built in" in err.splitlines()[-1]
    code, err = _run(["serve", str(tiny_engine_dir), "--port", "0", "--max-batch-size", "4"],
                     capsys)
    assert code == 2 and "built for 2 rows" in err.splitlines()[-1]
    code, err = _run(["serve", str(tiny_model_dir), "--drain-timeout", "-1"], capsys)
    assert code == 2 and "--drain-timeout" in err


def test_every_serve_option_has_help():
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                 ).choices["serve"]
    for action in serve._actions:
        assert action.help, action.option_strings or action.dest
    args = parser.parse_args(["serve", "somewhere"])
    assert (args.host, args.port, args.drain_timeout, args.max_waiting) == \
        ("127.0.0.1", 8000, 30.0, 256)


@pytest.fixture(scope="module")
def tiny_pair_engine():
    """A tiny Llama target with a random Mistral draft (gamma 2), buckets 1 and 2."""
    from engines import llama_target, mistral_draft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(llama_target(), draft=mistral_draft(), config=fuser.FuserConfig(
            max_batch_size=2, batch_buckets=(1, 2), max_seq_len=64, gamma=2, compile="fx"))


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "somewhere", *flags])


def test_adaptation_is_off_by_default_and_its_flags_reach_the_scheduler(tiny_pair_engine):
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.scheduler import Scheduler
    from fuser.server.cli import make_scheduler

    default = _serve_args()
    assert default.adapt_draft is False
    assert _serve_args("--no-adapt-draft").adapt_draft is False  # the default, still accepted
    assert _serve_args("--adapt-draft").adapt_draft is True
    engine = tiny_pair_engine
    config = engine.config
    plain = make_scheduler(engine, default)
    try:
        assert type(plain) is Scheduler  # plain continuous batching
        assert plain.max_num_batched_tokens is None  # (a contiguous cache: whole prompts)
        assert engine.config is config  # nothing changed in the engine
    finally:
        plain.close()
    on = make_scheduler(engine, _serve_args("--adapt-draft", "--distill-every", "7",
                                            "--distill-budget-s", "0.25"))
    try:
        assert isinstance(on, AdaptiveScheduler)
        assert on.suffix and on.distiller is not None
        # AdaptiveScheduler reads both from the engine's config when it updates the draft.
        assert (on.engine.config.distill_every, on.engine.config.distill_budget_s) == (7, 0.25)
        assert on.engine.config.gamma == config.gamma  # the rest as built
    finally:
        on.close()
        engine.config = config
    defaults = make_scheduler(engine, _serve_args("--adapt-draft"))
    try:  # the flags' defaults are FuserConfig's
        assert (engine.config.distill_every, engine.config.distill_budget_s) == \
            (fuser.FuserConfig().distill_every, fuser.FuserConfig().distill_budget_s)
    finally:
        defaults.close()
        engine.config = config


def test_distill_flags_need_adaptation_and_positive_values(tiny_model_dir, capsys):
    code, err = _run(["serve", str(tiny_model_dir), "--distill-every", "10"], capsys)
    assert code == 2 and "--distill-every applies with --adapt-draft only" in err
    code, err = _run(["serve", str(tiny_model_dir), "--adapt-draft", "--distill-budget-s", "0"],
                     capsys)
    assert code == 2 and "--distill-budget-s 0 must be greater than 0" in err


def test_an_engine_directory_adapts_and_keeps_its_distilled_draft(tiny_pair_engine, tmp_path):
    """`fuser serve ENGINE_DIR --adapt-draft`: the loaded engine's draft module is rebuilt
    from the directory's draft config and the loaded tensors (bit for bit the built draft's),
    the target's over the loaded tensors (its logits the built target's), the scheduler adapts
    (suffix proposals and a distiller with the target's top-k labels) and serves the target's
    greedy tokens; after the drain, draft weights swapped in are saved into the directory, and
    a new load computes them."""
    from engines import llama_target

    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.distill import draft_module, rebuild_draft, rebuild_target
    from fuser.runtime.scheduler import SamplingParams
    from fuser.server.cli import make_scheduler, save_adapted

    path = tmp_path / "engine"
    tiny_pair_engine.save(path)
    built = {n: p.detach().clone() for n, p in draft_module(tiny_pair_engine).named_parameters()}
    loaded = fuser.load(path)
    with pytest.raises(ValueError, match="no module"):
        draft_module(loaded)
    rebuilt = dict(rebuild_draft(loaded, path).named_parameters())
    assert rebuilt.keys() == built.keys()
    for name, value in built.items():
        assert torch.equal(rebuilt[name], value), name
    ids = torch.tensor([[5, 9, 14, 3, 7, 11, 40, 2]])
    with torch.no_grad():
        assert torch.equal(rebuild_target(loaded, path)(input_ids=ids).logits,
                           llama_target()(input_ids=ids).logits)
    prompts = [[5, 9, 14, 3, 7, 11], [8, 8, 2, 30, 41]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [loaded.generate(torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist()
                for p in prompts]
    args = _serve_args("--adapt-draft")
    args.path = str(path)
    scheduler = make_scheduler(loaded, args)
    assert isinstance(scheduler, AdaptiveScheduler)
    assert scheduler.suffix and scheduler.distiller is not None and scheduler.swap is not None
    # The target's top-k labels too: its module rebuilt over the loaded tensors (no copy).
    assert scheduler.distiller.labels_from_target
    scheduler.start()
    try:
        for _ in range(2):  # the second round finds the first's outputs in the suffix index
            got = [s.result(120.0) for s in [scheduler.submit(p, greedy) for p in prompts]]
            assert got == expected
        assert not save_adapted(loaded, scheduler, str(path))  # nothing swapped in yet
        torch.manual_seed(3)
        distilled = {n: p + 0.05 * torch.randn_like(p) for n, p in built.items()}
        scheduler.swap.swap(distilled)  # what an accepted update does
        assert scheduler.drain(120.0)
        assert save_adapted(loaded, scheduler, str(path))
    finally:
        scheduler.close()
    assert (path / "draft_config.json").is_file() and (path / "target_config.json").is_file()
    again = dict(rebuild_draft(fuser.load(path), path).named_parameters())
    for name, value in distilled.items():
        assert torch.equal(again[name], value.to(again[name].dtype)), name


def test_a_target_only_engine_directory_built_with_suffix_steps_adapts(tiny_engine_dir, tmp_path,
                                                                        capsys):
    """FuserConfig(suffix_speculation=True) (`fuser build --suffix-steps`) without a draft
    builds the target's verify steps for the gamma candidates; the loaded engine directory
    then serves with suffix proposals (no distiller: no draft), the target's greedy tokens.
    Without them (tiny_engine_dir), adaptation is off, and the message says how to rebuild."""
    from engines import llama_target

    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.scheduler import SamplingParams, Scheduler
    from fuser.runtime.steps import verify
    from fuser.server.cli import make_scheduler

    args = _serve_args("--adapt-draft")
    args.path = str(tiny_engine_dir)
    plain = make_scheduler(fuser.load(tiny_engine_dir), args)
    assert type(plain) is Scheduler
    assert "fuser build --suffix-steps" in capsys.readouterr().err
    plain.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(llama_target(), config=fuser.FuserConfig(
            max_batch_size=2, batch_buckets=(1, 2), max_seq_len=64, compile="fx",
            gamma_candidates=(2, 3), suffix_speculation=True))
    for bucket in engine.buckets.values():
        assert verify(2) in bucket.target and verify(3) in bucket.target
    engine.save(tmp_path / "engine")
    loaded = fuser.load(tmp_path / "engine")
    args.path = str(tmp_path / "engine")
    scheduler = make_scheduler(loaded, args)
    assert isinstance(scheduler, AdaptiveScheduler) and scheduler.suffix
    assert scheduler.distiller is None
    prompt = [5, 9, 14, 3, 7, 11, 5, 9, 14]
    expected = loaded.generate(torch.tensor([prompt]), max_new_tokens=16)[0, len(prompt):]
    scheduler.start()
    try:
        for _ in range(2):
            out = scheduler.submit(prompt, SamplingParams(max_tokens=16, temperature=0.0,
                                                          ignore_eos=True)).result(120.0)
            assert out == expected.tolist()
    finally:
        scheduler.close()


def test_draft_updates_are_shown_on_stderr(capsys):
    import logging

    from fuser.server.cli import show_draft_updates

    handler = show_draft_updates()
    try:
        record = logging.LogRecord("fuser", logging.INFO, "/x/runtime/distill.py", 1,
                                   "draft update %d: %s", (1, "accepted: ..."), None)
        logging.getLogger("fuser").handle(record)
        other = logging.LogRecord("fuser", logging.INFO, "/x/runtime/adapt.py", 1,
                                  "fuser: draft update: %s", ("accepted: ...",), None)
        logging.getLogger("fuser").handle(other)
    finally:
        logging.getLogger("fuser").removeHandler(handler)
    err = capsys.readouterr().err
    assert err == "fuser serve: draft update 1: accepted: ...\n"


def test_cold_start_parts_add_up(monkeypatch):
    """ColdStart: each mark is the time since the one before; a split lists the measured parts
    and keeps the rest under "<name>, other"."""
    from fuser.server import cli

    clock = iter([2.0, 5.0, 5.5])
    monkeypatch.setattr(cli, "process_age", lambda: next(clock))
    cold = cli.ColdStart()
    cold.mark("imports")
    cold.split("load", {"read": 1.5, "capture": 0.5})
    cold.mark("warm-up")
    assert cold.parts == {"imports": 2.0, "read": 1.5, "capture": 0.5, "load, other": 1.0,
                          "warm-up": 0.5}
    lines = cold.table().splitlines()
    assert lines[0] == "cold start, launch to ready (seconds):"
    assert lines[-1].split() == ["total", "5.50"]


def test_the_cold_start_shows_bucket_1s_capture_and_what_continues(monkeypatch, tmp_path):
    """An engine directory loaded with batch buckets still capturing in the background: the
    breakdown's capture line is bucket 1's, and a line under the table names the buckets that
    continue (the background thread logs when they are done)."""
    from types import SimpleNamespace

    from fuser.server import cli

    engine = SimpleNamespace(load_timings={"read": 1.0, "code": 0.25, "capture": 0.5},
                             graphs_status={1: "ready", 4: "capturing", 2: "pending"},
                             config=SimpleNamespace(max_batch_size=4), buckets={1: 0, 2: 0, 4: 0})
    monkeypatch.setattr(fuser, "load", lambda path, log, **options: engine)
    monkeypatch.setattr("fuser.launch.is_engine_dir", lambda path: True)
    clock = iter([2.0, 5.0])
    monkeypatch.setattr(cli, "process_age", lambda: next(clock))
    cold = cli.ColdStart()
    args = argparse.Namespace(path=str(tmp_path), draft=None, max_batch_size=None)
    assert cli.open_engine(args, cold) is engine
    assert cold.parts == {"imports": 2.0, "read": 1.0, "code load": 0.25,
                          "capture (bucket 1)": 0.5, "load, other": 1.25}
    lines = cold.table().splitlines()
    assert lines[-1] == ("  batch buckets [4, 2] capture in the background (a line says when "
                         "they are done); until then their steps run in a captured larger "
                         "bucket or uncaptured")
    assert lines[-2].split() == ["total", "5.00"]


def test_a_model_directory_serves_a_paged_cache_with_prefix_caching(tiny_model_dir):
    """The default build pages the KV cache (16-slot blocks; on the CPU the pool holds every
    row at full length) and the scheduler shares prompt prefixes; --max-num-batched-tokens N
    prefills prompts in chunks (off by default until measured on a GPU); --no-prefix-caching
    turns sharing off, --block-size 0 gives the contiguous cache."""
    from fuser.server.cli import kv_cache_config, make_scheduler, open_engine

    args = _serve_args("--max-batch-size", "2", "--max-seq-len", "64")
    args.path = str(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine(args)
    cache = engine.target.cache
    assert cache.paged and cache.k[0].shape[1] == 16
    assert cache.num_blocks == 1 + 2 * cache.block_table.shape[1]
    for flags, sharing, budget in (((), True, None), (("--no-prefix-caching",), False, None),
                                   (("--max-num-batched-tokens", "0"), True, None),
                                   (("--max-num-batched-tokens", "512"), True, 512),
                                   (("--max-num-batched-tokens", "64"), True, 64)):
        scheduler = make_scheduler(engine, _serve_args(*flags))
        try:
            assert scheduler.blocks is not None and scheduler.blocks.prefix_caching is sharing
            assert scheduler.max_num_batched_tokens == budget
            # admission: two measured steps at most, a 2 ms pause ending a burst (defaults)
            assert (scheduler.admission_wait, scheduler.admission_quiet) == (None, 0.002)
        finally:
            scheduler.close()
    scheduler = make_scheduler(engine, _serve_args("--admission-wait-ms", "0",
                                                   "--admission-quiet-ms", "3"))
    try:
        assert (scheduler.admission_wait, scheduler.admission_quiet) == (0.0, 0.003)
    finally:
        scheduler.close()
    assert kv_cache_config(_serve_args("--block-size", "0")) == {}
    assert kv_cache_config(_serve_args("--gpu-memory-fraction", "0.5")) == \
        dict(kv_block_size=16, kv_memory_fraction=0.5)


def test_precapture_plans_the_flags_seconds():
    """After /health, `fuser serve` plans --precapture-seconds (default 30) of idle-time
    captures (runtime/idle_capture.py); the benchmark's in-process server waits for them;
    0 plans none."""
    from fuser.server.cli import precapture

    calls: list[object] = []

    class Planned:
        def precapture(self, seconds: float) -> int:
            calls.append(seconds)
            return 3

        def wait_captures(self, timeout: float, planned: bool = False) -> bool:
            calls.append(("wait", planned))
            return True

    assert precapture(Planned(), _serve_args()) == 3 and calls == [30.0]
    calls.clear()
    assert precapture(Planned(), _serve_args("--precapture-seconds", "5"), wait=True) == 3
    assert calls == [5.0, ("wait", True)]
    calls.clear()
    assert precapture(Planned(), _serve_args("--precapture-seconds", "0"), wait=True) == 0
    assert calls == []


def test_adaptation_keeps_the_kv_cache_flags(tiny_model_dir):
    """`--adapt-draft` with --no-prefix-caching or --max-num-batched-tokens on a paged cache:
    both reach the adaptive scheduler, as they reach the plain one."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.server.cli import make_scheduler, open_engine

    args = _serve_args("--adapt-draft", "--max-batch-size", "2", "--max-seq-len", "64")
    args.path = str(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine(args)
    for flags, sharing, budget in (((), True, None), (("--no-prefix-caching",), False, None),
                                   (("--max-num-batched-tokens", "64"), True, 64)):
        scheduler = make_scheduler(engine, _serve_args("--adapt-draft", *flags))
        try:
            assert isinstance(scheduler, AdaptiveScheduler)
            assert scheduler.blocks is not None and scheduler.blocks.prefix_caching is sharing
            assert scheduler.max_num_batched_tokens == budget
        finally:
            scheduler.close()
    # the admission times reach it too (milliseconds to seconds)
    scheduler = make_scheduler(engine, _serve_args("--adapt-draft", "--admission-wait-ms", "7",
                                                   "--admission-quiet-ms", "0.5"))
    try:
        assert (scheduler.admission_wait, scheduler.admission_quiet) == (0.007, 0.0005)
    finally:
        scheduler.close()


def test_kv_cache_flag_mistakes_are_one_line(tiny_model_dir, capsys):
    for flags, word in ((["--block-size", "-1"], "--block-size"),
                        (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens"),
                        (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction"),
                        (["--block-size", "0", "--gpu-memory-fraction", "0.5"], "not with"),
                        (["--admission-wait-ms", "-1"], "--admission-wait-ms"),
                        (["--admission-quiet-ms", "-0.5"], "--admission-quiet-ms"),
                        (["--precapture-seconds", "-1"], "--precapture-seconds")):
        code, err = _run(["serve", str(tiny_model_dir), "--port", "0", *flags], capsys)
        assert code == 2 and err.count("\n") == 1 and word in err, err


def test_a_paged_engine_directory_serves_paged(tiny_model_dir, tmp_path):
    """`fuser build --block-size 8` writes a paged engine (inspect says so); `fuser serve` of
    it loads the paged cache and its scheduler manages the blocks (no rebuild)."""
    from fuser.server.cli import make_scheduler, open_engine

    out = tmp_path / "paged-engine"
    assert main(["build", str(tiny_model_dir), "--max-batch-size", "1", "--max-seq-len", "48",
                 "--gamma", "0", "--block-size", "8", "--out", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0
    args = _serve_args("--max-num-batched-tokens", "512")
    args.path = str(out)
    engine = open_engine(args)
    assert engine.target.cache.paged and engine.target.cache.k[0].shape[1] == 8
    scheduler = make_scheduler(engine, args)
    scheduler.start()
    try:
        params = fuser.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        assert len(scheduler.submit([5, 6, 7, 8, 9] * 3, params).result(120.0)) == 5
        assert scheduler.blocks.prefix_queries == 15 and scheduler.prefill_chunks == 1
    finally:
        scheduler.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_model_directory_serves_a_pool_sized_from_free_memory(tiny_model_dir):
    """On CUDA, `fuser serve MODEL_DIR --gpu-memory-fraction 0.05`: the pools take 5% of the
    memory free after the weights (far more blocks than the rows need at full length),
    and requests sharing an opening run through the captured step graphs with prefix hits.
    (0.05: the GPU tests share one GPU.)"""
    from fuser.server.cli import make_scheduler, open_engine

    total = torch.cuda.mem_get_info()[1]
    args = _serve_args("--max-batch-size", "2", "--max-seq-len", "256",
                       "--gpu-memory-fraction", "0.05")
    args.path = str(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine(args)
    cache = engine.target.cache
    pool_bytes = 2 * sum(k.numel() * k.element_size() for k in cache.k)
    # (other GPU tests run beside this one: the free memory moves, the bounds are loose)
    assert cache.paged and 0.01 * total < pool_bytes <= 0.05 * total
    assert cache.num_blocks > 1 + 2 * cache.block_table.shape[1]
    scheduler = make_scheduler(engine, args)
    scheduler.start()
    try:
        params = fuser.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        opening = list(range(10, 50))
        outs = [scheduler.submit(opening + [60 + i], params).result(120.0) for i in range(3)]
        assert all(len(out) == 8 for out in outs)
        assert scheduler.blocks.prefix_hits == 2 * 32  # two 16-slot blocks, twice
    finally:
        scheduler.close()
    replays = engine.report().graph_replays
    assert sum(v for k, v in replays.items() if k.startswith("step.b")) >= scheduler.steps > 0


def test_a_tokenizer_for_an_engine_saved_without_one_loads_beside_the_weights(
        tiny_engine_dir, tmp_path, monkeypatch, capsys):
    """--tokenizer for an engine directory saved without a tokenizer loads on the load's thread
    while the weights are read, not on the main thread after the load (transformers' tokenizer
    import and its files: seconds before /health). The engine keeps none (what --adapt-draft
    saves back is as saved), and a directory without a tokenizer is an error naming it, as
    when it loaded after the engine."""
    from transformers import AutoTokenizer

    from fuser.server import cli

    engine = fuser.load(tiny_engine_dir)
    engine.tokenizer = None
    path = tmp_path / "no-tokenizer"
    engine.save(path)
    real = AutoTokenizer.from_pretrained
    on_main: list[bool] = []

    def recording(*args: object, **kwargs: object) -> object:
        on_main.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    args = build_parser().parse_args(["serve", str(path), "--tokenizer", str(TARGET_PATH)])
    loaded = cli.open_engine(args)
    tokenizer = cli.load_tokenizer(args, loaded)
    assert on_main == [False]  # once, on the load's thread
    assert loaded.tokenizer is None
    assert tokenizer("def f(x):")["input_ids"] == real(str(TARGET_PATH))("def f(x):")["input_ids"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _run(["serve", str(path), "--port", "0", "--tokenizer", str(empty)], capsys)
    assert code == 2
    assert f"fuser: error: --tokenizer {empty}: cannot load a tokenizer (" in err
