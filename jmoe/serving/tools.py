"""Tool calls on chat completions (OpenAI's `tools` and `tool_choice`), for chat templates that take tools.

The tools go to the model's chat template (which describes them to the model in its own words);
the answer's tool calls are read back in the format the template teaches, told by what it says:

    Hermes / Qwen2.5 / Qwen3   <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
    Mistral                    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
                               (or, from newer templates, [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"})
    Llama 3.1 / 3.2 / 3.3      {"name": "get_weather", "parameters": {"city": "Paris"}}  (the whole answer,
                               after an optional <|python_tag|>; several joined by ";")
    DeepSeek-V3 / R1           <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                               ```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                               (V3.1: <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}...)
    GPT-OSS (harmony)          <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
                               {"city": "Paris"}<|call|>

`tool_choice` "auto" (the default with tools) lets the model answer or call; "none" renders no
tools; "required", or one named function, holds the answer to one call in the template's format by
constrained decoding (jmoe/serving/structured.py), its arguments to the function's parameter
schema (a marker the tokenizer holds as one special token is drawn as that token). GPT-OSS's harmony
messages (a commentary `to=functions.NAME` holding the JSON arguments) are read by
jmoe/harmony.py. A model whose template takes no tools, or in another format, is refused
with a 400 naming `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from jmoe import harmony
from jmoe.errors import InputError
from jmoe.serving.structured import COMPACT_JSON

MAX_TOOLS = 128  # as OpenAI allows
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DECODER = json.JSONDecoder()


def tool_call(name: str, arguments) -> dict:
    """One call in OpenAI's shape (arguments as a JSON string)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _json_values(text: str, separator: str = "") -> list | None:
    """The JSON values `text` is made of (optionally joined by `separator`), or None when it is not only that."""
    values, i, text = [], 0, text.strip()
    while i < len(text):
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
    return values


def _marker(tokenizer, text: str) -> str:
    """A literal of a Lark grammar: the tokenizer's special token when it holds `text` as one, else the text."""
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def _call_rules(call_schema: dict, key: str, one) -> str:
    """Lark rules for `call`: one alternative per function of `call_schema`, one(name, its
    arguments' JSON schema as text) writing it."""
    alternatives = []
    for entry in call_schema.get("anyOf", [call_schema]):
        name, arguments = entry["properties"]["name"]["const"], entry["properties"][key]
        alternatives.append(one(name, json.dumps({**arguments, "x-guidance": COMPACT_JSON})))
    rules = "\n".join(f"call{i}: {a}" for i, a in enumerate(alternatives))
    return f"call: {' | '.join(f'call{i}' for i in range(len(alternatives)))}\n{rules}"


@dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates writes tool calls: what in a template tells it, how a
    forced call is written (a Lark grammar around one call's JSON) and how calls are read back."""

    name: str
    markers: tuple  # a template that contains all of these teaches this format
    key: str = "arguments"  # the call's field holding its arguments

    def call_grammar(self, call_schema: dict, tokenizer) -> str:
        raise NotImplementedError

    def read(self, text: str, names: set) -> tuple[str | None, list[dict]]:
        """An answer -> (its content outside tool calls, or None when nothing else is said; its calls
        in OpenAI's shape). What is not a call of one of the tools stays in the content."""
        raise NotImplementedError

    def _as_call(self, value, names: set) -> dict | None:
        if isinstance(value, dict) and value.get("name") in names:
            return tool_call(value["name"], value.get(self.key, value.get("arguments", {})))
        return None


class _Hermes(ToolFormat):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

    def call_grammar(self, call_schema, tokenizer):
        opening = _marker(tokenizer, self.OPEN) + ' "\\n"'
        closing = '"\\n" ' + _marker(tokenizer, self.CLOSE)
        return f"start: {opening} call {closing}\ncall: %json {json.dumps(call_schema)}"

    def read(self, text, names):
        calls, kept, start = [], [], 0
        for match in self._BLOCK.finditer(text):
            values = _json_values(match.group(1))
            call = self._as_call(values[0], names) if values and len(values) == 1 else None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[start:match.start()])
            start = match.end()
        kept.append(text[start:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls


class _Mistral(ToolFormat):
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def call_grammar(self, call_schema, tokenizer):
        calls = {"type": "array", "minItems": 1, "maxItems": 1, "items": call_schema, "x-guidance": COMPACT_JSON}
        return f"start: {_marker(tokenizer, self.OPEN)} calls\ncalls: %json {json.dumps(calls)}"

    def read(self, text, names):
        head, found, rest = text.partition(self.OPEN)
        if not found:
            return text, []
        calls = []
        for part in rest.split(self.OPEN):
            name, has_args, arguments = part.partition(self.ARGS)
            if has_args:  # name[ARGS]{...}
                values = _json_values(arguments)
                call = self._as_call({"name": name.strip(), "arguments": values[0]}, names) if values else None
                calls.append(call)
                continue
            values = _json_values(part)
            listed = values[0] if values and len(values) == 1 else None
            listed = listed if isinstance(listed, list) else [listed]
            calls.extend(self._as_call(v, names) for v in listed)
        if not calls or None in calls:
            return text, []
        return head.strip() or None, calls


class _Llama3(ToolFormat):
    TAG = "<|python_tag|>"

    def call_grammar(self, call_schema, tokenizer):
        return f"start: call\ncall: %json {json.dumps(call_schema)}"

    def read(self, text, names):
        body = text.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        values = _json_values(body, ";") if body.startswith("{") else None
        calls = [self._as_call(v, names) for v in values or []]
        if not calls or None in calls:
            return text, []
        return None, calls


class _DeepSeek(ToolFormat):
    """DeepSeek-V3 / R1: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>;
    V3.1 (`fenced` False): <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>; the calls inside
    <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>."""

    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    fenced = True  # V3 / R1 (V3.1: _DeepSeekV31)

    def call_grammar(self, call_schema, tokenizer):
        m = lambda text: _marker(tokenizer, text)  # noqa: E731

        def one(name, arguments):
            if self.fenced:
                return f'"function" {m(self.SEP)} {json.dumps(name)} "\\n```json\\n" %json {arguments} "\\n```"'
            return f"{json.dumps(name)} {m(self.SEP)} %json {arguments}"

        return (f"start: {m(self.BEGIN)} {m(self.CALL)} call {m(self.CALL_END)} {m(self.END)}\n"
                + _call_rules(call_schema, self.key, one))

    def read(self, text, names):
        head, found, rest = text.partition(self.BEGIN)
        if not found:
            return text, []
        calls = []
        for block in rest.split(self.END)[0].split(self.CALL)[1:]:
            left, has_sep, right = block.split(self.CALL_END)[0].partition(self.SEP)
            if left.strip() == "function":  # V3 / R1: the name, then the arguments fenced as JSON
                name, _, arguments = right.partition("\n")
                arguments = arguments.strip().removeprefix("```json").removesuffix("```")
            else:
                name, arguments = left, right
            values = _json_values(arguments) if has_sep else None
            calls.append(self._as_call({"name": name.strip(), "arguments": values[0]}, names)
                         if values and len(values) == 1 else None)
        if not calls or None in calls:
            return text, []
        return head.strip() or None, calls


class _DeepSeekV31(_DeepSeek):
    fenced = False


class _Harmony(ToolFormat):
    """GPT-OSS: each call a commentary message to functions.NAME; its reasoning and answer in
    other channels (jmoe/harmony.py)."""

    def call_grammar(self, call_schema, tokenizer):
        m = lambda text: _marker(tokenizer, text)  # noqa: E731

        def one(name, arguments):
            return (f'{json.dumps("commentary to=functions." + name + " ")} {m(harmony.CONSTRAIN)} "json" '
                    f"{m(harmony.MESSAGE)} %json {arguments}")

        return f"start: {m(harmony.CHANNEL)} call {m(harmony.CALL)}\n" + _call_rules(call_schema, self.key, one)

    def read(self, text, names):
        _, content, calls = harmony.split(text, names)
        if not calls:
            return text, []
        return content.strip() or None, [tool_call(name, arguments) for name, arguments in calls]


HERMES = _Hermes("hermes", ("<tool_call>",))
MISTRAL = _Mistral("mistral", ("[TOOL_CALLS]",))
LLAMA3 = _Llama3("llama3", ('"parameters": dictionary of argument name',), key="parameters")
DEEPSEEK = _DeepSeek("deepseek", (_DeepSeek.BEGIN, "```json"))
DEEPSEEK_V31 = _DeepSeekV31("deepseek-v3.1", (_DeepSeek.BEGIN,))
HARMONY = _Harmony("harmony", (harmony.CHANNEL, "functions"))
FORMATS = (HERMES, MISTRAL, LLAMA3, DEEPSEEK, DEEPSEEK_V31, HARMONY)  # the first whose markers a template holds


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's function tools, as given) and what it lets the model do with them."""

    functions: tuple  # ({"name", "description"?, "parameters"?}, ...)
    choice: str  # "auto", "required" or "function" (a named one: `name`)
    name: str | None = None
    format: ToolFormat = field(default=HERMES)  # the template's (template_format)

    def for_template(self) -> list[dict]:
        """The tools as chat templates take them."""
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def grammar(self, tokenizer=None) -> str | None:
        """What the answer must be, as a grammar (llguidance's Lark), or None when the model may answer freely."""
        if self.choice == "auto":
            return None
        key = self.format.key
        chosen = [f for f in self.functions if self.choice == "required" or f["name"] == self.name]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                  "properties": {"name": {"const": f["name"]},
                                 key: f.get("parameters") or {"type": "object"}}} for f in chosen]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": COMPACT_JSON}
        return self.format.call_grammar(schema, tokenizer)


def parse_tools(tools, tool_choice) -> Tools | None:
    """OpenAI's `tools` and `tool_choice` checked; None when the request renders no tools (none
    given, or tool_choice "none"). Raises InputError naming the field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InputError("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise InputError(f"'tools' must be a list of 1 to {MAX_TOOLS} tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InputError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise InputError(f"'{where}' has no field {unknown[0]!r}")
        f = tool["function"]
        extra = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if extra:
            raise InputError(f"'{where}.function' has no field {extra[0]!r}")
        if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise InputError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'")
        if "description" in f and not isinstance(f["description"], str):
            raise InputError(f"'{where}.function.description' must be a string")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise InputError(f"'{where}.function.parameters' must be a JSON schema (an object)")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InputError("'tools' names a function twice")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return Tools(tuple(functions), choice)
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and choice["function"].get("name") in names):
        return Tools(tuple(functions), "function", choice["function"]["name"])
    raise InputError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}} naming one of the tools")


def template_format(tokenizer) -> ToolFormat:
    """The tool-call format the model's chat template teaches; refuses a template that takes no
    tools, or takes them in a format this server cannot read back."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the one chat uses, or the one for tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        raise InputError("this model's chat template takes no tools")
    for fmt in FORMATS:
        if all(marker in template for marker in fmt.markers):
            return fmt
    raise InputError("this model's chat template takes tools in a format this server does not read back "
                     "(it reads Hermes/Qwen <tool_call> blocks, Mistral [TOOL_CALLS], Llama 3.1 JSON, DeepSeek's "
                     "tool-call tokens and GPT-OSS's harmony commentary)")


def tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """An answer -> (its content outside tool calls, or None when nothing else is said; its calls
    in OpenAI's shape), in the request's template's format."""
    return tools.format.read(text, tools.names)
