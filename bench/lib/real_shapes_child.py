"""One measured jmoe process of bench/real_shapes.py: load, then time prefill and decode.

Run by the bench in a fresh process per configuration and round, so the process's peak memory
is that configuration's own; prints one JSON line. The spec (a JSON argument) names the converted
model, tier, device budget and policy (with its options, if any), prompt and generation lengths, and the mode:

- "speed": load, one warm-up of each measured call (compiles the step shapes and, offloaded,
  fills the expert pools), then a 512-token prompt with 128 new tokens (prefill tok/s, decode
  tok/s at depth 512) and a 1-token prompt with 128 new tokens (decode tok/s at depth 0). The
  peak RSS counter is reset after the warm-up, so `decode_peak_rss_bytes` is the peak while
  prefilling and decoding alone (the whole process's peak, load included, the parent reads).
- "startup": import, load and the first call (a 512-token prompt, one new token), as a user's
  fresh process sees them; run with JMOE_COMPILATION_CACHE pointing at an empty directory
  (cold) and again at the same directory (warm).

End-of-sequence tokens are ignored, as llama-bench does, so every run decodes all its tokens.

    python -m bench.lib.real_shapes_child '{"mode": "speed", "path": ..., "tier": "int4", ...}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T_START = time.perf_counter()


def status_bytes(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def stream_stamps(jmoe, model, ids, new_tokens: int) -> tuple[float, list[float]]:
    """Start time and the time each new token arrived."""
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in jmoe.generate(model, ids, max_new_tokens=new_tokens, stream=True)]
    if len(stamps) != new_tokens:
        raise RuntimeError(f"asked for {new_tokens} tokens, got {len(stamps)}")
    return t0, stamps


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second after the first token (which the prefill produced)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ignore_eos(model) -> None:
    """Generate past end-of-sequence tokens (llama-bench does), so each run decodes all its tokens."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"eos_token_ids": property(lambda self: ())})


def main() -> None:
    spec = json.loads(sys.argv[1])
    import jax
    import numpy as np

    import jmoe
    from jmoe.serving.compiles import no_compiles
    import_s = time.perf_counter() - T_START

    policy = spec["policy"]
    if spec.get("policy_options"):  # e.g. DyMoE's r for the mixed mode
        from jmoe.policies import make_policy
        policy = make_policy(policy, spec["tier"], **spec["policy_options"])
    t = time.perf_counter()
    model = jmoe.load(spec["path"], tier=spec["tier"], device_budget=spec.get("budget"), policy=policy,
                      max_seq_len=spec["max_seq_len"], cpu_dot=spec.get("cpu_dot", "float"), progress=False)
    load_s = time.perf_counter() - t
    load_peak = status_bytes("VmHWM")
    load_rss = status_bytes("VmRSS")
    ignore_eos(model)
    rng = np.random.default_rng(spec.get("seed", 0))
    prompt = rng.integers(0, model.config.vocab_size, spec["prompt"]).tolist()
    one = prompt[:1]
    out = {"mode": spec["mode"], "import_s": import_s, "load_s": load_s, "load_peak_rss_bytes": load_peak,
           "load_rss_bytes": load_rss,
           "backend": jax.default_backend()}

    if spec["mode"] == "startup":
        t0, stamps = stream_stamps(jmoe, model, prompt, 1)
        out["first_token_s"] = stamps[0] - t0
        out["process_to_first_token_s"] = stamps[0] - T_START
    else:
        new = spec["new_tokens"]
        t0, stamps = stream_stamps(jmoe, model, prompt, min(new, 4))  # compile prefill + decode, warm pools
        out["first_call_s"] = stamps[-1] - t0
        # and the 1-token prompt's shapes, at the timed run's length (its cache is a power of two
        # above prompt + new tokens: 4 new tokens would warm another)
        stream_stamps(jmoe, model, one, new)
        # less the load's: the step executables, and the KV cache and workspace the first steps allocated
        out["warm_rss_bytes"] = status_bytes("VmRSS")
        out["peak_reset"] = reset_peak_rss()
        with no_compiles(f"{spec['prompt']}-token prompt and {new} new tokens"):
            t0, stamps = stream_stamps(jmoe, model, prompt, new)
        out["prefill_tok_s"] = spec["prompt"] / (stamps[0] - t0)
        out["decode_tok_s@%d" % spec["prompt"]] = decode_rate(stamps)
        with no_compiles(f"1-token prompt and {new} new tokens"):
            _, stamps = stream_stamps(jmoe, model, one, new)
        out["decode_tok_s@0"] = decode_rate(stamps)
        out["decode_peak_rss_bytes"] = status_bytes("VmHWM")
        stats = jmoe.stats(model)
        out["stats"] = {k: stats.get(k) for k in ("policy", "tier", "pool_slots", "hit_rate", "bytes_h2d",
                                                  "stalls", "replays") if k in stats}
    out["memory"] = {k: int(v) for k, v in model.memory.items()} if isinstance(model.memory, dict) else None
    out["rss_end_bytes"] = status_bytes("VmRSS")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
