"""Peak memory of `jmoe convert`: it streams, so peak RSS stays far below the checkpoint size.

Each conversion runs in a fresh child process (peak RSS read from the OS for that child alone):
the bundled tiny model with RTN, GPTQ and HAQ (all tiers), and a synthetic Qwen3-30B-A3B-shaped
checkpoint (random weights, fewer layers) with RTN.

    python -m bench.convert_memory [--synthetic-layers 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.lib.common import CALIB_FILES, ROOT, TINY_HF, write_result
from bench.lib.synthetic import QWEN3_30B_A3B, checkpoint_bytes, write_checkpoint

TIERS = "bf16,int8,int4,int2"
CALIB = ",".join(str(p) for p in CALIB_FILES)

# The child measures itself: VmHWM is this process's peak resident set (file pages mapped by
# safetensors count there, though the kernel can drop them), RssAnon sampled every 20 ms is the
# memory the converter really holds. (ru_maxrss would also count the parent's pages at fork.)
CHILD = """
import json, sys, threading, time
from convert import convert_checkpoint

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
peak = [0]
done = threading.Event()
def sample():
    while not done.wait(0.02):
        peak[0] = max(peak[0], status("RssAnon"))
threading.Thread(target=sample, daemon=True).start()
src, out, method, calib = sys.argv[1:5]
t = time.perf_counter()
convert_checkpoint(src, out, tiers="{tiers}", method=method, calib=calib.split(",") if calib else None, progress=False)
seconds = time.perf_counter() - t
done.set()
print(json.dumps({{"seconds": seconds, "peak_rss_bytes": status("VmHWM"),
                  "peak_anon_bytes": max(peak[0], status("RssAnon"))}}))
"""


def convert_in_child(src: Path, out: Path, method: str) -> dict:
    """Run one conversion in a fresh child process, which reports its own peak memory."""
    calib = CALIB if method != "rtn" else ""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tiers=TIERS), str(src), str(out), method, calib],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"conversion failed:\n{proc.stderr[-3000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"method": method, "tiers": TIERS, **measured, "written_bytes": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--synthetic-layers", type=int, default=6)
    args = parser.parse_args()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        synthetic = write_checkpoint(tmp / "synthetic-hf", layers=args.synthetic_layers, vocab=4096, **QWEN3_30B_A3B)
        size = checkpoint_bytes(synthetic)
        run = convert_in_child(synthetic, tmp / "synthetic-jmoe", "rtn")
        cases.append({"model": f"synthetic Qwen3-30B-A3B shapes, {args.synthetic_layers} layers",
                      "checkpoint_bytes": size, **run})
        print(json.dumps(cases[-1]), flush=True)
        for method in ("rtn", "gptq", "haq"):
            run = convert_in_child(TINY_HF, tmp / f"tiny-{method}", method)
            cases.append({"model": "tiny-qwen3-moe", "checkpoint_bytes": checkpoint_bytes(TINY_HF), **run})
            print(json.dumps(cases[-1]), flush=True)
    write_result("convert_memory", "convert_memory", {
        "note": "peak_rss_bytes: the conversion process's VmHWM (includes memory-mapped checkpoint pages, "
                "which the kernel can reclaim); peak_anon_bytes: its peak anonymous memory, sampled every 20 ms",
        "cases": cases,
    })


if __name__ == "__main__":
    main()
