"""Where a decode step's time goes on the CPU: a jax.profiler trace of a model's decode steps, its
thunks summed by HLO instruction and named by the jax scope that made them (layer_3/moe/experts).

    python -m bench.decode_profile MODEL [--tier int4] [--cpu-dot int8] [--tokens 32] [--top 25]

The model is loaded as `jmoe bench` loads it, warmed by one generate of the same length, then
`--tokens` greedy tokens are decoded under the profiler. Each thunk XLA:CPU ran in those steps
(a fusion, a native kernel's custom call, a copy) is summed over the steps and divided by the
decode steps: milliseconds per token of each instruction, and of each kind (native calls, XLA
fusions, copies), beside the wall time per token. The profiler slows every call a little: compare
profiles with each other, not with `jmoe bench`'s tok/s. Writes
bench/results/kernels/decode_profile_NAME_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
from pathlib import Path

# The optimized HLO of the steps (for each instruction's jax scope), dumped by XLA as it compiles:
# set before jax starts its backend.
DUMP = tempfile.mkdtemp(prefix="jmoe-decode-profile-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=.*_decode.*").strip()

import jax  # noqa: E402

from bench.lib.common import result_name, write_result  # noqa: E402

SCOPE = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')
# an instruction XLA made without a jax scope (a dot of a batched einsum): named by its opcode and operands
UNSCOPED = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(([^)]*)\)')
TARGET = re.compile(r'custom_call_target="([^"]*)"')


def instruction_scopes(dump: str) -> dict[str, str]:
    """instruction name -> the jax scope of its op (the layer index folded to L, so that every
    layer's instance of one op sums together), from the dumped optimized HLO of the decode steps."""
    scopes = {}
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        for line in Path(path).read_text().splitlines():
            m = SCOPE.match(line)
            if m:
                scope = re.sub(r"^jit\([^)]*\)/", "", m.group(2))
                target = TARGET.search(line)  # a native call: which kernel
                scope += f" [{target.group(1)}]" if target else ""
                scopes[m.group(1)] = re.sub(r"layer_\d+", "layer_L", scope)
            elif (m := UNSCOPED.match(line)) and m.group(2) not in ("parameter", "constant", "bitcast", "tuple",
                                                                     "get-tuple-element"):
                operands = ", ".join(re.sub(r"\.\d+$", "", o.strip().lstrip("%")) for o in m.group(3).split(","))
                scopes[m.group(1)] = re.sub(r"layers___\d+___", "layers___L___", f"{m.group(2)}({operands})")
    return scopes


def thunk_times(trace_dir: str) -> list[tuple[str, str, float]]:
    """(event name, hlo_op, seconds) of every XLA:CPU thunk in the trace."""
    from jax.profiler import ProfileData

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    events = []
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    events.append((event.name, str(stats["hlo_op"]), event.duration_ns * 1e-9))
    return events


def kind_of(op: str, event: str) -> str:
    if op.startswith(("ffi_call", "custom-call", "custom_call")):
        return "native call"
    if op.startswith("copy") or "copy" in event:
        return "copy"
    return "XLA fusion or op"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tier", default=None)
    parser.add_argument("--cpu-dot", default="int8", choices=("float", "int8"))
    parser.add_argument("--policy", default=None,
                        help="load's policy (dymoe: the per-token mixed mode of a conversion holding int4 and int2)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--by-instruction", action="store_true",
                        help="list single HLO instructions (each layer's own), not their scopes summed")
    parser.add_argument("--name", type=result_name, default=None,
                        help="result file name (default: the model directory's)")
    args = parser.parse_args(argv)

    import jmoe
    from jmoe.bench import decode_seconds, random_prompt

    max_seq_len = max(256, args.prompt + args.tokens + 8)  # room for the prompt (a decode at depth)
    model = jmoe.load(args.model, tier=args.tier, cpu_dot=args.cpu_dot, max_seq_len=max_seq_len, policy=args.policy)
    prompts = [random_prompt(model, args.prompt, 0)]

    def decode() -> tuple[float, int]:
        return decode_seconds(model, prompts, args.tokens)  # as `jmoe bench` times a tg row

    decode()  # compiles every shape
    untraced, steps = decode()
    trace = tempfile.mkdtemp(prefix="jmoe-trace-")
    jax.profiler.start_trace(trace)
    traced, steps = decode()
    jax.profiler.stop_trace()

    # the prefill's thunks are in the trace too: keep the decode step's instructions only
    scopes = instruction_scopes(DUMP)
    per_op: dict[str, float] = collections.defaultdict(float)
    per_kind: dict[str, float] = collections.defaultdict(float)
    for event, op, seconds in thunk_times(trace):
        if op not in scopes and not op.startswith("copy"):
            continue
        per_op[op] += seconds
        per_kind[kind_of(op, event)] += seconds
    ms = lambda s: 1e3 * s / steps  # noqa: E731 - per decode token
    by_scope: dict[str, float] = collections.defaultdict(float)
    for op, seconds in per_op.items():
        by_scope[f"{op} ({scopes.get(op, '')})" if args.by_instruction else scopes.get(op, op)] += seconds
    top = sorted(by_scope.items(), key=lambda kv: -kv[1])[:args.top]
    print(f"{steps} decode steps: {ms(untraced):.2f} ms/token untraced, {ms(traced):.2f} traced; "
          f"thunks {ms(sum(per_kind.values())):.2f} ms/token")
    for kind, seconds in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:18s} {ms(seconds):7.3f} ms/token")
    for scope, seconds in top:
        print(f"  {ms(seconds):7.3f} ms  {scope}")
    write_result("kernels", f"decode_profile_{args.name or args.model.name}", {
        "model": str(args.model.name), "tier": args.tier, "cpu_dot": args.cpu_dot, "prompt": args.prompt,
        "decode_steps": steps,
        "ms_per_token_untraced": ms(untraced), "ms_per_token_traced": ms(traced),
        "ms_per_token_by_kind": {k: ms(v) for k, v in per_kind.items()},
        "ms_per_token_by_scope": {k: ms(v) for k, v in top}})


if __name__ == "__main__":
    sys.exit(main())
