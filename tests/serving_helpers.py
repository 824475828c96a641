"""A server on 127.0.0.1 in the test's own process, for the tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import threading
import time

from jmoe.serving.openai_api import create_app
from jmoe.serving.server import Server


def start(server: Server) -> threading.Thread:
    """Run `server` on a thread of its own; return once it accepts connections."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return thread


@contextlib.contextmanager
def serving(engine, name: str):
    """The base URL of a server over `engine` on an ephemeral port; stopped, and the engine closed, after."""
    server = Server(create_app(engine, name), engine, port=0)
    thread = start(server)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
        thread.join(timeout=30)
        engine.close()
