"""How a step can fetch only the experts it lacks from pinned host memory, measured on a GPU.

An offloaded step fetches missing experts inside itself: a dynamic slice of a pinned-host store
moved to device memory and written into a pool slot (jmoe/layers/fetch.py). On an accelerator each
of a layer's fixed miss slots moves a whole record every step, used or not, so a step gets few
slots and one that lacks more is run again. This bench times the ways to copy only what a step
lacks, each for --layers layers of --slots slots of Qwen3-30B-A3B int4 records, with 0, 1, 2 and
--slots of them used, beside the same step with no fetch at all:

- fixed:  every slot copies its record (what steps do now; unused ones into a sink slot);
- cond:   each slot's copy inside a `lax.cond` on a device-computed predicate;
- switch: one `lax.switch` per layer on the number of misses (branch k copies k records);
- cond2:  cond, with even slots writing one pool and odd ones another (two tiers' pools);
- condrec: the `lax.cond` around the fetch alone (an unused slot gives zeros), every record then
  written as in fixed (the pool is no operand of a conditional, so XLA need not copy it);
- while:  a `fori_loop` over the layer's misses (a device-computed trip count).

Each runs under XLA's default command-buffer settings and with CONDITIONAL and WHILE added to
them (--xla_gpu_enable_command_buffer), given as XLA_FLAGS and as the jit's compiler_options, in
separate processes. Without those, a conditional or a
while loop reads its predicate back to the host inside the executable; with them, CUDA graph
conditional nodes decide on the device. Every variant's pool is checked against the store.

    python -m bench.gpu_fetch [--layers 8] [--slots 8] [--out DIR]

Writes gpu_fetch_<device>.json (bench/results/gpu_fetch/, or --out). On a machine without a GPU
it runs at toy sizes to check itself (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORD_BYTES = 2_506_752  # a Qwen3-30B-A3B int4 expert: gate_up and down codes plus their scales
EXPERTS = 128
VARIANTS = ("none", "fixed", "cond", "cond2", "condrec", "switch", "while")
COMMAND_BUFFER_CONTROL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
HLO_OPS = {"conditional": r"= \S+ conditional\(", "while": r"= \S+ while\(", "async host slices": r"fusion-start\(",
           "copy-start": r"copy-start\(", "command buffers": r"command_buffer", "copy": r"= \S+ copy\("}
# how the command-buffer setting reaches XLA: not at all, the process's XLA_FLAGS, or the step's jit
MODES = ("default", "flags", "options")


def build(variant: str, layers: int, slots: int, record: int, options: dict | None = None):
    """A jitted step: per layer, fetch ids[l, :n[l]] into pool slots l*slots + i, then read them."""
    import jax
    import jax.numpy as jnp

    def fetch(store, expert):
        piece = jax.lax.dynamic_slice(store, (expert, 0), (1, record))
        return jax.device_put(piece, jax.memory.Space.Device)

    def write(pool, row, slot):
        return jax.lax.dynamic_update_slice(pool, row, (slot, 0))

    sink = layers * slots

    def layer_fetch(pool, store, ids, n, layer):
        base = layer * slots
        if variant == "none":
            return pool
        if variant == "condrec":
            for i in range(slots):
                row = jax.lax.cond(i < n, lambda i=i: fetch(store, ids[i]), lambda: jnp.zeros((1, record), jnp.uint8))
                pool = write(pool, row, jnp.where(i < n, base + i, sink))
            return pool
        if variant == "cond2":
            pools = list(pool)
            for i in range(slots):
                pools[i % 2] = jax.lax.cond(i < n, lambda p, i=i: write(p, fetch(store, ids[i]), base + i),
                                            lambda p: p, pools[i % 2])
            return tuple(pools)
        if variant == "fixed":
            for i in range(slots):
                pool = write(pool, fetch(store, ids[i]), jnp.where(i < n, base + i, sink))
            return pool
        if variant == "cond":
            for i in range(slots):
                pool = jax.lax.cond(i < n, lambda p, i=i: write(p, fetch(store, ids[i]), base + i), lambda p: p, pool)
            return pool
        if variant == "switch":
            def branch(k):
                def go(p):
                    for i in range(k):
                        p = write(p, fetch(store, ids[i]), base + i)
                    return p
                return go
            return jax.lax.switch(jnp.clip(n, 0, slots), [branch(k) for k in range(slots + 1)], pool)
        if variant == "while":
            return jax.lax.fori_loop(0, jnp.clip(n, 0, slots),
                                     lambda i, p: write(p, fetch(store, ids[i]), base + i), pool)
        raise ValueError(variant)

    def step(pool, stores, ids, n, x):
        acc = x
        for layer in range(layers):
            pool = layer_fetch(pool, stores[layer], ids[layer], n[layer], layer)
            # the layer's compute reads what it fetched (a data dependence on every write)
            for p in (pool if isinstance(pool, tuple) else (pool,)):
                rows = jax.lax.dynamic_slice(p, (layer * slots, 0), (slots, 4096)).astype(jnp.float32)
                acc = jnp.tanh(acc + rows.sum(0) * 1e-3)
        return pool, acc

    return jax.jit(step, donate_argnums=0, **({"compiler_options": options} if options else {}))


THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def new_thunks(seen: set) -> dict:
    """The thunk kinds (top level, and at any depth) of the step modules XLA dumped since the last
    call (XLA_FLAGS --xla_dump_to=DUMP_DIR): whether conditionals and loops sit in command buffers."""
    folder = os.environ.get("DUMP_DIR")
    if not folder or not Path(folder).is_dir():
        return {}
    found = {}
    for path in sorted(Path(folder).glob("*jit_step*thunk_sequence_after_thunk_passes.txt")):
        if path.name in seen:
            continue
        seen.add(path.name)
        top, every = {}, {}
        for line in path.read_text().splitlines():
            if m := THUNK.match(line):
                every[m.group(2)] = every.get(m.group(2), 0) + 1
                if not m.group(1):
                    top[m.group(2)] = top.get(m.group(2), 0) + 1
        found[path.name.split(".")[1]] = {"top_level": top, "all": every}
    return found


def fetched_rows(variant: str, pool, layers: int, slots: int):
    """[layers, slots, 64] the first bytes of every fetch slot (cond2: from the pool each slot wrote)."""
    import numpy as np

    if variant != "cond2":
        return np.asarray(pool[:layers * slots, :64]).reshape(layers, slots, 64)
    a, b = (np.asarray(p[:layers * slots, :64]).reshape(layers, slots, 64) for p in pool)
    return np.where((np.arange(slots) % 2 == 0)[None, :, None], a, b)


def run(layers: int, slots: int, record: int, repeat: int, options: dict | None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    host_kind = "pinned_host" if device.platform == "gpu" else "unpinned_host"
    host = jax.sharding.SingleDeviceSharding(device, memory_kind=host_kind)
    rng = np.random.default_rng(0)
    stores_np = [np.frombuffer(rng.bytes(EXPERTS * record), np.uint8).reshape(EXPERTS, record) for _ in range(layers)]
    stores = tuple(jax.device_put(s, host) for s in stores_np)
    ids_np = np.stack([rng.choice(EXPERTS, slots, replace=False) for _ in range(layers)]).astype(np.int32)
    ids = jnp.asarray(ids_np)
    x = jnp.zeros((4096,), jnp.float32)
    used_counts = sorted({0, 1, 2, slots})
    out = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
           # the flags as given, without the temporary dump folder
           "xla_flags": re.sub(r"\s*--xla_dump_to=\S+", "", os.environ.get("XLA_FLAGS", "")).strip(),
           "layers": layers, "slots": slots, "record_bytes": record,
           "host_memory_kind": host_kind, "variants": {}}
    seen: set = set()
    for variant in VARIANTS:
        row = {}
        try:
            step = build(variant, layers, slots, record, options)
            pool = jnp.zeros((layers * slots + 1, record), jnp.uint8)
            if variant == "cond2":
                pool = (pool, jnp.zeros_like(pool))
            t = time.perf_counter()
            for used in used_counts:  # every argument shape is the same: one compile
                pool, acc = step(pool, stores, ids, jnp.full((layers,), used, jnp.int32), x)
            jax.block_until_ready(acc)
            row["compile_and_first_s"] = time.perf_counter() - t
            # correctness: with every slot used, each layer's slots hold its fetched records
            pool, acc = step(pool, stores, ids, jnp.full((layers,), slots, jnp.int32), x)
            if variant != "none":
                got = fetched_rows(variant, pool, layers, slots)
                want = np.stack([stores_np[layer][ids_np[layer], :64] for layer in range(layers)])
                row["correct"] = bool((got == want).all())
            for used in used_counts:
                n = jnp.full((layers,), used, jnp.int32)
                times = []
                for _ in range(repeat):
                    t = time.perf_counter()
                    pool, acc = step(pool, stores, ids, n, x)
                    jax.block_until_ready(acc)
                    times.append(time.perf_counter() - t)
                times.sort()
                med = times[len(times) // 2]
                row[f"used_{used}"] = {"median_us": med * 1e6, "min_us": times[0] * 1e6, "max_us": times[-1] * 1e6,
                                       "GBps": used * layers * record / med / 1e9 if used else None}
            hlo = step.lower(pool, stores, ids, jnp.zeros((layers,), jnp.int32), x).compile().as_text()
            row["hlo"] = {op: len(re.findall(pattern, hlo)) for op, pattern in HLO_OPS.items()}
            row["thunks"] = new_thunks(seen)
        except Exception as e:  # noqa: BLE001 - a variant XLA refuses is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        out["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--out", help="folder for the JSON (default bench/results/gpu_fetch)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import jax

        toy = jax.devices()[0].platform != "gpu"
        options = {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_CONTROL} if args.child == "options" else None
        result = run(2 if toy else args.layers, 2 if toy else args.slots, 4096 * 4 if toy else RECORD_BYTES,
                     3 if toy else args.repeat, options)
        result["command_buffer"] = args.child
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for child in MODES:
        env = dict(os.environ)
        dump = tempfile.mkdtemp(prefix=f"gpu_fetch_{child}_")
        env["DUMP_DIR"] = dump
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
        if child == "flags":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_gpu_enable_command_buffer={COMMAND_BUFFER_CONTROL}").strip()
        cmd = [sys.executable, "-m", "bench.gpu_fetch", "--child", child, "--layers", str(args.layers),
               "--slots", str(args.slots), "--repeat", str(args.repeat)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        shutil.rmtree(dump, ignore_errors=True)
        sys.stderr.write(done.stderr[-3000:])
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        print("\n".join(ln for ln in done.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
        results.append(json.loads(lines[-1][7:]) if lines else {"command_buffer": child, "error": done.returncode})
    folder = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "gpu_fetch"
    folder.mkdir(parents=True, exist_ok=True)
    device = results[0].get("platform", "unknown")
    path = folder / f"gpu_fetch_{device}.json"
    path.write_text(json.dumps({"runs": results}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
