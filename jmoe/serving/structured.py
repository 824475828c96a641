"""Structured output: answers held to a JSON schema by constrained decoding (OpenAI's `response_format`).

The grammar engine is llguidance (the one vLLM and SGLang use; the serve extra: `pip install -e '.[serve]'`). A
request's `response_format` becomes a grammar (llguidance's JSON form) that travels with the
request (so the processes of a multi-process server build the same constraint); each running row
keeps a matcher of it. Before each of the row's draws the matcher gives the tokens the grammar
allows next as a bitmask, the row's logits outside it become -inf, and the drawn token advances the
matcher. The end-of-sequence token is allowed only where the answer is complete, and is the only
token allowed once nothing can follow, so a constrained answer ends by itself (or at max_tokens,
incomplete, with finish_reason "length", as OpenAI's does).

A constrained row is drawn by its own sampler on the host's schedule (as any row that is not plain
greedy): the mask of its next token depends on the token just drawn.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.errors import InputError
from jmoe.tokenizer import TokenizerFile

# JSON without optional whitespace: a model cannot pad an answer with blank lines forever
COMPACT_JSON = {"whitespace_flexible": False}
_TOKENIZERS: dict = {}  # id(hf tokenizer) -> (tokenizer, llguidance's view of it)
_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance  # deferred: only structured requests need it
        import llguidance.hf  # noqa: F401
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise InputError("'response_format' needs the llguidance package: pip install -e '.[serve]' in the jmoe "
                         "checkout") from None
    return llguidance


def grammar(response_format, tokenizer, vocab_size: int, eos_token_ids) -> str | None:
    """OpenAI's response_format -> a grammar (llguidance JSON), or None for plain text.

    {"type": "text"}: none; {"type": "json_object"}: any JSON object; {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}: JSON valid against the schema.
    Raises InputError naming what is wrong (a schema the grammar engine cannot hold included)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InputError("'response_format' must be an object such as {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise InputError(f"'response_format.type' must be one of {', '.join(allowed)}, got {kind!r}"[:200])
    unknown = sorted(set(response_format) - allowed[kind])
    if unknown:
        raise InputError(f"'response_format' of type {kind} has no field {unknown[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InputError("'response_format.json_schema' must be an object with 'name' and 'schema'")
        extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
        if extra:
            raise InputError(f"'response_format.json_schema' has no field {extra[0]!r}")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InputError("'response_format.json_schema.name' must be a non-empty string")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise InputError("'response_format.json_schema.schema' must be a JSON schema (an object)")
    if tokenizer is None:
        raise InputError("this model was converted without a tokenizer; 'response_format' needs one")
    llg = _llguidance()
    try:
        text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"'response_format' schema: {e}"[:300]) from None
    return _checked(text, "'response_format' schema", tokenizer, vocab_size, eos_token_ids)


def lark(grammar_text: str, tokenizer, vocab_size: int, eos_token_ids) -> str:
    """A grammar in llguidance's Lark dialect (JSON schemas inline as `%json {...}`) -> its JSON form, checked."""
    if tokenizer is None:
        raise InputError("this model was converted without a tokenizer; a grammar needs one")
    llg = _llguidance()
    return _checked(llg.LLMatcher.grammar_from_lark(grammar_text), "the tools' grammar", tokenizer, vocab_size,
                    eos_token_ids)


def _checked(text: str, what: str, tokenizer, vocab_size: int, eos_token_ids) -> str:
    problem = _llguidance().LLMatcher.validate_grammar(text, _tokenizer(tokenizer, vocab_size, eos_token_ids))
    if problem:
        raise InputError(f"{what}: {problem}"[:300])
    return text


def _tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's view of the model's tokenizer (built once per tokenizer: about a second for a
    large vocabulary), its vocabulary the width of the model's logits."""
    with _LOCK:
        known = _TOKENIZERS.get(id(tokenizer))
        if known is None or known[0] is not tokenizer:
            llg = _llguidance()
            eos = sorted(eos_token_ids) or None
            if isinstance(tokenizer, TokenizerFile):  # what llguidance.hf builds from transformers' tokenizer
                view = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                       eos_token=tokenizer.eos_token_id if eos is None else eos)
            else:
                view = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
            known = (tokenizer, view)
            _TOKENIZERS[id(tokenizer)] = known
        return known[1]


class Constraint:
    """One row's position in its grammar: the tokens allowed next, advanced by each drawn token."""

    def __init__(self, grammar_text: str, tokenizer, vocab_size: int, eos_token_ids):
        llg = _llguidance()
        self._fill = llg.numpy.fill_next_token_bitmask
        self.matcher = llg.LLMatcher(_tokenizer(tokenizer, vocab_size, eos_token_ids), grammar_text)
        self.bitmask = llg.numpy.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._check()

    def allowed(self) -> np.ndarray:
        """The tokens allowed next: bit v % 32 of word v // 32 ([1, words] int32)."""
        self._fill(self.matcher, self.bitmask, 0)
        self._check()
        return self.bitmask

    def advance(self, token: int) -> None:
        """The row drew `token` (end of sequence included)."""
        self.matcher.consume_token(int(token))
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise InputError(f"structured output: {self.matcher.get_error()}"[:300])


@jax.jit
def masked_row(logits, b, bitmask):
    """Row b of logits [n, V] as [1, V], with -inf at every token the bitmask [1, words] leaves out."""
    row = jax.lax.dynamic_slice_in_dim(logits, b, 1)
    V = row.shape[-1]
    vocab = jnp.arange(V, dtype=jnp.int32)
    allowed = (bitmask[:, vocab >> 5] >> (vocab & 31)) & 1
    return jnp.where(allowed.astype(bool), row, -jnp.inf)
