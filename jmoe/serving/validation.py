"""The OpenAI API's request bodies checked and parsed: the JSON itself (size, depth, Unicode), every
field of a completion, chat, tokenize or detokenize request (its type, bounds and limits), the
sampling parameters, prompts and chat messages; a bad body raises ApiError naming the field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from jmoe import harmony, validate
from jmoe.decoding.sampling import MAX_SEED, SamplingOptions
from jmoe.errors import InputError
from jmoe.serving import structured
from jmoe.serving.chat import chat_prompt
from jmoe.serving.logits import MAX_TOP_LOGPROBS
from jmoe.serving.tools import Tools, parse_tools, template_format
from jmoe.tokenizer import encode

MAX_BODY_BYTES = 1 << 20  # a request body past this is refused before it is parsed
MAX_JSON_DEPTH = 32  # nesting a request body may have (a chat request needs 4)
MAX_N = 8  # completions per prompt (each takes a slot)
MAX_CHOICES = 256  # completions per request (prompts × n) at most, whatever the engine's queue holds
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI allows
DEFAULT_MAX_TOKENS = 256
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
    harmony: bool = False  # chat with a harmony template (GPT-OSS): answers split by channel (jmoe/harmony.py)

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
    check_model(body.get("model"), model_name)
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
    if tools is not None and tools.choice != "auto":
        if grammar is not None:
            raise ApiError("'response_format' and a 'tool_choice' that requires a call cannot both hold the answer",
                           "response_format")
        try:
            grammar = structured.lark(tools.grammar(model.tokenizer), model.tokenizer, model.config.vocab_size,
                                      model.eos_token_ids)
        except InputError as e:
            raise ApiError(str(e), "tools") from None
    return Parsed(prompts, texts, n, stream, include_usage, max_tokens, sampling, _stop(body), _logprobs(body, chat),
                  echo, grammar, tools, harmony=chat and harmony.uses_harmony(model.tokenizer))


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ApiError(f"unknown field '{unknown[0]}'{more}", unknown[0])


def check_model(requested, model_name: str, param: str | None = "model") -> None:
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
    check_model(body.get("model"), model_name)
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
    check_model(body.get("model"), model_name)
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
            tools = dataclasses.replace(tools, format=template_format(model.tokenizer))
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
