"""GPT-OSS's harmony answers, read back for chat (the server's chat completions, and generate on
chat messages).

A harmony model answers in messages, each a header, `<|message|>`, a body and an end marker:

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>4.<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The "analysis" channel is the model's reasoning (OpenAI's `reasoning_content`), "final" (and a
commentary without a recipient, a preamble) the answer's content, and a commentary addressed
`to=functions.NAME` a tool call with its JSON arguments. The markers are special tokens, so a
harmony chat answer's text keeps special tokens and is split here (generate keeps the content
only); text outside any message (a model that never opens one) is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MESSAGE, CHANNEL, CONSTRAIN, CALL = "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"
_END = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([\w.\-]+)")
_MARKER = re.compile(r"<\|\w+\|>")
_PARTIAL_MARKER = re.compile(r"<(?:\|\w*\|?)?$")
_DECODER = json.JSONDecoder()


def uses_harmony(tokenizer) -> bool:
    """Whether the model's chat template writes harmony messages (GPT-OSS's)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return isinstance(template, str) and CHANNEL in template and MESSAGE in template


@dataclass(frozen=True)
class Message:
    channel: str | None  # None: none named (or text outside any message)
    recipient: str | None  # e.g. "functions.get_weather"
    body: str
    stop: int | None  # where in the text the next message starts (None: this one may still grow)
    outside: bool = False  # text outside any message (it ends at the next marker, not at an end marker)


def messages(text: str) -> list[Message]:
    """The messages of a harmony answer, in order (the last may be unfinished)."""
    out, start = [], 0
    while start < len(text):
        rest = text[start:]
        head, found, after = rest.partition(MESSAGE)
        marker = _MARKER.search(head)
        leading = head[:marker.start()] if marker else head
        if leading.strip() and not leading.lstrip().startswith(("assistant", "to=")):  # plain text before a header
            out.append(Message(None, None, leading, start + marker.start() if marker else None, outside=True))
        if not found:  # no message opens any more (a header may be being written)
            break
        end = _END.search(after)
        body_at = start + len(head) + len(MESSAGE)
        body, stop = (after[:end.start()], body_at + end.end()) if end else (after, None)
        channel, recipient = _CHANNEL.search(head), _RECIPIENT.search(head)
        out.append(Message(channel and channel.group(1), recipient and recipient.group(1), body, stop))
        if stop is None:
            break
        start = stop
    return out


def _tool_call(message: Message, names: set) -> tuple[str, str] | None:
    """A commentary to one of the tools, as (name, JSON arguments), else None."""
    if not (message.recipient or "").startswith("functions."):
        return None
    name = message.recipient.removeprefix("functions.")
    try:
        value, end = _DECODER.raw_decode(message.body.strip())
    except json.JSONDecodeError:
        return None
    if name not in names or end != len(message.body.strip()) or not isinstance(value, dict):
        return None
    return name, json.dumps(value)


def split(text: str, names: set = frozenset()) -> tuple[str, str, list[tuple[str, str]]]:
    """A whole answer -> (reasoning, content, tool calls as (name, JSON arguments)); a message
    to a function that is not one of `names`, or whose body is not a JSON object, stays content."""
    reasoning, content, calls = [], [], []
    for m in messages(text):
        call = _tool_call(m, names)
        if call is not None:
            calls.append(call)
        elif m.channel == "analysis":
            reasoning.append(m.body)
        else:
            content.append(m.body)
    return "".join(reasoning), "".join(content), calls


class HarmonyStream:
    """A streamed harmony answer's deltas: feed() each text piece, get (reasoning, content) added.
    A message to one of the tools `names` is not content (split reads its call at the end). Each
    piece is read once: a message's body is only searched for its end marker where it grew."""

    def __init__(self, names: set = frozenset()):
        self.names = names
        self.text = ""
        self.start = 0  # where the first unfinished message begins (all before it was sent)
        self.held = 0  # where a marker still being written begins (len(text): none)
        self.body = None  # the unfinished message whose header was read: (where its body begins, kind or None)
        self.sent = 0  # how much of the first unfinished message's body was sent

    def feed(self, piece: str) -> tuple[str, str]:
        added = {"reasoning": "", "content": ""}
        grown = len(self.text)  # a new marker (whole or partial) begins at or after min(held, grown)
        self.text += piece
        partial = _PARTIAL_MARKER.search(self.text, min(self.held, grown))
        scanned, self.held = self.held, partial.start() if partial else len(self.text)
        if self.body is not None:  # the body of a message being written: where does it end?
            body_at, kind = self.body
            end = _END.search(self.text, max(scanned - 1, body_at), self.held)
            if kind is not None:
                added[kind] += self.text[body_at + self.sent:end.start() if end else self.held]
            if end is None:
                self.sent = self.held - body_at
                return added["reasoning"], added["content"]
            self.start, self.sent, self.body = end.end(), 0, None
        base = self.start
        for m in messages(self.text[base:self.held]):
            kind = None if (m.recipient or "").removeprefix("functions.") in self.names else (
                "reasoning" if m.channel == "analysis" else "content")
            if kind is not None:
                added[kind] += m.body[self.sent:]
            if m.stop is not None:
                self.start, self.sent = base + m.stop, 0
            else:
                self.sent = len(m.body)
                if not m.outside:
                    self.body = (self.held - len(m.body), kind)
        return added["reasoning"], added["content"]
