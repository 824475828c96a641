"""Bytes one decode token reads, jmoe beside llama.cpp, counted from the files: on a CPU whose decode
is bound by memory bandwidth, the ratio of these bounds the ratio of decode speeds at equal efficiency.

A jmoe conversion reads every dense array but the embedding table (a token reads one row of it;
a table tied to the LM head is read whole) and a six-bit weight's high-plane scales (the one CPU pass
under the int8 dot reads the low plane's only; counted apart), the LM head included; a refined head's
int8 rows (jmoe/layers/refined_head.py) only at its `top` logits, and top_k routed
experts a MoE layer, at one tier or, in the per-token mixed
mode (DyMoE with both tiers resident), a share r of the uses at the high tier and the rest at the
low one (the depth schedule's mean is r). A GGUF reads every tensor but token_embd, its routed
experts' tensors (ffn_*_exps) at top_k of their experts. Attention over the KV cache (a few KiB a
layer at short depths) and activations are left out on both sides.

    python -m bench.decode_bytes JMOE_DIR --gguf Q4_0=model-Q4_0.gguf [--r 0.5 0.75] --name NAME
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from bench.lib.common import result_name, write_result
from bench.lib.llama_cpp import EXPERT_TENSOR, find_llama_cpp, gguf_module
from jmoe.config import ModelConfig
from jmoe.manifest import read_manifest

MIB = 2**20


def jmoe_dense_bytes(dense_dir: Path, tied: bool, refine_top: int = 0) -> dict[str, int]:
    """The dense checkpoint's bytes, from orbax's metadata: what a token reads, the embedding table's
    rows it does not (none where the table is also the LM head: `tied`, unless the head is refined),
    the six-bit weights' high-plane scales, which the int8 dot's one pass does not read
    (kernel_formats.qarray), and a refined head's rows, of which a token reads `refine_top`."""
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(dense_dir.absolute())
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    out = {"embedding": 0, "six_bit_high_scales": 0, "refine_rows": 0, "read_per_token": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(meta)[0]:
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        key = jax.tree_util.keystr(path)
        rows = "head_rows" in key or (refine_top and tied and "embed_tokens" in key)  # the table refined from
        if rows:
            out["refine_rows"] += nbytes
            out["read_per_token"] += nbytes * refine_top // leaf.shape[0]
        if "embed_tokens" in key and (not tied or refine_top):
            out["embedding"] += nbytes
        elif rows:
            continue
        elif key.endswith("['high']['scales']"):
            out["six_bit_high_scales"] += nbytes
        else:
            out["read_per_token"] += nbytes
    return out


def jmoe_bytes(root: Path, ratios: list[float]) -> dict:
    manifest = read_manifest(root)
    cfg = ModelConfig.from_dict(manifest["config"])
    uses = cfg.top_k * cfg.num_moe_layers  # routed experts a token runs
    record = {tier: t["record_nbytes"] for tier, t in manifest["tiers"].items()}
    refine_top = manifest["dense"].get("head_rows", {}).get("top", 0)
    dense = jmoe_dense_bytes(root / manifest["dense"]["dir"], cfg.tie_word_embeddings, refine_top)
    rows = {f"{tier} experts": dense["read_per_token"] + uses * n for tier, n in record.items()}
    tiers = sorted(record, key=lambda t: -record[t])
    for hi, lo in zip(tiers, tiers[1:]):
        for r in ratios:
            rows[f"{hi}/{lo} at r = {r:g}"] = dense["read_per_token"] + uses * (r * record[hi] + (1 - r) * record[lo])
    return {"dense_bytes_read": dense["read_per_token"], "embedding_bytes": dense["embedding"],
            "six_bit_high_scale_bytes": dense["six_bit_high_scales"], "refine_row_bytes": dense["refine_rows"],
            "refine_top": refine_top,
            "expert_record_bytes": record, "top_k": cfg.top_k, "expert_uses_per_token": uses,
            "bytes_per_token": rows}


def gguf_bytes(gguf, path: Path, top_k: int) -> dict:
    """What a token reads of the GGUF at `path` (`gguf`: llama.cpp's gguf-py module)."""
    dense = experts = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name == "token_embd.weight":
            continue
        if EXPERT_TENSOR.search(tensor.name):
            experts += int(tensor.n_bytes) * top_k // int(tensor.shape[-1])  # [.., .., experts]
        else:
            dense += int(tensor.n_bytes)
    return {"dense_bytes_read": dense, "expert_bytes_read": experts, "bytes_per_token": dense + experts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--r", type=float, nargs="*", default=[0.75, 0.5])
    parser.add_argument("--name", type=result_name, required=True)
    args = parser.parse_args()
    ours = jmoe_bytes(args.model, args.r)
    gguf = gguf_module(find_llama_cpp()) if args.gguf else None
    theirs = {name: gguf_bytes(gguf, Path(p), ours["top_k"]) for name, p in (g.split("=", 1) for g in args.gguf)}
    ratios = {f"{g} / jmoe {row}": t["bytes_per_token"] / n
              for g, t in theirs.items() for row, n in ours["bytes_per_token"].items()}
    for row, n in ours["bytes_per_token"].items():
        print(f"jmoe {row:28s} {n / MIB:8.1f} MiB a token")
    for g, t in theirs.items():
        print(f"llama.cpp {g:23s} {t['bytes_per_token'] / MIB:8.1f} MiB a token "
              f"(experts {t['expert_bytes_read'] / MIB:.1f})")
    write_result("real_shapes", args.name, {"model": args.model.name, "jmoe": ours, "llama_cpp": theirs,
                                             "bytes_ratio_llama_cpp_over_jmoe": ratios})


if __name__ == "__main__":
    main()
