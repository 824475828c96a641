"""The model's own tokenizer: prompts (text, chat messages or ids) in, streamed text out.

jmoe's calls into the tokenizer are serialised: a loaded model may be shared between threads, and
the Rust fast tokenizers refuse some concurrent calls ("Already borrowed").
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jmoe import validate
from jmoe.errors import FormatError, InputError, JmoeError

_LOCK = threading.Lock()


def load_tokenizer(path: Path | None, error: type[JmoeError] = FormatError):
    """The tokenizer in `path` (None where there is none): a `TokenizerFile` where the files ask for
    nothing beyond tokenizer.json, else the class AutoTokenizer would choose."""
    if path is None or not Path(path).is_dir():
        return None
    try:
        plain = TokenizerFile.open(Path(path))
        if plain is not None:
            return plain
        return tokenizer_class(Path(path)).from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for damaged tokenizer files
        raise error(f"the tokenizer in {path} cannot be loaded: {first_line(e)}") from None


# tokenizer_config.json classes that are tokenizer.json and nothing more: transformers' generic fast
# tokenizer (the name it writes since 5.0 and the name before).
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Settings with which transformers changes what tokenizer.json alone would give: special tokens
# added or moved, a rebuilt post-processor, cleaned-up decoded text, custom code.
CHANGING_SETTINGS = ("add_bos_token", "add_eos_token", "added_tokens_decoder", "additional_special_tokens",
                     "extra_special_tokens", "auto_map", "clean_up_tokenization_spaces", "add_prefix_space")
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerFile:
    """A tokenizer.json read by the `tokenizers` library itself, for the tokenizers transformers would
    only wrap (`open`): the same ids and text as transformers' fast tokenizer, without importing
    transformers (a second of every command's start-up; measured in bench/startup.py). A chat
    template is rendered by transformers' tokenizer, built the first time one is needed."""

    def __init__(self, path: Path, config: dict, backend):
        self.path, self.config, self.backend = path, config, backend
        self.backend.no_truncation()  # as transformers leaves an encode without max_length
        self.backend.no_padding()
        self.chat_template = config.get("chat_template")
        jinja = path / "chat_template.jinja"
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text()
        self._full = None

    @classmethod
    def open(cls, path: Path) -> "TokenizerFile | None":
        """The tokenizer in `path` where this class gives what AutoTokenizer would, else None (each
        file read once)."""
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or not (path / "tokenizer.json").is_file():
            return None
        if config.get("tokenizer_class") not in PLAIN_CLASSES or any(config.get(k) for k in CHANGING_SETTINGS):
            return None
        specials = [config.get(name) for name in SPECIAL_NAMES]
        if not all(s is None or isinstance(s, str) for s in specials):
            return None  # an AddedToken's settings (lstrip, normalized, ...) are transformers' to apply
        import tokenizers

        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        if not all(s is None or backend.token_to_id(s) is not None for s in specials):
            return None  # transformers would add them
        return cls(path, config, backend)

    # -- what jmoe asks of a tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.config.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.config.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.config.get("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: i for i, token in self.backend.get_added_tokens_decoder().items()}

    def apply_chat_template(self, messages, **kwargs):
        kwargs.setdefault("chat_template", self.chat_template)  # as set on this object, as transformers allows
        return self.full().apply_chat_template(messages, **kwargs)

    def full(self):
        """transformers' own tokenizer for these files (its import deferred to the first chat)."""
        if self._full is None:
            self._full = tokenizer_class(self.path).from_pretrained(str(self.path))
        return self._full


def tokenizer_class(path: Path):
    """The class AutoTokenizer would load the tokenizer in `path` with, found without importing
    AutoTokenizer: that import pulls in transformers' model configuration and with it torch, where
    installed (2.4 s against 0.8-1.1 s for the tokenizer's own module). Where the files name no
    class transformers holds, or custom code (auto_map), AutoTokenizer itself."""
    import transformers  # deferred: importing transformers takes a second

    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        name = config.get("tokenizer_class")
        if isinstance(name, str) and "auto_map" not in config:
            found = getattr(transformers, name, None)
            if isinstance(found, type) and hasattr(found, "from_pretrained"):
                return found
    except (OSError, ValueError, AttributeError, ImportError):
        pass
    return transformers.AutoTokenizer


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_ids(prompt: Any) -> bool:
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer)
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt)


def check_text(name: str, text: str) -> str:
    """`text` if it is Unicode text: a lone surrogate ("\\ud800", which JSON can spell) is not, and
    the tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{name} holds a lone surrogate at character {e.start}, which is not Unicode text") from None
    return text


def check_messages(messages: Sequence[dict]) -> list[dict]:
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            if key not in m:
                raise InputError(f"chat message {i} has no {key!r} (each message needs 'role' and 'content')")
            if not isinstance(m[key], str):
                raise InputError(f"chat message {i}: {key!r} must be a string, got {type(m[key]).__name__}")
            check_text(f"chat message {i}: {key!r}", m[key])
    return list(messages)


def encode(tokenizer, prompt: Any, vocab_size: int, name: str = "prompt", add_special_tokens: bool = True,
           tools: list[dict] | None = None) -> list[int]:
    """One prompt -> token ids. Strings use the model's tokenizer (with the special tokens it adds,
    such as a BOS, unless add_special_tokens is False); chat messages its chat template (given
    `tools` when set)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"{name} is empty")
        if tokenizer is None:
            raise InputError("this model was converted without a tokenizer; pass token ids instead of text")
        check_text(name, prompt)
        with _LOCK:
            ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif is_chat(prompt):
        messages = check_messages(prompt)
        if tokenizer is None:
            raise InputError("this model was converted without a tokenizer; pass token ids instead of messages")
        if not getattr(tokenizer, "chat_template", None):  # a base model (the bundled tiny one): a transcript
            return encode(tokenizer, transcript(messages), vocab_size, name)
        try:
            with _LOCK:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, tools=tools)
        except Exception as e:  # the template is user-editable Jinja
            raise InputError(f"the chat template cannot render these messages: {first_line(e)}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    elif is_ids(prompt):
        ids = prompt
    else:
        raise InputError(f"{name} must be a string, chat messages or token ids, not {type(prompt).__name__}")
    if len(ids) == 0:
        raise InputError(f"{name} is empty")
    return validate.token_ids(name, ids, vocab_size)


def transcript(messages: Sequence[dict]) -> str:
    """Chat messages as plain text for a model without a chat template: `role: content` lines, then
    `assistant:` (generate, chat and the server all prompt such a model this way)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Token ids -> text, special tokens included (ids the tokenizer does not know decode to nothing)."""
    if tokenizer is None:
        raise InputError("this model was converted without a tokenizer; it cannot turn ids into text")
    with _LOCK:
        return tokenizer.decode(list(ids), skip_special_tokens=False)


class StreamDetokenizer:
    """Turns generated ids into text deltas without splitting multi-byte characters.

    Decodes a short window of recent ids and emits only the new, complete suffix (the approach
    of text-generation-inference), so streaming costs O(1) per token.
    """

    def __init__(self, tokenizer, special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = not special_tokens  # special_tokens: kept in the text (harmony's markers)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        skip = self.skip_special
        with _LOCK:
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
            text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix) :]
        return ""

