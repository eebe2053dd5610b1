"""uvicorn in a background thread, on a socket bound before it starts.

`fuser serve` binds first (a port in use is one clear line before minutes of loading), serves
/health 503 while the engine loads on the main thread, and keeps signals on the main thread
(uvicorn installs no signal handlers outside it): SIGTERM drains the scheduler there, then
`stop()` ends uvicorn. The tests run their servers the same way, on port 0.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one). A port in use or a host that
    is not this machine's raises ValueError with one line saying so."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise ValueError(f"port {port} on {host} is already in use (another server?): pick "
                             "another with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerThread:
    """Serve `app` on `sock` (or a new socket on host:port) from a daemon thread.

    start() returns once uvicorn accepts connections; stop() asks it to exit and joins it
    (open connections get `graceful_seconds` to finish, then are closed)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 sock: socket.socket | None = None, log_level: str = "warning",
                 graceful_seconds: float = 5.0) -> None:
        self.sock = sock if sock is not None else bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=graceful_seconds, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="fuser-serve-http", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 (reported by start() / alive)
            self.error = e

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start ({self.error!r})")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for its thread (idempotent)."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.thread.is_alive():  # still open connections: close them
            self.server.force_exit = True
            self.thread.join(5.0)
        try:
            self.sock.close()
        except OSError:
            pass
