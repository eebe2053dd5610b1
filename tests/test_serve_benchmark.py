"""benchmarks/serve.py on CPU: its metrics, its streaming client against a scripted server, and
a dry run end to end (tiny random model, two levels, a few requests)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve  # noqa: E402

PRINTED = ("request throughput", "output token throughput", "total token throughput", "TTFT",
           "TPOT", "ITL", "E2E latency")
LEVEL_KEYS = ("completed", "errors", "duration_s", "request_throughput", "output_throughput",
              "total_token_throughput", *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                          for s in ("mean", "median", "p99")))


def record(ttft: float, e2e: float, tokens: int, itl: list[float], ok: bool = True,
           prompt: int = 4) -> dict:
    return {"ok": ok, "prompt_tokens": prompt, "output_tokens": tokens, "ttft": ttft, "e2e": e2e,
            "start": 0.0, "itl": itl, "finish_reason": "length", "error": "" if ok else "boom"}


def test_summarize_follows_vllm_definitions() -> None:
    records = [record(0.1, 1.1, 11, [0.1] * 10), record(0.3, 2.3, 5, [0.5] * 4),
               record(0, 0, 0, [], ok=False)]
    m = serve.summarize(records, duration=4.0, concurrency=2)
    assert (m["completed"], m["errors"], m["num_requests"]) == (2, 1, 3)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(16 / 4)
    assert m["total_token_throughput"] == pytest.approx((16 + 8) / 4)
    # TPOT per request: (e2e - ttft) / (tokens - 1) = 100 ms and 500 ms
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["median_tpot_ms"] == pytest.approx(300.0)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 400)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    # ITL pools every gap of every request: ten of 100 ms, four of 500 ms
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["median_e2el_ms"] == pytest.approx(1700.0)
    assert m["error_messages"] == ["boom"]
    assert serve.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert serve.percentile([], 50) != serve.percentile([], 50)  # nan


# -- a scripted server: the HTTP contract of API.md, without an engine -------------------------


def scripted_app(chunk_delay: float, reject_after: int | None = None):
    """/v1/completions streams max_tokens chunks of one token each, chunk_delay apart, then the
    finish chunk, the usage chunk and [DONE]; after `reject_after` requests it answers 429."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    seen = {"requests": 0, "bodies": []}

    async def completions(request):
        body = await request.json()
        seen["requests"] += 1
        seen["bodies"].append(body)
        if reject_after is not None and seen["requests"] > reject_after:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit",
                                           "param": None, "code": None}}, status_code=429)
        n = body["max_tokens"]

        async def events():
            def event(data: dict) -> str:
                return f"data: {json.dumps(data)}\n\n"

            for i in range(n):
                await asyncio.sleep(chunk_delay)
                yield event({"object": "text_completion",
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
            yield event({"object": "text_completion",
                         "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            yield event({"object": "text_completion", "choices": [],
                         "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                   "total_tokens": len(body["prompt"]) + n}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def health(request):
        return PlainTextResponse("ok")

    async def metrics(request):
        return PlainTextResponse("fuser_num_requests_running 0.0\nfuser_kv_slots_used 0.0\n")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/health", health),
                            Route("/metrics", metrics)])
    return app, seen


@pytest.fixture
def scripted_server(request):
    """(url, what the server saw) of a scripted server on 127.0.0.1, stopped afterwards."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    app, seen = scripted_app(**getattr(request, "param", {"chunk_delay": 0.01}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        serve.wait_healthy(url, timeout=30)
        yield url, seen
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_client_times_a_stream_and_reads_usage(scripted_server) -> None:
    url, seen = scripted_server
    raw = serve.drive_level(url, "scripted", [[5, 6, 7], [8, 9]], concurrency=2, num_requests=3,
                            output_len=6, warmup_tokens=2)
    assert raw["warmup_errors"] == []
    assert seen["requests"] == 2 + 3  # a warm-up request per concurrent client, then the level
    timed = seen["bodies"][2:]
    # (the prompts in turn; two clients at once reach the server in either order)
    assert sorted(b["prompt"] for b in timed) == [[5, 6, 7], [5, 6, 7], [8, 9]]
    for body in timed:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["max_tokens"] == 6 and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
    for r in raw["records"]:
        assert r["ok"], r["error"]
        assert r["output_tokens"] == 6 and r["finish_reason"] == "length"
        assert len(r["itl"]) == 5 and min(r["itl"]) >= 0  # a gap between successive chunks
        # the server sleeps 10 ms before each chunk (the client may read two at once when
        # the machine is busy, so no bound on a single gap)
        assert r["ttft"] >= 0.01 and r["e2e"] >= 0.06
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-6
    assert raw["records"][0]["prompt_tokens"] == 3
    m = serve.summarize(raw["records"], raw["duration"], 2)
    assert m["completed"] == 3 and m["total_output_tokens"] == 18
    assert m["median_tpot_ms"] > 0


@pytest.mark.parametrize("scripted_server", [{"chunk_delay": 0.0, "reject_after": 1}],
                         indirect=True)
def test_client_counts_rejected_requests_as_errors(scripted_server) -> None:
    url, _ = scripted_server
    raw = serve.drive_level(url, "scripted", [[1, 2]], 1, 3, 4, warmup_tokens=0)
    m = serve.summarize(raw["records"], raw["duration"], 1)
    assert (m["completed"], m["errors"]) == (1, 2)
    assert m["error_messages"][0].startswith("HTTP 429")


def run_benchmark(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def check_levels(levels: list[dict], concurrency: list[int], requests: int, tokens: int) -> None:
    assert [m["concurrency"] for m in levels] == concurrency
    for m in levels:
        for key in LEVEL_KEYS:
            assert key in m and m[key] == m[key], key  # present, not nan
        assert (m["completed"], m["errors"]) == (requests, 0), m["error_messages"]
        assert m["total_output_tokens"] == requests * tokens
        assert m["short_requests"] == 0


@pytest.mark.parametrize("scripted_server", [{"chunk_delay": 0.002}], indirect=True)
def test_url_mode_prints_every_metric_and_writes_json_and_plot(scripted_server,
                                                                tmp_path: Path) -> None:
    url, seen = scripted_server
    proc = run_benchmark("--url", url, "--preset", "tiny-random-llama", "--concurrency", "1,2",
                         "--num-requests", "3", "--prompt-len", "5", "--output-len", "4",
                         "--out", str(tmp_path))
    results = json.loads((tmp_path / "serve.json").read_text())
    check_levels(results["url_levels"], [1, 2], 3, 4)
    assert all(len(b["prompt"]) == 5 for b in seen["bodies"])
    assert (tmp_path / "serve.png").stat().st_size > 0
    for field in PRINTED:
        assert proc.stdout.count(field) >= 2, field  # once per level
    assert "errors: 0" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("server at --url")  # the table last


def serving_available() -> str | None:
    """Why the in-process server cannot run here, or None."""
    try:
        import uvicorn  # noqa: F401

        from fuser.runtime.scheduler import Scheduler  # noqa: F401
        from fuser.server import create_app  # noqa: F401
    except ImportError as error:
        return f"the server or scheduler is not importable yet ({error})"
    return None


@pytest.mark.skipif(serving_available() is not None, reason=str(serving_available()))
def test_dry_run_serves_a_tiny_engine_and_compares(tmp_path: Path) -> None:
    """The whole benchmark on a tiny random Llama: build, engine figures, static batches, the
    in-process server at two levels, Hugging Face."""
    start = time.perf_counter()
    proc = run_benchmark("--preset", "tiny-random-llama", "--compile", "fx",
                         "--max-batch-size", "2", "--concurrency", "1,2", "--num-requests", "3",
                         "--prompt-len", "8", "--output-len", "6", "--hf-requests", "1",
                         "--server-args", "--max-waiting 77", "--out", str(tmp_path))
    results = json.loads((tmp_path / "serve.json").read_text())
    system = results["systems"]["fuser"]
    # --server-args reach the scheduler fuser serve would run (fuser.server.cli.make_scheduler)
    scheduler = system["scheduler"]
    assert {k: scheduler[k] for k in ("class", "max_waiting")} == \
        {"class": "Scheduler", "max_waiting": 77}
    # its counters over the levels (benchmarks/serve.py `scheduler_counters`)
    assert scheduler["steps"] > 0 and scheduler["steps_ahead"] >= 0, scheduler
    assert set(scheduler) == {"class", "max_waiting", "steps", "steps_ahead", "chunks_ahead",
                              "prefill_chunks", "preemptions", "admissions",
                              "admission_drains", "prefill_groups", "padded_rows",
                              "graphs_captured_on_path", "graphs_run_uncaptured",
                              "graphs_captured_idle"}, scheduler
    check_levels(system["levels"], [1, 2], 3, 6)
    # each level's part of them: its requests (3) and warm-up (c) all prefilled whole
    for level in system["levels"]:
        moved = level["scheduler"]
        assert set(moved) == set(scheduler) - {"class", "max_waiting"}, moved
        assert 1 <= moved["prefill_groups"] <= 3 + level["concurrency"], moved
        assert moved["admission_drains"] <= moved["admissions"] <= moved["prefill_groups"]
    assert set(system["static"]) == {"1", "2"}
    assert all(s["output_tok_s"] > 0 for s in system["static"].values())
    for key in ("first_token_ms", "per_token_ms"):
        assert system["engine"][key] > 0
    assert results["build"]["target"]["max_batch_size"] == 2
    assert results["hf"]["output_tokens"] == 6
    for m in system["levels"]:
        assert not any(m["gauges_after"].values()), m["gauges_after"]  # no slot left behind
    for field in PRINTED:
        assert field in proc.stdout, field
    assert "built the target engine for 2 rows in" in proc.stdout
    assert "TPOT p50" in proc.stdout and "% of static generate" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("Hugging Face eager generate")
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert time.perf_counter() - start < 120


@pytest.mark.slow  # about 25 s on a 2-core CPU: a build, then a fresh process loads and serves
@pytest.mark.skipif(serving_available() is not None, reason=str(serving_available()))
def test_cold_start_times_fuser_serve_of_an_engine_directory(tmp_path: Path) -> None:
    """--cold-start alone: `fuser serve DIR` launched, /health 200, the first request and warm
    ones (tokens as the engine's), SIGTERM -> exit 0. The engine has one row: a loaded engine keeps only its max_batch_size bucket, and
    the scheduler prefills through a bucket of 1."""
    import torch
    import transformers

    import fuser
    from fuser.models import PRESETS

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**PRESETS["tiny-random-llama"])).eval()
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=1, max_seq_len=64,
                                                            compile="fx"))
    engine.save(tmp_path / "engine")
    proc = run_benchmark("--cold-start", str(tmp_path / "engine"), "--json",
                         str(tmp_path / "cold.json"))
    result = json.loads((tmp_path / "cold.json").read_text())["cold_start"]
    assert "error" not in result, result
    assert result["seconds_to_health_200"] > 0
    # random weights, no tokenizer in the engine: served with an id tokenizer, so every token
    # streams as text, and the ids the server generated are those of the engine in-process
    assert result["first_request"]["output_tokens"] == 16
    prompt = torch.tensor([list(range(3, 19))])
    assert result["tokens"] == engine.generate(prompt, 16)[0, 16:].tolist()
    assert result["same_text_warm"] and result["first_ttft_over_warm"] > 0
    assert result["exit_status"] == 0
    assert "cold start (launch -> /health 200)" in proc.stdout
    assert "cold start, first request: TTFT" in proc.stdout
    assert any(line.split()[:1] == ["total"] for line in result["breakdown"]), result
    assert "systems" not in json.loads((tmp_path / "cold.json").read_text())  # nothing else ran


def test_server_args_are_fuser_serve_flags() -> None:
    pytest.importorskip("fastapi")
    assert serve.serve_namespace([], 99).max_waiting == 99
    args = serve.serve_namespace(["--max-waiting", "7", "--adapt-draft"], 99)
    assert args.max_waiting == 7 and args.adapt_draft
    with pytest.raises(SystemExit, match="--no-such-flag"):
        serve.serve_namespace(["--no-such-flag"], 99)
    assert serve.serve_has_flag("--max-waiting") and not serve.serve_has_flag("--no-such-flag")


def test_cases_are_checked() -> None:
    args = serve.parse_args(["--cases", "rate,mixed", "--mixed-lengths", "4,40",
                             "--config", "kv_block_size=16", "--config", "compile=fx",
                             "--server-args", "--max-waiting 5"])
    assert args.cases == ["rate", "mixed"] and args.mixed_lengths == [4, 40]
    assert args.config == {"kv_block_size": 16, "compile": "fx"}
    assert args.server_args == ["--max-waiting", "5"]
    assert args.prefix_off_args == ["--no-prefix-caching"]
    # every case's longest request fits the engine built for it
    assert serve.needed_seq_len(args) == max(512, 40 + 256, 32 + 32)
    for bad in (["--cases", "levels,nope"], ["--mixed-lengths", "40,4"],
                ["--rate-start", "0"], ["--config", "novalue"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)


@pytest.mark.skipif(serving_available() is not None, reason=str(serving_available()))
def test_dry_run_of_the_issue_45_cases(tmp_path: Path) -> None:
    """shared-prefix (its uncached run given a harmless flag, so both runs serve and compare),
    mixed, rate and long-context on a tiny random Llama in one run, without the levels."""
    proc = run_benchmark(
        "--preset", "tiny-random-llama", "--compile", "fx", "--max-batch-size", "2",
        "--cases", "shared-prefix,mixed,rate,long-context", "--concurrency", "2",
        "--num-requests", "3", "--prompt-len", "8", "--output-len", "6",
        "--prefix-len", "24", "--prefix-own-len", "8", "--prefix-concurrency", "1,2",
        "--prefix-off-args", "--max-waiting 300", "--mixed-lengths", "4,40",
        "--rate-start", "4", "--rate-max", "8", "--rate-seconds", "1",
        "--rate-min-requests", "4", "--rate-max-requests", "16", "--rate-clients", "2",
        "--rate-bisections", "1", "--rate-prompt-len", "8", "--rate-output-len", "4",
        "--long-len", "64", "--long-output-len", "12", "--long-clients", "1",
        "--long-rounds", "2", "--json", str(tmp_path / "cases.json"))
    results = json.loads((tmp_path / "cases.json").read_text())
    assert "systems" not in results and "hf" not in results  # the levels did not run
    cases = results["cases"]

    shared = cases["shared-prefix"]
    assert [row["concurrency"] for row in shared["comparison"]] == [1, 2]
    for name in ("cached", "no prefix caching"):
        for m in shared["runs"][name]["levels"]:
            assert (m["completed"], m["errors"]) == (m["num_requests"], 0)
            assert all(r["prompt_tokens"] == 32 and r["text"] for r in m["requests"])
    # greedy on one engine: the same text whatever the server's flags
    assert all(row["identical"] and row["ratio"] > 0 for row in shared["comparison"])
    assert "shared prefix c=2: outputs identical with and without the cache: yes" in proc.stdout

    mixed = cases["mixed"]
    lengths = [r["prompt_tokens"] for m in mixed["levels"] for r in m["requests"]]
    assert all(4 <= n <= 40 for n in lengths) and len(set(lengths)) > 1
    assert all(m["errors"] == 0 for m in mixed["levels"])
    assert "mixed 4..40 c=2: 3 of 3 requests, 0 errors [limit 0] PASS" in proc.stdout

    rate = cases["rate"]
    assert [t["rate"] for t in rate["trials"]] == [4.0, 8.0] and rate["capped"]
    for t in rate["trials"]:  # the in-process server's TTFT histogram, every request answered
        assert t["ttft_source"] == "server" and t["errors"] == 0 and t["held"]
        assert t["completed"] == t["requests"] == max(4, math.ceil(t["rate"]))
        assert 0 < t["ttft_p50_ms"] <= t["ttft_p99_ms"] and t["within_1s"] == 1.0
    assert rate["rate"] == 8.0
    assert "request rate held (TTFT p99 <= 1 s, 0 errors): 8.0 req/s" in proc.stdout

    long = cases["long-context"]
    assert long["long_ok"] and long["long_output_tokens"] == 12
    assert long["short_errors"] == 0 and long["short_requests"] >= 3
    assert long["gaps_alone"] == 2 * 5 and long["itl_alone_p99_ms"] > 0
    assert "long context: the 64-token request completed" in proc.stdout
    for title in ("shared prefix (24 + 8 tokens per prompt)", "mixed prompt lengths 4..40",
                  "request rate: highest held 8.0 req/s", "long context (64 tokens)"):
        assert title in proc.stdout, title


def test_a_streamed_requests_ttft_does_not_count_making_a_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cold start's TTFT (`streamed_request`) runs through a client made beforehand:
    making an httpx client (its TLS context) took ~15 ms, 50 ms for a process's first, which
    the first and warm TTFTs counted. Here making one takes 0.3 s and the TTFT stays short."""
    import httpx

    events = [{"choices": [{"text": " t5"}]}, {"choices": [{"text": " t6"}]},
              {"choices": [], "usage": {"completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, text=body, headers={"content-type": "text/event-stream"}))
    client = httpx.Client(transport=transport)
    made = httpx.Client.__init__

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        made(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", slow)
    with client:
        result = serve.streamed_request(client, "http://127.0.0.1:1", "m", [1, 2], 2, 10.0)
    assert result["text"] == " t5 t6" and result["output_tokens"] == 2
    assert result["ttft"] < 0.2


@pytest.mark.parametrize("no_hf", [True, False])
def test_a_loaded_engine_builds_the_presets_model_only_for_hugging_face(monkeypatch, no_hf
                                                                        ) -> None:
    """--engine DIR --preset: the random transformers model of the preset's shape is built only
    when Hugging Face's generate will run (beside a paged engine's KV blocks it may not fit on
    the GPU; with --no-hf it ran out of memory there)."""
    import types

    import fuser
    import fuser.cli
    import fuser.server.cli

    built: list[str] = []
    engine = types.SimpleNamespace(config=types.SimpleNamespace(max_batch_size=4),
                                   vocab_size=99, tokenizer=None)
    monkeypatch.setattr(fuser.cli, "is_engine_dir", lambda path: True)
    monkeypatch.setattr(fuser.server.cli, "check_engine_precision", lambda *a: None)
    monkeypatch.setattr(fuser, "load", lambda path, **kw: engine)
    monkeypatch.setattr(serve, "load_models", lambda args: built.append(args.preset) or
                        ("model", None, None, "name"))
    argv = ["--engine", "/nowhere/e", "--preset", "tiny-random-llama"] + (["--no-hf"] * no_hf)
    source = serve.make_source(serve.parse_args(argv))
    assert source.engine is engine and source.vocab_size == 99
    assert built == ([] if no_hf else ["tiny-random-llama"])
    assert source.model == (None if no_hf else "model")


def test_each_level_sends_prompts_no_earlier_level_sent(monkeypatch) -> None:
    """A prompt sent again is a prefix-cache hit: every level's requests and warm-up take
    prompts of their own, and `requests_of` counts them all."""
    from concurrent.futures import Future

    sent: list[list[list[int]]] = []

    class Pool:
        def submit(self, fn, url, model, prompts, c, n, *rest):
            sent.append(prompts)
            done: Future = Future()
            done.set_result({"duration": 1.0, "warmup_errors": [],
                             "records": [dict(record(0.01, 0.1, 4, [0.03] * 3), prompt=p[0])
                                         for p in prompts[:n]]})
            return done

    monkeypatch.setattr(serve, "scrape_text", lambda url: "")
    monkeypatch.setattr(serve, "scrape_gauges", lambda url, *a, **kw: {})
    args = serve.parse_args(["--concurrency", "1,4,16", "--output-len", "4"])
    prompts = [[i, i] for i in range(serve.requests_of(args, args.levels))]
    assert len(prompts) == (8 + 1) + (8 + 4) + (32 + 16)
    serve.run_levels(Pool(), "http://127.0.0.1:1", "m", prompts, args, "fuser")
    assert [len(p) for p in sent] == [9, 12, 48]
    firsts = [p[0] for level in sent for p in level]
    assert sorted(firsts) == list(range(len(prompts)))  # every prompt once
