"""An OpenAI-compatible HTTP API over a BatchEngine (FastAPI; `pip install 'jmoe[serve]'`).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events in the OpenAI chunk
format, ending with `data: [DONE]`, or answered whole), GET /v1/models and /v1/models/{id}, POST
/tokenize and /detokenize, GET /tokenizer_info, GET /health and GET /metrics (Prometheus). An API
key, when set, guards every route but /health and /metrics; allowed origins turn on CORS. Every
request body is checked field by field before anything is queued (jmoe/serving/validation.py); a
bad one gets an OpenAI-style error (status 400, 401 without the key, or 404 for an unknown model)
naming the field, a full queue 429 with Retry-After. `response_format` (JSON, or JSON of a schema) is
held by constrained decoding (jmoe/serving/structured.py). Every other error is an OpenAI-style
JSON error too (500; 503 once the engine has stopped), never plain text. Answers, streamed or
whole, are awaited on the event loop (no thread per request), and a client that goes away cancels
its requests, freeing their slots. Each request leaves one line in the `jmoe.access` log.
"""

import asyncio  # (no postponed annotations: FastAPI reads the endpoints' annotations, bound inside create_app)
import hmac
import json
import logging
import re
import time
import uuid
import dataclasses
from itertools import accumulate

from jmoe.decoding.sampling import MAX_SEED
from jmoe.errors import InputError
from jmoe.serving.batcher import BatchEngine
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream, TokenLogprob
from jmoe.serving.metrics import EngineMetrics
from jmoe import harmony
from jmoe.serving.tools import Tools, tool_call, tool_calls
from jmoe.serving.validation import (
    MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_N,
    ApiError,
    Parsed,
    check_model,
    parse_body,
    parse_detokenize,
    parse_request,
    parse_tokenize,
)
from jmoe.tokenizer import decode

CLIENT_GONE = 499  # the access log's status for a request whose client went away first (nginx's)
access_log = logging.getLogger("jmoe.access")


# ----------------------------------------------------------------------------- responses


def _usage(prompt: int, streams: list[Stream]) -> dict:
    """OpenAI's usage: each prompt counted once (not once per completion), every completion's tokens."""
    completion = sum(s.usage["completion_tokens"] for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# the finish reason a client sees for each of the engine's ("error" becomes an error instead)
FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "cancelled",
                  "reader_timeout": "reader_timeout"}


def _finish(stream: Stream) -> str:
    return FINISH_REASONS[stream.finish_reason]


class LogprobFormat:
    """TokenLogprobs in the OpenAI shapes: chat's `content` list, or completions' parallel lists
    (`text_offset` counted from `offset`, the length of the text before them)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat

    def text(self, token: int) -> str:
        return decode(self.tokenizer, [token])

    def __call__(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        if not entries:
            return None
        if self.chat:
            def item(token: int, logprob: float) -> dict:
                text = self.text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens = [self.text(e.token) for e in entries]
        offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=offset))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else {self.text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    @staticmethod
    def joined(first: dict | None, then: dict | None) -> dict | None:
        """Completions' logprobs of two texts one after the other (an echoed prompt, its completion)."""
        if first is None or then is None:
            return first or then
        return {key: first[key] + then[key] for key in first}


def _choice(chat: bool, index: int, text: str, finish: str | None, delta: bool = False, logprobs=None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if delta:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def _whole_choices(parsed: Parsed, chat: bool, answers: list, streams: list[Stream],
                   prefixes: list | None, logprobs: LogprobFormat) -> list[dict]:
    """The choices of a whole answer, prompt by prompt, n each; with echo each text and its logprobs
    start with its prompt's (max_tokens 0: the prompt alone, finish reason "length")."""
    choices = []
    for c in range(len(parsed.prompts) * parsed.n):
        text, entries = answers[c] if streams else ("", [])
        finish = _finish(streams[c]) if streams else "length"
        prefix, prefix_logprobs = prefixes[c // parsed.n] if prefixes is not None else ("", None)
        generated = logprobs(entries, len(prefix))
        joined = LogprobFormat.joined(prefix_logprobs, generated)
        choice = _choice(chat, c, prefix + text, finish, logprobs=joined)
        if parsed.harmony:
            _read_harmony(choice, "message", parsed.tools)
        elif parsed.tools is not None:
            _read_tool_calls(choice, "message", parsed.tools)
        choices.append(choice)
    return choices


def _read_tool_calls(choice: dict, key: str, tools: Tools) -> None:
    """A chat choice's tool calls taken out of its text (`key`: "message", or "delta" when streamed);
    an answer that calls a tool finishes with "tool_calls"."""
    content, calls = tool_calls(choice[key].get("content") or "", tools)
    if calls:
        choice[key]["content"] = content
        _attach_calls(choice, key, calls)


def _read_harmony(choice: dict, key: str, tools: Tools | None) -> None:
    """A harmony chat choice split by channel: its reasoning (`reasoning_content`), its answer
    (`content`) and, with tools, its calls (finishing with "tool_calls")."""
    reasoning, content, calls = harmony.split(choice[key].get("content") or "", tools.names if tools else set())
    choice[key]["content"] = content or (None if calls or key == "message" and reasoning else "")
    if reasoning:
        choice[key]["reasoning_content"] = reasoning
    if calls:
        _attach_calls(choice, key, [tool_call(name, arguments) for name, arguments in calls])


def _attach_calls(choice: dict, key: str, calls: list[dict]) -> None:
    """Calls in OpenAI's shape onto a choice (indexed when streamed); it finishes with "tool_calls"."""
    choice[key]["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)] if key == "delta" else calls
    if choice["finish_reason"] in ("stop", None):
        choice["finish_reason"] = "tool_calls"


def _drop(task: asyncio.Future) -> None:
    """Cancel a task nobody will await any more (its error, if it failed, is not the answer's)."""
    task.cancel()
    if task.done() and not task.cancelled():
        task.exception()  # read: no "exception was never retrieved" in the log


async def _collect(stream: Stream) -> tuple[str, list[TokenLogprob]]:
    """A whole answer: its text and its tokens' logprobs (awaited until the request ends)."""
    text, entries = [], []
    async for piece, logprobs in stream.with_logprobs_async():
        text.append(piece)
        entries.extend(logprobs)
    return "".join(text), entries


async def _client_gone(receive) -> None:
    """Returns once the client has hung up (its request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _whole_answers(receive, streams: list[Stream]) -> list | None:
    """Every stream's (text, logprobs), or None if the client hung up first; either way the streams
    are cancelled after (a no-op for finished ones; frees the slots of the others)."""
    answers = asyncio.ensure_future(asyncio.gather(*(_collect(s) for s in streams)))
    gone = asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait({answers, gone}, return_when=asyncio.FIRST_COMPLETED)
        return answers.result() if answers.done() else None
    finally:
        answers.cancel()
        gone.cancel()
        for s in streams:
            s.cancel()


async def send_error(send, error: ApiError, close: bool = False, headers: list | None = None) -> None:
    """An OpenAI-style JSON error as a whole ASGI response (`headers`: more (name, value) byte pairs)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *(headers or [])]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_disconnect(error: BaseException, answering: bool) -> bool:
    """Whether `error` only says that the client went away (an OSError does once the answer is
    being sent: the connection broke)."""
    from starlette.requests import ClientDisconnect

    if isinstance(error, BaseExceptionGroup):
        return all(_is_disconnect(e, answering) for e in error.exceptions)
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
            if seen["gone"] or _is_disconnect(error, answering=seen["status"] is not None):
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


def _add_cors(app, origins: list[str]) -> None:
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


def create_app(engine: BatchEngine, model_name: str, *, request_timeout: float | None = None,
               max_tokens: int | None = None, api_key: str | None = None, allowed_origins: list[str] | None = None):
    """The FastAPI application serving `engine`'s model as `model_name`; a request still running
    `request_timeout` seconds after it arrived ends there (finish reason "length"); a request may
    ask for at most `max_tokens` tokens (default: the engine's context). With `api_key`, the API's
    routes need it as a bearer token; `allowed_origins` (parse_origins') may call it from a browser."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="jmoe", docs_url=None, redoc_url=None)
    # the last added runs first: the access log sees everything, a preflight needs no key
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=check_api_key(api_key))
    if allowed_origins:
        _add_cors(app, allowed_origins)
    app.add_middleware(RequestGuard)
    created = int(time.time())
    model = engine.model
    max_tokens = engine.context if max_tokens is None else min(max_tokens, engine.context)

    @app.exception_handler(ApiError)
    async def _api_error(_, error: ApiError):
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_, error: HTTPException):  # an unknown path, a wrong method
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(ApiError(str(error.detail), status=error.status_code, kind=kind).body(),
                            status_code=error.status_code, headers=error.headers)

    metrics = EngineMetrics(engine)
    # completions per request: what the engine's rows and queue can take at once (else it could only be a 429)
    max_choices = min(MAX_CHOICES, max(MAX_N, engine.max_batch + engine.max_waiting))

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health():
        if engine.closed:  # failed (a supervisor should restart the server), or stopping
            status = "failed" if engine.failure else "stopping"
            return JSONResponse({"status": status, "error": engine.failure}, status_code=503)
        return {"status": "ok", "running": engine.running, "waiting": engine.queued}

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "jmoe"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str):
        check_model(model_id, model_name, param=None)
        return model_card

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        ids = parse_tokenize(parse_body(await read_body(http)), model, model_name)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The special tokens and chat template, for clients that tokenize through this server (as
        lm-evaluation-harness's tokenizer_backend=remote does, with /tokenize and /detokenize)."""
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ApiError("this model was converted without a tokenizer", None, status=404, code="no_tokenizer")
        return {"eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": engine.context}

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        ids = parse_detokenize(parse_body(await read_body(http)), model, model_name)
        try:
            return {"prompt": decode(model.tokenizer, ids)}
        except InputError as e:
            raise ApiError(str(e), "tokens") from None

    def submit(parsed: Parsed) -> list[Stream]:
        """A stream per completion, prompt by prompt (choice index = prompt index * n + j); none when
        no token is asked for (echo's max_tokens 0)."""
        streams = []
        try:
            for prompt in parsed.prompts if parsed.max_tokens else []:
                for i in range(parsed.n):
                    sampling = parsed.sampling
                    if i:  # the n answers of one prompt differ by their seeds
                        sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % (MAX_SEED + 1))
                    streams.append(engine.submit(Request(prompt, parsed.max_tokens, sampling, parsed.stop,
                                                         logprobs=parsed.logprobs, timeout=request_timeout,
                                                         grammar=parsed.grammar, special_tokens=parsed.harmony)))
        except (QueueFull, InputError, EngineClosed) as e:
            for s in streams:
                s.cancel()
            if isinstance(e, QueueFull):
                raise ApiError("the server is busy: too many requests are waiting", status=429,
                               kind="rate_limit_error") from None
            if isinstance(e, EngineClosed):
                raise ApiError(f"the server is not taking requests: {e}", status=503, kind="server_error") from None
            raise ApiError(str(e)) from None
        return streams

    async def read_body(http: HttpRequest) -> bytes:
        """The request body, refused (413) as soon as it is known to pass MAX_BODY_BYTES."""
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are accepted", status=413)
        body = bytearray()
        async for part in http.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(f"the request body passes {MAX_BODY_BYTES} bytes, the most accepted", status=413)
        return bytes(body)

    async def score(ids: list[int], top: int) -> list[TokenLogprob]:
        """The engine's scoring of a prompt (BatchEngine.score), awaited on the event loop."""
        try:
            return await asyncio.wrap_future(engine.score(ids, top))
        except EngineClosed as e:
            raise ApiError(f"the server is not taking requests: {e}", status=503, kind="server_error") from None

    async def echoes(parsed: Parsed, logprobs: LogprobFormat) -> list[tuple[str, dict | None]]:
        """Each prompt's echo: its text, and its tokens' logprobs when asked for."""
        out = []
        for ids, text in zip(parsed.prompts, parsed.texts):
            text = decode(model.tokenizer, ids) if text is None else text
            scored = None if parsed.logprobs is None else logprobs(await score(ids, parsed.logprobs))
            out.append((text, scored))
        return out

    async def complete(http: HttpRequest, chat: bool):
        parsed = parse_request(parse_body(await read_body(http)), model, model_name, chat=chat,
                               max_tokens=max_tokens, max_choices=max_choices)
        logprobs = LogprobFormat(model.tokenizer, chat)
        streams = submit(parsed)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name}
        if parsed.stream:
            return StreamingResponse(_events(http, head, streams, chat, parsed, logprobs),
                                     media_type="text/event-stream")
        echoed = asyncio.ensure_future(echoes(parsed, logprobs)) if parsed.echo else None  # beside the engine
        try:
            answers = await _whole_answers(http.receive, streams)
            usage = _usage(parsed.prompt_tokens, streams)
            http.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])
            if answers is None:  # the client hung up: nobody reads this
                return Response(status_code=CLIENT_GONE)
            if failed := [s.error for s in streams if s.finish_reason == "error"]:
                raise ApiError(f"the engine failed: {failed[0]}", status=500, kind="server_error")
            prefixes = await echoed if echoed is not None else None
        finally:
            if echoed is not None:
                _drop(echoed)
        return {**head, "choices": _whole_choices(parsed, chat, answers, streams, prefixes, logprobs), "usage": usage}

    async def _events(http: HttpRequest, head: dict, streams: list[Stream], chat: bool, parsed: Parsed,
                      logprobs: LogprobFormat):
        include_usage = parsed.include_usage
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices, usage=None) -> str:
            payload = {**chunk_head, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        # each stream's pieces, in the order they come; a small buffer, so that a client that stops
        # reading stops taking its streams' output (which the engine's reader timeout then sees)
        pieces: asyncio.Queue = asyncio.Queue(maxsize=16)

        async def pump(i: int, stream: Stream):
            async for piece, entries in stream.with_logprobs_async():
                await pieces.put((i, piece, entries))
            await pieces.put((i, None, []))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            if chat:
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(streams))])
            sent = [0] * len(streams)  # text so far per choice: completions' text offsets
            if parsed.echo:  # each choice's first chunk: its prompt (and the prompt's logprobs)
                prefixes = await echoes(parsed, logprobs)
                choices = len(parsed.prompts) * parsed.n
                for c in range(choices):
                    text, scored = prefixes[c // parsed.n]
                    yield event([_choice(chat, c, text, None if streams else "length", logprobs=scored)])
                sent = [len(prefixes[c // parsed.n][0]) for c in range(len(streams))]
            # with tools, a choice's text is held to its end: only then is it known to be a call or an answer
            held = [("", []) for _ in streams] if parsed.tools is not None else None
            channels = [harmony.HarmonyStream() for _ in streams] if parsed.harmony else None
            open_streams = len(streams)
            while open_streams:
                i, piece, entries = await pieces.get()
                if piece is not None and held is not None:
                    held[i] = (held[i][0] + piece, held[i][1] + entries)
                elif piece is not None and channels is not None:
                    reasoning, content = channels[i].feed(piece)
                    if reasoning or content:
                        choice = _choice(chat, i, content, None, delta=True, logprobs=logprobs(entries, sent[i]))
                        if reasoning:
                            choice["delta"]["reasoning_content"] = reasoning
                        yield event([choice])
                    sent[i] += len(piece)
                elif piece is not None:
                    yield event([_choice(chat, i, piece, None, delta=True, logprobs=logprobs(entries, sent[i]))])
                    sent[i] += len(piece)
                elif streams[i].finish_reason == "error":
                    error = ApiError(f"the engine failed: {streams[i].error}", status=500, kind="server_error")
                    yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"
                    return
                else:
                    if held is not None and held[i][0]:
                        choice = _choice(chat, i, held[i][0], _finish(streams[i]), delta=True,
                                         logprobs=logprobs(held[i][1]))
                        if parsed.harmony:
                            _read_harmony(choice, "delta", parsed.tools)
                        else:
                            _read_tool_calls(choice, "delta", parsed.tools)
                        finish, choice["finish_reason"] = choice["finish_reason"], None
                        yield event([choice])
                        yield event([_choice(chat, i, "", finish, delta=True)])
                    else:
                        yield event([_choice(chat, i, "", _finish(streams[i]), delta=True)])
                    open_streams -= 1
            if include_usage:
                usage = _usage(parsed.prompt_tokens, streams)
                yield f"data: {json.dumps({**chunk_head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:
                s.cancel()  # the client went away (or everything finished: then a no-op)
            usage = _usage(parsed.prompt_tokens, streams)
            http.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, chat=True)

    return app
