"""The model's own tokenizer: prompts (text, chat messages or ids) in, streamed text out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from jmoe.errors import InputError


def load_tokenizer(path: Path | None):
    if path is None or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    return AutoTokenizer.from_pretrained(str(path))


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)


def encode(tokenizer, prompt: Any) -> list[int]:
    """One prompt -> token ids. Strings use the model's tokenizer; chat messages its chat template."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError("this model was converted without a tokenizer; pass token ids instead of text")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif is_chat(prompt):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InputError("this model's tokenizer has no chat template; pass a plain string instead of messages")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    elif is_ids(prompt):
        ids = list(prompt)
    else:
        raise InputError(f"a prompt must be a string, chat messages or token ids, not {type(prompt).__name__}")
    if not ids:
        raise InputError("the prompt is empty")
    return [int(t) for t in ids]


class StreamDetokenizer:
    """Turns generated ids into text deltas without splitting multi-byte characters.

    Decodes a short window of recent ids and emits only the new, complete suffix (the approach
    of text-generation-inference), so streaming costs O(1) per token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix) :]
        return ""


def decode_all(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)
