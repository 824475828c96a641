"""An OpenAI-compatible HTTP API over a BatchEngine (FastAPI; `pip install 'jmoe[serve]'`).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events in the OpenAI chunk
format, ending with `data: [DONE]`, or answered whole), GET /v1/models, GET /health and GET /metrics
(Prometheus). Every
request body is checked field by field before anything is queued; a bad one gets an OpenAI-style
error (status 400, or 404 for an unknown model) naming the field, a full queue 429 with
Retry-After. A streaming client that goes away cancels its requests, freeing their slots.
"""

import json  # (no postponed annotations: FastAPI reads the endpoints' annotations, bound inside create_app)
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate

from jmoe.decoding.sampling import MAX_SEED, SamplingOptions
from jmoe.errors import InputError
from jmoe.serving.batcher import MAX_TOP_LOGPROBS, BatchEngine, QueueFull, Request, Stream, TokenLogprob
from jmoe.serving.chat import chat_prompt
from jmoe.serving.metrics import EngineMetrics
from jmoe.tokenizer import encode

MAX_BODY_BYTES = 1 << 20  # a request body past this is refused before it is parsed
MAX_N = 8  # completions per request (each takes a slot)
MAX_STOP = 4  # stop strings per request, as OpenAI allows
DEFAULT_MAX_TOKENS = 256
# fields this server does not implement, and the value each may still take (it asks for nothing)
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": None, "tools": None,
               "functions": None, "tool_choice": None, "response_format": None}


class ApiError(Exception):
    """A request the API refuses: HTTP status, OpenAI error type, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------- request checks


def _int(body: dict, name: str, default, *, minimum: int, maximum: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{name}' must be an integer, not {type(value).__name__}", name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ApiError(f"'{name}' must be {bound}, got {value}", name)
    return value


def _real(body: dict, name: str, default: float, *, minimum: float, maximum: float, above: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{name}' must be a number, not {type(value).__name__}", name)
    if not (minimum < value if above else minimum <= value) or value > maximum:
        raise ApiError(f"'{name}' must be {'above' if above else 'at least'} {minimum} and at most {maximum}, "
                       f"got {value}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{name}' must be true or false, not {type(value).__name__}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise ApiError(f"'stop' holds at most {MAX_STOP} strings, got {len(items)}", "stop")
    return [s for s in items if s]


@dataclass
class Parsed:
    prompt: list[int]
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int
    sampling: SamplingOptions
    stop: list[str]
    logprobs: int | None  # alternatives per token, None: no logprobs


def parse_body(raw: bytes) -> dict:
    """The JSON object of a body read_body has already bounded."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def parse_request(body: dict, model, model_name: str, *, chat: bool) -> Parsed:
    """Every field checked; the prompt tokenized (chat: with the model's chat template)."""
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise ApiError("'model' must be a string", "model")
    if requested not in (None, model_name):
        raise ApiError(f"the model '{requested}' does not exist; this server serves '{model_name}'", "model",
                       status=404, code="model_not_found")
    if chat:
        prompt = _messages(body, model)
    else:
        prompt = _prompt(body, model)
    if len(prompt) >= model.max_seq_len:
        raise ApiError(f"the prompt has {len(prompt)} tokens; the context holds {model.max_seq_len}",
                       "messages" if chat else "prompt", code="context_length_exceeded")
    for name, inert in UNSUPPORTED.items():
        if body.get(name) not in (None, inert):
            raise ApiError(f"'{name}' is not supported by this server", name)
    for kind in ("presence_penalty", "frequency_penalty"):
        if _real(body, kind, 0.0, minimum=-2.0, maximum=2.0) != 0.0:
            raise ApiError(f"'{kind}' is not supported by this server (use repetition_penalty)", kind)
    max_tokens = _int(body, "max_completion_tokens", None, minimum=1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, minimum=1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    stream = _bool(body, "stream", False)
    if options is not None and not stream:
        raise ApiError("'stream_options' needs 'stream': true", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    try:
        sampling = SamplingOptions(
            temperature=_real(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
            top_k=_int(body, "top_k", 0, minimum=0),
            top_p=_real(body, "top_p", 1.0, minimum=0.0, maximum=1.0, above=True),
            repetition_penalty=_real(body, "repetition_penalty", 1.0, minimum=0.0, maximum=10.0, above=True),
            seed=_int(body, "seed", 0, minimum=0, maximum=MAX_SEED),
        )
    except InputError as e:
        raise ApiError(str(e)) from None
    return Parsed(prompt, _int(body, "n", 1, minimum=1, maximum=MAX_N), stream, include_usage, max_tokens,
                  sampling, _stop(body), _logprobs(body, chat))


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs carry (None: no logprobs). Completions ask with
    `logprobs: N`; chat with `logprobs: true` and `top_logprobs: N`."""
    if not chat:
        return _int(body, "logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _prompt(body: dict, model) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' is empty", "prompt")
        try:
            return encode(model.tokenizer, prompt, model.config.vocab_size)
        except InputError as e:  # a model converted without a tokenizer
            raise ApiError(str(e), "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < model.config.vocab_size for t in prompt):
            raise ApiError(f"'prompt' token ids must be in [0, {model.config.vocab_size})", "prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError("'prompt' is required", "prompt")
    raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def _messages(body: dict, model) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(f"'messages[{i}].role' must be system, user, assistant or developer", f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise ApiError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
    chat = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages]
    try:
        return chat_prompt(model, chat)
    except InputError as e:
        raise ApiError(str(e), "messages") from None


# ----------------------------------------------------------------------------- responses


def _usage(streams: list[Stream]) -> dict:
    prompt = streams[0].usage["prompt_tokens"]
    completion = sum(s.usage["completion_tokens"] for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(stream: Stream) -> str:
    return "length" if stream.finish_reason in ("length", "timeout") else "stop"


class LogprobFormat:
    """TokenLogprobs in the OpenAI shapes: chat's `content` list, or completions' parallel lists
    (`text_offset` counted from `offset`, the length of the text before them)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

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
                "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def _choice(chat: bool, index: int, text: str, finish: str | None, delta: bool = False, logprobs=None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if delta:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def _collect(stream: Stream) -> tuple[str, list[TokenLogprob]]:
    """A whole answer: its text and its tokens' logprobs (blocks until the request ends)."""
    text, entries = [], []
    for piece, logprobs in stream.with_logprobs():
        text.append(piece)
        entries.extend(logprobs)
    return "".join(text), entries


def create_app(engine: BatchEngine, model_name: str, *, request_timeout: float | None = None):
    """The FastAPI application serving `engine`'s model as `model_name`; a request still running
    `request_timeout` seconds after it arrived ends there (finish reason "length")."""
    import anyio
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="jmoe", docs_url=None, redoc_url=None)
    created = int(time.time())
    model = engine.model

    @app.exception_handler(ApiError)
    async def _api_error(_, error: ApiError):
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    metrics = EngineMetrics(engine)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.running, "waiting": len(engine.waiting)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jmoe"}]}

    def submit(parsed: Parsed) -> list[Stream]:
        streams = []
        try:
            for i in range(parsed.n):
                sampling = parsed.sampling
                if i:  # the n answers of one request differ by their seeds
                    sampling = SamplingOptions(sampling.temperature, sampling.top_k, sampling.top_p,
                                               sampling.repetition_penalty, (sampling.seed + i) % (MAX_SEED + 1))
                streams.append(engine.submit(Request(parsed.prompt, parsed.max_tokens, sampling, parsed.stop,
                                                     logprobs=parsed.logprobs, timeout=request_timeout)))
        except QueueFull:
            for s in streams:
                s.cancel()
            raise ApiError("the server is busy: too many requests are waiting", status=429,
                           kind="rate_limit_error") from None
        except InputError as e:
            for s in streams:
                s.cancel()
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

    async def complete(http: HttpRequest, chat: bool):
        parsed = parse_request(parse_body(await read_body(http)), model, model_name, chat=chat)
        streams = submit(parsed)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name}
        logprobs = LogprobFormat(model.tokenizer, chat)
        if not parsed.stream:
            try:
                answers = [await run_in_threadpool(_collect, s) for s in streams]
            finally:
                for s in streams:
                    s.cancel()  # a no-op for finished ones; frees the slots if the client went away
            if failed := [s.error for s in streams if s.finish_reason == "error"]:
                raise ApiError(f"the engine failed: {failed[0]}", status=500, kind="server_error")
            return {**head, "choices": [_choice(chat, i, text, _finish(s), logprobs=logprobs(entries))
                                        for i, ((text, entries), s) in enumerate(zip(answers, streams))],
                    "usage": _usage(streams)}
        return StreamingResponse(_events(head, streams, chat, parsed.include_usage, logprobs),
                                 media_type="text/event-stream")

    async def _events(head: dict, streams: list[Stream], chat: bool, include_usage: bool, logprobs: LogprobFormat):
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices, usage=None) -> str:
            payload = {**chunk_head, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(streams))])
            send, receive = anyio.create_memory_object_stream(64)

            async def pump(i: int, stream: Stream):
                iterator = stream.with_logprobs()
                # a cancelled wait (the client went away) leaves its thread, which the stream's
                # cancel below ends at the next step
                while (item := await anyio.to_thread.run_sync(next, iterator, None, abandon_on_cancel=True)) is not None:
                    await send.send((i, *item))
                await send.send((i, None, []))

            sent = [0] * len(streams)  # text so far per choice: completions' text offsets
            async with anyio.create_task_group() as tasks:
                for i, s in enumerate(streams):
                    tasks.start_soon(pump, i, s)
                open_streams = len(streams)
                async for i, piece, entries in receive:
                    if piece is None:
                        yield event([_choice(chat, i, "", _finish(streams[i]), delta=True)])
                        open_streams -= 1
                        if not open_streams:
                            break
                    else:
                        yield event([_choice(chat, i, piece, None, delta=True, logprobs=logprobs(entries, sent[i]))])
                        sent[i] += len(piece)
            if include_usage:
                yield f"data: {json.dumps({**chunk_head, 'choices': [], 'usage': _usage(streams)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.cancel()  # the client went away (or everything finished: then a no-op)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, chat=True)

    return app
