"""Running the HTTP API (uvicorn; the serve extra: `pip install -e '.[serve]'`) so that it holds up and stops when told.

- Connections: one that stays silent for `idle_timeout` seconds (before its first request, or
  between requests) is closed; past `max_connections` open at once, a new connection's requests are
  answered 503 (an OpenAI-style JSON error) and it is closed.
- Signals: SIGINT or SIGTERM stops taking connections, lets running requests finish for up to
  `drain_timeout` seconds, then cancels what is left; a second signal cuts the drain short. The
  server notes the signal and returns (uvicorn's own handling raises it again after the shutdown,
  which asyncio may swallow: a stop could then end as a normal return or as KeyboardInterrupt).
- An engine that fails stops the server the same way, so the process exits and a supervisor can
  restart it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from jmoe.serving.middleware import send_error
from jmoe.serving.validation import ApiError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def connection_class(max_connections: int) -> type:
    """uvicorn's HTTP protocol, closing silent connections and refusing those past max_connections."""

    class BoundedConnection(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app = _too_many_connections
            # uvicorn arms its keep-alive timer only after a response: a connection that never
            # sends a request would stay open for good
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    return BoundedConnection


async def _too_many_connections(scope, receive, send) -> None:
    await send_error(send, ApiError("the server has too many open connections; retry later", status=503,
                                    kind="server_error"), close=True)


class _SignalledServer(uvicorn.Server):
    """uvicorn.Server noting the signal that stops it instead of raising it again afterwards."""

    stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # a second signal: stop draining
            self.force_exit = True
        self.should_exit = True
        if self.stopped_by is None:
            self.stopped_by = sig


class Server:
    """A uvicorn server for `app` that stops on SIGINT/SIGTERM, on stop(), or when `engine` fails."""

    def __init__(self, app, engine, *, host: str = "127.0.0.1", port: int = 0, idle_timeout: float = 15.0,
                 max_connections: int = 256, drain_timeout: float = 10.0, log_level: str = "warning"):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                http=connection_class(max_connections), timeout_keep_alive=idle_timeout,
                                timeout_graceful_shutdown=drain_timeout)
        self._server = _SignalledServer(config)
        engine.on_failure = lambda why: self.stop()

    def run(self) -> None:
        """Serve until stopped."""
        self._server.run()

    def stop(self) -> None:
        """Begin a graceful stop (from any thread)."""
        self._server.should_exit = True

    @property
    def started(self) -> bool:
        return self._server.started

    @property
    def port(self) -> int:
        """The port it listens on (once started; useful with port=0)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the server, if one did."""
        return self._server.stopped_by
