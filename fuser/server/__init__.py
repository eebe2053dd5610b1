"""`fuser serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Needs the `serve` extra (`pip install 'fuser[serve]'`: FastAPI, uvicorn, prometheus_client).

    from fuser.server import create_app
    app = create_app(scheduler, engine.tokenizer, "my-model", engine=engine)

The command line is `fuser serve` (fuser/server/cli.py); `python -m fuser.server` is the same.
Importing this package needs none of the extra: `create_app` imports FastAPI when first used,
so `fuser --help` works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from fuser.server.app import create_app

        return create_app
    raise AttributeError(f"module 'fuser.server' has no attribute {name!r}")
