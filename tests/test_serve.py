"""The HTTP layer of `fuser serve` over a fake scheduler (tests/serve_fake.py): request and
response shapes through the official openai client, streaming, stop strings, every error status
with its body (and a good request after each), auth, the queue bound, disconnects, health and
metrics. Seconds on a CPU; the engine-backed checks are in tests/test_serve_engine.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from fuser.models import TARGET_PATH
from fuser.server.app import create_app
from serve_fake import EOS, FakeScheduler, expected_ids
from serve_util import TIMEOUT, metric, scrape, serving, sse_events, wait_for


MODEL = "fake-model"
FAIL_TOKEN = 7
ERROR_TOKEN = 8


@pytest.fixture(scope="module")
def tokenizer():
    if not (TARGET_PATH / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is not installed")
    return AutoTokenizer.from_pretrained(str(TARGET_PATH))


@pytest.fixture(scope="module")
def server(tokenizer):
    """(url, scheduler): one fake-backed server for the module."""
    scheduler = FakeScheduler(max_slots=4, max_waiting=64, max_seq_len=128,
                              fail_token=FAIL_TOKEN, error_token=ERROR_TOKEN)
    scheduler.start()
    try:
        with serving(create_app(scheduler, tokenizer, MODEL)) as running:
            yield running.url, scheduler
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0,
                       timeout=30.0) as c:
        yield c


def greedy_text(tokenizer, prompt: str, max_tokens: int, ignore_eos: bool = False
                ) -> tuple[str, list[int]]:
    ids = expected_ids(tokenizer(prompt)["input_ids"], max_tokens, ignore_eos)
    return tokenizer.decode(ids, skip_special_tokens=True), ids


PROMPTS = ["def add(a, b):", "class Queue:\n    def push(self, x):", "import os\nimport"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_scheduler_tokens(client, tokenizer, prompt):
    text, ids = greedy_text(tokenizer, prompt, 12)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == text
    assert done.choices[0].finish_reason == ("stop" if ids[-1] == EOS else "length")
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == \
        (n_prompt, len(ids), n_prompt + len(ids))
    assert done.model == MODEL and done.object == "text_completion"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == done.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_eos_ends_with_stop_and_ignore_eos_runs_on(client, tokenizer):
    # A prompt whose fake continuation meets eos within 40 tokens.
    prompt = next(p for p in (f"x = {i}" for i in range(500))
                  if expected_ids(tokenizer(p)["input_ids"], 40)[-1] == EOS)
    text, ids = greedy_text(tokenizer, prompt, 40)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text == text
    assert done.usage.completion_tokens == len(ids) < 40
    longer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert longer.choices[0].finish_reason == "length" and longer.usage.completion_tokens == 40
    assert longer.choices[0].text == greedy_text(tokenizer, prompt, 40, ignore_eos=True)[0]


def test_chat_streaming_and_not(client, tokenizer):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    text, _ = greedy_text(tokenizer, "def add(a, b):", 10)  # one user message = its text
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == text
    assert done.usage.completion_tokens == done.usage.total_tokens - done.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == done.choices[0].finish_reason


def test_include_usage_and_done_marker(server):
    url, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT, json={
            "model": MODEL, "prompt": "def f(x):", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_the_text(client, tokenizer):
    prompt = "def add(a, b):"
    full, _ = greedy_text(tokenizer, prompt, 30, ignore_eos=True)
    stop = full[11:14]
    assert stop and full.find(stop) >= 0
    cut = full[:full.find(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30,
                                        temperature=0, stop=[stop, "never-there"], stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens < 30
        assert (text, finish) == (cut, "stop")


def test_echo_prepends_the_prompt(client, tokenizer):
    text, _ = greedy_text(tokenizer, "def g():", 4)
    out = client.completions.create(model=MODEL, prompt="def g():", max_tokens=4, temperature=0,
                                    echo=True)
    assert out.choices[0].text == "def g():" + text


def test_token_id_prompt(client, tokenizer):
    ids = tokenizer("def h(y):")["input_ids"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == tokenizer.decode(expected_ids(ids, 6), skip_special_tokens=True)


def test_seeded_requests_repeat(client):
    kwargs = dict(model=MODEL, prompt="x =", max_tokens=8, temperature=0.8, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == a


def test_models_endpoint(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


GOOD = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 3}
BAD = [  # (path, body: dict or raw bytes, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b"", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": "3"}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": 1000}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": -0.1}, 400, "temperature"),
    ("completions", {**GOOD, "temperature": 2.5}, 400, "temperature"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("completions", {**GOOD, "n": 2}, 400, "n"),
    ("completions", {**GOOD, "seed": 2 ** 63}, 400, "seed"),
    ("completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("completions", {**GOOD, "stop": 3}, 400, "stop"),
    ("completions", {**GOOD, "logprobs": 2}, 400, "logprobs"),
    ("completions", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {**GOOD, "prompt": "x" * 400}, 400, "prompt"),
    ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("chat/completions", {**CHAT, "messages": "hello"}, 400, "messages"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "n": 3}, 400, "n"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_input_gets_its_status_and_error_body(server, path, body, status, param):
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}/v1/{path}", content=content, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    # and the server still serves
    good = CHAT if path.startswith("chat") else GOOD
    assert httpx.post(f"{url}/v1/{path}", json=good, timeout=TIMEOUT).status_code == 200


def test_openai_client_raises_the_statuses(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=3)


def test_unknown_route_and_method_in_openai_shape(server):
    url, _ = server
    r = httpx.get(f"{url}/v1/nothing-here", timeout=TIMEOUT)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{url}/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "error" in r.json()


def test_internal_error_is_500_without_traceback_and_serving_goes_on(server, tokenizer):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                   json={**GOOD, "prompt": [5, 6, FAIL_TOKEN]})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "internal_error" and "deliberate failure" in error["message"]
    assert "Traceback" not in r.text and "File " not in r.text
    assert httpx.post(f"{url}/v1/completions", json=GOOD, timeout=TIMEOUT).status_code == 200


def test_a_failed_step_is_500_or_an_error_event(server):
    url, scheduler = server
    body = {**GOOD, "prompt": [5, 6, ERROR_TOKEN], "max_tokens": 20}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 500 and "failed while generating" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "internal_error"
    wait_for(lambda: scheduler.slots_used == 0, 10, "the slots to be free")
    assert httpx.post(f"{url}/v1/completions", json=GOOD, timeout=TIMEOUT).status_code == 200


def test_queue_full_is_429(tokenizer):
    scheduler = FakeScheduler(max_slots=1, max_waiting=1, step_seconds=0.001)
    scheduler.start()
    try:
        with serving(create_app(scheduler, tokenizer, MODEL)) as running:
            scheduler.pause()  # nothing is admitted: the first request waits, the queue is full

            async def scenario() -> tuple[int, int, int]:
                async with httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as c:
                    first = asyncio.ensure_future(c.post("/v1/completions", json=GOOD))
                    await asyncio.wait_for(_until(lambda: scheduler.num_waiting == 1), 10)
                    second = await c.post("/v1/completions", json=GOOD)
                    body = second.json()["error"]
                    assert body["code"] == "queue_full" and body["type"] == "rate_limit_error"
                    scheduler.resume()
                    first_done = await asyncio.wait_for(first, 20)
                    third = await c.post("/v1/completions", json=GOOD)
                    return second.status_code, first_done.status_code, third.status_code

            assert asyncio.run(scenario()) == (429, 200, 200)
    finally:
        scheduler.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_api_key(tokenizer):
    scheduler = FakeScheduler()
    scheduler.start()
    try:
        with serving(create_app(scheduler, tokenizer, MODEL, api_key="s3cret")) as running:
            url = running.url
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.post(f"{url}/v1/completions", json=GOOD, headers=headers,
                               timeout=TIMEOUT)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).status_code == 401
            with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError):
                    bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
            with openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0) as good:
                assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
            assert httpx.get(f"{url}/metrics", timeout=TIMEOUT).status_code == 200
    finally:
        scheduler.close()


def test_disconnect_mid_stream_frees_the_slot(tokenizer):
    scheduler = FakeScheduler(max_slots=2, step_seconds=0.02)
    scheduler.start()
    try:
        with serving(create_app(scheduler, tokenizer, MODEL)) as running:
            url = running.url
            with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT, json={
                    **GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert scheduler.num_running == 1
            # the connection is closed: the request is cancelled, its slot freed
            wait_for(lambda: metric(scrape(url), "fuser_num_requests_running") == 0, 10,
                     "the running gauge to return to 0")
            assert scheduler.slots_used == 0
            text = scrape(url)
            assert metric(text, "fuser_request_success_total", 'finished_reason="abort"') == 1
            assert metric(text, "fuser_kv_slots_used") == 0
            # a non-streaming request whose client leaves is cancelled too
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={**GOOD, "max_tokens": 100,
                                                          "ignore_eos": True}, timeout=0.3)
            wait_for(lambda: scheduler.num_running == 0, 10, "the slot to be freed")
            wait_for(lambda: metric(scrape(url), "fuser_request_success_total",
                                    'finished_reason="abort"') == 2, 10, "the abort count")
    finally:
        scheduler.close()


def test_health_loading_ready_draining(tokenizer):
    scheduler = FakeScheduler()
    scheduler.start()
    app = create_app(None, None, MODEL)
    try:
        with serving(app) as running:
            url = running.url
            r = httpx.get(f"{url}/health", timeout=TIMEOUT)
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=TIMEOUT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            assert httpx.get(f"{url}/metrics", timeout=TIMEOUT).status_code == 200
            app.state.serving.attach(scheduler, tokenizer)
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
            assert httpx.post(f"{url}/v1/completions", json=GOOD,
                              timeout=TIMEOUT).status_code == 200
            app.state.serving.drain()
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503
            r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=TIMEOUT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    finally:
        scheduler.close()


def test_a_held_server_takes_its_own_warm_up_before_health(tokenizer):
    """`fuser serve`'s HTTP warm-up (fuser/server/cli.py `warm_up_http`): attached with
    hold=True, /v1 serves (a streamed and a whole completion) while /health still answers 503,
    and none of it is metered; released, /health answers 200."""
    from fuser.server.cli import warm_up_http

    scheduler = FakeScheduler()
    scheduler.start()
    app = create_app(None, None, MODEL)
    try:
        with serving(app) as running:
            url = running.url
            app.state.serving.attach(scheduler, tokenizer, hold=True)
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503
            submitted = []
            submit = scheduler.submit
            scheduler.submit = lambda ids, params: (submitted.append(params.temperature),
                                                    submit(ids, params))[1]
            assert warm_up_http(running, MODEL, None, tokenizer) is None
            assert submitted == [0.0, 1.0]  # the greedy streamed one, the sampled whole one
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503
            text = scrape(url)
            assert metric(text, "fuser_prompt_tokens_total") in (None, 0.0)
            assert metric(text, "fuser_time_to_first_token_seconds_count") in (None, 0.0)
            assert not any(line.startswith("fuser_request_success_total{")
                           and not line.endswith(" 0.0") for line in text.splitlines()), text
            app.state.serving.release()
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
            assert httpx.post(f"{url}/v1/completions", json=GOOD,
                              timeout=TIMEOUT).status_code == 200
            wait_for(lambda: metric(scrape(url), "fuser_time_to_first_token_seconds_count")
                     == 1.0, 10, "the one metered request")
            # a wrong model name is what the warm-up reports, never raises
            assert "404" in warm_up_http(running, "no-such-model", None, tokenizer)
    finally:
        scheduler.close()


def test_the_http_warm_up_reports_a_malformed_answer_never_raises():
    """`warm_up_http` against a socket that answers no HTTP (http.client's HTTPException, not
    an OSError): it returns what failed, so that `fuser serve` still releases /health."""
    import socket
    import threading
    import types

    from fuser.server.cli import warm_up_http

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def answer() -> None:
        answered = 0
        while answered < 2 and not done.is_set():  # (the warm-up may stop at its first failure)
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            answered += 1
            with connection:
                connection.recv(65536)
                connection.sendall(b"not http at all\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        fake = types.SimpleNamespace(host="127.0.0.1", port=listener.getsockname()[1])
        tokenizer = lambda text: {"input_ids": [1, 2]}  # noqa: E731
        failed = warm_up_http(fake, MODEL, None, tokenizer)
        assert failed is not None and "BadStatusLine" in failed, failed
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()
    assert not thread.is_alive()


def test_the_heap_is_settled_before_health():
    """`fuser serve` collects the load's garbage and freezes what survives before /health
    (fuser/server/cli.py `settle_heap`): a garbage cycle is gone, a live object is frozen."""
    import gc
    import weakref

    from fuser.server.cli import settle_heap

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    kept = [Node()]
    try:
        settle_heap()
        assert gone() is None
        assert gc.get_freeze_count() > 0 and kept
    finally:
        gc.unfreeze()


def test_metrics_names_and_counts(server, client):
    url, _ = server
    before = scrape(url)
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = scrape(url)
    for name in ("fuser_num_requests_running", "fuser_num_requests_waiting",
                 "fuser_kv_slots_used", "fuser_time_to_first_token_seconds_count",
                 "fuser_time_per_output_token_seconds_count",
                 "fuser_e2e_request_latency_seconds_count", "fuser_prompt_tokens_total",
                 "fuser_generation_tokens_total"):
        assert metric(after, name) is not None, name
    length = 'finished_reason="length"'
    assert metric(after, "fuser_request_success_total", length) == \
        metric(before, "fuser_request_success_total", length) + 1
    assert metric(after, "fuser_prompt_tokens_total") - metric(before, "fuser_prompt_tokens_total") \
        == out.usage.prompt_tokens
    assert metric(after, "fuser_generation_tokens_total") - \
        metric(before, "fuser_generation_tokens_total") == 7
    assert metric(after, "fuser_e2e_request_latency_seconds_count") == \
        metric(before, "fuser_e2e_request_latency_seconds_count") + 1
    names = [line.split()[2] for line in after.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
