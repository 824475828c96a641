"""The OpenAI API's ASGI middleware (jmoe/serving/openai_api.py adds it): one access-log line per
request and every unexpected error as a JSON 500 (RequestGuard), the API key (ApiKeyGuard), and
CORS for the allowed origins; OpenAI-style JSON errors sent straight over ASGI (send_error)."""

import hmac
import json
import logging
import re
import time

from jmoe.errors import InputError
from jmoe.serving.validation import ApiError

CLIENT_GONE = 499  # the access log's status for a request whose client went away first (nginx's)


access_log = logging.getLogger("jmoe.access")


async def send_error(send, error: ApiError, close: bool = False, headers: list | None = None) -> None:
    """An OpenAI-style JSON error as a whole ASGI response (`headers`: more (name, value) byte pairs)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *(headers or [])]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def is_disconnect(error: BaseException, answering: bool) -> bool:
    """Whether `error` only says that the client went away (an OSError does once the answer is
    being sent: the connection broke)."""
    from starlette.requests import ClientDisconnect

    if isinstance(error, BaseExceptionGroup):
        return all(is_disconnect(e, answering) for e in error.exceptions)
    return isinstance(error, ClientDisconnect) or (answering and isinstance(error, OSError))


class RequestGuard:
    """ASGI middleware around the app: one access-log line per request (client, method, path,
    status, seconds, prompt+completion tokens); an unexpected error answered as an OpenAI-style JSON
    500 (its traceback logged once); a client that went away logged as status 499, quietly."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        seen = {"status": None, "sent": False, "gone": False}

        async def receive_noting():
            message = await receive()
            if message["type"] == "http.disconnect" and not seen["sent"]:  # (after the answer: the usual end)
                seen["gone"] = True
            return message

        async def send_noting(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["sent"] = True
            await send(message)

        try:
            await self.app(scope, receive_noting, send_noting)
        except Exception as error:  # noqa: BLE001 - no error leaves as plain text
            if seen["gone"] or is_disconnect(error, answering=seen["status"] is not None):
                seen["gone"] = True
            elif seen["status"] is None:
                logging.getLogger("jmoe.serving").error("%s %s failed", scope["method"], scope["path"],
                                                        exc_info=error)
                await send_error(send, ApiError(f"the server failed ({type(error).__name__}); its log has the "
                                                "details", status=500, kind="server_error"))
                seen["status"] = 500
            else:  # the answer has begun: only closing the connection can tell the client
                raise
        finally:
            self._log(scope, seen, time.perf_counter() - started)

    @staticmethod
    def _log(scope, seen: dict, seconds: float) -> None:
        status = CLIENT_GONE if seen["gone"] else seen["status"]
        tokens = scope.get("state", {}).get("tokens")
        client = scope.get("client")
        access_log.info('%s "%s %s" %s %.3fs tokens=%s', f"{client[0]}:{client[1]}" if client else "-",
                        scope["method"], scope["path"], status or "-", seconds,
                        f"{tokens[0]}+{tokens[1]}" if tokens else "-")


# the routes an API key guards (every /v1 route too); /health and /metrics stay open to probes and scrapers
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class ApiKeyGuard:
    """ASGI middleware: the API's routes answer only requests that carry `Authorization: Bearer KEY`
    (compared in constant time), others get an OpenAI-style 401."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._guarded(scope["path"]) and not self._authorized(scope["headers"]):
            error = ApiError("this server needs an API key: send 'Authorization: Bearer KEY' with the server's key",
                             status=401, code="invalid_api_key")
            return await send_error(send, error, headers=[(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)

    @staticmethod
    def _guarded(path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS

    def _authorized(self, headers) -> bool:
        value = next((v for name, v in headers if name == b"authorization"), b"")
        scheme, _, key = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._key)


def check_api_key(key: str) -> str:
    """An API key a client can send in a header: printable ASCII without spaces (never shown in errors)."""
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key:
        raise InputError("the API key must be a non-empty string of printable ASCII characters without spaces")
    return key


ORIGIN = re.compile(r"https?://[^/\s,]+")  # a scheme and a host (and port): no path, no trailing slash


def parse_origins(text: str) -> list[str]:
    """--allowed-origins: `*` (any origin) or a comma-separated list of origins such as
    https://app.example.com or http://localhost:3000."""
    origins = [o.strip() for o in text.split(",") if o.strip()]
    if origins == ["*"]:
        return origins
    if not origins or "*" in origins:
        raise InputError("allowed origins must be '*' alone or a comma-separated list of origins")
    for origin in origins:
        if not ORIGIN.fullmatch(origin):
            raise InputError(f"allowed origin {origin[:100]!r} is not a scheme and host "
                             "such as https://app.example.com")
    return origins


def add_cors(app, origins: list[str]) -> None:
    """Starlette's CORS middleware (a preflight answered, the origin's headers on every answer),
    its refused preflights an OpenAI-style JSON 400 instead of plain text."""
    from fastapi.responses import JSONResponse
    from starlette.middleware.cors import CORSMiddleware

    class Cors(CORSMiddleware):
        def preflight_response(self, request_headers):
            response = super().preflight_response(request_headers)
            if response.status_code == 200:
                return response
            headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
            return JSONResponse(ApiError(response.body.decode()).body(), status_code=400, headers=headers)

    app.add_middleware(Cors, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
