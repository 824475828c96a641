"""Tool calls on chat completions (OpenAI's `tools` and `tool_choice`), for chat templates that take tools.

The tools go to the model's chat template (which describes them to the model in its own words);
the answer's tool calls are read back in the format such templates teach, Hermes' and Qwen's:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` "auto" (the default with tools) lets the model answer or call; "none" renders no
tools; "required", or one named function, holds the answer to such a call by constrained
decoding (jmoe/serving/structured.py), its arguments to the function's parameter schema. A model
whose template takes no tools, or not in this format, is refused with a 400 naming `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from jmoe.errors import InputError
from jmoe.serving.structured import COMPACT_JSON

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # as OpenAI allows
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's function tools, as given) and what it lets the model do with them."""

    functions: tuple  # ({"name", "description"?, "parameters"?}, ...)
    choice: str  # "auto", "required" or "function" (a named one: `name`)
    name: str | None = None

    def for_template(self) -> list[dict]:
        """The tools as chat templates take them."""
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def grammar(self) -> str | None:
        """What the answer must be, as a grammar (llguidance's Lark), or None when the model may answer freely."""
        if self.choice == "auto":
            return None
        chosen = [f for f in self.functions if self.choice == "required" or f["name"] == self.name]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or {"type": "object"}}} for f in chosen]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": COMPACT_JSON}
        opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
        return f"start: {opening} call {closing}\ncall: %json {json.dumps(schema)}"


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


def check_template(tokenizer) -> None:
    """Refuse tools unless the model's chat template takes them in the <tool_call> format."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str) or "tools" not in template or OPEN not in template:
        raise InputError("this model's chat template takes no tools in the <tool_call> format (Hermes, Qwen) "
                         "that this server reads back")


def tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """An answer -> (its content outside tool calls, or None when nothing else is said; its calls
    in OpenAI's shape). A block that is not a call of one of the tools stays in the content."""
    calls, kept, start = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in tools.names:
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[start:match.start()])
        start = match.end()
    kept.append(text[start:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
