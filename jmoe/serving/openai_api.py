"""An OpenAI-compatible HTTP API over a BatchEngine (FastAPI; the serve extra: `pip install -e '.[serve]'`).

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
import dataclasses
import json
import time
import uuid

from jmoe import harmony
from jmoe.decoding.sampling import MAX_SEED
from jmoe.errors import InputError
from jmoe.serving import responses
from jmoe.serving.batcher import BatchEngine
from jmoe.serving.metrics import EngineMetrics
from jmoe.serving.middleware import CLIENT_GONE, ApiKeyGuard, RequestGuard, add_cors, check_api_key
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream, TokenLogprob
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


def create_app(engine: BatchEngine, model_name: str, *, request_timeout: float | None = None,
               max_tokens: int | None = None, api_key: str | None = None, allowed_origins: list[str] | None = None):
    """The FastAPI application serving `engine`'s model as `model_name`; a request still running
    `request_timeout` seconds after it arrived ends there (finish reason "length"); a request may
    ask for at most `max_tokens` tokens (default: the engine's context). With `api_key`, the API's
    routes need it as a bearer token; `allowed_origins` (parse_origins') may call it from a browser."""
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="jmoe", docs_url=None, redoc_url=None)
    # the last added runs first: the access log sees everything, a preflight needs no key
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=check_api_key(api_key))
    if allowed_origins:
        add_cors(app, allowed_origins)
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

    async def echoes(parsed: Parsed, logprobs: responses.LogprobFormat) -> list[tuple[str, dict | None]]:
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
        logprobs = responses.LogprobFormat(model.tokenizer, chat)
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
            usage = responses.usage(parsed.prompt_tokens, streams)
            http.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])
            if answers is None:  # the client hung up: nobody reads this
                return Response(status_code=CLIENT_GONE)
            if failed := [s.error for s in streams if s.finish_reason == "error"]:
                raise ApiError(f"the engine failed: {failed[0]}", status=500, kind="server_error")
            prefixes = await echoed if echoed is not None else None
        finally:
            if echoed is not None:
                _drop(echoed)
        choices = responses.whole_choices(parsed, chat, answers, streams, prefixes, logprobs)
        return {**head, "choices": choices, "usage": usage}

    async def _events(http: HttpRequest, head: dict, streams: list[Stream], chat: bool, parsed: Parsed,
                      logprobs: responses.LogprobFormat):
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
                    yield event([responses.as_choice(chat, c, text, None if streams else "length", logprobs=scored)])
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
                        choice = responses.as_choice(chat, i, content, None, delta=True,
                                                     logprobs=logprobs(entries, sent[i]))
                        if reasoning:
                            choice["delta"]["reasoning_content"] = reasoning
                        yield event([choice])
                    sent[i] += len(piece)
                elif piece is not None:
                    yield event([responses.as_choice(chat, i, piece, None, delta=True,
                                                     logprobs=logprobs(entries, sent[i]))])
                    sent[i] += len(piece)
                elif streams[i].finish_reason == "error":
                    error = ApiError(f"the engine failed: {streams[i].error}", status=500, kind="server_error")
                    yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"
                    return
                else:
                    if held is not None and held[i][0]:
                        choice = responses.as_choice(chat, i, held[i][0], responses.finish_reason(streams[i]),
                                                     delta=True, logprobs=logprobs(held[i][1]))
                        if parsed.harmony:
                            responses.read_harmony(choice, "delta", parsed.tools)
                        else:
                            responses.read_tool_calls(choice, "delta", parsed.tools)
                        finish, choice["finish_reason"] = choice["finish_reason"], None
                        yield event([choice])
                        yield event([responses.as_choice(chat, i, "", finish, delta=True)])
                    else:
                        yield event([responses.as_choice(chat, i, "", responses.finish_reason(streams[i]), delta=True)])
                    open_streams -= 1
            if include_usage:
                usage = responses.usage(parsed.prompt_tokens, streams)
                yield f"data: {json.dumps({**chunk_head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:
                s.cancel()  # the client went away (or everything finished: then a no-op)
            usage = responses.usage(parsed.prompt_tokens, streams)
            http.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, chat=True)

    return app
