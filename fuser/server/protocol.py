"""OpenAI request bodies: parsing, validation, and the error shape.

Bodies are parsed by pydantic in strict mode from the raw JSON (a string where a number belongs
is a 400, as at OpenAI), unknown fields are ignored (clients send extensions), and every range
check names the parameter in the error's `param`. What fuser cannot do (logprobs, penalties,
logit bias, tools, n > 1) is a 400 that says so, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Stop = str | list[str] | None


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields that completions and chat completions share (OpenAI's, plus vLLM's ignore_eos)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # vLLM's extension: -1 or 0 = off, else >= 1
    seed: Annotated[int, Field(ge=-(2 ** 63), lt=2 ** 63)] | None = None  # the engine's int64
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    skip_special_tokens: bool = True  # vLLM's extension
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("must be -1 or 0 (off) or a positive number of tokens")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Stop) -> Stop:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("a stop string must not be empty")
        return value

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        if self.n != 1:
            raise _Unsupported("n", f"n={self.n}: fuser serves one choice per request (n=1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _Unsupported(name, f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise _Unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise _Unsupported("stream_options", "stream_options needs stream=true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class _Unsupported(ValueError):
    """A well-formed request asking for what fuser does not do (param named)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.logprobs is not None:
            raise _Unsupported("logprobs", "logprobs are not supported")
        if self.best_of not in (None, 1):
            raise _Unsupported("best_of", f"best_of={self.best_of}: only 1 is supported")
        if self.suffix:
            raise _Unsupported("suffix", "suffix is not supported")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise _Unsupported("prompt", f"{len(self.prompt)} prompts in one request: fuser "
                                   "serves one prompt per request (send them concurrently)")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt as one string or one list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extension

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise _Unsupported("logprobs", "logprobs are not supported")
        if self.tools:
            raise _Unsupported("tools", "tools are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise _Unsupported("tool_choice", "tool_choice is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _Unsupported("response_format", "response_format other than text is not "
                               "supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The request body `raw` as `model`, or an APIError(400) naming the parameter."""
    if not raw.strip():
        raise bad_request("the request body is empty: expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _field_names() -> set[str]:
    return {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                               StreamOptions) for name in model.model_fields}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as an OpenAI 400."""
    if not errors:
        return bad_request("invalid request")
    error = errors[0]
    if error.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {error.get('msg')}")
    # pydantic's loc also names the union member it tried ("str", "list[int]"): keep field
    # names and list indices.
    fields = _field_names()
    loc = [str(p) for p in error.get("loc", ()) if isinstance(p, int) or p in fields]
    param = ".".join(loc) or None
    inner = (error.get("ctx") or {}).get("error")
    if isinstance(inner, _Unsupported):
        return bad_request(inner.message, param=inner.param or param)
    if error.get("type") == "missing":
        return bad_request(f"missing required parameter: {param!r}", param=param)
    if error.get("type") == "model_type" and not loc:
        return bad_request("the request body must be a JSON object")
    # A union (prompt, stop, content) fails once per member: say every member's complaint.
    top = loc[0] if loc else None
    messages = []
    for e in errors:
        e_loc = [p for p in e.get("loc", ()) if isinstance(p, int) or p in fields]
        if (e_loc[0] if e_loc else None) == top:
            inner = (e.get("ctx") or {}).get("error")
            text = str(inner) if isinstance(inner, ValueError) else e.get("msg", "invalid value")
            if text not in messages:
                messages.append(text)
    what = f"{param!r}" if param else "the request"
    return bad_request(f"invalid value for {what}: {'; or '.join(messages)}", param=param)
