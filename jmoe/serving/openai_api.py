"""An OpenAI-compatible HTTP API over a BatchEngine (FastAPI; `pip install 'jmoe[serve]'`).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events in the OpenAI chunk
format, ending with `data: [DONE]`, or answered whole), GET /v1/models and /v1/models/{id}, POST
/tokenize and /detokenize, GET /tokenizer_info, GET /health and GET /metrics (Prometheus). An API
key, when set, guards every route but /health and /metrics; allowed origins turn on CORS. Every
request body is checked field by field before anything is queued; a bad one gets an OpenAI-style
error (status 400, 401 without the key, or 404 for an unknown model) naming the field, a full
queue 429 with Retry-After. `response_format` (JSON, or JSON of a schema) is held by constrained
decoding (jmoe/serving/structured.py). Every other error is an OpenAI-style JSON error too (500; 503 once the engine has
stopped), never plain text. Answers, streamed or whole, are awaited on the event loop (no thread
per request), and a client that goes away cancels its requests, freeing their slots. Each request
leaves one line in the `jmoe.access` log.
"""

import asyncio  # (no postponed annotations: FastAPI reads the endpoints' annotations, bound inside create_app)
import hmac
import json
import logging
import re
import time
import uuid
import dataclasses
from dataclasses import dataclass
from itertools import accumulate

from jmoe import validate
from jmoe.decoding.sampling import MAX_SEED, SamplingOptions
from jmoe.errors import InputError
from jmoe.serving.batcher import BatchEngine
from jmoe.serving.logits import MAX_TOP_LOGPROBS
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream, TokenLogprob
from jmoe.serving.chat import chat_prompt
from jmoe.serving.metrics import EngineMetrics
from jmoe.serving import structured
from jmoe.serving.scoring import PromptScorer
from jmoe.serving.tools import Tools, check_template, parse_tools, tool_calls
from jmoe.tokenizer import decode, encode

MAX_BODY_BYTES = 1 << 20  # a request body past this is refused before it is parsed
MAX_JSON_DEPTH = 32  # nesting a request body may have (a chat request needs 4)
MAX_N = 8  # completions per prompt (each takes a slot)
MAX_CHOICES = 256  # completions per request (prompts × n) at most, whatever the engine's queue holds
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI allows
DEFAULT_MAX_TOKENS = 256
CLIENT_GONE = 499  # the access log's status for a request whose client went away first (nginx's)
access_log = logging.getLogger("jmoe.access")
# fields this server does not implement, and the value each may still take (it asks for nothing):
# by endpoint, keyed by chat as FIELDS is (chat has no echo)
_NOT_IMPLEMENTED = {"best_of": 1, "suffix": None, "functions": None}
UNSUPPORTED = {False: {**_NOT_IMPLEMENTED, "tools": None, "tool_choice": None},
               True: {**_NOT_IMPLEMENTED, "echo": False}}
# every field a request may carry; any other is refused, naming it
COMMON_FIELDS = {"model", "max_tokens", "stream", "stream_options", "temperature", "top_k", "top_p", "min_p",
                 "repetition_penalty", "seed", "n", "stop", "logprobs", "logit_bias", "presence_penalty",
                 "frequency_penalty", "response_format", *UNSUPPORTED[False], *UNSUPPORTED[True]}
# OpenAI fields that ask nothing of the answer's content, accepted and ignored (documented as such)
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities"}
FIELDS = {False: COMMON_FIELDS | IGNORED | {"prompt"},
          True: COMMON_FIELDS | IGNORED | {"messages", "max_completion_tokens", "top_logprobs"}}


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
    prompts: list[list[int]]  # token ids of each prompt (chat: one); each gets n completions
    texts: list[str | None]  # each prompt as given when it was text (echo repeats it), else None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int
    sampling: SamplingOptions
    stop: list[str]
    logprobs: int | None  # alternatives per token, None: no logprobs
    echo: bool = False  # completions: each text (and its logprobs) starts with its prompt's
    grammar: str | None = None  # what its answers follow (response_format, tool_choice; jmoe/serving/structured.py)
    tools: Tools | None = None  # chat: the tools the template was given (tool calls are read back from answers)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def parse_body(raw: bytes) -> dict:
    """The JSON object of a body read_body has already bounded: nested at most MAX_JSON_DEPTH deep,
    every string valid Unicode."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_json(body)
    return body


def _check_json(body: dict) -> None:
    """Refuse nesting past MAX_JSON_DEPTH and strings that are not Unicode text (a lone surrogate
    such as "\\ud800", which JSON can spell but no tokenizer can encode), naming where."""
    pending = [(body, "", 1)]
    while pending:
        value, where, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                field = where.lstrip(".") or None
                raise ApiError(f"'{field}' holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
                               field) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                pending.append((key, where, depth))
                pending.append((item, f"{where}.{key}", depth + 1))
        elif isinstance(value, list):
            pending.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def parse_request(body: dict, model, model_name: str, *, chat: bool, max_tokens: int | None = None,
                  max_choices: int = MAX_CHOICES) -> Parsed:
    """Every field checked; the prompts tokenized (chat: with the model's chat template). max_tokens:
    the most a request may ask for (default: the model's context); max_choices: the most
    completions (prompts × n) it may ask for."""
    _check_fields(body, FIELDS[chat])
    _check_model(body.get("model"), model_name)
    n = _int(body, "n", 1, minimum=1, maximum=MAX_N)
    tools = _tools(body, model) if chat else None
    prompts, texts = ([_messages(body, model, tools)], [None]) if chat else _prompts(body, model, max_choices, n)
    for i, prompt in enumerate(prompts):
        if len(prompt) >= model.max_seq_len:
            field = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(f"the prompt has {len(prompt)} tokens; the context holds {model.max_seq_len}",
                           field, code="context_length_exceeded")
    for name, inert in UNSUPPORTED[chat].items():
        if body.get(name) not in (None, inert):
            raise ApiError(f"'{name}' is not supported by this server", name)
    echo = False if chat else _bool(body, "echo", False)
    bound = model.max_seq_len if max_tokens is None else max_tokens
    max_tokens = _int(body, "max_completion_tokens", None, minimum=1, maximum=bound) if chat else None
    if max_tokens is None:  # echo may ask for none: the prompt's own logprobs
        max_tokens = _int(body, "max_tokens", min(DEFAULT_MAX_TOKENS, bound), minimum=0 if echo else 1, maximum=bound)
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
            top_k=_int(body, "top_k", 0, minimum=0, maximum=model.config.vocab_size),
            top_p=_real(body, "top_p", 1.0, minimum=0.0, maximum=1.0, above=True),
            repetition_penalty=_real(body, "repetition_penalty", 1.0, minimum=0.0, maximum=10.0, above=True),
            seed=_int(body, "seed", 0, minimum=0, maximum=MAX_SEED),
            min_p=_real(body, "min_p", 0.0, minimum=0.0, maximum=1.0),
            logit_bias=_logit_bias(body, model.config.vocab_size),
            presence_penalty=_real(body, "presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
            frequency_penalty=_real(body, "frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        )
    except InputError as e:
        fields = ("logit_bias", "min_p", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                  "presence_penalty", "frequency_penalty")
        raise ApiError(str(e), next((f for f in fields if str(e).startswith(f)), None)) from None
    try:
        grammar = structured.grammar(body.get("response_format"), model.tokenizer, model.config.vocab_size,
                                     model.eos_token_ids)
    except InputError as e:
        raise ApiError(str(e), "response_format") from None
    if tools is not None and tools.grammar() is not None:
        if grammar is not None:
            raise ApiError("'response_format' and a 'tool_choice' that requires a call cannot both hold the answer",
                           "response_format")
        try:
            grammar = structured.lark(tools.grammar(), model.tokenizer, model.config.vocab_size, model.eos_token_ids)
        except InputError as e:
            raise ApiError(str(e), "tools") from None
    return Parsed(prompts, texts, n, stream, include_usage, max_tokens, sampling, _stop(body), _logprobs(body, chat),
                  echo, grammar, tools)


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ApiError(f"unknown field '{unknown[0]}'{more}", unknown[0])


def _check_model(requested, model_name: str, param: str | None = "model") -> None:
    """`requested` must name the served model (None: the served one); another name is a 404."""
    if requested is not None and not isinstance(requested, str):
        raise ApiError("'model' must be a string", param)
    if requested not in (None, model_name):
        raise ApiError(f"the model '{requested}' does not exist; this server serves '{model_name}'"[:300], param,
                       status=404, code="model_not_found")


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def parse_tokenize(body: dict, model, model_name: str) -> list[int]:
    """A /tokenize body's ids: its `prompt` (with the tokenizer's special tokens unless
    `add_special_tokens` is false) or its chat `messages` (as chat completions would prompt)."""
    _check_fields(body, TOKENIZE_FIELDS)
    _check_model(body.get("model"), model_name)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("give one of 'prompt' or 'messages'", "prompt")
    if "messages" in body:
        if "add_special_tokens" in body:
            raise ApiError("'add_special_tokens' applies to 'prompt' (messages follow the chat template)",
                           "add_special_tokens")
        return _messages(body, model)
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string", "prompt")
    special = _bool(body, "add_special_tokens", True)
    try:
        return encode(model.tokenizer, prompt, model.config.vocab_size, add_special_tokens=special)
    except InputError as e:
        raise ApiError(str(e), "prompt") from None


def parse_detokenize(body: dict, model, model_name: str) -> list[int]:
    """A /detokenize body's `tokens`: ids of the model's vocabulary (an empty list is empty text)."""
    _check_fields(body, DETOKENIZE_FIELDS)
    _check_model(body.get("model"), model_name)
    if "tokens" not in body:
        raise ApiError("'tokens' is required", "tokens")
    try:
        return validate.token_ids("tokens", body["tokens"], model.config.vocab_size)
    except InputError as e:
        raise ApiError(str(e), "tokens") from None


def _logit_bias(body: dict, vocab_size: int) -> dict:
    """OpenAI's logit_bias: an object mapping token ids (as strings) to biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ApiError(f"'logit_bias' holds at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}", "logit_bias")
    for token in bias:
        if not (isinstance(token, str) and token.isdigit() and int(token) < vocab_size):
            raise ApiError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {token!r}"[:200],
                           "logit_bias")
    return {int(token): value for token, value in bias.items()}


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


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompts(body: dict, model, max_choices: int, n: int) -> tuple[list[list[int]], list[str | None]]:
    """The completions' prompts, as OpenAI takes them: a string, a list of token ids, or a list of
    either (n completions each, at most max_choices in all); each one's ids, and its text when it
    was given as text."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required", "prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_prompt_ids(prompt, model, "prompt")], [prompt if isinstance(prompt, str) else None]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if len(prompt) * n > max_choices:
        raise ApiError(f"'prompt' holds {len(prompt)} prompts, {n} completion(s) each; this server answers at most "
                       f"{max_choices} completions per request", "prompt")
    ids = [_prompt_ids(item, model, f"prompt[{i}]") for i, item in enumerate(prompt)]
    return ids, [item if isinstance(item, str) else None for item in prompt]


def _prompt_ids(prompt, model, field: str) -> list[int]:
    """One prompt's token ids: a non-empty string, tokenized, or token ids of the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(f"'{field}' is empty", field)
        try:
            return encode(model.tokenizer, prompt, model.config.vocab_size)
        except InputError as e:  # a model converted without a tokenizer
            raise ApiError(str(e), field) from None
    if _is_ids(prompt):
        if not all(0 <= t < model.config.vocab_size for t in prompt):
            raise ApiError(f"'{field}' token ids must be in [0, {model.config.vocab_size})", field)
        return list(prompt)
    raise ApiError(f"'{field}' must be a string or a non-empty list of token ids", field)


def _tools(body: dict, model) -> Tools | None:
    """The request's tools (None: it renders none), refused unless the chat template takes them."""
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except InputError as e:
        raise ApiError(str(e), "tool_choice" if str(e).startswith("'tool_choice'") else "tools") from None
    if tools is not None:
        try:
            check_template(model.tokenizer)
        except InputError as e:
            raise ApiError(str(e), "tools") from None
    return tools


def _messages(body: dict, model, tools: Tools | None = None) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    try:
        return chat_prompt(model, chat, None if tools is None else tools.for_template())
    except InputError as e:
        raise ApiError(str(e), "messages") from None


def _message(m, i: int) -> dict:
    """One chat message as the template takes it: its role, its text, and a tool turn's call id or an
    assistant turn's tool calls (whose content may then be null)."""
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(f"'{field}' must be an object", field)
    role = m.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise ApiError(f"'{field}.role' must be system, user, assistant, developer or tool", f"{field}.role")
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise ApiError(f"'{field}.tool_calls' must be a list of tool calls", f"{field}.tool_calls")
    content = "" if calls and m.get("content") is None else _content(m.get("content"), i)
    message = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        message["tool_calls"] = [{**c, "function": _called(c, f"{field}.tool_calls[{j}]")} for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ApiError(f"'{field}.tool_call_id' must be a string (the call this answers)", f"{field}.tool_call_id")
        message["tool_call_id"] = m["tool_call_id"]
    return message


def _called(call: dict, field: str) -> dict:
    """A tool call's function with its arguments as an object (what chat templates print as JSON)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(f"'{field}.function' must name the function called", f"{field}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ApiError(f"'{field}.function.arguments' must be JSON", f"{field}.function.arguments") from None
    return {"name": function["name"], "arguments": arguments}


def _content(content, i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts, whose text parts are joined
    (this server reads no images, audio or files: any other part is refused, naming it)."""
    field = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"'{field}' must be a string or a list of content parts", field)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ApiError(f"'{field}[{j}]' must be an object", f"{field}[{j}]")
        if part.get("type") != "text":
            raise ApiError(f"'{field}[{j}].type' must be 'text' (this server reads text only), got "
                           f"{str(part.get('type'))[:40]!r}", f"{field}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise ApiError(f"'{field}[{j}].text' must be a string", f"{field}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


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
        if parsed.tools is not None:
            _read_tool_calls(choice, "message", parsed.tools)
        choices.append(choice)
    return choices


def _read_tool_calls(choice: dict, key: str, tools: Tools) -> None:
    """A chat choice's tool calls taken out of its text (`key`: "message", or "delta" when streamed);
    an answer that calls a tool finishes with "tool_calls"."""
    content, calls = tool_calls(choice[key].get("content") or "", tools)
    if not calls:
        return
    choice[key]["content"] = content
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
               max_tokens: int | None = None, api_key: str | None = None, allowed_origins: list[str] | None = None,
               warm_up_echo: bool = False):
    """The FastAPI application serving `engine`'s model as `model_name`; a request still running
    `request_timeout` seconds after it arrived ends there (finish reason "length"); a request may
    ask for at most `max_tokens` tokens (default: the engine's context). With `api_key`, the API's
    routes need it as a bearer token; `allowed_origins` (parse_origins') may call it from a browser.
    warm_up_echo: compile echo's prompt scoring now (else its first use at each prompt-length bucket
    compiles it, holding the model meanwhile)."""
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
    # echo's prompt logprobs run forward beside the engine: not where other processes replay its steps
    scorer = PromptScorer(model) if engine.mirror is None else None
    if warm_up_echo and scorer is not None:
        scorer.warm_up(engine.context)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health():
        if engine.closed:  # failed (a supervisor should restart the server), or stopping
            status = "failed" if engine.failure else "stopping"
            return JSONResponse({"status": status, "error": engine.failure}, status_code=503)
        return {"status": "ok", "running": engine.running, "waiting": len(engine.waiting)}

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "jmoe"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str):
        _check_model(model_id, model_name, param=None)
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
                                                         grammar=parsed.grammar)))
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

    async def echoes(parsed: Parsed, logprobs: LogprobFormat) -> list[tuple[str, dict | None]]:
        """Each prompt's echo: its text, and its tokens' logprobs when asked for."""
        out = []
        for ids, text in zip(parsed.prompts, parsed.texts):
            text = decode(model.tokenizer, ids) if text is None else text
            scored = None if parsed.logprobs is None else logprobs(await scorer.score(ids, parsed.logprobs))
            out.append((text, scored))
        return out

    async def complete(http: HttpRequest, chat: bool):
        parsed = parse_request(parse_body(await read_body(http)), model, model_name, chat=chat,
                               max_tokens=max_tokens, max_choices=max_choices)
        if parsed.echo and parsed.logprobs is not None and scorer is None:
            raise ApiError("'echo' with 'logprobs' is not available when the model is served by several processes",
                           "echo")
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
            open_streams = len(streams)
            while open_streams:
                i, piece, entries = await pieces.get()
                if piece is not None and held is not None:
                    held[i] = (held[i][0] + piece, held[i][1] + entries)
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
