"""Peak memory of `jmoe convert`: it streams, so peak RSS stays far below the checkpoint size.

Each conversion runs in a fresh child process (peak RSS read from the OS for that child alone):
the bundled tiny model with RTN, GPTQ and HAQ (all tiers), and a synthetic Qwen3-30B-A3B-shaped
checkpoint (random weights, fewer layers) with RTN.

    python -m bench.convert_memory [--synthetic-layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import CORPUS, ROOT, TINY_HF, write_result
from bench.synthetic import QWEN3_30B_A3B, checkpoint_bytes, write_checkpoint

TIERS = "bf16,int8,int4,int2"
CALIB = ",".join(str(CORPUS / f"{d}.train.txt") for d in ("prose", "code", "math"))

CHILD = """
import sys, time
from convert import convert_checkpoint
src, out, method, calib = sys.argv[1:5]
t = time.perf_counter()
convert_checkpoint(src, out, tiers="{tiers}", method=method, calib=calib.split(",") if calib else None, progress=False)
print(time.perf_counter() - t)
"""


def convert_in_child(src: Path, out: Path, method: str) -> dict:
    """Run one conversion in a child process and read that child's own peak RSS (os.wait4)."""
    calib = CALIB if method != "rtn" else ""
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", CHILD.format(tiers=TIERS), str(src), str(out), method, calib],
                                cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    text = log.read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"conversion failed:\n{text[-3000:]}")
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"method": method, "tiers": TIERS, "seconds": float(text.strip().splitlines()[-1]),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "written_bytes": written}


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
    write_result("convert_memory", {
        "note": "peak_rss_bytes is each conversion process's own maximum resident set (ru_maxrss via wait4)",
        "cases": cases,
    })


if __name__ == "__main__":
    main()
