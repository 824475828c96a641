"""Token sampling with Hugging Face transformers' semantics, ties included.

The order and the arithmetic follow transformers' logits processors exactly:
RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper and MinPLogitsWarper (min_tokens_to_keep=1), each applied only when it is
switched on. Filtered tokens get -inf. A logit bias (OpenAI's `logit_bias`: token -> a value added
to its logit, -100 in effect bans it) is added to the raw logits before all of them. OpenAI's
presence and frequency penalties (as vLLM applies them, after the repetition penalty and before the
temperature) subtract `frequency_penalty * count + presence_penalty * (count > 0)` from each
token's logit, count being how often the row has GENERATED it (its prompt does not count). Greedy
decoding applies the bias and the penalties and takes the argmax.

A row's history is one int32 per vocabulary token: how many times the row has generated it, plus
PROMPT_MARK when its prompt holds it (marked only when the repetition penalty is on, the one thing
that reads it). The repetition penalty applies to every token whose history is not 0, the presence
and frequency penalties read the count below PROMPT_MARK.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jmoe import validate
from jmoe.errors import InputError

MAX_SEED = 2**64 - 1
# The warpers a step may apply, after the temperature: a step compiles only those a request switches on
# (a static argument), so the vocabulary-wide sorts of top-k and top-p cost nothing when they are off.
ALL_FILTERS = ("top_k", "top_p", "min_p")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value: [-100, 100]
MAX_TOP_K = 2**31 - 1  # the step takes top_k as an int32
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
PROMPT_MARK = 1 << 30  # a history's flag for a prompt token; the bits below count the row's generated ones
HISTORY_DTYPE = np.int32
FLOAT32_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))  # positive normal float32s


def _float32(name: str, value: float) -> float:
    """A positive value the step's float32 arithmetic holds (neither rounded to 0 nor to inf)."""
    low, high = FLOAT32_RANGE
    if not low <= value <= high:
        raise InputError(f"{name} must be between {low:.2g} and {high:.2g} (float32), got {value:g}")
    return value


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple = ()  # ((token id, bias), ...) or a dict token -> bias; () = off
    presence_penalty: float = 0.0  # 0 = off; in [-2, 2]
    frequency_penalty: float = 0.0  # 0 = off; in [-2, 2]

    def __post_init__(self):
        temperature = validate.real("temperature", self.temperature, minimum=0.0)
        if temperature > 0:  # 0 is greedy: it never divides the logits
            _float32("temperature", temperature)
        fields = dict(
            temperature=temperature,
            top_k=validate.integer("top_k", self.top_k, minimum=0, maximum=MAX_TOP_K),
            top_p=validate.real("top_p", self.top_p, above=0.0, maximum=1.0),
            repetition_penalty=_float32("repetition_penalty", validate.real(
                "repetition_penalty", self.repetition_penalty, above=0.0)),
            seed=validate.integer("seed", self.seed, minimum=0, maximum=MAX_SEED),
            min_p=validate.real("min_p", self.min_p, minimum=0.0, maximum=1.0),
            logit_bias=_logit_bias(self.logit_bias),
            presence_penalty=validate.real("presence_penalty", self.presence_penalty, minimum=-MAX_PENALTY,
                                           maximum=MAX_PENALTY),
            frequency_penalty=validate.real("frequency_penalty", self.frequency_penalty, minimum=-MAX_PENALTY,
                                            maximum=MAX_PENALTY),
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> tuple[str, ...]:
        """The warpers this request switches on (none when greedy: they never change the argmax)."""
        if self.greedy:
            return ()
        on = {"top_k": self.top_k > 0, "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0}
        return tuple(name for name in ALL_FILTERS if on[name])

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing changing the logits first: the argmax of the logits themselves."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.logit_bias
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise InputError unless every logit_bias token is in a vocabulary of this size."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise InputError(f"logit_bias token {token} is not in the vocabulary (size {vocab_size})")

    def device_params(self, vocab_size: int, where=None) -> tuple[jax.Array, ...]:
        """(temperature, top_k, 1 - top_p, penalty, min_p, bias [vocab_size], presence, frequency) as
        the jitted sampler takes them (one transfer each, no executable), committed to `where` (a
        sharding) when given.

        1 - top_p is computed here in double precision, as transformers does in Python, and only
        then rounded to float32, so the top-p cut compares against the same float32 threshold.
        """
        self.check_vocabulary(vocab_size)
        bias = np.zeros(vocab_size, np.float32)
        for token, value in self.logit_bias:
            bias[token] = value
        return tuple(jax.device_put((
            np.float32(self.temperature if self.temperature > 0 else 1.0),
            np.int32(self.top_k),
            np.float32(1.0 - self.top_p),
            np.float32(self.repetition_penalty),
            np.float32(self.min_p),
            bias,
            np.float32(self.presence_penalty),
            np.float32(self.frequency_penalty),
        ), where))

    def rng(self) -> jax.Array:
        """A PRNG key from all 64 bits of the seed (seeds below 2**32 give jax.random.key(seed)), made
        by one executable."""
        return _seed_key(np.uint32(self.seed & 0xFFFFFFFF), np.uint32(self.seed >> 32), high=bool(self.seed >> 32))


def _logit_bias(value) -> tuple:
    """((token, bias), ...) sorted by token, each token an int32 id >= 0 and each bias a finite
    float in [-100, 100]; from a dict (JSON's string keys accepted) or pairs."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InputError("logit_bias must map token ids to numbers") from None
    out = {}
    for token, bias in pairs:
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)
        token = validate.integer("logit_bias token", token, minimum=0, maximum=2**31 - 1)
        out[token] = validate.real(f"logit_bias[{token}]", bias, minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)
    return tuple(sorted(out.items()))


@partial(jax.jit, static_argnames=("high",))
def _seed_key(low, high_bits, *, high: bool):
    key = jax.random.key(low)
    return jax.random.fold_in(key, high_bits) if high else key


def prompt_history(prompts: list[list[int]], vocab_size: int, sampling: SamplingOptions) -> np.ndarray:
    """[B, V] int32: each row's history before its first new token (see the module docstring):
    PROMPT_MARK at its prompt's tokens, which the repetition penalty counts; all 0 when that
    penalty is off (the presence and frequency penalties count generated tokens only)."""
    seen = np.zeros((len(prompts), vocab_size), HISTORY_DTYPE)
    if sampling.repetition_penalty != 1.0:
        for b, p in enumerate(prompts):
            seen[b, p] = PROMPT_MARK
    return seen


def generated_counts(history):
    """How many times each row generated each token: the history without its prompt mark (int32)."""
    return history & (PROMPT_MARK - 1)


def record(history, rows, tokens, mode=None):
    """The history with tokens[i] generated once more in row rows[i] (indices as `.at[]` takes
    them; mode="drop" leaves out-of-range tokens out)."""
    return history.at[rows, tokens].add(1, mode=mode)


def apply_presence_frequency(logits, counts, presence, frequency):
    """OpenAI's presence and frequency penalties over the generated counts [B, V] (as vLLM applies
    them): logits - frequency * count - presence * (count > 0)."""
    return logits - frequency * counts.astype(logits.dtype) - presence * (counts > 0).astype(logits.dtype)


def apply_repetition_penalty(logits, seen, penalty):
    """Tokens seen so far: negative logits multiplied by the penalty, the others divided by it."""
    penalized = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalized, logits)


# top-k and top-p without sorting the vocabulary: each finds its cut by bisection over the logits'
# values (their float32 bits as order-preserving unsigned keys), one count or masked sum over the
# vocabulary per halving (32 halvings cover every float32), where a sort of 151,936 logits took
# tens of milliseconds per token on the CPU. The kept sets are the sorting warpers' own.
KEY_BITS = 32


def order_keys(x):
    """float32 [..., V] -> uint32 keys ordered as the values (-0.0 taken as +0.0, -inf lowest)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(keys, goes_up):
    """Per row, the smallest key k in [min(keys), max(keys)] for which goes_up(k [..., 1]) holds
    (a predicate that holds from some key on, and at the largest key)."""

    def halve(bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        up = goes_up(mid)
        return jnp.where(up, lo, mid + 1), jnp.where(up, mid, hi)

    def unrolled(bounds):  # a loop would split a GPU step's one command buffer
        for _ in range(KEY_BITS):
            bounds = halve(bounds)
        return bounds[0]

    def looped(bounds):  # XLA:CPU compiles 32 copies of a vocabulary-wide reduction slowly (~0.5 s each filter)
        return jax.lax.fori_loop(0, KEY_BITS, lambda _, b: halve(b), bounds)[0]

    bounds = (keys.min(-1, keepdims=True), keys.max(-1, keepdims=True))
    return jax.lax.platform_dependent(bounds, cpu=looped, default=unrolled)  # chosen when lowered: no conditional


def top_k_filter(logits, top_k):
    """Keep every token whose logit is at least the k-th largest (ties with it kept); top_k=0: off."""
    V = logits.shape[-1]
    k = jnp.clip(top_k, 1, V)
    keys = order_keys(logits)
    # the k-th largest key: the largest key with at least k keys at or above it, i.e. the smallest
    # one past which fewer than k remain (counted above it)
    kth = _bisect(keys, lambda key: (keys > key).sum(-1, keepdims=True) < k)
    return jnp.where((top_k > 0) & (keys < kth), -jnp.inf, logits)


def top_p_filter(logits, one_minus_top_p):
    """transformers' TopPLogitsWarper: in ascending order (ties in index order, as torch's CPU sort
    leaves them), drop tokens whose cumulative probability is <= 1 - top_p; always keep the last.

    Found without sorting: the cut value is the smallest one whose cumulative probability passes
    1 - top_p; everything below it goes, everything above stays, and of the tokens at it the first
    ones (by index) go while their running sum stays <= 1 - top_p."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = order_keys(logits)
    q = one_minus_top_p
    cut = _bisect(keys, lambda key: jnp.where(keys <= key, probs, 0.0).sum(-1, keepdims=True) > q)
    below = jnp.where(keys < cut, probs, 0.0).sum(-1, keepdims=True)
    at_cut = keys == cut
    before = jnp.cumsum(at_cut, axis=-1) - at_cut  # tied tokens at the cut ahead of each, by index
    cumulative = below + (before + 1) * jnp.where(at_cut, probs, 0.0)
    drop = (keys < cut) | (at_cut & (cumulative <= q))
    V = logits.shape[-1]
    top = keys.max(-1, keepdims=True)
    last = jnp.arange(V) == jnp.max(jnp.where(keys == top, jnp.arange(V), -1), -1, keepdims=True)
    drop = drop & ~last & (one_minus_top_p > 0)  # top_p = 1: the warper is not applied at all
    return jnp.where(drop, -jnp.inf, logits)


def min_p_filter(logits, min_p):
    """transformers' MinPLogitsWarper: drop tokens whose probability is below min_p times the most
    likely token's (which always stays); min_p = 0: off."""
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p * probs.max(-1, keepdims=True)
    return jnp.where((min_p > 0) & (probs < threshold), -jnp.inf, logits)


def warp(logits, temperature, top_k, one_minus_top_p, min_p=0.0, filters=ALL_FILTERS):
    """Temperature, then top-k, top-p and min-p (those named in `filters`; each is a no-op at its
    off value anyway): logits [B, V] -> filtered logits (-inf outside)."""
    logits = logits / temperature
    if "top_k" in filters:
        logits = top_k_filter(logits, top_k)
    if "top_p" in filters:
        logits = top_p_filter(logits, one_minus_top_p)
    if "min_p" in filters:
        logits = min_p_filter(logits, min_p)
    return logits


def biased(logits, history, penalty, bias, presence, frequency):
    """The logits greedy decoding and the warpers start from: the bias added, then the repetition
    penalty (over the prompt's and the generated tokens), then the presence and frequency penalties
    (over the generated ones)."""
    logits = apply_repetition_penalty(logits + bias, history != 0, penalty)
    return apply_presence_frequency(logits, generated_counts(history), presence, frequency)


def greedy_tokens(logits):
    """logits [..., V] -> the first index of each row's largest logit, int32 (jnp.argmax's choice).

    A max, then the smallest index holding it: two plain reductions, where argmax's paired (value,
    index) reduction runs a scalar loop on XLA:CPU (0.7 ms per row of 151,936 logits). On the CPU
    the native kernel does the same (XLA:CPU of jax 0.10 still took about 0.4 ms for the two); a
    row without a largest value (NaN) gives the last index."""
    if cpu_kernels.available():
        return cpu_kernels.first_max(logits)
    V = logits.shape[-1]
    best = logits.max(-1, keepdims=True)
    first = jnp.where(logits == best, jnp.arange(V, dtype=jnp.int32), V).min(-1)
    return jnp.minimum(first, V - 1)


def sample_tokens(logits, seen, key, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency,
                  *, greedy: bool, filters=ALL_FILTERS):
    """logits [B, V] float32, seen [B, V] the history (int32), bias [V] -> next tokens [B] int32."""
    logits = biased(logits, seen, penalty, bias, presence, frequency)
    if greedy:
        return greedy_tokens(logits)
    return jax.random.categorical(key, warp(logits, temperature, top_k, one_minus_top_p, min_p, filters),
                                  axis=-1).astype(jnp.int32)


class Sampler:
    """Draws next tokens with the request's key and history. A decode step may draw inside itself
    (advance() takes its new key and history), and a draw can be made again from corrected logits
    with the key and history it started from, so a corrected step samples what an exact one would."""

    def __init__(self, engine, sampling: SamplingOptions, seen: np.ndarray, where=None):
        """where: the model's placement's `commit_to`. The sampler's arrays are committed there, as
        the draws' outputs are: a jitted function given an uncommitted array and later a committed
        one compiles twice (the serving engine's first draw, then every later one)."""
        self.engine, self.greedy, self.filters = engine, sampling.greedy, sampling.filters
        self.params = sampling.device_params(seen.shape[-1], where)
        self.rng, self.seen = jax.device_put((sampling.rng(), seen), where)

    def __call__(self, logits):
        """Next tokens [B] from logits [B, V]."""
        tokens, self.seen, self.rng = self.engine.sample(logits, self.seen, self.rng, *self.params, greedy=self.greedy,
                                                         filters=self.filters)
        return tokens

    @staticmethod
    def cost(sampling: SamplingOptions, seen: np.ndarray) -> dict:
        """What making one costs the host: an executable making the key from the seed (its high
        bits only when set), the history, 7 scalar parameters and the bias moved to the device."""
        high = bool(sampling.seed >> 32)
        return dict(executions=1, transfers=10 + high, nbytes=seen.nbytes + 4 * seen.shape[-1] + 28 + 4 * (1 + high))

    def advance(self, rng, seen) -> None:
        """A step drew with this sampler's key and history: take the ones it left."""
        self.rng, self.seen = rng, seen

    def redraw(self, logits, start: tuple):
        """Draw again from `logits` with the (rng, seen) a draw started from, forgetting later draws."""
        self.rng, self.seen = start
        return self(logits)
