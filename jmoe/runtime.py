"""A loaded jmoe model: config, tokenizer, dense weights on the device, experts, compiled steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.budget import format_size, parse_size, tree_nbytes
from jmoe.config import ModelConfig
from jmoe.engine import PREFILL_CHUNK, Engine, cache_nbytes
from jmoe.errors import BudgetError, FormatError, InputError
from jmoe.format import check_files, read_manifest
from jmoe.model import abstract_model
from jmoe.pools import ResidentExperts
from jmoe.store import ExpertStore
from jmoe.tokenizer import load_tokenizer

DEFAULT_MAX_SEQ_LEN = 4096
POLICIES = ("resident",)


@dataclass
class JmoeModel:
    """What jmoe.load returns and jmoe.generate / jmoe.forward take."""

    path: Path
    config: ModelConfig
    manifest: dict[str, Any]
    tokenizer: Any
    graphdef: Any
    dense: Any
    store: ExpertStore
    experts: Any
    engine: Engine
    compute_dtype: Any
    max_seq_len: int
    device_budget: int | None
    memory: dict[str, int]

    def check_batch_fits(self, batch: int, cache_len: int) -> None:
        """Under a budget, the KV cache of a request must fit what load() reserved for it."""
        if self.device_budget is None:
            return
        need = cache_nbytes(self.config, batch, cache_len, self.compute_dtype)
        if need > self.memory["kv_cache"]:
            raise BudgetError(
                f"a batch of {batch} with a {cache_len}-token cache needs {format_size(need)} of KV cache; "
                f"load() reserved {format_size(self.memory['kv_cache'])} (raise max_batch or max_seq_len at load)"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def __repr__(self) -> str:
        return (
            f"JmoeModel({self.config.family}, {self.config.num_layers} layers, {self.config.num_experts} experts, "
            f"compute {jnp.dtype(self.compute_dtype).name}, experts {self.experts.tier})"
        )


def default_compute_dtype():
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def workspace_nbytes(cfg: ModelConfig, tokens: int, cache_len: int, dtype) -> int:
    """Rough peak activation memory of one step over `tokens` tokens (attention scores dominate)."""
    item = jnp.dtype(dtype).itemsize
    scores = 2 * cfg.num_heads * tokens * cache_len * 4
    acts = tokens * (6 * cfg.hidden_size + 3 * cfg.top_k * cfg.moe_intermediate_size) * max(item, 4)
    logits = cfg.vocab_size * 4 * 2
    return scores + acts + logits


def load(
    path: str | Path,
    *,
    device_budget: int | str | None = None,
    policy: str | None = None,
    tier: str | None = None,
    compute_dtype: Any = None,
    max_seq_len: int | None = None,
    max_batch: int = 1,
    verify: bool = False,
) -> JmoeModel:
    """Load a converted model onto the default device.

    Args:
      path: directory written by `jmoe convert`.
      device_budget: hard cap on device memory ("12GiB", bytes); None = no cap.
      policy: expert residency policy; "resident" (default) keeps every expert on the device.
      tier: expert precision to run ("bf16", ...); default the most precise tier converted.
      compute_dtype: activation dtype; default bfloat16 on GPU, float32 on CPU.
      max_seq_len: longest context (prompt + output) to plan memory for; default min(model max, 4096).
      max_batch: prompts per generate call to reserve KV cache for (checked only under a budget).
      verify: also check every file's sha256 (reads the whole model once).
    """
    root = Path(path)
    manifest = read_manifest(root)
    check_files(root, manifest, verify_checksums=verify)
    cfg = ModelConfig.from_dict(manifest["config"])
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else jnp.dtype(default_compute_dtype())
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise InputError(f"compute_dtype must be float32, bfloat16 or float16, not {dtype}")
    max_seq_len = int(max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN))
    policy = policy or "resident"
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    store = ExpertStore(root, manifest, cfg)
    tier = tier or store.tiers[0]
    store.record_nbytes(tier)  # clear error for a tier the model was not converted with

    graphdef, abstract_state = nnx.split(abstract_model(cfg, dtype))
    memory = {
        "dense": tree_nbytes(abstract_state),
        "experts": store.record_nbytes(tier) * cfg.num_moe_layers * cfg.num_experts,
        "kv_cache": cache_nbytes(cfg, max_batch, max_seq_len, dtype),
        "workspace": max_batch * workspace_nbytes(cfg, min(max_seq_len, PREFILL_CHUNK), max_seq_len, dtype),
    }
    budget = parse_size(device_budget) if device_budget is not None else None
    if budget is not None and sum(memory.values()) > budget:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in memory.items())
        raise BudgetError(
            f"device budget {format_size(budget)} is too small for policy {policy!r} at tier {tier}: "
            f"needs at least {format_size(sum(memory.values()))} ({parts}); "
            f"raise the budget or lower max_seq_len / max_batch"
        )

    device = jax.devices()[0]
    dense = restore_dense(root / manifest["dense"]["dir"], abstract_state, device)
    experts = ResidentExperts(store, tier, device)
    tokenizer = load_tokenizer(root / manifest["tokenizer"]) if manifest.get("tokenizer") else None
    return JmoeModel(
        path=root,
        config=cfg,
        manifest=manifest,
        tokenizer=tokenizer,
        graphdef=graphdef,
        dense=dense,
        store=store,
        experts=experts,
        engine=Engine(graphdef),
        compute_dtype=dtype,
        max_seq_len=max_seq_len,
        device_budget=budget,
        memory=memory,
    )


def restore_dense(path: Path, abstract_state, device):
    import orbax.checkpoint as ocp

    sharding = jax.sharding.SingleDeviceSharding(device)
    target = nnx.to_pure_dict(abstract_state)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), target)
    try:
        restored = ocp.StandardCheckpointer().restore(path.absolute(), target)
    except Exception as e:  # orbax raises several types for missing or damaged checkpoints
        raise FormatError(f"dense weights at {path} cannot be restored: {e}") from None
    state = abstract_state
    nnx.replace_by_pure_dict(state, restored)
    return state
