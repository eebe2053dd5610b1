"""Helpers of the serving tests: a server on 127.0.0.1 for the length of a `with`, metric
values from /metrics, SSE reading with httpx. Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx

from fuser.server.runner import ServerThread

TIMEOUT = httpx.Timeout(60.0, connect=10.0)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[ServerThread]:
    """uvicorn serving `app` on a free port of 127.0.0.1 in a thread; stopped on exit."""
    server = ServerThread(app, "127.0.0.1", 0)
    try:
        server.start(timeout=30)
        yield server
    finally:
        server.stop(timeout=15)


def metric(text: str, name: str, labels: str | None = None) -> float | None:
    """The value of sample `name` (with exactly `labels`, e.g. 'finished_reason="stop"') in a
    Prometheus exposition, or None if absent."""
    label_part = r"\{" + re.escape(labels) + r"\}" if labels else ""
    match = re.search(rf"^{re.escape(name)}{label_part} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else None


def scrape(url: str) -> str:
    response = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return response.text


def wait_for(condition: Any, seconds: float = 20.0, what: str = "condition") -> None:
    """Poll `condition()` until true; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of a server-sent-event stream, then the string "[DONE]"."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
