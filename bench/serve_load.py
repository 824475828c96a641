"""A bounded load test of `jmoe serve`: many concurrent clients with random prompt and answer
lengths, streamed or whole, some asking for logprobs, some hanging up mid-stream, for a fixed
time. Afterwards every slot must be free, the offload cache's bookkeeping intact (cache.check()),
the device budget held, and the server still answering as `jmoe.generate` does; the process's RSS
is sampled throughout.

    python -m bench.serve_load [--seconds 120] [--streams 32] [--max-batch 8]

Writes bench/results/serve_load/serve_load_cpu.json. tests/test_serving_load.py runs a short version.
"""

from __future__ import annotations

import argparse
import random
import resource
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "tests" / "data"


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc), else its peak."""
    from jmoe.runtime.host_memory import process_memory

    return process_memory().get("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drive(base: str, model_name: str, *, seconds: float, streams: int, seed: int = 0) -> dict:
    """Run `streams` client threads against the server at `base` for `seconds`: counts of requests,
    hang-ups and failures (anything but a 200, or a transport error), and RSS samples."""
    text = "".join((DEV / f"{d}.dev.txt").read_text()[:8000] for d in ("prose", "code", "math"))
    counts = dict(requests=0, streamed=0, hung_up=0, tokens=0, failures=0)
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    samples: list[int] = []

    def client(worker: int) -> None:
        rng = random.Random(seed * 1000 + worker)
        with httpx.Client(base_url=base, timeout=120) as http:
            while time.monotonic() < deadline:
                start = rng.randrange(0, len(text) - 400)
                body = dict(model=model_name, prompt=text[start:start + rng.randrange(8, 300)],
                            max_tokens=rng.randrange(1, 48), temperature=rng.choice([0, 0.8]), seed=rng.randrange(1000))
                if rng.random() < 0.2:  # some ask for log-probabilities too
                    body["logprobs"] = rng.randrange(0, 6)
                stream = rng.random() < 0.6
                hang_up = stream and rng.random() < 0.3
                try:
                    if stream:
                        with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                            ok = r.status_code == 200
                            chunks = 0
                            for line in r.iter_lines():
                                chunks += line.startswith("data: ")
                                if hang_up and chunks >= 2:
                                    break  # leaving the block closes the connection mid-stream
                    else:
                        r = http.post("/v1/completions", json=body)
                        ok = r.status_code == 200
                        chunks = r.json()["usage"]["completion_tokens"] if ok else 0
                except httpx.HTTPError as e:
                    ok, chunks = False, 0
                    failures.append(f"{type(e).__name__}: {e}")
                with lock:
                    counts["requests"] += 1
                    counts["streamed"] += stream
                    counts["hung_up"] += hang_up
                    counts["tokens"] += chunks
                    counts["failures"] += not ok

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        samples.append(rss_bytes())
        alive[0].join(timeout=1.0)  # one RSS sample a second while the clients run
    return dict(counts, failure_examples=failures[:5], rss_samples=samples)


def main(argv=None) -> None:
    import jmoe
    from bench.lib.common import write_result
    from convert import convert_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    args = p.parse_args(argv)
    path = convert_checkpoint(ROOT / "examples" / "tiny-qwen3-moe", ROOT / "out" / "bench-serve-load",
                              overwrite=True, progress=False)
    plan = jmoe.memory_plan(path, max_seq_len=512, max_batch=args.max_batch)
    budget = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan["all_experts"] // 3
    model = jmoe.load(path, device_budget=budget, max_seq_len=512, max_batch=args.max_batch)
    result = serve_and_drive(model, "tiny", seconds=args.seconds, streams=args.streams, max_batch=args.max_batch)
    result.update(budget=budget, seconds=args.seconds, streams=args.streams, max_batch=args.max_batch)
    rss = result["rss_samples"]
    print({k: v for k, v in result.items() if k != "rss_samples"}, "RSS MiB first/last:",
          rss[0] >> 20, rss[-1] >> 20)
    write_result("serve_load", "serve_load", result)


def serve_and_drive(model, name: str, *, seconds: float, streams: int, max_batch: int, context: int = 512) -> dict:
    """Start a server on an ephemeral port, drive it, wait for it to drain, check, stop it."""
    import uvicorn

    from jmoe.serving.batcher import BatchEngine
    from jmoe.serving.openai_api import create_app

    engine = BatchEngine(model, max_batch=max_batch, max_waiting=4 * streams, context=context, reader_timeout=30.0,
                         warm_up=True)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        result = drive(base, name, seconds=seconds, streams=streams)
        drained = time.monotonic() + 60
        while (engine.running or engine.queued or engine.prefilling) and time.monotonic() < drained:
            time.sleep(0.05)  # hung-up rows leave at the engine's next step
        engine.pool.check([engine.table])  # every page free or held by one row
        result.update(running_after=engine.running, waiting_after=engine.queued, steps=engine.steps,
                      kv_pages=engine.pool.pages, kv_pages_free_after=engine.pool.free,
                      kv_preemptions=engine.preemptions)
        final = httpx.post(f"{base}/v1/completions", json=dict(model=name, prompt="12 + 35 =", max_tokens=12,
                                                              temperature=0), timeout=60)
        result["final_text"] = final.json()["choices"][0]["text"] if final.status_code == 200 else None
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
    return result


if __name__ == "__main__":
    main()
