"""Would an expert tier at another grid earn its place? Quality per stored bit of GPTQ grids.

The bundled tiny model's experts are converted by GPTQ (calibrated on the train splits, as
bench.quality calibrates), dense weights and LM head at bf16, once per grid: the int4 and int2
tiers' own formats, and grids no tier stores yet, 3-bit codes and 4-bit codes with 8-bit scales, in
groups of 32 or 64 with float16 scales or 8-bit ones (kernel_formats/qarray.py). Perplexity over
bf16 on each dev domain (windows of --ctx tokens, each scoring its second half, as bench.quality
--llama-cpp scores) is set beside the bits per weight a real model's widths store: codes, plus a
scale and an offset per group (16 bits each as float16, 8 as codes).

A grid of fewer levels than the storage it borrows is a simulation: 3-bit codes are converted in a
process of their own with the quantizers' grid narrowed to 8 levels (QuantFormat.qmax) and the
searched grid the 2-bit tier uses (convert/quantizers/grid.py), and stored in int4's nibbles, so the
model runs on the int4 kernels unchanged and scores what a packed 3-bit tier would. No bytes are
saved by that storage: the bits column is what a 3-bit packing would hold.

    python -m bench.grid_bits [--chunks 200] [--ctx 256] [--work DIR]

Writes bench/results/quality/grid_bits_cpu.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.lib.common import CALIB_FILES, DOMAINS, ROOT, TINY_HF, dev_tokens, write_result

# name -> (code bits, group size, scale bits); the first two are the int4 and int2 tiers' formats
GRIDS = {
    "int4 (tier): 4-bit, groups of 64, float16 scales": (4, 64, 16),
    "int2 (tier): 2-bit, groups of 32, 8-bit scales": (2, 32, 8),
    "4-bit, groups of 64, 8-bit scales": (4, 64, 8),
    "4-bit, groups of 32, 8-bit scales": (4, 32, 8),
    "3-bit, groups of 64, float16 scales": (3, 64, 16),
    "3-bit, groups of 32, 8-bit scales": (3, 32, 8),
    "3-bit, groups of 64, 8-bit scales": (3, 64, 8),
}


def stored_bits(bits: int, group: int, scale_bits: int) -> float:
    """Bits per weight at a real model's widths: the code, and an asymmetric group's scale and offset."""
    return bits + 2 * scale_bits / group


def convert_grid(bits: int, group: int, scale_bits: int, out: Path) -> None:
    """The tiny model's experts by GPTQ on this grid, into out (in this process: the grid is patched)."""
    from convert import convert_checkpoint
    from convert.quantizers import grid
    from jmoe import tiers
    from kernel_formats.qarray import QuantFormat

    tier = "int2" if bits == 2 else "int4"
    if bits == 3:  # 8 levels in int4's storage, with the low-bit tiers' searched grid
        QuantFormat.qmax = property(lambda fmt: 7 if fmt.bits == 4 else (1 << fmt.bits) - 1)
        grid.SEARCH_MAX_BITS = 4
    tiers.DEFAULT_FORMATS[tier] = QuantFormat(bits=2 if bits == 2 else 4, group_size=group, symmetric=False,
                                              scale_bits=scale_bits)
    convert_checkpoint(TINY_HF, out, tiers=tier, method="gptq", calib=[str(p) for p in CALIB_FILES],
                       progress=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=256, help="window (the tiny model's training length)")
    parser.add_argument("--chunks", type=int, default=200, help="windows per domain")
    parser.add_argument("--work", help="keep the conversions here (reused when present)")
    parser.add_argument("--convert", nargs=4, metavar=("BITS", "GROUP", "SCALE_BITS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.convert:  # one grid's conversion, in a process of its own
        bits, group, scale_bits, out = args.convert
        return convert_grid(int(bits), int(group), int(scale_bits), Path(out))

    import jmoe
    from convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        models = {"bf16": (work / "bf16", "bf16")}
        if not (work / "bf16" / "manifest.json").is_file():
            convert_checkpoint(TINY_HF, work / "bf16", tiers="bf16", progress=False)
        for i, (name, (bits, group, scale_bits)) in enumerate(GRIDS.items()):
            out = work / f"grid-{i}"
            if not (out / "manifest.json").is_file():
                subprocess.run([sys.executable, "-m", "bench.grid_bits", "--convert", str(bits), str(group),
                                str(scale_bits), str(out)], cwd=ROOT, check=True)
            models[name] = (out, "int2" if bits == 2 else "int4")

        ppl = {}
        for name, (path, tier) in models.items():
            model = jmoe.load(path, tier=tier, compute_dtype="float32")
            ppl[name] = {}
            for domain in DOMAINS:
                ids = dev_tokens(model.tokenizer, domain)
                windows = min(len(ids) // args.ctx, args.chunks)
                ppl[name][domain] = jmoe.perplexity(model, ids[: windows * args.ctx], window=args.ctx,
                                                    context=args.ctx // 2)
            print(f"{name:52s} " + "  ".join(f"{d} {ppl[name][d]:.4f}" for d in DOMAINS), flush=True)

    base = ppl["bf16"]
    rows = [{"grid": name, "code_bits": bits, "group": group, "scale_bits": scale_bits,
             "bits_per_weight": stored_bits(bits, group, scale_bits), "perplexity": ppl[name],
             "over_bf16": {d: ppl[name][d] / base[d] - 1 for d in DOMAINS}}
            for name, (bits, group, scale_bits) in GRIDS.items()]
    for row in rows:
        print(f"{row['grid']:52s} {row['bits_per_weight']:.2f} bits  " +
              " / ".join(f"{100 * row['over_bf16'][d]:+.2f}%" for d in DOMAINS))
    write_result("quality", "grid_bits", {
        "model": "tiny-qwen3-moe", "method": "gptq (experts; dense weights and LM head bf16)", "ctx": args.ctx,
        "scored": "the second half of each window", "bf16_perplexity": base, "rows": rows})


if __name__ == "__main__":
    main()
