"""The OpenAI-compatible HTTP layer: a FastAPI app over a continuous-batching scheduler.

    app = create_app(scheduler, tokenizer, "fuser-code", api_key=None, engine=engine)

Endpoints (API.md, Serving): POST /v1/completions, POST /v1/chat/completions (JSON, or
server-sent events with stream=true), GET /v1/models, GET /health, GET /metrics.

The app is thin: it turns a request body into prompt ids and `SamplingParams`, submits them,
and turns the token ids the scheduler streams back into text (fuser/server/text.py: incremental
detokenization, stop strings). Errors answer in OpenAI's shape with the status API.md gives.

Choices made where OpenAI and vLLM leave room (the README's Serving section says the same):
- prompt tokens + max_tokens > max_seq_len is a 400 (as vLLM does), never a silent clamp.
  Without max_tokens, completions generate 16 tokens (OpenAI's default) and chat completions
  the rest of the context (vLLM's);
- one prompt and one choice per request (n=1);
- a request the server aborts (drain timeout) ends with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fuser.runtime.scheduler import QueueFull, SamplingParams, SchedulerClosed
from fuser.server.metrics import CONTENT_TYPE, ServingMetrics
from fuser.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                   bad_request, parse, validation_error)
from fuser.server.text import IncrementalDetokenizer, StopChecker

log = logging.getLogger("fuser.server")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class ServingState:
    """What the app serves, and whether it serves now.

    ready: the engine is loaded and warmed (`attach`); draining: SIGTERM arrived (`drain`).
    /health answers 200 only when ready and not draining; /v1 answers 503 before `attach` and
    while draining. held: attached with /health still 503 (`attach(hold=True)` until
    `release`), while the server's own warm-up requests go through /v1; requests admitted then
    are not metered."""

    model_name: str
    api_key: str | None = None
    scheduler: Any = None
    tokenizer: Any = None
    engine: Any = None
    draining: bool = False
    held: bool = False
    adapt_draft: bool = False  # `fuser serve --adapt-draft`
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServingMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServingMetrics(lambda: self.scheduler)

    @property
    def attached(self) -> bool:
        """Whether /v1 serves (a scheduler and tokenizer are attached)."""
        return self.scheduler is not None and self.tokenizer is not None

    @property
    def ready(self) -> bool:
        """Whether /health answers 200 (attached, not held)."""
        return self.attached and not self.held

    def attach(self, scheduler: Any, tokenizer: Any, engine: Any = None, *,
               hold: bool = False) -> None:
        """Serve `scheduler` (started, warmed) with `tokenizer`: /health turns 200, or with
        `hold` once `release` is called (/v1 serves already)."""
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer (the engine has none)")
        self.held = hold
        if engine is not None:
            self.metrics.bind_engine(engine.metrics_text)
        else:
            self.metrics.bind_engine(lambda: "")
        self.engine = engine
        self.tokenizer = tokenizer
        self.scheduler = scheduler

    @property
    def metered(self) -> bool:
        """Whether a request admitted now counts in the metrics (not while held)."""
        return not self.held

    def release(self) -> None:
        """After `attach(hold=True)`: /health answers 200 from now on."""
        self.held = False

    def drain(self) -> None:
        """Stop taking requests: /health and /v1 answer 503 from now on."""
        self.draining = True

    def unavailable(self) -> APIError | None:
        if self.draining:
            return APIError(503, "the server is shutting down (draining); retry on another "
                            "replica", "service_unavailable", code="draining")
        if not self.attached:
            return APIError(503, "the model is loading; retry when GET /health answers 200",
                            "service_unavailable", code="not_ready")
        return None


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def internal_error(e: BaseException) -> APIError:
    """A 500 with a one-line message (the traceback goes to the server's log only)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0][:300] if str(e) else type(e).__name__
    return APIError(500, f"internal server error ({text}); the server keeps serving",
                    "internal_error")


class Generation:
    """One submitted request as text: detokenized, cut at its stop strings, metered."""

    def __init__(self, state: ServingState, stream: Any, stops: list[str],
                 skip_special_tokens: bool) -> None:
        self.state = state
        self.stream = stream
        self.detok = IncrementalDetokenizer(state.tokenizer, skip_special_tokens)
        self.stops = StopChecker(stops)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._recorded = not state.metered  # the server's own warm-up: never recorded

    @property
    def text(self) -> str:
        return self.stops.text

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it becomes final; afterwards finish_reason and completion_tokens are set."""
        sent = 0
        try:
            async for ids in self.stream:
                if self.stops.stops:
                    self._feed_each(ids)
                else:  # a step's tokens at once: one decode
                    self.completion_tokens += len(ids)
                    self.stops.feed(self.detok.extend(ids))
                if self.stops.stopped:
                    break
                n = self.stops.releasable(finished=False)
                if n > sent:
                    yield self.stops.text[sent:n]
                    sent = n
            if not self.stops.stopped:
                self.stops.feed(self.detok.flush())
            if self.stream.finish_reason == "error":  # the scheduler's step failed
                self.finish_reason = "error"
                raise RuntimeError("the engine failed while generating this request (the "
                                   "server's log has the cause)")
            if len(self.stops.text) > sent:
                yield self.stops.text[sent:]
            self.finish_reason = "stop" if self.stops.stopped else (self.stream.finish_reason
                                                                    or "abort")
        finally:
            self.close()

    def _feed_each(self, ids: list[int]) -> None:
        """A step's tokens one at a time, so that the count ends at the token that completes a
        stop string."""
        for token in ids:
            self.completion_tokens += 1
            if self.stops.feed(self.detok.add(token)):
                self.stream.finish("stop")  # the slot frees at the next step boundary
                return

    def close(self) -> None:
        """The response is over (complete, or its client left): free the slot if the request
        still runs, and record it once."""
        if self.finish_reason is None and not self.stream.done:
            self.stream.cancel()
        self.record()

    async def collect(self) -> str:
        async for _ in self.pieces():
            pass
        return self.text

    def record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        s = self.stream
        finish = s.finish_time if s.finish_time is not None else time.perf_counter()
        self.state.metrics.finished_request(self.finish_reason or "abort", self.completion_tokens,
                                            s.arrival_time, s.first_token_time, finish)

    def usage(self) -> dict[str, int]:
        prompt = len(self.stream.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}


GREEDY_BELOW = 1e-5  # a temperature this small is greedy (vLLM's rule): logits / 1e-30 overflow


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int
                    ) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    temperature = 0.0 if temperature < GREEDY_BELOW else temperature
    top_k = body.top_k if body.top_k not in (None, 0, -1) else None
    top_p = body.top_p if body.top_p not in (None, 1.0) else None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=body.seed, ignore_eos=body.ignore_eos)


def _budget(state: ServingState, prompt_ids: list[int], requested: int | None, default: int | None,
            param: str, prompt_param: str) -> int:
    """max_tokens for this prompt: as requested, else the default (None: the rest of the
    context). Over max_seq_len is a 400 (vLLM's behaviour), never a silent clamp; its param is
    the prompt when the prompt alone leaves no room, else the token budget."""
    limit = state.scheduler.max_seq_len
    n = len(prompt_ids)
    if not prompt_ids:
        raise bad_request("the prompt is empty", param=prompt_param)
    max_tokens = requested if requested is not None else (default if default is not None
                                                           else limit - n)
    if n + max(max_tokens, 1) > limit:
        blame = prompt_param if n >= limit or requested is None else param
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the request "
                       f"asks for {n + max(max_tokens, 1)} ({n} in the prompt, "
                       f"{max(max_tokens, 1)} for the completion): shorten the prompt or lower "
                       f"{param}", param=blame, code="context_length_exceeded")
    return max_tokens


def _submit(state: ServingState, prompt_ids: list[int], params: SamplingParams) -> Any:
    try:
        stream = state.scheduler.submit(prompt_ids, params)
    except QueueFull as e:
        raise APIError(429, f"the waiting queue is full ({e}); retry later", "rate_limit_error",
                       code="queue_full") from None
    except SchedulerClosed:
        raise APIError(503, "the server is shutting down (draining)", "service_unavailable",
                       code="draining") from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    if state.metered:
        state.metrics.admitted(len(prompt_ids))
    return stream


async def _until_done_or_gone(request: Request, work: asyncio.Future) -> None:
    """Wait for `work`; if the client disconnects first, cancel it and raise CancelledError."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        raise asyncio.CancelledError("the client disconnected")


class EventStream(StreamingResponse):
    """Server-sent events of one generation. However the response ends (its last event sent,
    the client gone before or after the first event), the generation is closed: a request
    nobody reads does not keep its slot."""

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def create_app(scheduler: Any = None, tokenizer: Any = None, model_name: str = "fuser", *,
               api_key: str | None = None, engine: Any = None) -> FastAPI:
    """The server's FastAPI app.

    scheduler: a started `fuser.runtime.scheduler.Scheduler` (warmed up), or None to start in
        the loading state (/health 503) and `app.state.serving.attach(...)` it later.
    tokenizer: a transformers tokenizer (required with a scheduler).
    model_name: the name clients pass as `model` (others answer 404).
    api_key: when set, /v1 requires `Authorization: Bearer <api_key>` (401 otherwise);
        /health and /metrics stay open.
    engine: its `metrics_text()` opens the /metrics exposition.
    """
    state = ServingState(model_name=model_name, api_key=api_key)
    if scheduler is not None:
        state.attach(scheduler, tokenizer, engine)
    app = FastAPI(title="fuser serve", docs_url=None, redoc_url=None)
    app.state.serving = state

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return error_response(internal_error(exc))

    def check(request: Request, model: str | None) -> None:
        if state.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                raise APIError(401, "missing or incorrect API key: send the header "
                               "'Authorization: Bearer <key>'", "invalid_request_error",
                               code="invalid_api_key")
        unavailable = state.unavailable()
        if unavailable is not None:
            raise unavailable
        if model is not None and model != state.model_name:
            raise APIError(404, f"the model {model!r} does not exist (this server serves "
                           f"{state.model_name!r})", "invalid_request_error", param="model",
                           code="model_not_found")

    async def guarded(request: Request, handler: Any, body_type: type) -> Response:
        """Parse, check and run one /v1 request; every failure in the OpenAI error shape."""
        try:
            if state.api_key is not None or state.unavailable() is not None:
                check(request, None)  # 401 / 503 before looking at the body
            body = parse(body_type, await request.body())
            check(request, body.model)
            return await handler(request, body)
        except APIError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 (answer 500 and keep serving)
            log.error("internal error on %s", request.url.path, exc_info=e)
            return error_response(internal_error(e))

    async def respond(request: Request, body: Any, prompt_ids: list[int], max_tokens: int,
                      chat: bool, echo: str = "") -> Response:
        stream = _submit(state, prompt_ids, sampling_params(body, max_tokens))
        generation = Generation(state, stream, body.stops, body.skip_special_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{random.getrandbits(128):032x}"
        created = int(time.time())
        if body.stream:
            return EventStream(_events(generation, rid, created, chat, echo, body.include_usage),
                               generation)
        work = asyncio.ensure_future(generation.collect())
        try:
            await _until_done_or_gone(request, work)
        except asyncio.CancelledError:
            return Response(status_code=499)  # nobody reads it: the client left
        text = work.result()
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": generation.finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": echo + text, "logprobs": None,
                      "finish_reason": generation.finish_reason}
            kind = "text_completion"
        return JSONResponse({"id": rid, "object": kind, "created": created,
                             "model": state.model_name, "choices": [choice],
                             "usage": generation.usage()})

    async def _events(generation: Generation, rid: str, created: int, chat: bool, echo: str,
                      include_usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = {"usage": None} if include_usage else {}

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return _sse({"id": rid, "object": kind, "created": created,
                         "model": state.model_name, "choices": choices, **extra})

        def piece(text: str, finish: str | None = None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if first else \
                    ({"content": text} if text or finish is None else {})
                return chunk([{"index": 0, "delta": delta, "logprobs": None,
                               "finish_reason": finish}], **usage)
            return chunk([{"index": 0, "text": text, "logprobs": None,
                           "finish_reason": finish}], **usage)

        try:
            if chat:
                yield piece("", first=True)
            elif echo:
                yield piece(echo)
            async for text in generation.pieces():
                yield piece(text)
            yield piece("", finish=generation.finish_reason)
            if include_usage:
                yield chunk([], usage=generation.usage())
        except Exception as e:  # noqa: BLE001 (headers are sent: report in the stream)
            log.error("internal error while streaming %s", rid, exc_info=e)
            yield _sse(internal_error(e).body())
        yield "data: [DONE]\n\n"

    async def completions(request: Request, body: CompletionRequest) -> Response:
        prompt = body.single_prompt
        if isinstance(prompt, str):
            prompt_ids = list(state.tokenizer(prompt)["input_ids"])
        else:
            prompt_ids = list(prompt)
            if any(t < 0 for t in prompt_ids):
                raise bad_request("token ids must be >= 0", param="prompt")
        max_tokens = _budget(state, prompt_ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS,
                             "max_tokens", "prompt")
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else state.tokenizer.decode(
                prompt_ids, skip_special_tokens=body.skip_special_tokens)
        return await respond(request, body, prompt_ids, max_tokens, chat=False, echo=echo)

    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        tokenizer = state.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions",
                              param="messages")
        messages = [m.as_template_message() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 (a template's own error: the messages' fault)
            raise bad_request(f"the chat template failed on these messages: {e}",
                              param="messages") from None
        prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        max_tokens = _budget(state, prompt_ids, body.max_new_tokens, None,
                             "max_completion_tokens" if body.max_completion_tokens is not None
                             else "max_tokens", "messages")
        return await respond(request, body, prompt_ids, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def post_completions(request: Request) -> Response:
        return await guarded(request, completions, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def post_chat_completions(request: Request) -> Response:
        return await guarded(request, chat_completions, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check(request, None)
        except APIError as e:
            if e.status != 503:  # the list is known while loading and draining too
                return error_response(e)
        max_len = state.scheduler.max_seq_len if state.scheduler is not None else None
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created,
             "owned_by": "fuser", "max_model_len": max_len}]})

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.text(), media_type=CONTENT_TYPE)

    return app
