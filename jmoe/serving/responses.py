"""The OpenAI API's answer shapes (jmoe/serving/openai_api.py's routes build them): choices whole
or streamed, usage, finish reasons, logprobs in completions' or chat's format, and tool calls or
harmony channels read out of a chat answer's text."""

from itertools import accumulate

from jmoe import harmony
from jmoe.serving.requests import Stream, TokenLogprob
from jmoe.serving.tools import Tools, tool_call, tool_calls
from jmoe.serving.validation import Parsed
from jmoe.tokenizer import decode

# the finish reason a client sees for each of the engine's ("error" becomes an error instead)
FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "cancelled",
                  "reader_timeout": "reader_timeout"}


def usage(prompt: int, streams: list[Stream]) -> dict:
    """OpenAI's usage: each prompt counted once (not once per completion), every completion's tokens."""
    completion = sum(s.usage["completion_tokens"] for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(stream: Stream) -> str:
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


def as_choice(chat: bool, index: int, text: str, finish: str | None, delta: bool = False, logprobs=None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if delta:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def whole_choices(parsed: Parsed, chat: bool, answers: list, streams: list[Stream],
                   prefixes: list | None, logprobs: LogprobFormat) -> list[dict]:
    """The choices of a whole answer, prompt by prompt, n each; with echo each text and its logprobs
    start with its prompt's (max_tokens 0: the prompt alone, finish reason "length")."""
    choices = []
    for c in range(len(parsed.prompts) * parsed.n):
        text, entries = answers[c] if streams else ("", [])
        finish = finish_reason(streams[c]) if streams else "length"
        prefix, prefix_logprobs = prefixes[c // parsed.n] if prefixes is not None else ("", None)
        generated = logprobs(entries, len(prefix))
        joined = LogprobFormat.joined(prefix_logprobs, generated)
        choice = as_choice(chat, c, prefix + text, finish, logprobs=joined)
        if parsed.harmony:
            read_harmony(choice, "message", parsed.tools)
        elif parsed.tools is not None:
            read_tool_calls(choice, "message", parsed.tools)
        choices.append(choice)
    return choices


def read_tool_calls(choice: dict, key: str, tools: Tools) -> None:
    """A chat choice's tool calls taken out of its text (`key`: "message", or "delta" when streamed);
    an answer that calls a tool finishes with "tool_calls"."""
    content, calls = tool_calls(choice[key].get("content") or "", tools)
    if calls:
        choice[key]["content"] = content
        attach_calls(choice, key, calls)


def read_harmony(choice: dict, key: str, tools: Tools | None) -> None:
    """A harmony chat choice split by channel: its reasoning (`reasoning_content`), its answer
    (`content`) and, with tools, its calls (finishing with "tool_calls")."""
    reasoning, content, calls = harmony.split(choice[key].get("content") or "", tools.names if tools else set())
    choice[key]["content"] = content or (None if calls or key == "message" and reasoning else "")
    if reasoning:
        choice[key]["reasoning_content"] = reasoning
    if calls:
        attach_calls(choice, key, [tool_call(name, arguments) for name, arguments in calls])


def attach_calls(choice: dict, key: str, calls: list[dict]) -> None:
    """Calls in OpenAI's shape onto a choice (indexed when streamed); it finishes with "tool_calls"."""
    choice[key]["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)] if key == "delta" else calls
    if choice["finish_reason"] in ("stop", None):
        choice["finish_reason"] = "tool_calls"
