"""Serving: fuser's OpenAI-compatible server under concurrent streaming clients, in one run.

    # H200, the 8B shape with random bf16 weights, engine built for 64 rows (issue #40):
    python benchmarks/serve.py --preset llama-3-8b --max-batch-size 64 --max-seq-len 512 \\
        --json $OUT/serve.json --plot $OUT/serve.png
    # the bundled pair with speculation against the same server without the draft:
    python benchmarks/serve.py --draft --concurrency 1,4 --json $OUT/serve_pair.json
    # cold start of an engine directory: `fuser serve DIR` launched to /health 200
    python benchmarks/serve.py --cold-start DIR
    # a server that is already running
    python benchmarks/serve.py --url http://127.0.0.1:8000 --preset llama-3-8b
    # CPU: the plumbing on a tiny random model
    python benchmarks/serve.py --preset tiny-random-llama --compile fx --max-batch-size 2 \\
        --concurrency 1,2 --prompt-len 8 --output-len 6
    # issue #45's cases (benchmarks/gpu.sh serve256, serve256fp8, servepaged, serverate and
    # servelong run them on the GPU):
    python benchmarks/serve.py --preset llama-3-8b --max-batch-size 256 --precision fp8 \\
        --concurrency 1,16,64,128,256 --output-len 128
    python benchmarks/serve.py --preset llama-3-8b --max-batch-size 256 --max-seq-len 8192 \\
        --cases shared-prefix,mixed --concurrency 256 --config kv_block_size=16
    python benchmarks/serve.py --draft --max-batch-size 256 --cases rate
    python benchmarks/serve.py --preset llama-3.1-8b --max-batch-size 32 --cases long-context \\
        --config kv_block_size=16

The engine is built (or loaded) once, in this process; the server (fuser.server's app under
uvicorn, on 127.0.0.1) runs in a thread over it, and the load generator runs in a separate
process (asyncio + httpx), so that its parsing does not compete with the scheduler for this
process's interpreter lock. Each concurrency level c sends --num-requests requests (default
max(2c, 8)), at most c at a time, after a warm-up of c short requests: POST /v1/completions,
stream=true, the prompt as token ids (held-out text cut into --prompt-len-token windows, or
random ids for a preset's random weights), max_tokens=--output-len, temperature 0,
ignore_eos, stream_options.include_usage.

Per level, as vLLM's serving benchmark defines them: successful requests, errors, duration
(first request sent to last one finished), request throughput, output and total token
throughput; TTFT (request sent to the first chunk carrying a token), TPOT per request
((e2e - TTFT) / (output tokens - 1)), ITL (the gaps between successive token-carrying chunks:
a chunk that carries several tokens counts once) and end-to-end latency, each mean, p50, p99.

In the same run, on the same engine (before its server starts, so nothing else drives it):
its decode and first-token times (generate of one row, 1 and --output-len new tokens; on CUDA
also the target-only iteration graph, as benchmarks/decode.py times it), `generate` on a static
[c, prompt-len] batch for every level c <= the engine's max_batch_size (what continuous
batching costs), and Hugging Face eager `generate`, one request after another (--no-hf skips
it). With --draft, a second engine of the target alone serves the same levels (the speedup of
speculation through the server). The summary table comes last; --json writes everything,
--plot a PNG of output tok/s against TPOT p50.

--cases picks what runs, in order, on the one engine (default: levels, all of the above):
  shared-prefix  every prompt opens with the same --prefix-len-token system prompt, then
                 --prefix-own-len tokens of its own; each --prefix-concurrency level is served
                 with prefix caching and by a server with --no-prefix-caching: TTFT p50 both
                 ways, and whether the greedy outputs are identical;
  mixed          prompts of --mixed-lengths LO..HI tokens (uniform, seeded) at each level;
  rate           Poisson arrivals (vLLM's --request-rate), non-streamed, --rate-prompt-len
                 tokens in, --rate-output-len out: the highest rate held with TTFT p99 <= 1 s
                 (the server's TTFT histogram in /metrics: a non-streamed client sees no first
                 token) and 0 errors, by doubling then bisection, each trial bounded in
                 requests and seconds, sent by --rate-clients processes; a per-trial table;
  long-context   one --long-len-token request while --long-clients streams of short requests
                 run beside it: their ITL p99 with it against their ITL p99 alone.
Each case prints a short table and its criteria line (PASS/FAIL where issue #45 sets a bar) and
is saved under "cases" in the JSON. --precision and --config FIELD=VALUE shape the engine built
here (FuserConfig); --server-args passes `fuser serve` flags to the in-process server's
scheduler (fuser.server.cli.make_scheduler, as `fuser serve` builds it).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import json
import math
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serve_workloads import (gaps_within, histogram_delta, histogram_quantile, mixed_lengths,
                             parse_histogram, poisson_offsets, search_rate, shared_prefix_prompts,
                             windows)

# torch and fuser are imported inside the functions that need them: the load generator runs
# in a spawned process that imports this module again and must start quickly.
if TYPE_CHECKING:
    import httpx

RESULTS: dict = {}
PERCENTILES = (50, 99)
ROOT = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(message, flush=True)


def save(path: str | None) -> None:
    """Write RESULTS so far (each stage saves: a run cut short keeps what it measured)."""
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=2))


# -- the load generator (runs in its own process) ---------------------------------------------


@dataclass
class RequestResult:
    """One streamed completion, as the client saw it (seconds from the request's start)."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    start: float = 0.0  # since the level began
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    text: str = ""  # the completion's text, when asked for (keep_text)


async def stream_completion(client: object, url: str, body: dict, headers: dict,
                            started: float, keep_text: bool = False,
                            on_first: Callable[[], None] | None = None) -> RequestResult:
    """POST body to {url}/v1/completions with stream=true and time its server-sent events.

    A chunk carries a token when it has a choice whose text is not empty, or whose
    finish_reason is still None (a token that decodes to no text yet); the usage chunk and
    `data: [DONE]` carry none. Output tokens are usage.completion_tokens when the server sends
    usage, else the token-carrying chunks. keep_text: the result keeps the text; on_first is
    called when the first token arrives."""
    import httpx

    result = RequestResult(prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    result.start = start - started
    chunks, last, usage, done = 0, start, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason") is not None:
                        result.finish_reason = choice["finish_reason"]
                    if keep_text:
                        result.text += choice.get("text") or ""
                    if choice.get("text") or choice.get("finish_reason") is None:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                            if on_first is not None:
                                on_first()
                        else:
                            result.itl.append(now - last)
                        last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as error:
        result.error = f"{type(error).__name__}: {error}"[:300]
        return result
    result.e2e = time.perf_counter() - start
    if not done:
        result.error = "the stream ended without data: [DONE]"
        return result
    if chunks == 0:
        result.error = "no token in the stream"
        return result
    result.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and "prompt_tokens" in usage:
        result.prompt_tokens = int(usage["prompt_tokens"])
    result.ok = True
    return result


async def _drive(url: str, model: str, prompts: list[list[int]], concurrency: int,
                 num_requests: int, output_len: int, ignore_eos: bool, warmup_tokens: int,
                 api_key: str | None, timeout: float, keep_text: bool = False) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeouts = httpx.Timeout(connect=30.0, read=timeout, write=30.0, pool=None)
    gate = asyncio.Semaphore(concurrency)

    def body(i: int, tokens: int) -> dict:
        return {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
                "stream_options": {"include_usage": True}}

    async with httpx.AsyncClient(limits=limits, timeout=timeouts) as client:
        async def one(i: int, tokens: int, started: float) -> RequestResult:
            async with gate:
                return await stream_completion(client, url, body(i, tokens), headers, started,
                                               keep_text)

        warm = []
        if warmup_tokens > 0:  # connections opened, the level's batch bucket run once
            began = time.perf_counter()
            warm = await asyncio.gather(*(one(num_requests + i, warmup_tokens, began)
                                          for i in range(concurrency)))
        began = time.perf_counter()
        records = await asyncio.gather(*(one(i, output_len, began) for i in range(num_requests)))
        duration = time.perf_counter() - began
    return {"duration": duration, "records": [asdict(r) for r in records],
            "warmup_errors": [r.error for r in warm if not r.ok]}


def drive_level(url: str, model: str, prompts: list[list[int]], concurrency: int,
                num_requests: int, output_len: int, ignore_eos: bool = True,
                warmup_tokens: int = 8, api_key: str | None = None,
                timeout: float = 600.0, keep_text: bool = False) -> dict:
    """Send num_requests streamed completions (prompt i = prompts[i % len]), at most
    `concurrency` at a time, after a warm-up of `concurrency` requests of warmup_tokens
    (prompts num_requests + j). -> {"duration": seconds of the timed requests, "records":
    [RequestResult as dict], "warmup_errors": [...]}"""
    return asyncio.run(_drive(url, model, prompts, concurrency, num_requests, output_len,
                              ignore_eos, warmup_tokens, api_key, timeout, keep_text))


async def plain_completion(client: object, url: str, body: dict, headers: dict,
                           started: float) -> RequestResult:
    """POST body (stream false) to {url}/v1/completions. The client sees the whole answer at
    once, so its TTFT is its end-to-end latency (the server's own TTFT is in /metrics)."""
    import httpx

    result = RequestResult(prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    result.start = start - started
    try:
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        result.e2e = result.ttft = time.perf_counter() - start
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return result
        answer = response.json()
        result.output_tokens = int(answer["usage"]["completion_tokens"])
        result.finish_reason = answer["choices"][0].get("finish_reason")
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError) as error:
        result.error = f"{type(error).__name__}: {error}"[:300]
        return result
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no token in the answer"
    return result


def raise_open_files_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit: a rate trial past what
    the server holds keeps thousands of connections open (1,024 is a common soft limit)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


async def _drive_rate(url: str, model: str, prompts: list[list[int]], offsets: list[float],
                      start_at: float, output_len: int, api_key: str | None,
                      timeout: float) -> dict:
    import httpx

    raise_open_files_limit()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeouts = httpx.Timeout(timeout, connect=30.0, pool=None)
    lags: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeouts) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        began = time.perf_counter()

        async def one(i: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
            lags.append(time.perf_counter() - began - at)
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": output_len,
                    "temperature": 0.0, "stream": False, "ignore_eos": True}
            try:
                return await asyncio.wait_for(
                    plain_completion(client, url, body, headers, began), timeout)
            except asyncio.TimeoutError:
                return RequestResult(prompt_tokens=len(body["prompt"]), start=at,
                                     error=f"no answer within {timeout:g} s")

        records = await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
        duration = time.perf_counter() - began
    return {"duration": duration, "records": [asdict(r) for r in records], "lags": lags}


def drive_rate(url: str, model: str, prompts: list[list[int]], offsets: list[float],
               start_at: float, output_len: int, api_key: str | None = None,
               timeout: float = 60.0) -> dict:
    """Send one non-streamed greedy completion (ignore_eos, output_len tokens) at each of
    `offsets` (seconds after the wall-clock time `start_at`, shared by every client process),
    request i with prompts[i % len]. -> {"duration", "records": [RequestResult as dict],
    "lags": [seconds each request was sent after its time]}"""
    return asyncio.run(_drive_rate(url, model, prompts, offsets, start_at, output_len, api_key,
                                   timeout))


async def _drive_long(url: str, model: str, short_prompts: list[list[int]],
                      long_prompt: list[int], clients: int, output_len: int, long_tokens: int,
                      rounds: int, api_key: str | None, timeout: float) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    timeouts = httpx.Timeout(connect=30.0, read=timeout, write=30.0, pool=None)

    def body(prompt: list[int], tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}

    out: dict = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeouts) as client:
        began = time.perf_counter()

        async def rounds_of(j: int) -> list[RequestResult]:
            return [await stream_completion(
                client, url, body(short_prompts[(j * rounds + r) % len(short_prompts)],
                                  output_len), headers, began) for r in range(rounds)]

        alone = await asyncio.gather(*(rounds_of(j) for j in range(clients)))
        out["alone"] = [asdict(r) for rs in alone for r in rs]
        out["alone_duration"] = time.perf_counter() - began

        began = time.perf_counter()
        stop = asyncio.Event()
        started = [asyncio.Event() for _ in range(clients)]

        async def until_stopped(j: int) -> list[RequestResult]:
            done: list[RequestResult] = []
            while not done or not stop.is_set():
                prompt = short_prompts[(j + clients * len(done)) % len(short_prompts)]
                done.append(await stream_completion(client, url, body(prompt, output_len),
                                                    headers, began,
                                                    on_first=started[j].set))
                started[j].set()  # an error counts as started (it is counted as an error)
            return done

        async def the_long_one() -> RequestResult:
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout)
                return await stream_completion(client, url, body(long_prompt, long_tokens),
                                               headers, began)
            except asyncio.TimeoutError:
                return RequestResult(prompt_tokens=len(long_prompt),
                                     error=f"the short streams did not start in {timeout:g} s")
            finally:
                stop.set()

        long_task = asyncio.create_task(the_long_one())
        beside = await asyncio.gather(*(until_stopped(j) for j in range(clients)))
        long = await long_task
        out["beside"] = [asdict(r) for rs in beside for r in rs]
        out["long"] = asdict(long)
        out["window"] = [long.start, long.start + long.e2e]
    return out


def drive_long(url: str, model: str, short_prompts: list[list[int]], long_prompt: list[int],
               clients: int, output_len: int, long_tokens: int, rounds: int = 2,
               api_key: str | None = None, timeout: float = 600.0) -> dict:
    """The long-context case's load: `clients` streams of short requests (output_len tokens
    each), first alone (`rounds` requests each, back to back), then again, back to back, while
    one long request (long_prompt, long_tokens new tokens) runs beside them: it is sent once
    every stream has its first token, and the streams stop when it is done.
    -> {"alone": [records], "beside": [records], "long": record, "window": [sent, done] of
    the long one (seconds on the beside records' clock)}"""
    return asyncio.run(_drive_long(url, model, short_prompts, long_prompt, clients, output_len,
                                   long_tokens, rounds, api_key, timeout))


# -- metrics ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[dict], duration: float, concurrency: int) -> dict:
    """vLLM's serving metrics of one level from its request records (times in ms)."""
    ok = [r for r in records if r["ok"]]
    output = sum(r["output_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    metrics: dict = {
        "concurrency": concurrency, "num_requests": len(records), "completed": len(ok),
        "errors": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration > 0 else float("nan"),
        "output_throughput": output / duration if duration > 0 else float("nan"),
        "total_token_throughput": (prompt + output) / duration if duration > 0 else float("nan"),
        "finish_reasons": {},
    }
    for r in ok:
        reason = str(r["finish_reason"])
        metrics["finish_reasons"][reason] = metrics["finish_reasons"].get(reason, 0) + 1
    samples = {
        "ttft": [r["ttft"] for r in ok],
        "tpot": [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
                 for r in ok if r["output_tokens"] > 1],
        "itl": [gap for r in ok for gap in r["itl"]],
        "e2el": [r["e2e"] for r in ok],
    }
    for name, values in samples.items():
        ms = [1e3 * v for v in values]
        metrics[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else float("nan")
        metrics[f"median_{name}_ms"] = percentile(ms, 50)
        for q in PERCENTILES[1:]:
            metrics[f"p{q}_{name}_ms"] = percentile(ms, q)
    metrics["error_messages"] = sorted({r["error"] for r in records if not r["ok"]})[:5]
    return metrics


def format_level(m: dict, label: str) -> str:
    lines = [f"[{label}] concurrency {m['concurrency']}: {m['completed']} of {m['num_requests']} "
             f"requests succeeded, {m['errors']} errors, in {m['duration_s']:.2f} s",
             f"  request throughput      {m['request_throughput']:10.2f} req/s",
             f"  output token throughput {m['output_throughput']:10.1f} tok/s",
             f"  total token throughput  {m['total_token_throughput']:10.1f} tok/s",
             f"  {'(ms)':<22}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        lines.append(f"  {title:<22}{m[f'mean_{name}_ms']:10.2f}{m[f'median_{name}_ms']:10.2f}"
                     f"{m[f'p99_{name}_ms']:10.2f}")
    if m["errors"]:
        lines.append(f"  errors: {m['error_messages']}")
    return "\n".join(lines)


# -- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> float:
    """Poll GET {url}/health until it answers 200; -> the seconds it took. Raises
    RuntimeError on timeout or when `process` exits first."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before "
                               "/health answered 200")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")


def served_model(url: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def scrape_text(url: str) -> str:
    """GET {url}/metrics ("" when it does not answer)."""
    import httpx

    try:
        return httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return ""


def scrape_gauges(url: str, names: tuple[str, ...] = ("fuser_num_requests_running",
                                                        "fuser_num_requests_waiting",
                                                        "fuser_kv_slots_used"),
                  text: str | None = None) -> dict:
    """The named gauges (or counters) of GET /metrics, summed over their labels (after a
    level the gauges must be back at 0); {} if none. `text`: an exposition already scraped."""
    text = scrape_text(url) if text is None else text
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def serve_parser() -> argparse.ArgumentParser:
    """`fuser serve`'s own argument parser."""
    from fuser.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["serve"]


def serve_has_flag(flag: str) -> bool:
    """Whether `fuser serve` (this tree's) takes `flag`."""
    return any(flag in action.option_strings for action in serve_parser()._actions)


def serve_namespace(extra: list[str], max_waiting: int) -> argparse.Namespace:
    """`fuser serve`'s arguments for the in-process server: its defaults, then `extra` (flags
    of `fuser serve`, e.g. --no-prefix-caching), with --max-waiting `max_waiting` unless
    `extra` sets it. Flags fuser serve does not take are refused by name."""
    parser = serve_parser()
    args, unknown = parser.parse_known_args(["in-process", *extra])
    if unknown:
        raise SystemExit(f"--server-args: {' '.join(unknown)} is not a flag of this tree's "
                         "fuser serve (fuser serve --help)")
    if not any(word.split("=", 1)[0] == "--max-waiting" for word in extra):
        args.max_waiting = max_waiting
    return args


class InProcessServer:
    """fuser.server's app over the scheduler `fuser serve` would run on `engine` (its
    `make_scheduler`, given `serve_args`: `serve_namespace`), warmed up as `fuser serve` does,
    served by uvicorn in a thread on 127.0.0.1 at a free port. A context manager: leaving it
    stops both."""

    def __init__(self, engine: object, tokenizer: object, model_name: str,
                 max_waiting: int, serve_args: list[str] | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.serve_args = serve_namespace(serve_args or [], max_waiting)
        self.server = self.scheduler = None
        self.url = ""

    def __enter__(self) -> InProcessServer:
        from fuser.server import create_app
        from fuser.server.cli import make_scheduler, precapture, warm_up
        from fuser.server.runner import ServerThread

        try:
            self.scheduler = make_scheduler(self.engine, self.serve_args)
            self.scheduler.start()
            warm_up(self.scheduler, self.tokenizer)
            # (its idle-time captures of likely shapes done before the levels: --server-args
            # "--precapture-seconds 0" leaves every shape to the captures requests cause)
            precapture(self.scheduler, self.serve_args, wait=True)
            app = create_app(self.scheduler, self.tokenizer, self.model_name, engine=self.engine)
            self.server = ServerThread(app, "127.0.0.1", 0).start()
            self.url = self.server.url
            wait_healthy(self.url, timeout=60.0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
        if self.scheduler is not None:
            self.scheduler.close()


class IdTokenizer:
    """Token ids as text, for a preset's random weights (no tokenizer makes sense of them):
    decode gives " <id>" per token, so every token streams as a chunk of its own text; the
    prompts go to the server as ids. Its decoding costs less than a real tokenizer's."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, **kwargs: object) -> dict:
        return {"input_ids": [int(word) for word in text.split() if word.isdigit()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **kwargs: object) -> str:
        return "".join(f" {int(i)}" for i in ids)


def id_tokenizer_dir(vocab_size: int, path: Path) -> Path:
    """A tokenizer directory that decodes every id below `vocab_size` to text ("t<id>", joined
    by spaces) and encodes such text back: what `fuser serve` needs for an engine of random
    weights, whose ids mostly lie past any real tokenizer's vocabulary (they would decode to ""
    and stream no token). Written once under `path`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    if (path / "tokenizer.json").is_file():
        return path
    model = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    model.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="t0").save_pretrained(str(path))
    return path


def ids_of_text(text: str) -> list[int]:
    """The ids an id tokenizer's text (`id_tokenizer_dir`) stands for."""
    return [int(word[1:]) for word in text.split() if word[:1] == "t" and word[1:].isdigit()]


COLD_PROMPT = list(range(3, 19))  # 16 ids: the cold start's request prompt
COLD_TOKENS = 16  # tokens it asks for
WARM_REQUESTS = 3  # the same request again, after the first: the warm TTFT (median)


def streamed_request(client: httpx.Client, url: str, model: str, prompt: list[int],
                     max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion of `prompt` (ids) through `client`: TTFT (to the first
    chunk with text), end-to-end seconds, the text, and usage's completion tokens. The client
    is made beforehand: making one (its TLS context) takes ~15 ms, the first one in a process
    ~50 ms on the CPU machine, which a TTFT must not count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, tokens = None, "", 0
    with client.stream("POST", f"{url}/v1/completions", json=body,
                       timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text += choice["text"]
    if ttft is None:
        raise RuntimeError(f"no text in the stream ({tokens} tokens by usage)")
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "text": text,
            "output_tokens": tokens}


def cold_start(engine_dir: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Launch `fuser serve ENGINE_DIR` on 127.0.0.1 and time launch -> /health 200; then the
    first request (COLD_PROMPT, COLD_TOKENS greedy tokens, streamed) and WARM_REQUESTS more of
    the same (the warm TTFT), then SIGTERM (the server drains and exits: its status is kept).

    An engine of random weights (no tokenizer/ in it: engine_files.py's) is served with an id
    tokenizer (`id_tokenizer_dir`): its tokens then stream as text, and `tokens` are the ids
    the server generated, for comparison with the engine's own. `env`: the server's
    environment (default: this process's)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "fuser.cli", "serve", engine_dir, "--host", "127.0.0.1",
               "--port", str(port)]
    by_ids = not (Path(engine_dir) / "tokenizer").is_dir()
    scratch = tempfile.TemporaryDirectory()
    if by_ids:
        manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
        vocab = int(manifest["info"]["engine"]["vocab_size"])
        command += ["--tokenizer", str(id_tokenizer_dir(vocab, Path(scratch.name) / "ids"))]
    result: dict = {"engine_dir": engine_dir, "command": " ".join(command)}
    with tempfile.TemporaryFile("w+") as output, scratch:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=env)
        try:
            wait_healthy(url, timeout, process)
            result["seconds_to_health_200"] = time.perf_counter() - start
            log(f"cold start: `fuser serve {engine_dir}` answered /health 200 "
                f"{result['seconds_to_health_200']:.2f} s after launch")
            model = served_model(url, None)
            with httpx.Client() as client:
                first = streamed_request(client, url, model, COLD_PROMPT, COLD_TOKENS, timeout)
                warm = [streamed_request(client, url, model, COLD_PROMPT, COLD_TOKENS, timeout)
                        for _ in range(WARM_REQUESTS)]
            warm_ttft = sorted(w["ttft"] for w in warm)[len(warm) // 2]
            result["first_request"] = first
            result["warm_ttft"] = warm_ttft
            result["first_ttft_over_warm"] = first["ttft"] / warm_ttft
            if by_ids:
                result["tokens"] = ids_of_text(first["text"])
            result["same_text_warm"] = all(w["text"] == first["text"] for w in warm)
            log(f"cold start: first request TTFT {1e3 * first['ttft']:.1f} ms "
                f"({result['first_ttft_over_warm']:.2f}x the warm {1e3 * warm_ttft:.1f} ms), "
                f"{first['output_tokens']} tokens in {1e3 * first['e2e']:.1f} ms")
            stop = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            result["exit_status"] = process.wait(timeout=120)
            result["seconds_sigterm_to_exit"] = time.perf_counter() - stop
            log(f"cold start: SIGTERM -> exit status {result['exit_status']} in "
                f"{result['seconds_sigterm_to_exit']:.2f} s")
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
            result["error"] = str(error)
            log(f"cold start failed: {error}")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            output.seek(0)
            server_output = output.read()
            result["server_output_tail"] = server_output[-3000:]
            # the server's own breakdown of its cold start (fuser/server/cli.py), and the line
            # of the batch buckets captured in the background after ready
            result["breakdown"] = [line.removeprefix("fuser serve: ")
                                   for line in server_output.splitlines()
                                   if line.startswith("fuser serve:   ")
                                   or "cold start, launch to ready" in line
                                   or "in the background in" in line]
            if "error" in result:
                log(result["server_output_tail"])
    return result


# -- engines and prompts ----------------------------------------------------------------------


@dataclass
class Source:
    """What the run serves: the engine (or None with --url), the Hugging Face model behind it
    (None when loaded from an engine directory), tokenizer, a name, and the vocabulary."""

    engine: object | None
    model: object | None
    draft: object | None
    tokenizer: object | None
    name: str
    vocab_size: int


def device_and_dtype() -> tuple[object, object]:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_models(args: argparse.Namespace) -> tuple[object, object | None, object | None, str]:
    """(HF target, HF draft or None, tokenizer or None, name) from --preset or --model
    (default: the bundled pair's target; --draft alone: the bundled draft)."""
    from fuser.launch import load_pair
    from fuser.models import DRAFT_PATH, PRESETS, TARGET_PATH

    if args.preset:
        if args.draft:
            raise SystemExit("--draft with --preset: a random target's draft never agrees; "
                             "benchmarks/e2e.py measures that case")
        import torch
        import transformers

        device, dtype = device_and_dtype()
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)  # built directly in dtype on device
        try:
            with torch.device(device):
                model = transformers.LlamaForCausalLM(
                    transformers.LlamaConfig(**PRESETS[args.preset])).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        return model, None, None, f"{args.preset} (random weights, {str(dtype)[6:]})"
    model = args.model or str(TARGET_PATH)
    draft = args.draft if args.draft != "bundled" else str(DRAFT_PATH)
    target, draft_model, tokenizer, name = load_pair(model, draft)
    return target, draft_model, tokenizer, name


@contextmanager
def build_progress(start: float) -> Iterator[list[str]]:
    """Print the build's progress lines (the "fuser" logger's INFO: each step kind over the
    buckets, each bucket's warm-up with its compile, each bucket's captures), each with the
    seconds since `start`; yields the list they are also collected in (RESULTS["build"]):
    where a many-bucket build spends its time."""
    import logging

    lines: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = f"+{time.perf_counter() - start:7.1f} s  {record.getMessage()}"
            lines.append(line)
            log(f"  [build] {line}")

    logger = logging.getLogger("fuser")
    handler, level = Handler(logging.INFO), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def build(args: argparse.Namespace, target: object, draft: object | None,
          tokenizer: object | None, max_seq_len: int, what: str) -> object:
    """fuser's engine of target (+ draft), timed (RESULTS["build"][what])."""
    import warnings

    import fuser
    from fuser.pipeline import build_engine

    device, _ = device_and_dtype()
    # The scheduler prefills through a bucket of 1: CUDA builds every bucket, the CPU only the
    # largest unless asked.
    buckets = "auto" if device.type == "cuda" else (1,)
    fields = {"max_batch_size": args.max_batch_size, "max_seq_len": max_seq_len,
              "compile": args.compile, "batch_buckets": buckets,
              "precision": args.precision or "auto",
              "tensor_parallel": getattr(args, "tensor_parallel_size", 1),
              **args.config}
    try:
        config = fuser.FuserConfig(**fields)
    except (TypeError, ValueError) as error:  # a --config field this tree's FuserConfig
        raise SystemExit(f"--config: {error}") from None  # lacks, or a value it refuses
    extra = "".join(f", {k} {v}" for k, v in args.config.items())
    log(f"building the {what} engine: max_batch_size {args.max_batch_size}, max_seq_len "
        f"{max_seq_len}, compile {args.compile}, precision {args.precision or 'auto'}{extra} ...")
    start = time.perf_counter()
    with warnings.catch_warnings(), build_progress(start) as steps:
        warnings.simplefilter("ignore", FutureWarning)
        engine = build_engine(target, draft, config, tokenizer)
    seconds = time.perf_counter() - start
    RESULTS.setdefault("build", {})[what] = {"seconds": seconds,
                                             "max_batch_size": args.max_batch_size,
                                             "max_seq_len": max_seq_len,
                                             "precision": args.precision,
                                             "config": args.config,
                                             "steps": steps,
                                             "fallbacks": engine.report().fallbacks}
    log(f"built the {what} engine for {args.max_batch_size} rows in {seconds:.1f} s")
    return engine


def needed_seq_len(args: argparse.Namespace) -> int:
    """The engine's max_seq_len for every case asked: max(512, the longest request)."""
    need = [512, args.prompt_len + args.output_len]
    if "shared-prefix" in args.cases:
        need.append(args.prefix_len + args.prefix_own_len + args.output_len)
    if "mixed" in args.cases:
        need.append(args.mixed_lengths[1] + args.output_len)
    if "rate" in args.cases:
        need.append(args.rate_prompt_len + args.rate_output_len)
    if "long-context" in args.cases:
        need.append(args.long_len + args.long_output_len)
    return max(need)


def make_source(args: argparse.Namespace) -> Source:
    """Build or load the engine to serve (none with --url)."""
    from fuser.cli import is_engine_dir

    max_seq_len = args.max_seq_len or needed_seq_len(args)
    if max_seq_len < needed_seq_len(args):
        log(f"note: --max-seq-len {max_seq_len} is below the {needed_seq_len(args)} tokens the "
            "longest request of these cases needs: the server refuses those (400, errors)")
    if args.url:
        if args.preset:
            from fuser.models import PRESETS

            return Source(None, None, None, None, args.preset, PRESETS[args.preset]["vocab_size"])
        tokenizer = tokenizer_of(args.model)
        return Source(None, None, None, tokenizer, "server", len(tokenizer))
    if is_engine_dir(args.model):
        import fuser
        from fuser.server.cli import check_engine_precision

        try:
            check_engine_precision(args.model, args.precision)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        log(f"loading the engine directory {args.model} ...")
        start = time.perf_counter()
        # Every batch bucket's graphs before measuring (a load otherwise returns with bucket 1's
        # and captures the rest in the background).
        engine = fuser.load(args.model, wait_for_graphs=True)
        seconds = time.perf_counter() - start
        RESULTS["load"] = {"seconds": seconds, "engine_dir": args.model,
                           "max_batch_size": engine.config.max_batch_size}
        log(f"loaded in {seconds:.1f} s (max_batch_size {engine.config.max_batch_size})")
        model = None
        if args.preset and not args.no_hf:  # the same random shape for Hugging Face (the
            # engine's own weights are not a transformers model once loaded); not built when
            # unused: beside a paged engine's KV blocks it may not fit
            model = load_models(argparse.Namespace(**{**vars(args), "model": None}))[0]
        vocab = engine.vocab_size
        return Source(engine, model, None, engine.tokenizer, Path(args.model).name, vocab)
    target, draft, tokenizer, name = load_models(args)
    engine = build(args, target, draft, tokenizer, max_seq_len,
                   "speculative" if draft is not None else "target")
    if args.save_engine:
        start = time.perf_counter()
        engine.save(args.save_engine, overwrite=True)
        RESULTS["save_seconds"] = time.perf_counter() - start
        log(f"saved to {args.save_engine} in {RESULTS['save_seconds']:.1f} s")
    return Source(engine, target, draft, tokenizer, name, engine.vocab_size)


def token_stream(tokenizer: object | None, vocab_size: int, total: int) -> list[int]:
    """A stream of at least min(`total`, what the text holds) token ids to cut prompts from:
    the held-out sample's files, tokenized and concatenated, when there is a tokenizer; else
    `total` random ids in [3, vocab_size) (seeded)."""
    import random

    if tokenizer is None:
        rng = random.Random(0)
        return [rng.randrange(3, vocab_size) for _ in range(total)]
    from fuser.models.evaluate import heldout_files

    stream: list[int] = []
    for text in heldout_files():
        stream += tokenizer(text, verbose=False)["input_ids"]
        if len(stream) >= total:
            break
    return stream


def tokenizer_of(path: str | None) -> object:
    from transformers import AutoTokenizer

    from fuser.models import TARGET_PATH

    return AutoTokenizer.from_pretrained(path or TARGET_PATH)


def make_prompts(tokenizer: object | None, vocab_size: int, length: int, count: int,
                 fewer: bool = False) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids: windows of the held-out sample's files
    (each file's first window, then each file's second, ...) when there is a tokenizer, else
    random ids in [3, vocab_size) (seeded). fewer: where the sample has fewer windows, all it
    has (said on stderr), else ValueError."""
    import torch

    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab_size, (count, length), generator=g).tolist()
    from fuser.models.evaluate import heldout_files

    files = [tokenizer(text, verbose=False)["input_ids"] for text in heldout_files()]
    prompts: list[list[int]] = []
    window = 0
    while len(prompts) < count:
        row = [ids[window * length:(window + 1) * length] for ids in files
               if len(ids) >= (window + 1) * length]
        if not row and fewer and prompts:
            log(f"note: the held-out sample has {len(prompts)} {length}-token windows, not "
                f"{count}: later levels send some prompts again (prefix-cache hits)")
            break
        if not row:
            raise ValueError(f"the held-out sample has too few {length}-token windows for "
                             f"{count} prompts")
        prompts += row
        window += 1
    return prompts[:count]


# -- the engine's own figures, static batches, Hugging Face ----------------------------------


def timed(fn: object, runs: int) -> float:
    """Median seconds of fn() over `runs` calls (synchronized on CUDA)."""
    import torch

    samples = []
    for _ in range(runs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def engine_figures(engine: object, prompt: list[int], output_len: int, runs: int) -> dict:
    """One row through `generate`: the first token (prefill + set-up) and each further one
    ((t(n) - t(1)) / (n - 1), the median over runs of t(1) and t(n) timed one after the other,
    so that both see the same load); on CUDA also the target-only iteration graph at the run's
    mid length (CUDA events; decode.py's "iteration_ms")."""
    import torch

    figures = {}
    if engine.device.type == "cuda" and engine.target is not None:
        from fuser.runtime.step_graphs import PLAIN

        bucket = engine.bucket(1)
        figures["iteration_ms"] = 1e3 * bucket.measure(PLAIN, len(prompt) + output_len // 2, 20)
        bucket.reset_for_timing(0)  # generate below loads the state afresh
    ids = torch.tensor([prompt], device=engine.device)
    no_eos = dict(eos_token_id=[])
    engine.generate(ids, 2, **no_eos)  # warm
    pairs = [(timed(lambda: engine.generate(ids, 1, **no_eos), 1),
              timed(lambda: engine.generate(ids, output_len, **no_eos), 1))
             for _ in range(runs)]  # (a busy host's slow spell falls on one pair)
    first = statistics.median(f for f, _ in pairs)
    whole = statistics.median(w for _, w in pairs)
    further = statistics.median(w - f for f, w in pairs)
    figures.update(first_token_ms=1e3 * first,
                   per_token_ms=1e3 * further / max(output_len - 1, 1),
                   generate_tok_s=output_len / whole)
    log(f"engine, one row: first token (prefill of {len(prompt)} + set-up) "
        f"{figures['first_token_ms']:.2f} ms, then {figures['per_token_ms']:.3f} ms per token "
        f"({figures['generate_tok_s']:.1f} tok/s)"
        + (f"; target-only iteration graph {figures['iteration_ms']:.3f} ms"
           if "iteration_ms" in figures else ""))
    return figures


def static_batches(engine: object, prompts: list[list[int]], levels: list[int], output_len: int,
                   runs: int) -> dict[int, dict]:
    """`generate` on a static [c, prompt_len] batch, eos ignored, for each level c the engine
    holds: output tok/s (c * new tokens / seconds, median of runs)."""
    import torch

    out = {}
    for c in levels:
        if c > engine.config.max_batch_size:
            log(f"static batch {c}: above the engine's max_batch_size "
                f"{engine.config.max_batch_size}, skipped")
            continue
        ids = torch.tensor([prompts[i % len(prompts)] for i in range(c)], device=engine.device)
        engine.generate(ids, 2, eos_token_id=[])  # warm this bucket
        new = []
        seconds = timed(lambda: new.append(
            engine.generate(ids, output_len, eos_token_id=[]).shape[1] - ids.shape[1]), runs)
        tokens = c * new[-1]
        out[c] = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}
        log(f"static batch {c} x {ids.shape[1]} tokens, {new[-1]} new: generate "
            f"{tokens / seconds:.1f} output tok/s ({seconds:.3f} s)")
    return out


def hf_sequential(model: object, prompts: list[list[int]], output_len: int, requests: int
                  ) -> dict:
    """Hugging Face eager `generate`, `requests` prompts one after another, eos ignored."""
    import torch
    from peers import make_hf_eager

    device = next(model.parameters()).device
    make_hf_eager(model, torch.tensor([prompts[0]], device=device), 2)()  # warm
    tokens, seconds = 0, 0.0
    for i in range(requests):
        run = make_hf_eager(model, torch.tensor([prompts[i % len(prompts)]], device=device),
                            output_len)
        new = []
        seconds += timed(lambda: new.append(run().shape[1]), 1)
        tokens += new[-1]
    result = {"requests": requests, "output_tokens": tokens, "seconds": seconds,
              "output_tok_s": tokens / seconds}
    log(f"Hugging Face eager generate, {requests} requests one after another: "
        f"{result['output_tok_s']:.1f} tok/s")
    return result


# -- the run ----------------------------------------------------------------------------------


def run_levels(pool: ProcessPoolExecutor, url: str, model: str, prompts: list[list[int]],
               args: argparse.Namespace, label: str, levels: list[int] | None = None,
               keep_text: bool = False, scheduler: object | None = None) -> list[dict]:
    """Each concurrency level (default --concurrency) through `drive_level`, summarized and
    printed. keep_text: each request's record keeps its text. scheduler (an in-process
    server's): each level records and prints what its counters moved by (`scheduler_counters`:
    the level's warm-up round included)."""
    out = []
    kept = ("ok", "start", "ttft", "e2e", "output_tokens", "prompt_tokens", "error") + \
        (("text",) if keep_text else ())
    offset = 0  # each level's requests and warm-up take prompts no earlier level sent: a
    # prompt sent again would be a prefix-cache hit (`requests_of` sizes the prompts so)
    for c in levels or args.levels:
        n = args.num_requests or max(2 * c, 8)
        fresh = [prompts[(offset + i) % len(prompts)] for i in range(n + c)]
        offset += n + c
        before = scheduler_counters(scheduler) if scheduler is not None else {}
        raw = pool.submit(drive_level, url, model, fresh, c, n, args.output_len,
                          args.ignore_eos, min(8, args.output_len), args.api_key,
                          args.timeout, keep_text).result()
        metrics = summarize(raw["records"], raw["duration"], c)
        metrics["warmup_errors"] = raw["warmup_errors"]
        metrics["requests"] = [{k: r[k] for k in kept} for r in raw["records"]]
        exposition = scrape_text(url)
        metrics["gauges_after"] = scrape_gauges(url, text=exposition)
        gpu = scrape_gauges(url, GPU_GAUGES, text=exposition)  # NVML, where the server has it
        short = sum(r["ok"] and r["output_tokens"] != args.output_len for r in raw["records"])
        metrics["short_requests"] = short
        log(format_level(metrics, label))
        if short and args.ignore_eos:
            log(f"  {short} requests returned fewer than --output-len tokens with ignore_eos")
        if gpu:
            metrics["gpu_gauges_after"] = gpu
            log(f"  GPU after the level (NVML, summed over GPUs): memory used "
                f"{gpu.get(GPU_GAUGES[0], 0) / 2**30:.1f} GiB, utilization "
                f"{gpu.get(GPU_GAUGES[1], 0):.0f}%")
        if any(metrics["gauges_after"].values()):
            log(f"  gauges after the level (should be 0): {metrics['gauges_after']}")
        if scheduler is not None:
            moved = {k: v - before.get(k, 0) for k, v in scheduler_counters(scheduler).items()}
            metrics["scheduler"] = moved
            log(f"  scheduler over the level (warm-up included): {format_counters(moved)}")
        out.append(metrics)
        save(args.json)
    return out


def serve_engine(pool: ProcessPoolExecutor, source: Source, engine: object, label: str,
                 prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Engine figures and static batches, then the levels through an in-process server."""
    result: dict = {"label": label}
    RESULTS.setdefault("systems", {})[label] = result
    runs = args.runs
    result["engine"] = engine_figures(engine, prompts[0], args.output_len, runs)
    if not args.no_static:
        result["static"] = static_batches(engine, prompts, args.levels, args.output_len, runs)
    save(args.json)
    max_waiting = max(args.levels) * 4 + (args.num_requests or 0)
    tokenizer = source.tokenizer or IdTokenizer(source.vocab_size)
    with InProcessServer(engine, tokenizer, source.name, max_waiting,
                         args.server_args) as server:
        log(f"[{label}] serving {source.name} at {server.url}")
        result["scheduler"] = {"class": type(server.scheduler).__name__,
                               "max_waiting": server.scheduler.max_waiting}
        if getattr(server.scheduler, "max_num_batched_tokens", None):  # chunked prefill
            result["scheduler"]["max_num_batched_tokens"] = \
                server.scheduler.max_num_batched_tokens
        engine.stats.reset()
        result["levels"] = run_levels(pool, server.url, served_model(server.url, None), prompts,
                                      args, label, scheduler=server.scheduler)
        result["scheduler"].update(scheduler_counters(server.scheduler))
        log(f"[{label}] scheduler over the levels: {result['scheduler']}")
    if engine.draft is not None:  # what speculation did over every level's requests
        stats = engine.stats
        result["speculation"] = {"drafts": stats.num_drafts,
                                 "mean_accepted_length": stats.mean_accepted_length}
        log(f"[{label}] speculation over the levels: {stats.num_drafts} drafts, mean accepted "
            f"length {stats.mean_accepted_length:.2f}")
    return result


def scheduler_counters(scheduler: object) -> dict[str, int]:
    """The scheduler's counts over its life (the warm-up's few requests included): steps
    read back, steps queued before the previous one was read back (`steps_ahead`), of which
    after a prompt chunk (`chunks_ahead`), prompt chunks run, preemptions; admissions (each
    a stop of the steps queued ahead), of which while rows decoded (`admission_drains`: each
    stalled them), the whole-prompt prefills they ran (`prefill_groups`) and the dummy rows
    those ran to fill their buckets (`padded_rows`); prefill and chunk CUDA graphs captured
    on a request's path (`graphs_captured_on_path`, 0 unless the scheduler captures there),
    prefills and chunks run uncaptured while their shape waited for its capture
    (`graphs_run_uncaptured`), and graphs captured while idle (`graphs_captured_idle`)."""
    names = ("steps", "steps_ahead", "chunks_ahead", "prefill_chunks", "preemptions",
             "admissions", "admission_drains", "prefill_groups", "padded_rows",
             "graphs_captured_on_path", "graphs_run_uncaptured", "graphs_captured_idle")
    return {name: int(getattr(scheduler, name)) for name in names if hasattr(scheduler, name)}


def format_counters(counters: dict[str, int]) -> str:
    """One line of `scheduler_counters` (or their change over a level)."""
    return ", ".join(f"{name} {value}" for name, value in counters.items())


# -- the cases beyond the concurrency levels (issue #45) ---------------------------------------

GPU_GAUGES = ("fuser_gpu_memory_used_bytes", "fuser_gpu_utilization_perc")
CASES = ("levels", "shared-prefix", "mixed", "rate", "long-context")
TTFT_HISTOGRAM = "fuser_time_to_first_token_seconds"
PREFIX_COUNTERS = ("fuser_prefix_cache_queries_total", "fuser_prefix_cache_hits_total")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def case_waiting(args: argparse.Namespace) -> int:
    """The in-process server's --max-waiting for the cases: room for every request a case
    keeps in flight (429s would count as errors that the server's bound, not its speed, made)."""
    levels = args.levels + args.prefix_levels
    most = max(4 * max(levels) + (args.num_requests or 0), 1024)
    return max(most, args.rate_max_requests) if "rate" in args.cases else most


@contextmanager
def server_for(source: Source, engine: object, args: argparse.Namespace,
               extra: list[str]) -> Iterator[str]:
    """The URL a case drives: the server at --url (`extra` cannot reach it), or an in-process
    server over `engine` with --server-args and `extra` (flags of `fuser serve`)."""
    if args.url:
        yield args.url
        return
    tokenizer = source.tokenizer or IdTokenizer(source.vocab_size)
    with InProcessServer(engine, tokenizer, source.name, case_waiting(args),
                         args.server_args + extra) as server:
        yield server.url


def requests_of(args: argparse.Namespace, levels: list[int]) -> int:
    """Prompts a set of levels needs, none sent twice (`run_levels`): each level's requests
    plus its warm-up."""
    return sum((args.num_requests or max(2 * c, 8)) + c for c in levels)


def shared_prefix_case(pool: ProcessPoolExecutor, source: Source, engine: object,
                       args: argparse.Namespace) -> dict:
    """Every prompt opens with the same --prefix-len-token system prompt, then
    --prefix-own-len tokens of its own; each --prefix-concurrency level is served with prefix
    caching (the server's default) and again by a server with --prefix-off-args (default
    --no-prefix-caching): TTFT p50 both ways, and whether the greedy outputs are identical."""
    levels = args.prefix_levels
    count = requests_of(args, levels)
    stream = token_stream(source.tokenizer, source.vocab_size,
                          args.prefix_len + count * args.prefix_own_len)
    cut = windows(stream, [args.prefix_len] + [args.prefix_own_len] * count)
    prompts = shared_prefix_prompts(cut[0], cut[1:])
    result: dict = {"prefix_len": args.prefix_len, "own_len": args.prefix_own_len,
                    "levels": levels, "runs": {}}
    off = args.prefix_off_args
    for name, extra in (("cached", []), ("no prefix caching", off)):
        missing = [w for w in extra if w.startswith("--") and not serve_has_flag(w.split("=")[0])]
        if extra and args.url:
            result["runs"][name] = {"skipped": "a server at --url keeps its own flags"}
        elif missing:
            result["runs"][name] = {"skipped": f"this tree's fuser serve has no "
                                               f"{' '.join(missing)}"}
        if "skipped" in result["runs"].get(name, {}):
            log(f"[shared prefix] {name}: skipped ({result['runs'][name]['skipped']})")
            continue
        with server_for(source, engine, args, extra) as url:
            before = scrape_gauges(url, PREFIX_COUNTERS)
            served = run_levels(pool, url, served_model(url, args.api_key), prompts, args,
                                f"shared prefix, {name}", levels, keep_text=True)
            after = scrape_gauges(url, PREFIX_COUNTERS)
        result["runs"][name] = {"levels": served,
                                "prefix_cache": {k: after[k] - before.get(k, 0.0)
                                                 for k in after}}
        save(args.json)
    runs = result["runs"]
    result["comparison"] = []
    if "levels" in runs.get("cached", {}) and "levels" in runs.get("no prefix caching", {}):
        for on, off in zip(runs["cached"]["levels"], runs["no prefix caching"]["levels"]):
            same = [a["ok"] and b["ok"] and a["text"] == b["text"]
                    for a, b in zip(on["requests"], off["requests"])]
            result["comparison"].append({
                "concurrency": on["concurrency"], "ttft_p50_cached_ms": on["median_ttft_ms"],
                "ttft_p50_uncached_ms": off["median_ttft_ms"],
                "ratio": on["median_ttft_ms"] / off["median_ttft_ms"],
                "identical": all(same), "differing": same.count(False)})
    log(shared_prefix_table(result))
    return result


def shared_prefix_table(result: dict) -> str:
    lines = [f"shared prefix ({result['prefix_len']} + {result['own_len']} tokens per prompt)",
             f"  {'c':>4}{'TTFT p50 cached':>18}{'without cache':>16}{'ratio':>8}"
             f"{'identical':>11}"]
    for row in result["comparison"]:
        lines.append(f"  {row['concurrency']:>4}{row['ttft_p50_cached_ms']:>15.2f} ms"
                     f"{row['ttft_p50_uncached_ms']:>13.2f} ms{row['ratio']:>8.3f}"
                     f"{'yes' if row['identical'] else 'NO':>11}")
    for name, run in result["runs"].items():
        if "skipped" in run:
            lines.append(f"  {name}: skipped ({run['skipped']})")
        elif not result["comparison"]:
            lines += [f"  {name}: c={m['concurrency']} TTFT p50 {m['median_ttft_ms']:.2f} ms"
                      for m in run["levels"]]
        if run.get("prefix_cache"):
            lines.append(f"  {name}: prefix cache over the run: {run['prefix_cache']}")
    return "\n".join(lines)


def mixed_case(pool: ProcessPoolExecutor, source: Source, engine: object,
               args: argparse.Namespace) -> dict:
    """Prompts of --mixed-lengths lo,hi tokens (uniform, seeded), at every --concurrency
    level."""
    lo, hi = args.mixed_lengths
    lengths = mixed_lengths(lo, hi, requests_of(args, args.levels), seed=1)
    stream = token_stream(source.tokenizer, source.vocab_size, sum(lengths))
    prompts = windows(stream, lengths)
    with server_for(source, engine, args, []) as url:
        served = run_levels(pool, url, served_model(url, args.api_key), prompts, args,
                            f"mixed {lo}..{hi}")
    result = {"lengths": [lo, hi], "mean_prompt_len": sum(lengths) / len(lengths),
              "levels": served}
    lines = [f"mixed prompt lengths {lo}..{hi} (mean {result['mean_prompt_len']:.0f})",
             f"  {'c':>4}{'ok':>6}{'err':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'ITL p99':>9}"]
    lines += [f"  {m['concurrency']:>4}{m['completed']:>6}{m['errors']:>5}"
              f"{m['output_throughput']:>11.1f}{m['median_ttft_ms']:>10.2f}"
              f"{m['p99_ttft_ms']:>10.2f}{m['p99_itl_ms']:>9.2f}" for m in served]
    log("\n".join(lines))
    return result


def wait_drained(url: str, timeout: float) -> bool:
    """Poll the gauges until nothing runs or waits (a trial's stragglers are done)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        gauges = scrape_gauges(url)
        if not gauges or not (gauges.get("fuser_num_requests_running", 0)
                              or gauges.get("fuser_num_requests_waiting", 0)):
            return True
        time.sleep(0.1)
    return False


def rate_trial(clients: ProcessPoolExecutor, url: str, model: str, prompts: list[list[int]],
               rate: float, args: argparse.Namespace, seed: int) -> dict:
    """One trial of the request-rate search: Poisson arrivals at `rate`, split round-robin over
    --rate-clients processes (together exactly the one Poisson schedule), bounded by
    --rate-seconds of arrivals and --rate-max-requests requests; then its figures."""
    n = min(args.rate_max_requests, max(args.rate_min_requests,
                                        math.ceil(rate * args.rate_seconds)))
    offsets = poisson_offsets(rate, n, seed)
    k = max(1, min(args.rate_clients, n))
    before = scrape_text(url)
    start_at = time.time() + 0.5
    futures = [clients.submit(drive_rate, url, model,
                              [prompts[i % len(prompts)] for i in range(j, n, k)],
                              offsets[j::k], start_at, args.rate_output_len, args.api_key,
                              args.rate_timeout) for j in range(k)]
    raws = [f.result() for f in futures]
    drained = wait_drained(url, args.timeout)
    after = scrape_text(url)
    records = [r for raw in raws for r in raw["records"]]
    lags = [lag for raw in raws for lag in raw["lags"]]
    ok = [r for r in records if r["ok"]]
    duration = max(raw["duration"] for raw in raws)
    trial = {"requests": n, "completed": len(ok), "errors": len(records) - len(ok),
             "offered_rate": n / offsets[-1], "duration_s": duration,
             "request_throughput": len(ok) / duration,
             "output_throughput": sum(r["output_tokens"] for r in ok) / duration,
             "e2e_p50_ms": percentile([1e3 * r["e2e"] for r in ok], 50),
             "e2e_p99_ms": percentile([1e3 * r["e2e"] for r in ok], 99),
             "lag_p99_ms": percentile([1e3 * lag for lag in lags], 99),
             "drained": drained,
             "error_messages": sorted({r["error"] for r in records if not r["ok"]})[:5]}
    ttft = histogram_delta(parse_histogram(before, TTFT_HISTOGRAM),
                           parse_histogram(after, TTFT_HISTOGRAM))
    if ttft and ttft[math.inf] > 0:  # the server's TTFT (arrival to first token)
        below = [le for le in ttft if le <= 1.0]
        trial.update(ttft_source="server", ttft_p50_ms=1e3 * histogram_quantile(0.5, ttft),
                     ttft_p99_ms=1e3 * histogram_quantile(0.99, ttft),
                     within_1s=(ttft[max(below)] if below else 0.0) / ttft[math.inf])
    else:  # a server without the histogram: the client's end-to-end latency bounds TTFT
        e2e = [r["e2e"] for r in ok]
        trial.update(ttft_source="client e2e", ttft_p50_ms=trial["e2e_p50_ms"],
                     ttft_p99_ms=trial["e2e_p99_ms"],
                     within_1s=sum(x <= 1.0 for x in e2e) / len(records) if records else 0.0)
    reasons = []
    if trial["errors"]:
        reasons.append(f"{trial['errors']} errors")
    if trial["within_1s"] < 0.99:
        reasons.append(f"TTFT <= 1 s for {100 * trial['within_1s']:.1f}% only")
    if trial["lag_p99_ms"] > 1e3 * args.rate_max_lag:
        reasons.append(f"the clients sent late (p99 {trial['lag_p99_ms']:.0f} ms: add "
                       "--rate-clients)")
    trial["held"], trial["why_not"] = not reasons, "; ".join(reasons)
    log(f"[rate] {rate:>9.1f}  {rate_row(dict(trial, rate=rate))}")
    return trial


def rate_row(t: dict) -> str:
    return (f"{t['requests']:>6}{t['completed']:>6}{t['errors']:>5}{t['offered_rate']:>9.1f}"
            f"{t['request_throughput']:>9.1f}{t['ttft_p50_ms']:>10.1f}{t['ttft_p99_ms']:>10.1f}"
            f"{100 * t['within_1s']:>8.1f}{t['e2e_p99_ms']:>10.1f}{t['lag_p99_ms']:>8.1f}  "
            + ("held" if t["held"] else f"not held: {t['why_not']}"))


def rate_case(source: Source, engine: object, args: argparse.Namespace) -> dict:
    """The highest Poisson request rate held with TTFT p99 <= 1 s and 0 errors (non-streamed,
    --rate-prompt-len-token prompts, --rate-output-len new tokens, ignore_eos): doubling from
    --rate-start up to --rate-max, then --rate-bisections trials (`search_rate`)."""
    import multiprocessing

    raise_open_files_limit()  # the in-process server's side of the connections
    count = args.rate_max_requests
    stream = token_stream(source.tokenizer, source.vocab_size, count * args.rate_prompt_len)
    prompts = windows(stream, [args.rate_prompt_len] * count)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.rate_clients, mp_context=context) as clients, \
            server_for(source, engine, args, []) as url:
        model = served_model(url, args.api_key)
        warm = clients.submit(drive_level, url, model, prompts, 8, 8, args.rate_output_len,
                              True, 0, args.api_key, args.timeout).result()
        log(f"[rate] warm-up: {sum(r['ok'] for r in warm['records'])} of 8 requests; TTFT from "
            "the server's histogram when it has one")
        log(f"[rate] {'req/s':>9}  {RATE_HEADER}")
        seeds = itertools.count()  # each trial's Poisson schedule its own
        found = search_rate(lambda rate: rate_trial(clients, url, model, prompts, rate, args,
                                                    seed=next(seeds)),
                            args.rate_start, args.rate_max, args.rate_bisections)
    result = {"prompt_len": args.rate_prompt_len, "output_len": args.rate_output_len, **found}
    lines = [f"request rate (Poisson, non-streamed, {args.rate_prompt_len}-token prompts, "
             f"{args.rate_output_len} new tokens): highest held {found['rate']:.1f} req/s"
             + (" (the search's --rate-max)" if found["capped"] else ""),
             f"  {'req/s':>9}  {RATE_HEADER}"]
    lines += [f"  {t['rate']:>9.1f}  {rate_row(t)}" for t in found["trials"]]
    log("\n".join(lines))
    return result


RATE_HEADER = (f"{'sent':>6}{'ok':>6}{'err':>5}{'offered':>9}{'done/s':>9}{'TTFT p50':>10}"
               f"{'TTFT p99':>10}{'<=1s %':>8}{'E2E p99':>10}{'lag p99':>8}")


def long_context_case(pool: ProcessPoolExecutor, source: Source, engine: object,
                      args: argparse.Namespace) -> dict:
    """One --long-len-token request (--long-output-len new tokens) while --long-clients
    streams of short requests (--prompt-len, --output-len) run beside it: the short ones' ITL
    with it against their ITL alone."""
    clients = args.long_clients
    shorts = clients * max(2 * args.long_rounds, 8)
    stream = token_stream(source.tokenizer, source.vocab_size,
                          args.long_len + shorts * args.prompt_len)
    cut = windows(stream, [args.long_len] + [args.prompt_len] * shorts)
    with server_for(source, engine, args, []) as url:
        raw = pool.submit(drive_long, url, served_model(url, args.api_key), cut[1:], cut[0],
                          clients, args.output_len, args.long_output_len, args.long_rounds,
                          args.api_key, args.timeout).result()
    long, (lo, hi) = raw["long"], raw["window"]
    alone = [gap for r in raw["alone"] if r["ok"] for gap in r["itl"]]
    beside = gaps_within(raw["beside"], lo, hi)
    records = raw["alone"] + raw["beside"]
    result = {
        "long_len": args.long_len, "long_output_len": args.long_output_len,
        "clients": clients, "long_ok": long["ok"], "long_error": long["error"],
        "long_ttft_ms": 1e3 * long["ttft"], "long_e2e_ms": 1e3 * long["e2e"],
        "long_output_tokens": long["output_tokens"],
        "short_requests": len(records), "short_errors": sum(not r["ok"] for r in records),
        "itl_alone_p50_ms": percentile([1e3 * g for g in alone], 50),
        "itl_alone_p99_ms": percentile([1e3 * g for g in alone], 99),
        "itl_beside_p50_ms": percentile([1e3 * g for g in beside], 50),
        "itl_beside_p99_ms": percentile([1e3 * g for g in beside], 99),
        "gaps_alone": len(alone), "gaps_beside": len(beside),
        "error_messages": sorted({r["error"] for r in records + [long] if not r["ok"]})[:5]}
    result["ratio"] = result["itl_beside_p99_ms"] / result["itl_alone_p99_ms"]
    log(f"long context: one {args.long_len}-token request ({args.long_output_len} new tokens) "
        f"beside {clients} streams of {args.prompt_len}-token requests\n"
        f"  the long request: {'ok' if long['ok'] else 'FAILED ' + long['error']}, TTFT "
        f"{result['long_ttft_ms']:.1f} ms, {long['output_tokens']} tokens in "
        f"{result['long_e2e_ms']:.1f} ms\n"
        f"  short requests' ITL (ms)   p50 {result['itl_alone_p50_ms']:9.2f}  p99 "
        f"{result['itl_alone_p99_ms']:9.2f}  alone ({len(alone)} gaps)\n"
        f"  {'':<25}  p50 {result['itl_beside_p50_ms']:9.2f}  p99 "
        f"{result['itl_beside_p99_ms']:9.2f}  beside it ({len(beside)} gaps)\n"
        f"  short requests: {result['short_requests']}, {result['short_errors']} errors")
    return result


def run_cases(pool: ProcessPoolExecutor, source: Source, engine: object | None,
              args: argparse.Namespace) -> None:
    """Every case of --cases but the levels, on `engine` (or the server at --url), each
    saved in RESULTS["cases"] as it ends."""
    cases = RESULTS.setdefault("cases", {})
    for name in args.cases:
        if name == "levels":
            continue
        log(f"==== case {name}")
        if name == "shared-prefix":
            cases[name] = shared_prefix_case(pool, source, engine, args)
        elif name == "mixed":
            cases[name] = mixed_case(pool, source, engine, args)
        elif name == "rate":
            cases[name] = rate_case(source, engine, args)
        elif name == "long-context":
            cases[name] = long_context_case(pool, source, engine, args)
        save(args.json)


def case_criteria() -> list[str]:
    """Issue #45's bars for the cases this run measured, PASS or FAIL each."""
    lines = []
    cases = RESULTS.get("cases", {})
    if "shared-prefix" in cases:
        shared = cases["shared-prefix"]
        for row in shared["comparison"]:
            lines.append(f"shared prefix c={row['concurrency']}: TTFT p50 cached "
                         f"{row['ttft_p50_cached_ms']:.2f} ms = {100 * row['ratio']:.1f}% of "
                         f"{row['ttft_p50_uncached_ms']:.2f} ms with --no-prefix-caching "
                         f"[limit 25%] {verdict(row['ratio'] <= 0.25)}")
            lines.append(f"shared prefix c={row['concurrency']}: outputs identical with and "
                         f"without the cache: {'yes' if row['identical'] else 'no'} "
                         f"({row['differing']} differ) [limit identical] "
                         f"{verdict(row['identical'])}")
        if not shared["comparison"]:
            lines.append("shared prefix: no comparison (" + "; ".join(
                f"{k}: {v['skipped']}" for k, v in shared["runs"].items() if "skipped" in v)
                + ")")
    for m in cases.get("mixed", {}).get("levels", []):
        lo, hi = cases["mixed"]["lengths"]
        lines.append(f"mixed {lo}..{hi} c={m['concurrency']}: {m['completed']} of "
                     f"{m['num_requests']} requests, {m['errors']} errors [limit 0] "
                     f"{verdict(m['errors'] == 0)}")
    if "rate" in cases:
        rate = cases["rate"]
        lines.append(f"request rate held (TTFT p99 <= 1 s, 0 errors): {rate['rate']:.1f} req/s "
                     f"[limit 1,000 req/s, the bundled pair] {verdict(rate['rate'] >= 1000)}")
    if "long-context" in cases:
        long = cases["long-context"]
        lines.append(f"long context: the {long['long_len']}-token request "
                     f"{'completed' if long['long_ok'] else 'FAILED'}; short requests' ITL "
                     f"p99 {long['itl_beside_p99_ms']:.2f} ms beside it = {long['ratio']:.2f}x "
                     f"{long['itl_alone_p99_ms']:.2f} ms alone [limit 2x] "
                     f"{verdict(long['long_ok'] and long['ratio'] <= 2.0)}")
    return lines


def criteria() -> list[str]:
    """The serving figures of issues #40 and #45 where this run measured them; PASS or FAIL
    where issue #45 sets a bar (its bars are for the 8B shape on an H200)."""
    lines = []
    systems = RESULTS.get("systems", {})
    fp8 = RESULTS.get("env", {}).get("precision") == "fp8"
    for label, s in systems.items():
        levels = {m["concurrency"]: m for m in s.get("levels", [])}
        engine = s.get("engine", {})
        if 1 in levels and engine:
            tpot = levels[1]["median_tpot_ms"]
            step = engine.get("iteration_ms", engine["per_token_ms"])
            lines.append(f"[{label}] c=1 TPOT p50 {tpot:.3f} ms = {tpot / step:.3f}x the "
                         f"decode {'iteration graph' if 'iteration_ms' in engine else 'step'} "
                         f"({step:.3f} ms; {tpot / engine['per_token_ms']:.3f}x generate's "
                         f"{engine['per_token_ms']:.3f} ms per token) [limit 1.05x] "
                         f"{verdict(tpot <= 1.05 * step)}")
            ttft = levels[1]["median_ttft_ms"]
            lines.append(f"[{label}] c=1 TTFT p50 {ttft:.2f} ms vs first token of generate "
                         f"{engine['first_token_ms']:.2f} ms + 10 ms [limit: TTFT <= that]")
        for c, m in levels.items():
            static = s.get("static", {}).get(c)
            if static:
                m["pct_of_static"] = 100 * m["output_throughput"] / static["output_tok_s"]
                lines.append(f"[{label}] c={c} output {m['output_throughput']:.1f} tok/s = "
                             f"{m['pct_of_static']:.1f}% of static generate "
                             f"{static['output_tok_s']:.1f} tok/s [limit 95% at 16 and 64]"
                             + (f" {verdict(m['pct_of_static'] >= 95)}" if c in (16, 64)
                                else ""))
        if 64 in levels:
            m = levels[64]
            lines.append(f"[{label}] c=64 ITL p99 {m['p99_itl_ms']:.2f} ms = "
                         f"{m['p99_itl_ms'] / m['median_itl_ms']:.2f}x ITL p50 "
                         f"{m['median_itl_ms']:.2f} ms [limit 1.5x] "
                         f"{verdict(m['p99_itl_ms'] <= 1.5 * m['median_itl_ms'])}")
        if 256 in levels:
            m, bar = levels[256], 28000 if fp8 else 20000
            lines.append(f"[{label}] c=256 output {m['output_throughput']:.1f} tok/s "
                         f"[limit {bar:,} in {'fp8' if fp8 else 'bf16'}] "
                         f"{verdict(m['output_throughput'] >= bar)}")
    if "speedup" in RESULTS:
        for c, x in RESULTS["speedup"].items():
            lines.append(f"speculation through the server, c={c}: {x:.2f}x target-only output "
                         "tok/s [limit 1.3x at c=1]")
    lines += case_criteria()
    errors = sum(m["errors"] for s in systems.values() for m in s.get("levels", []))
    errors += sum(m["errors"] for m in RESULTS.get("url_levels", []))
    lines.append(f"errors: {errors} [limit 0]")
    if "cold_start" in RESULTS and "seconds_to_health_200" in RESULTS["cold_start"]:
        cold = RESULTS["cold_start"]
        lines.append(f"cold start (launch -> /health 200): "
                     f"{cold['seconds_to_health_200']:.2f} s [limit 15 s]")
        if "first_ttft_over_warm" in cold:
            lines.append(f"cold start, first request: TTFT {1e3 * cold['first_request']['ttft']:.1f}"
                         f" ms = {cold['first_ttft_over_warm']:.2f}x the warm "
                         f"{1e3 * cold['warm_ttft']:.1f} ms [limit 2x], "
                         f"{cold['first_request']['output_tokens']} tokens")
        lines += [f"  {line}" for line in cold.get("breakdown", [])]
    for what, b in RESULTS.get("build", {}).items():
        lines.append(f"build ({what}, {b['max_batch_size']} rows, max_seq_len "
                     f"{b['max_seq_len']}): {b['seconds']:.1f} s [limit 300 s for the 8B shape "
                     f"at 64 and 256 rows] {verdict(b['seconds'] <= 300)}")
    if "load" in RESULTS:
        lines.append(f"load of {RESULTS['load']['engine_dir']}: {RESULTS['load']['seconds']:.1f} s")
    return lines


def case_tables() -> str:
    """The short tables of the cases this run measured (each was printed as it ended)."""
    cases = RESULTS.get("cases", {})
    parts = []
    if "shared-prefix" in cases:
        parts.append(shared_prefix_table(cases["shared-prefix"]))
    if "mixed" in cases:
        lo, hi = cases["mixed"]["lengths"]
        parts.append("\n".join([f"mixed prompt lengths {lo}..{hi}"] + [
            f"  c={m['concurrency']}: {m['completed']} ok, {m['errors']} errors, "
            f"{m['output_throughput']:.1f} out tok/s, TTFT p50 {m['median_ttft_ms']:.2f} ms, "
            f"ITL p99 {m['p99_itl_ms']:.2f} ms" for m in cases["mixed"]["levels"]]))
    if "rate" in cases:
        rate = cases["rate"]
        parts.append("\n".join(
            [f"request rate: highest held {rate['rate']:.1f} req/s",
             f"  {'req/s':>9}  {RATE_HEADER}"]
            + [f"  {t['rate']:>9.1f}  {rate_row(t)}" for t in rate["trials"]]))
    if "long-context" in cases:
        long = cases["long-context"]
        parts.append(f"long context ({long['long_len']} tokens): short ITL p99 "
                     f"{long['itl_alone_p99_ms']:.2f} ms alone, {long['itl_beside_p99_ms']:.2f}"
                     f" ms beside it ({long['ratio']:.2f}x); the long request "
                     f"{'completed' if long['long_ok'] else 'FAILED'}")
    return "\n\n".join(parts)


def summary_table() -> str:
    rows = []
    header = (f"{'system':<24}{'c':>4}{'ok':>6}{'err':>5}{'req/s':>8}{'out tok/s':>11}"
              f"{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>10}{'static':>10}"
              f"{'% st':>7}")
    rows.append(header)
    levels = [(label, m, s.get("static", {})) for label, s in RESULTS.get("systems", {}).items()
              for m in s.get("levels", [])]
    levels += [("server at --url", m, {}) for m in RESULTS.get("url_levels", [])]
    for label, m, static in levels:
        st = static.get(m["concurrency"])
        rows.append(f"{label[:23]:<24}{m['concurrency']:>4}{m['completed']:>6}{m['errors']:>5}"
                    f"{m['request_throughput']:>8.2f}{m['output_throughput']:>11.1f}"
                    f"{m['median_ttft_ms']:>10.2f}{m['median_tpot_ms']:>10.3f}"
                    f"{m['median_itl_ms']:>9.3f}{m['median_e2el_ms']:>10.1f}"
                    + (f"{st['output_tok_s']:>10.1f} {m.get('pct_of_static', 0):>5.0f}%" if st
                       else f"{'-':>10}{'-':>7}"))
    if "hf" in RESULTS:
        rows.append(f"Hugging Face eager generate, one request after another: "
                    f"{RESULTS['hf']['output_tok_s']:.1f} tok/s")
    return "\n".join(rows)


def plot(path: str) -> None:
    """Output tok/s against TPOT p50, one point per concurrency level, per system (static
    batches: their tok/s against their time per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    series = [(label, s.get("levels", []), s.get("static", {}))
              for label, s in RESULTS.get("systems", {}).items()]
    series += [("server at --url", RESULTS.get("url_levels", []), {})]
    for label, levels, static in series:
        if not levels:
            continue
        xs = [m["median_tpot_ms"] for m in levels]
        ys = [m["output_throughput"] for m in levels]
        ax.plot(xs, ys, "o-", label=f"{label}: server" if static else label)
        for m, x, y in zip(levels, xs, ys):
            ax.annotate(f"c={m['concurrency']}", (x, y), textcoords="offset points", xytext=(5, 5))
        if static:
            cs = sorted(static)
            per_step = [1e3 * static[c]["seconds"] / (static[c]["output_tokens"] / c) for c in cs]
            ax.plot(per_step, [static[c]["output_tok_s"] for c in cs], "s--",
                    label=f"{label}: static-batch generate")
    if "hf" in RESULTS:
        ax.axhline(RESULTS["hf"]["output_tok_s"], color="gray", linestyle=":",
                   label="Hugging Face eager, sequential")
    ax.set_xlabel("TPOT p50 (ms)  [static batch: ms per step]")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"fuser serve: {RESULTS.get('env', {}).get('source', '')}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot: {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_argument_group("what to serve")
    source.add_argument("--model", "--engine", dest="model", default=None, metavar="PATH",
                        help="a model directory (built here) or an engine directory (loaded); "
                             "default: the bundled pair's target")
    source.add_argument("--preset", default=None,
                        help="a fuser.models preset shape with random weights (bf16 on CUDA), "
                             "e.g. llama-3-8b; with an engine directory as --model, only the "
                             "Hugging Face peer and the prompts' vocabulary come from it")
    source.add_argument("--draft", nargs="?", const="bundled", default=None, metavar="PATH",
                        help="a draft model directory (alone: the bundled draft); the same "
                             "levels are then also served by the target alone")
    source.add_argument("--max-batch-size", type=int, default=64, help="the engine's rows")
    source.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the engine's ranks (GPUs), as fuser serve's flag")
    source.add_argument("--max-seq-len", type=int, default=None,
                        help="the engine's; default max(512, prompt + output)")
    source.add_argument("--compile", default="auto", choices=["auto", "inductor", "fx"],
                        help="FuserConfig.compile")
    source.add_argument("--precision", default=None,
                        choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                        help="FuserConfig.precision of the engine built here (default auto); "
                             "an engine directory must have it")
    source.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                        help="another FuserConfig field of the engine built here (repeatable; "
                             "VALUE a Python literal or a word), e.g. kv_block_size=16")
    source.add_argument("--server-args", default="", metavar="FLAGS",
                        help="flags of `fuser serve` for the in-process server, as one string "
                             "(e.g. \"--max-waiting 4096\"); they reach its scheduler as in "
                             "`fuser serve` (fuser.server.cli.make_scheduler)")
    source.add_argument("--save-engine", default=None, metavar="DIR",
                        help="save the built engine there (a later run can load it)")
    source.add_argument("--url", default=None,
                        help="drive a running server instead (no engine, static batch or "
                             "Hugging Face here); prompts from --preset's vocabulary or "
                             "--model's tokenizer")
    source.add_argument("--api-key", default=None, help="with --url: the server's key")
    source.add_argument("--cold-start", default=None, metavar="ENGINE_DIR",
                        help="first launch `fuser serve ENGINE_DIR` and time launch -> /health "
                             "200, a first request and the SIGTERM exit; alone, nothing else "
                             "runs")
    parser.add_argument("--cases", default="levels",
                        help="comma-separated, run in this order on one engine: levels (the "
                             "concurrency levels, engine figures, static batches, Hugging "
                             "Face), shared-prefix, mixed, rate, long-context (default: "
                             "%(default)s)")
    load = parser.add_argument_group("the load")
    load.add_argument("--prompt-len", type=int, default=128)
    load.add_argument("--output-len", type=int, default=256)
    load.add_argument("--concurrency", default="1,4,16,64",
                      help="comma-separated levels")
    load.add_argument("--num-requests", type=int, default=None,
                      help="requests per level (default max(2c, 8))")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="vLLM's ignore_eos: every request runs --output-len tokens")
    load.add_argument("--timeout", type=float, default=600.0,
                      help="seconds a request may wait for its next chunk")
    shared = parser.add_argument_group("--cases shared-prefix")
    shared.add_argument("--prefix-len", type=int, default=1024,
                        help="the system prompt every prompt opens with (tokens)")
    shared.add_argument("--prefix-own-len", type=int, default=128,
                        help="each prompt's own tokens after it")
    shared.add_argument("--prefix-concurrency", default="1,16",
                        help="levels, each served with prefix caching and without")
    shared.add_argument("--prefix-off-args", default="--no-prefix-caching", metavar="FLAGS",
                        help="the `fuser serve` flags of the run without the cache, added to "
                             "--server-args (default: %(default)s)")
    mixed = parser.add_argument_group("--cases mixed")
    mixed.add_argument("--mixed-lengths", default="64,2048", metavar="LO,HI",
                       help="prompt lengths, uniform in [LO, HI] (seeded), at every "
                            "--concurrency level")
    rate = parser.add_argument_group("--cases rate: Poisson arrivals, non-streamed requests")
    rate.add_argument("--rate-prompt-len", type=int, default=32)
    rate.add_argument("--rate-output-len", type=int, default=32)
    rate.add_argument("--rate-start", type=float, default=16.0,
                      help="the first trial's rate (req/s); doubled while held")
    rate.add_argument("--rate-max", type=float, default=8192.0,
                      help="the highest rate tried")
    rate.add_argument("--rate-bisections", type=int, default=4,
                      help="trials between the highest held and the lowest failed rate")
    rate.add_argument("--rate-seconds", type=float, default=10.0,
                      help="seconds of arrivals per trial")
    rate.add_argument("--rate-min-requests", type=int, default=32)
    rate.add_argument("--rate-max-requests", type=int, default=8000)
    rate.add_argument("--rate-timeout", type=float, default=30.0,
                      help="seconds a request may take before it counts as an error")
    rate.add_argument("--rate-clients", type=int, default=4,
                      help="client processes sending the arrivals")
    rate.add_argument("--rate-max-lag", type=float, default=0.1,
                      help="a trial whose clients sent requests later than this (p99, "
                           "seconds) is not held: the clients, not the server, were the limit")
    long = parser.add_argument_group("--cases long-context")
    long.add_argument("--long-len", type=int, default=131072,
                      help="the long request's prompt (tokens)")
    long.add_argument("--long-output-len", type=int, default=16)
    long.add_argument("--long-clients", type=int, default=16,
                      help="streams of short requests (--prompt-len, --output-len) beside it")
    long.add_argument("--long-rounds", type=int, default=2,
                      help="short requests per stream without the long one")
    comparisons = parser.add_argument_group("comparisons and output")
    comparisons.add_argument("--no-static", action="store_true",
                             help="skip the static-batch generate")
    comparisons.add_argument("--no-hf", action="store_true",
                             help="skip Hugging Face generate")
    comparisons.add_argument("--hf-requests", type=int, default=3,
                             help="Hugging Face requests, one after another")
    comparisons.add_argument("--runs", type=int, default=3,
                             help="timed runs of each engine figure and static batch (median)")
    comparisons.add_argument("--json", default=None, metavar="FILE", help="write every result")
    comparisons.add_argument("--out", default=None, metavar="DIR",
                             help="write DIR/serve.json and DIR/serve.png (benchmarks/gpu.sh)")
    comparisons.add_argument("--plot", default=None, metavar="PNG",
                             help="output tok/s against TPOT p50 (needs matplotlib)")
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if any(c < 1 for c in args.levels) or args.prompt_len < 1 or args.output_len < 2:
        parser.error("levels and --prompt-len must be >= 1, --output-len >= 2")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        parser.error(f"--cases {','.join(unknown) or '(none)'}: each one of {', '.join(CASES)}")
    args.prefix_levels = [int(c) for c in args.prefix_concurrency.split(",") if c.strip()]
    try:
        args.mixed_lengths = [int(x) for x in args.mixed_lengths.split(",")]
        mixed_lengths(*args.mixed_lengths, 1)
    except (ValueError, TypeError):
        parser.error(f"--mixed-lengths {args.mixed_lengths}: LO,HI with 1 <= LO <= HI")
    if not (args.prefix_levels and min(args.prefix_levels) >= 1 and args.prefix_len >= 1
            and args.prefix_own_len >= 1):
        parser.error("--prefix-concurrency levels, --prefix-len and --prefix-own-len must be "
                     ">= 1")
    if not (0 < args.rate_start <= args.rate_max and args.rate_seconds > 0
            and 1 <= args.rate_min_requests <= args.rate_max_requests
            and args.rate_clients >= 1 and args.rate_bisections >= 0
            and args.rate_prompt_len >= 1 and args.rate_output_len >= 1):
        parser.error("--rate-*: need 0 < start <= max, seconds > 0, 1 <= min-requests <= "
                     "max-requests, clients >= 1, bisections >= 0, lengths >= 1")
    if args.long_len < 1 or args.long_output_len < 2 or args.long_clients < 1 \
            or args.long_rounds < 1:
        parser.error("--long-len and --long-clients, --long-rounds must be >= 1, "
                     "--long-output-len >= 2")
    config = {}
    for item in args.config:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            parser.error(f"--config {item}: FIELD=VALUE")
        try:
            config[name.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            config[name.strip()] = raw
    args.config = config
    args.server_args = shlex.split(args.server_args)
    args.prefix_off_args = shlex.split(args.prefix_off_args)
    if args.url:
        args.url = args.url.rstrip("/")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.json = args.json or str(Path(args.out) / "serve.json")
        args.plot = args.plot or str(Path(args.out) / "serve.png")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers
    import torch
    import transformers

    import fuser

    RESULTS.clear()
    RESULTS["env"] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                      else "cpu", "torch": torch.__version__, "fuser": fuser.__version__,
                      "transformers": transformers.__version__, "command": " ".join(sys.argv),
                      "prompt_len": args.prompt_len, "output_len": args.output_len,
                      "levels": args.levels, "ignore_eos": args.ignore_eos,
                      "cases": args.cases, "precision": args.precision or "auto",
                      "config": args.config, "server_args": args.server_args}
    if args.cold_start:
        RESULTS["cold_start"] = cold_start(args.cold_start, args.timeout)
        save(args.json)
    serve_here = not args.cold_start or args.model or args.preset or args.draft or args.url
    if serve_here:
        source = make_source(args)
        RESULTS["env"]["source"] = source.name
        prompts = make_prompts(source.tokenizer, source.vocab_size, args.prompt_len,
                               requests_of(args, args.levels), fewer=True)
        # Spawned, not forked: a fork of a process holding CUDA and threads is unsafe.
        import multiprocessing

        levels = "levels" in args.cases
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            if args.url:
                if levels:
                    RESULTS["url_levels"] = run_levels(pool, args.url,
                                                       served_model(args.url, args.api_key),
                                                       prompts, args, "server at --url")
                run_cases(pool, source, None, args)
            else:
                label = "fuser + draft" if source.draft is not None else "fuser"
                if levels:
                    first = serve_engine(pool, source, source.engine, label, prompts, args)
                run_cases(pool, source, source.engine, args)  # on the first engine only
                if source.draft is not None and levels:
                    source.engine.close()  # (its follower ranks, with --tensor-parallel-size)
                    source.engine = None  # free it before the second engine
                    target_only = build(args, source.model, None, source.tokenizer,
                                        RESULTS["build"]["speculative"]["max_seq_len"], "target")
                    second = serve_engine(pool, source, target_only, "fuser target-only",
                                          prompts, args)
                    RESULTS["speedup"] = {
                        m["concurrency"]: m["output_throughput"] / n["output_throughput"]
                        for m, n in zip(first["levels"], second["levels"])}
        if not args.url and not args.no_hf and levels:
            if source.model is None:
                log("Hugging Face generate skipped: a loaded engine directory has no "
                    "transformers model (give --preset for a random one of its shape)")
            else:
                RESULTS["hf"] = hf_sequential(source.model, prompts, args.output_len,
                                              args.hf_requests)
    save(args.json)
    log("\n" + "\n".join(criteria()))
    save(args.json)
    if args.plot and serve_here and "levels" in args.cases:
        try:
            plot(args.plot)
        except ImportError:
            log("plot skipped: matplotlib is not installed (pip install 'fuser[plots]')")
    if serve_here:
        tables = case_tables()
        if tables:
            log("\n" + tables)
        if "levels" in args.cases:
            log("\n" + summary_table())


if __name__ == "__main__":
    main()
