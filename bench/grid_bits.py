"""Quality per stored bit of expert grids: which tiers, groups and scales earn their bytes.

The bundled tiny model's experts are converted by GPTQ (calibrated on the train splits, as
bench.quality calibrates), dense weights and LM head at bf16, once per grid: the int4, int3 and int2
tiers' own formats, and other groups and scales of the same codes, in groups of 32 or 64 with
float16 scales or 8-bit ones (`jmoe convert --group-size`, `--scale-bits`; kernel_formats/qarray.py).
Perplexity over bf16 on each dev domain (windows of --ctx tokens, each scoring its second half, as
bench.quality --llama-cpp scores) is set beside the bits per weight a real model's widths store:
codes, plus a scale and an offset per group (16 bits each as float16, 8 as codes).

    python -m bench.grid_bits [--chunks 200] [--ctx 256] [--work DIR]

Writes bench/results/quality/grid_bits_cpu.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.lib.common import CALIB_FILES, DOMAINS, TINY_HF, dev_tokens, write_result

# name -> (code bits, group size, scale bits); the first three are the int4, int2 and int3 tiers' formats
GRIDS = {
    "int4 (tier): 4-bit, groups of 64, float16 scales": (4, 64, 16),
    "int2 (tier): 2-bit, groups of 32, 8-bit scales": (2, 32, 8),
    "int3 (tier): 3-bit, groups of 32, 8-bit scales": (3, 32, 8),
    "4-bit, groups of 64, 8-bit scales": (4, 64, 8),
    "4-bit, groups of 32, 8-bit scales": (4, 32, 8),
    "3-bit, groups of 64, float16 scales": (3, 64, 16),
    "3-bit, groups of 64, 8-bit scales": (3, 64, 8),
}
TIER_OF_BITS = {2: "int2", 3: "int3", 4: "int4"}


def stored_bits(bits: int, group: int, scale_bits: int) -> float:
    """Bits per weight at a real model's widths: the code, and an asymmetric group's scale and offset."""
    return bits + 2 * scale_bits / group


def convert_grid(bits: int, group: int, scale_bits: int, out: Path) -> None:
    """The tiny model's experts by GPTQ on this grid (the tier of these bits, this group and scale), into out."""
    from convert import convert_checkpoint

    convert_checkpoint(TINY_HF, out, tiers=TIER_OF_BITS[bits], method="gptq", calib=[str(p) for p in CALIB_FILES],
                       group_size=group, scale_bits=scale_bits, progress=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=256, help="window (the tiny model's training length)")
    parser.add_argument("--chunks", type=int, default=200, help="windows per domain")
    parser.add_argument("--work", help="keep the conversions here (reused when present)")
    args = parser.parse_args(argv)

    import jmoe
    from convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        models = {"bf16": (work / "bf16", "bf16")}
        if not (work / "bf16" / "manifest.json").is_file():
            convert_checkpoint(TINY_HF, work / "bf16", tiers="bf16", progress=False)
        for name, (bits, group, scale_bits) in GRIDS.items():
            out = work / f"{TIER_OF_BITS[bits]}-g{group}-s{scale_bits}"
            if not (out / "manifest.json").is_file():
                convert_grid(bits, group, scale_bits, out)
            models[name] = (out, TIER_OF_BITS[bits])

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
