"""Text generation: batching with left padding, the decode loop, streaming, stop conditions."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from jmoe import harmony, validate
from jmoe.decoding import prefixes
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_CACHE_BUCKET, MIN_PROMPT_BUCKET, bucket
from jmoe.decoding.loaded import check_model
from jmoe.decoding.sampling import Sampler, SamplingOptions, prompt_history
from jmoe.decoding.speculative import SpeculativeOptions, speculative_steps
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.tokenizer import StreamDetokenizer, encode, is_chat, is_ids

log = logging.getLogger("jmoe.decoding.generation")


@dataclass(frozen=True)
class Batch:
    prompts: list[list[int]]
    batched: bool  # the caller passed a list of prompts
    as_text: bool  # answer with text (prompts were text/chat) or with token ids
    harmony: bool = False  # chat messages to a harmony template (GPT-OSS): the answer is its final channel


@dataclass(frozen=True)
class Lengths:
    prompt: int  # P: prompt bucket (left-padded)
    cache: int  # S: KV cache length
    new_tokens: int  # how many new tokens fit


def split_prompts(tokenizer, prompt: Any, vocab_size: int) -> Batch:
    """Tell one prompt from a batch: str | chat messages | ids, or a list of those."""
    single = isinstance(prompt, str) or is_chat(prompt) or (is_ids(prompt) and len(prompt) > 0)
    chat_format = harmony.uses_harmony(tokenizer)
    if single:
        return Batch([encode(tokenizer, prompt, vocab_size)], batched=False, as_text=not is_ids(prompt),
                     harmony=chat_format and is_chat(prompt))
    if not isinstance(prompt, (list, tuple)):
        raise InputError(f"prompt must be a string, chat messages or token ids (or a list of them), "
                         f"not {type(prompt).__name__}")
    if not prompt:
        raise InputError("prompt is empty")
    kinds = {"ids" if is_ids(p) else "text" for p in prompt}
    if len(kinds) > 1:
        raise InputError("a batch must be all text (or chat messages) or all token ids, not a mix")
    ids = [encode(tokenizer, p, vocab_size, name=f"prompt[{i}]") for i, p in enumerate(prompt)]
    return Batch(ids, batched=True, as_text=kinds == {"text"}, harmony=chat_format and all(is_chat(p) for p in prompt))


# A request whose cache bucket is smaller than one an earlier request of as many rows used, by at most
# this factor, takes that cache instead: its decode step is then one already compiled and held, where
# a bucket of its own would compile another (seconds) and keep it for the process's life (tens of MiB
# at real widths: docs/design.md). Attention reads only the slots a token reaches, so the longer
# cache costs its zeroing and, within the KV reservation, its memory; the factor bounds both.
CACHE_REUSE_FACTOR = 4


def plan_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int,
                 used_caches: Iterable[int] = ()) -> Lengths:
    """Prompt bucket, cache length and the number of new tokens that fit; `used_caches`: the cache
    lengths earlier requests of as many rows ran with (see CACHE_REUSE_FACTOR)."""
    longest = max(len(p) for p in prompts)
    if longest >= max_seq_len:
        raise InputError(f"the prompt has {longest} tokens; the context holds {max_seq_len} (leave room for output)")
    P = bucket(longest, MIN_PROMPT_BUCKET, max_seq_len)
    if P + max_new_tokens > max_seq_len:  # near the context limit, padding would cost output room
        P = longest
    S = bucket(P + max_new_tokens, MIN_CACHE_BUCKET, max_seq_len)
    S = min((s for s in used_caches if S < s <= min(CACHE_REUSE_FACTOR * S, max_seq_len)), default=S)
    fit = S - P
    if fit < max_new_tokens:
        log.warning("only %d new tokens fit in the %d-token context; generating that many", fit, max_seq_len)
    return Lengths(P, S, min(fit, max_new_tokens))


def token_steps(model, prompts: list[list[int]], lengths: Lengths, sampling: SamplingOptions) -> Iterator[np.ndarray]:
    """Yield the next token of every row, one step at a time ([B] int32 numpy).

    The prompt is prefilled in chunks (Decoder.prefill). Each decode step samples its next tokens
    itself and takes its input tokens from the previous step on the device, so the host never waits
    between steps: it reads step i - 1's tokens (with its routing summary, one read) after step i is
    dispatched. A step that must be run again (it lacked more experts than it could fetch) draws its
    token again with the same key and history, and its successor is taken back and run again. Each
    step takes the model's lock, so requests sharing a model interleave step by step.
    """
    cfg = model.config
    B = len(prompts)
    decoder = Decoder(model, prompts, lengths.prompt, lengths.cache)
    seen = prompt_history(prompts, cfg.vocab_size, sampling)
    sample = Sampler(model.engine, sampling, seen, model.placement.commit_to)
    model.count(**Sampler.cost(sampling, seen), phase="prefill")
    clock = RequestClock()
    current = sample(prefixes.prefill(decoder, model.prefixes, prompts))  # token 1, on the device
    model.count(executions=1, phase="prefill")
    for i in range(1, lengths.new_tokens + 1):
        last = i == lengths.new_tokens
        if not last:
            nxt = decoder.decode_sampled(current, sample)  # step i: token i -> token i + 1
        if i == 1:
            out = model.read_tokens(current, phase="prefill")  # the prompt's token
        else:
            out, redrawn = decoder.settle_sampled(sample)  # step i - 1: token i
            if redrawn and not last:  # step i ran from the token drawn first: run it again
                decoder.rewind_last()
                nxt = decoder.decode_sampled(jnp.asarray(out), sample)
        current = None if last else nxt
        with model.lock:
            clock.tick(model.stats, B)
        yield out


class RowText:
    """Streaming text of one row: detokenizes, holds back what could start a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str], special_tokens: bool = False):
        self.detok = StreamDetokenizer(tokenizer, special_tokens)
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self.text += self.detok.push(token)
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self.flush()
        upto = max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta


def stream(model, batch: Batch, lengths: Lengths, sampling: SamplingOptions, stop: Sequence[str],
           speculative: SpeculativeOptions | None = None) -> Iterator[list]:
    """Per step, each row's new piece: text delta (text mode), token id, or None once the row is done
    (or when it has nothing new this step: speculative rows advance by different counts)."""
    eos = set(model.eos_token_ids)
    B = len(batch.prompts)
    rows = [RowText(model.tokenizer, stop, batch.harmony) for _ in range(B)] if batch.as_text else None
    channels = [harmony.HarmonyStream() for _ in range(B)] if batch.harmony else None
    done = [False] * B
    if speculative is None:
        steps = token_steps(model, batch.prompts, lengths, sampling)
    else:
        steps = speculative_steps(model, batch.prompts, lengths, sampling, speculative)
    for tokens in steps:
        pieces: list = [None] * B
        for b, tok in enumerate(tokens.tolist()):
            if done[b] or tok < 0:
                continue
            if tok in eos:
                done[b] = True
                pieces[b] = rows[b].flush() if rows else None
                continue
            if rows:
                pieces[b] = rows[b].push(tok)
                done[b] = rows[b].stopped
            else:
                pieces[b] = tok
        yield _answers(pieces, channels)
        if all(done):
            return
    if rows:
        tail = [None if d else r.flush() for r, d in zip(rows, done)]
        if any(tail):
            yield _answers(tail, channels)


def _answers(pieces: list, channels: list | None) -> list:
    """Each row's piece of its answer: a harmony row's final channel only (not its markers or reasoning)."""
    if channels is None:
        return pieces
    return [p if p is None else channels[b].feed(p)[1] for b, p in enumerate(pieces)]


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
    return list(items)


def generate(model, prompt, *, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
             seed=0, stop: str | Sequence[str] | None = None, stream_output=False, speculative=None, min_p=0.0,
             logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0):
    """Every argument is checked here, before any work, so a streaming call fails at once."""
    check_model(model)
    max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, minimum=1)
    sampling = SamplingOptions(temperature, top_k, top_p, repetition_penalty, seed, min_p, logit_bias or (),
                               presence_penalty, frequency_penalty)
    sampling.check_vocabulary(model.config.vocab_size)
    stops = stop_strings(stop)
    stream_output = validate.boolean("stream", stream_output)
    speculative = SpeculativeOptions.parse(speculative)
    if speculative is not None:
        model.draft(speculative.draft)  # made (or refused) now, before any work
    batch = split_prompts(model.tokenizer, prompt, model.config.vocab_size)
    if stops and not batch.as_text:
        raise InputError("stop strings need text prompts; with token ids use max_new_tokens or EOS")
    used = model.cache_lengths.setdefault(len(batch.prompts), set())
    lengths = plan_lengths(batch.prompts, max_new_tokens, model.max_seq_len, tuple(used))  # a copy: threads add
    model.check_batch_fits(len(batch.prompts), lengths.cache)
    used.add(lengths.cache)
    steps = stream(model, batch, lengths, sampling, stops, speculative)
    if stream_output:
        return _unbatch(steps, batch)
    outputs: list[list] = [[] for _ in batch.prompts]
    for pieces in steps:
        for b, piece in enumerate(pieces):
            if piece is not None and piece != "":
                outputs[b].append(piece)
    results = ["".join(o) for o in outputs] if batch.as_text else [list(o) for o in outputs]
    return results if batch.batched else results[0]


def _unbatch(steps: Iterator[list], batch: Batch):
    for pieces in steps:
        if batch.batched:
            yield pieces
        elif pieces[0] not in (None, ""):
            yield pieces[0]
