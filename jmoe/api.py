"""The public surface: load a converted model, generate, score, and read its statistics."""

from __future__ import annotations

from jmoe.decoding.evaluate import forward, perplexity
from jmoe.decoding.evaluate import window_routing as trace_routing
from jmoe.decoding.loaded import check_model
from jmoe.runtime.loader import JmoeModel, load, memory_plan


def generate(model: JmoeModel, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int = 0, stop=None, stream: bool = False,
             speculative=None, min_p: float = 0.0, logit_bias=None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0):
    """Generate a continuation of `prompt` (greedy unless temperature > 0).

    Args:
      model: what jmoe.load returned.
      prompt: a string, chat messages ([{"role": ..., "content": ...}], through the model's chat
        template), token ids, or a list of any one of these kinds for a batch.
      max_new_tokens: stop after this many new tokens (earlier at EOS or a stop string).
      temperature: sampling temperature (0 = greedy). With top_k, top_p, repetition_penalty and
        min_p, transformers' semantics and order (penalty, temperature, top-k, top-p, min-p; ties
        kept as it does).
      top_k: keep the k likeliest tokens (0 = off).
      top_p: keep the smallest set of tokens whose probability reaches p (1 = off).
      repetition_penalty: transformers' repetition penalty (1 = off).
      min_p: drop tokens below min_p times the likeliest token's probability (0 = off).
      logit_bias: {token id: bias in [-100, 100]} added to those logits before everything else
        (greedy included; -100 in effect bans a token), as OpenAI's logit_bias.
      presence_penalty: OpenAI's presence penalty, in [-2, 2] (0 = off): every token the row has
        generated so far (its prompt does not count) has its logit lowered by
        frequency_penalty * its count + presence_penalty, after the repetition penalty and before the
        temperature (as vLLM applies them; greedy included).
      frequency_penalty: OpenAI's frequency penalty, in [-2, 2] (0 = off), applied with
        presence_penalty as above.
      seed: any integer in [0, 2**64): the sampling stream (all 64 bits count).
      stop: a string or strings that end generation (not included in the output).
      stream: yield pieces as they are produced instead of returning the whole output.
      speculative: draft with the model's own low-precision copy and verify k + 1 tokens per pass:
        a draft tier ("int4", "int2"), or dict(draft=..., k=int | "auto", k_max=8, max_cycle_s=None).
        Greedy output is identical to plain greedy; sampled output follows the same distribution
        (the same tokens for a seed only with a fixed k: with "auto" the draft lengths follow
        measured times). Under a device budget the draft must be reserved at load
        (jmoe.load(..., draft="int4")).

    Every argument is checked before any work (a bad one raises InputError naming it, also with
    stream=True). A model may be shared between threads: calls interleave step by step.

    Returns:
      Text for text prompts, token ids for id prompts; a list of those for a batch. With
      stream=True, an iterator of text deltas (or ids); for a batch, a list per step with one
      piece per prompt (None once that prompt is done).
    """
    from jmoe.decoding.generation import generate as _generate

    return _generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, stream_output=stream,
                     speculative=speculative, min_p=min_p, logit_bias=logit_bias,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)


def stats(model: JmoeModel) -> dict:
    """Offload counters since load: hit rate, bytes moved host->device, prefetch accuracy and
    predictor recall, stalls, replays, in-step fetches and misses, CPU-run experts, TTFT and TPOT
    (seconds); with a prefix cache ("prefix_cache"), its lookups, hits and reused prompt tokens.
    Rates of expert uses are None where no use was counted (a resident model)."""
    check_model(model)
    with model.lock:  # a consistent snapshot while other threads generate
        if hasattr(model.residency, "catch_up"):
            model.residency.catch_up()
        pools = getattr(model.residency, "pools", None)
        slots = {tier: pool.slots for tier, pool in pools.items()} if pools else None
        cache = getattr(model.residency, "cache", None)
        state = model.policy.report(cache) if cache is not None else {}
        prefixes = {"prefix_cache": model.prefixes.stats.summary()} if model.prefixes is not None else {}
        return {"policy": model.policy.name, "tier": model.policy.tier, "pool_slots": slots, **model.stats.summary(),
                **({"policy_state": state} if state else {}), **prefixes}


__all__ = ["load", "generate", "forward", "perplexity", "stats", "memory_plan", "trace_routing", "JmoeModel"]
