"""Host round trips, dispatches and transfers per decoded token, and decode time, per offloading policy.

Model: the bundled tiny Qwen3-MoE (8 layers, 32 experts, top-4) converted with the bf16 and int4
tiers, computed in float32. Cases: resident (every expert on the device, no budget); lru;
lru+prefetch; DyMoE (hi bf16, lo int4); DynaExq (hi bf16, lo int4); speculative decoding with the
int4 draft on lru+prefetch; speculative int4 with every expert resident (no budget). Every
offloaded case runs the default execution path ("auto") under a budget of its smallest loadable
budget plus 40% of the bf16 expert bytes. The smallest loadable budget is searched with jmoe.load
itself: each refusal's "needs (at least) X" names the next budget to try (twice the budget where
the refusal names no size, as DynaExq's does); once a load succeeds, a bisection between the
largest failing and the smallest succeeding budget narrows it to 1 KiB (the draft's reservation
is part of it in the speculative case).

Workload: three prompts, the first --prompt-tokens tokens of the prose, code and math dev texts,
each generating --new-tokens tokens (greedy, or sampled with --temperature and --seed).

Warm-up (before counting and before timing): a generate on another prompt of the same length,
then the three generates of the workload once, and for speculative decoding a generate at each
draft length the governor may choose, so that nothing compiles in what is measured (speculative
decoding compiles a draft per length; the governor's choice of draft length also reads cycle
times, which compilation would distort). A timed round in which anything compiled fails the run.
The measured generates therefore repeat the warm-up's, on caches it left.

Counting (one process, this one): a case is loaded, bench.lib.host_io installed (it clears JAX's
caches, so the warm-up compiles through the counted dispatch path) and the case warmed up; the
counts are taken around the three generates. Reported per generated token ("all", the prefill
included) and per decode token ("decode": from the first streamed token to the end of the stream,
over the tokens after the first; the window starts after the first decode step was dispatched and
ends after the last token was read, so it holds one decode dispatch fewer than token reads).
"blocking reads" = reads + waits. jmoe's own counters (jmoe.stats, differenced over the same
window) are recorded beside them, and the jmoe source line each counted event came from (its
innermost jmoe frame; --no-where skips this).

Timing (a fresh process per case, nothing patched): the resident model and the case's model are
loaded and warmed up, then timed in alternating rounds (resident, case, resident, case, ...).
Decode time per token = time from the first streamed token to the last, over the tokens after the
first, summed over the three prompts. Reported: the median over rounds and the min-max, and the
ratio case / resident taken within each round. Before each round the child waits (at most
--max-wait seconds) for a second in which other processes use under 0.3 cores, and records how
many cores other processes kept busy during the round (from /proc/stat).

    python -m bench.decode_io [--out decode_io] [--new-tokens 64] [--rounds 3] [--temperature 0]
        [--cases lru,dymoe] [--load-kw '{"execution": "auto"}'] [--model converted_dir]

--load-kw adds keyword arguments to every case's jmoe.load (the budget search included), not to
the timing's resident baseline. --out is a file name under bench/results/decode_io (".json" and
the "_cpu"/"_gpu" tag added) or a path ending in ".json".
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jmoe
from bench.lib import host_io
from bench.lib.common import CORPUS, DOMAINS, ROOT, TINY_HF, machine, result_path, spread
from jmoe.policies import DyMoE, DynaExq
from jmoe.serving.compiles import no_compiles

STATS_COUNTERS = ("host_syncs", "replays", "transfers", "bytes_h2d", "tokens", "steps", "expert_uses", "evictions",
                  "stalls", "degraded", "skipped")
BUDGET_SHARE = 0.4
SEARCH_TOLERANCE = 1024
MAX_BUDGET = 2**40
QUIET_CORES = 0.3
SIZE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class Case:
    label: str
    policy: object = "resident"
    offloaded: bool = False
    draft: str | None = None
    speculative: str | None = None

    def make_policy(self):
        return self.policy() if callable(self.policy) else self.policy

    def load_kw(self, budget: int | None, load_kw: dict) -> dict:
        kw = {"compute_dtype": "float32", "policy": self.make_policy(), **load_kw}
        if self.draft is not None:
            kw["draft"] = self.draft
        if budget is not None:
            kw["device_budget"] = budget
        return kw

    def gen_kw(self) -> dict:
        return {"speculative": self.speculative} if self.speculative is not None else {}


CASES = {
    "resident": Case("resident"),
    "lru": Case("lru (auto)", "lru", offloaded=True),
    "lru+prefetch": Case("lru+prefetch (auto)", "lru+prefetch", offloaded=True),
    "dymoe": Case("DyMoE bf16/int4 (auto)", lambda: DyMoE(hi="bf16", lo="int4"), offloaded=True),
    "dynaexq": Case("DynaExq bf16/int4 (auto)", lambda: DynaExq(hi="bf16", lo="int4"), offloaded=True),
    "spec-lru+prefetch": Case("speculative int4 + lru+prefetch (auto)", "lru+prefetch", offloaded=True,
                              draft="int4", speculative="int4"),
    "spec-resident": Case("speculative int4, no budget", "resident", speculative="int4"),
}


# ---------------------------------------------------------------- model and prompts

def jmoe_source() -> str:
    """The commit of the jmoe that ran (no path of this machine goes into a result)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(jmoe.__file__).parent,
                          capture_output=True, text=True)
    return f"commit {done.stdout.strip()}" if done.returncode == 0 else "unknown"


def converted_model(model_dir: str | None, tmp: str) -> Path:
    if model_dir:
        return Path(model_dir)
    from convert import convert_checkpoint

    return Path(convert_checkpoint(TINY_HF, Path(tmp) / "tiny-bf16-int4", tiers="bf16,int4", progress=False))


def prompts(tokenizer, corpus: Path, n_tokens: int) -> dict[str, list[int]]:
    """The first n_tokens of each domain's dev text, and a warm-up prompt of the same length."""
    texts = {d: (corpus / f"{d}.dev.txt").read_text()[:20000] for d in DOMAINS}
    out = {d: [int(t) for t in tokenizer.encode(text)[:n_tokens]] for d, text in texts.items()}
    out["warmup"] = [int(t) for t in tokenizer.encode(texts["prose"])[1000:1000 + n_tokens]]
    return out


def generate_kw(args, case: Case) -> dict:
    return {"max_new_tokens": args.new_tokens, "temperature": args.temperature, "seed": args.seed, **case.gen_kw()}


def streamed(model, ids: list[int], gen_kw: dict, on_first=None) -> tuple[int, float]:
    """Generate with stream=True; the number of tokens and the seconds from the first to the last."""
    first = last = None
    n = 0
    for _ in jmoe.generate(model, ids, stream=True, **gen_kw):
        last = time.perf_counter()
        n += 1
        if n == 1:
            first = last
            if on_first is not None:
                on_first()
    return n, (last - first) if n else 0.0


def warm_up(model, ids: dict, gen_kw: dict) -> None:
    """Compile every shape the workload meets: the warm-up prompt, then the workload once, and for
    speculative decoding each draft length the governor may choose (a draft executable of its own:
    it chooses by measured time, so a timed round can meet a length the workload's warm-up did not)."""
    for key in ("warmup", *DOMAINS):
        streamed(model, ids[key], gen_kw)
    spec = gen_kw.get("speculative")
    if spec:
        from jmoe.decoding.speculative import DEFAULT_K_MAX, auto_k_max

        draft = spec["draft"] if isinstance(spec, dict) else spec
        for k in range(1, auto_k_max(model, DEFAULT_K_MAX) + 1):
            streamed(model, ids["warmup"], {**gen_kw, "speculative": {"draft": draft, "k": k}})


def release(model) -> None:
    del model
    gc.collect()


# ---------------------------------------------------------------- smallest loadable budget

def needs_from(message: str) -> int | None:
    """The budget a BudgetError asks for, rounded up by half its printed precision."""
    m = re.search(r"needs (?:at least )?([\d.]+) (B|KiB|MiB|GiB)", message)
    if m is None:
        return None
    scale = SIZE_UNITS[m.group(2)]
    return int(float(m.group(1)) * scale + (0.005 * scale if scale > 1 else 0)) + 1


def loads(path: Path, case: Case, budget: int, load_kw: dict) -> tuple[bool, str]:
    try:
        model = jmoe.load(path, **case.load_kw(budget, load_kw))
    except jmoe.JmoeError as e:  # BudgetError, or a policy refusing the budget it was left
        if "budget" not in str(e):
            raise
        return False, f"{type(e).__name__}: {e}"
    release(model)
    return True, ""


def smallest_budget(path: Path, case: Case, load_kw: dict) -> dict:
    """Follow the budget errors' "needs X" up to a budget that loads (doubling where an error names no
    size), then bisect down to 1 KiB."""
    failing, budget, tries, messages = 0, 1, 0, []
    while True:
        tries += 1
        ok, message = loads(path, case, budget, load_kw)
        if ok:
            break
        failing = max(failing, budget)
        messages.append(message)
        asked = needs_from(message)
        budget = asked if asked is not None and asked > budget else 2 * budget
        if budget > MAX_BUDGET:
            raise RuntimeError(f"no budget up to {MAX_BUDGET} B loads {case.label}: {message}")
    good = budget
    while good - failing > SEARCH_TOLERANCE:
        mid = (good + failing) // 2
        tries += 1
        ok, message = loads(path, case, mid, load_kw)
        if ok:
            good = mid
        else:
            failing = mid
            messages.append(message)
    return {"bytes": good, "largest_failing": failing, "loads_tried": tries, "last_error": messages[-1] if messages else None,
            "method": "jmoe.load probes: each budget error's 'needs (at least) X' (plus half its printed precision) "
                      "is the next budget (twice the budget where the error names no size); then bisection between the largest failing and smallest loading budget "
                      f"to {SEARCH_TOLERANCE} B"}


def budgets(path: Path, names: list[str], load_kw: dict) -> tuple[dict, int]:
    all_experts = jmoe.memory_plan(path, tier="bf16", compute_dtype="float32")["all_experts"]
    out = {}
    for name in names:
        case = CASES[name]
        if not case.offloaded:
            continue
        found = smallest_budget(path, case, load_kw)
        found["budget"] = found["bytes"] + int(BUDGET_SHARE * all_experts)
        out[name] = found
        print(f"{name}: smallest loadable budget {found['bytes'] / 2**20:.3f} MiB, run at {found['budget'] / 2**20:.3f} MiB "
              f"({found['loads_tried']} loads)", flush=True)
    return out, all_experts


# ---------------------------------------------------------------- counting

class Sources:
    """The innermost jmoe frame of every counted event, per kind."""

    def __init__(self):
        self.tally = collections.defaultdict(collections.Counter)
        self.package = str(Path(jmoe.__file__).resolve().parent)
        self.original = None

    def where(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.package):
                name = Path(frame.f_code.co_filename).relative_to(Path(self.package).parent)
                return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return "(outside jmoe)"

    def __enter__(self):
        self.original = host_io._bump

        def bump(name, n=1):
            if name != "transfer_bytes":
                self.tally[name][self.where()] += n
            self.original(name, n)

        host_io._bump = bump
        return self

    def __exit__(self, *exc):
        host_io._bump = self.original

    def top(self, n: int = 12) -> dict:
        return {kind: [[site, c] for site, c in counter.most_common(n)] for kind, counter in self.tally.items()}


def stats_counters(model) -> dict:
    s = jmoe.stats(model)
    out = {k: s.get(k) for k in STATS_COUNTERS if isinstance(s.get(k), (int, float))}
    if isinstance(s.get("hit_rate"), (int, float)) and "expert_uses" in out:
        out["hits"] = s["hit_rate"] * out["expert_uses"]
    return out


def stats_delta(before: dict, after: dict, tokens: int) -> dict:
    delta = {k: after[k] - before.get(k, 0) for k in after}
    out = {f"{k}_per_token": v / max(tokens, 1) for k, v in delta.items() if k not in ("hits", "tokens")}
    out["window"] = delta
    if delta.get("expert_uses"):
        out["hit_rate"] = delta.get("hits", 0) / delta["expert_uses"]
    if "bytes_h2d" in delta:
        out["bytes_h2d_per_token"] = delta["bytes_h2d"] / max(tokens, 1)
    return out


def summed(windows: list[host_io.Counts]) -> host_io.Counts:
    return host_io.Counts(*(sum(getattr(w, f.name) for w in windows) for f in dataclasses.fields(host_io.Counts)))


def per_token(counts: host_io.Counts, tokens: int) -> dict:
    out = counts.per(tokens)
    out["blocking_reads"] = out["reads"] + out["waits"]
    return out


def count_case(path: Path, name: str, budget: int | None, ids: dict, args, load_kw: dict) -> dict:
    case = CASES[name]
    model = jmoe.load(path, **case.load_kw(budget, load_kw))
    gen_kw = generate_kw(args, case)
    host_io.install()
    try:
        warm_up(model, ids, gen_kw)
        with Sources() as sources:
            s0 = stats_counters(model)
            c0 = host_io.counts()
            tokens, decode_tokens, windows = 0, 0, []
            for domain in DOMAINS:
                marks = []
                n, _ = streamed(model, ids[domain], gen_kw, on_first=lambda: marks.append(host_io.counts()))
                tokens += n
                if n > 1:
                    decode_tokens += n - 1
                    windows.append(host_io.counts() - marks[0])
            total = host_io.counts() - c0
            decode = summed(windows)
        s1 = stats_counters(model)
    finally:
        host_io.uninstall()
    full = jmoe.stats(model)
    release(model)
    return {"label": case.label, "tokens": tokens, "decode_tokens": decode_tokens,
            "all": per_token(total, tokens), "decode": per_token(decode, decode_tokens),
            "totals": total.per(1), "jmoe_stats": stats_delta(s0, s1, tokens),
            "jmoe_stats_since_load": {k: full.get(k) for k in ("hit_rate", "host_syncs", "replays", "transfers",
                                                                 "bytes_h2d_per_token", "tokens", "speculative",
                                                                 "policy_state", "pool_slots")},
            "sources": sources.top() if args.where else None}


# ---------------------------------------------------------------- timing (a child process per case)

def decode_ms(model, ids: dict, gen_kw: dict) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for domain in DOMAINS:
        n, s = streamed(model, ids[domain], gen_kw)
        seconds, tokens = seconds + s, tokens + max(n - 1, 0)
    return 1e3 * seconds / max(tokens, 1), tokens


def busy_seconds() -> tuple[float, float] | None:
    """CPU seconds the whole machine and this process have been busy (Linux; None elsewhere)."""
    try:
        jiffies = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    own = os.times()
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def other_cores(before, after, wall: float) -> float | None:
    """Cores that other processes kept busy between two busy_seconds() samples."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


def wait_for_quiet(max_wait: float, threshold: float = QUIET_CORES) -> float:
    """Wait (at most max_wait seconds) for a second in which other processes use under `threshold` cores."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        before = busy_seconds()
        time.sleep(1.0)
        others = other_cores(before, busy_seconds(), 1.0)
        if others is None or others < threshold:
            break
    return time.perf_counter() - start


def time_case(args) -> dict:
    case = CASES[args.child_case]
    load_kw = json.loads(args.load_kw)
    baseline = jmoe.load(args.model, compute_dtype="float32")
    model = jmoe.load(args.model, **case.load_kw(args.child_budget, load_kw))
    ids = prompts(baseline.tokenizer, Path(args.corpus), args.prompt_tokens)
    base_kw, case_kw = generate_kw(args, CASES["resident"]), generate_kw(args, case)
    warm_up(baseline, ids, base_kw)
    warm_up(model, ids, case_kw)
    rounds = []
    for _ in range(args.rounds):
        waited = wait_for_quiet(args.max_wait)
        before, start = busy_seconds(), time.perf_counter()
        with no_compiles(args.child_case):  # a round that compiles would time the compile, not decoding
            resident_ms, _ = decode_ms(baseline, ids, base_kw)
            case_ms, tokens = decode_ms(model, ids, case_kw)
        rounds.append({"resident_ms": resident_ms, "case_ms": case_ms, "ratio": case_ms / resident_ms,
                       "decode_tokens": tokens, "waited_for_quiet_s": waited,
                       "other_processes_cores": other_cores(before, busy_seconds(), time.perf_counter() - start)})
    return {"rounds": rounds, "jmoe_source": jmoe_source()}


def run_timing(path: Path, name: str, budget: int | None, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.decode_io", "--child-case", name, "--child-out", out.name,
               "--model", str(path), "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds),
               "--temperature", str(args.temperature), "--seed", str(args.seed), "--load-kw", args.load_kw,
               "--corpus", str(args.corpus), "--prompt-tokens", str(args.prompt_tokens), "--max-wait", str(args.max_wait)]
        if budget is not None:
            cmd += ["--child-budget", str(budget)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        result = json.loads(Path(out.name).read_text())
    rounds = result["rounds"]
    result.update({"resident_ms_per_token": spread([r["resident_ms"] for r in rounds]),
                   "case_ms_per_token": spread([r["case_ms"] for r in rounds]),
                   "ratio": spread([r["ratio"] for r in rounds])})
    return result


# ---------------------------------------------------------------- report

def table(results: dict, window: str) -> str:
    lines = ["| policy/path | blocking reads/token | executions/token | host-to-device transfers/token | x resident (ms/token) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        c = r["counts"][window]
        t = r.get("timing")
        ratio = "-" if t is None else (f"{t['ratio']['median']:.1f}x ({t['ratio']['min']:.1f}-{t['ratio']['max']:.1f}), "
                                       f"{t['case_ms_per_token']['median']:.2f} ms")
        lines.append(f"| {r['counts']['label']} | {c['blocking_reads']:.1f} ({c['reads']:.1f} + {c['waits']:.1f}) | "
                     f"{c['executions']:.1f} | {c['transfers']:.1f} | {ratio} |")
    return "\n".join(lines)


def out_path(out: str) -> Path:
    if out.endswith(".json"):
        return Path(out)
    return result_path("decode_io", out)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_io")
    parser.add_argument("--model", default=None, help="a converted model with bf16 and int4 (default: convert the tiny model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"a subset of {','.join(CASES)}")
    parser.add_argument("--load-kw", default="{}", help="extra jmoe.load keyword arguments (JSON object)")
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--max-wait", type=float, default=60.0,
                        help="before each timing round, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--where", action=argparse.BooleanOptionalAction, default=True,
                        help="record the jmoe source line of every counted event")
    parser.add_argument("--child-case", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    args.case_names = names
    return args


def main() -> None:
    args = parse_args()
    if args.child_case:
        Path(args.child_out).write_text(json.dumps(time_case(args)))
        return
    load_kw = json.loads(args.load_kw)
    print(f"jmoe from {jmoe.__file__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = converted_model(args.model, tmp)
        found, all_experts = budgets(path, args.case_names, load_kw)
        results = {name: {} for name in args.case_names}
        if not args.no_timing:
            for name in args.case_names:
                results[name]["timing"] = run_timing(path, name, found.get(name, {}).get("budget"), args)
                print(f"{name}: x{results[name]['timing']['ratio']['median']:.2f}", flush=True)
        tokenizer = jmoe.load(path, compute_dtype="float32").tokenizer
        ids = prompts(tokenizer, Path(args.corpus), args.prompt_tokens)
        for name in args.case_names:
            results[name]["budget"] = found.get(name)
            results[name]["counts"] = count_case(path, name, found.get(name, {}).get("budget"), ids, args, load_kw)
            print(f"{name}: counted", flush=True)
    payload = {
        "machine": machine(), "jmoe_source": jmoe_source(), "model": "tiny-qwen3-moe (bf16,int4)", "compute_dtype": "float32",
        "prompts": {d: ids[d] for d in DOMAINS}, "warmup_prompt": ids["warmup"], "new_tokens": args.new_tokens,
        "temperature": args.temperature, "seed": args.seed, "rounds": args.rounds, "load_kw": load_kw,
        "all_bf16_expert_bytes": all_experts, "budget_share_of_bf16_experts": BUDGET_SHARE,
        "method": __doc__, "cases": results,
    }
    path = out_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    for window, title in (("all", "per generated token, prefill included"), ("decode", "per decode token")):
        print(f"\n{title}\n\n{table(results, window)}")


if __name__ == "__main__":
    main()
