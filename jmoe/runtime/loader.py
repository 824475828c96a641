"""A loaded jmoe model: config, tokenizer, dense weights on the device, experts, compiled steps."""

from __future__ import annotations

import functools
import gc
import logging
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cpu_kernels

from jmoe import validate
from jmoe.config import ModelConfig
from jmoe.decoding.engine import KV_PAGE, PREFILL_CHUNK, Engine, cache_nbytes, prefill_chunk
from jmoe.decoding.prefixes import PREFIX_BLOCK, PrefixCache
from jmoe.decoding.loaded import LoadedModel
from jmoe.decoding.speculative import DEFAULT_K_MAX
from jmoe.distributed.mesh import Placement
from jmoe.errors import BudgetError, FormatError, InputError
from jmoe.layers.attention import attention_scores_nbytes, key_block
from jmoe.layers.linear import Embed, Linear, use_tiled_kernels
from jmoe.layers.mla import absorb_up_projections
from jmoe.layers.modules import attention_head_widths, cache_spec
from jmoe.layers.transformer import abstract_model
from jmoe.manifest import check_files, dense_format, head_format, inside, read_manifest, tiled_kernels
from jmoe.policies import BASELINES, POLICY_NAMES, ExpertCounters, Plan, Policy, StepView, make_policy
from jmoe.runtime import compile_cache, threads
from jmoe.runtime.budget import BudgetTracker, format_size, parse_size, tree_nbytes
from jmoe.runtime.collector import collector_paused
from jmoe.runtime.execution import PATHS, Executor
from jmoe.runtime.host_memory import available_memory, device_is_host, heap_trimmed_while_loading, release_free_heap
from jmoe.runtime.fetching import fetch_slots
from jmoe.runtime.pools import plan_pools, slot_nbytes, staging_nbytes
from jmoe.runtime.residency import AllResident, Offloaded
from jmoe.runtime.store import ExpertStore
from jmoe.runtime.trace import Trace
from jmoe.tiers import TIER_NAMES
from jmoe.tokenizer import load_tokenizer
from jmoe.kernels import BACKENDS
from jmoe.kernels.attention import native_tokens

DEFAULT_MAX_SEQ_LEN = 4096
log = logging.getLogger("jmoe.runtime")


@dataclass
class JmoeModel(LoadedModel):
    """What jmoe.load returns and jmoe.generate / jmoe.forward take."""

    path: Path
    config: ModelConfig
    manifest: dict[str, Any]
    tokenizer: Any
    graphdef: Any
    dense: Any
    store: ExpertStore
    residency: Any  # AllResident or Offloaded (jmoe/runtime/residency.py)
    executor: Executor
    compute_dtype: Any
    kv_dtype: Any  # the KV cache's: compute_dtype, bfloat16, or int8 (jmoe/layers/attention.py: QuantizedRows)
    max_seq_len: int
    device_budget: int | None
    memory: dict[str, int]
    policy: Policy
    # Where the arrays live: one device, or a mesh whose ep axis partitions the experts
    placement: Placement = field(default_factory=Placement, repr=False, compare=False)
    # Speculative drafts by tier (AllResident, sharing the dense weights and the KV cache)
    drafts: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Speculative decoding's governors (jmoe/decoding/speculative.py) by draft, draft length and rows:
    # what one request measured (draft and step times, acceptance) steers the next one's first cycles
    governors: dict = field(default_factory=dict, repr=False, compare=False)
    # Kept prompt blocks that later prompts starting alike reuse (jmoe/decoding/prefixes.py), or None
    prefixes: PrefixCache | None = field(default=None, repr=False, compare=False)
    # The cache lengths generate() has run with, by rows: a later, shorter request reuses one
    # (jmoe.decoding.generation.CACHE_REUSE_FACTOR)
    cache_lengths: dict[int, set[int]] = field(default_factory=dict, repr=False, compare=False)
    # Whether memory["kv_cache"] bounds a serving engine's KV pool (load's kv_cache, or a budget)
    kv_bounded: bool = field(default=False, repr=False, compare=False)
    # Serialises steps: threads sharing the model interleave step by step, never inside one
    # (the cache, pools and handle table change only under it).
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def step(self, tokens, cache, start, key_start, *, last_only: bool, phase: str, residency=None,
             defer: bool = False):
        """One forward step over tokens [B, T], row b written from cache slot start[b]: (logits, cache).

        `residency` runs the step over other experts (a draft sharing the dense weights and cache).
        With `defer`, returns (logits, cache, pending): pass a non-None pending to settle() before
        the next step of the same cache."""
        with self.lock:
            logits, cache, pending = self.executor.step(tokens, cache, start, key_start, last_only=last_only,
                                                        phase=phase, residency=residency, defer=defer)
        return (logits, cache, pending) if defer else (logits, cache)

    def settle(self, pending, cache):
        """Finish a deferred step: (None, cache) if its logits stand, else (corrected logits, cache)."""
        with self.lock:
            return self.executor.settle(pending, cache)

    def decode_sampled(self, tokens, cache, start, key_start, sampler):
        """One decode step that draws its next tokens itself: (next tokens [B] on the device, cache,
        a SampledStep to pass to settle_sampled)."""
        with self.lock:
            return self.executor.decode_sampled(tokens, cache, start, key_start, sampler)

    def settle_sampled(self, step, cache, sampler):
        """(tokens [B] numpy, whether they were drawn again, cache) of a decode_sampled step."""
        with self.lock:
            return self.executor.settle_sampled(step, cache, sampler)

    def speculate(self, last, cache, start, key_start, sampler, k: int, draft):
        """Dispatch a speculative cycle (Executor.speculate): (cache, cycle)."""
        with self.lock:
            return self.executor.speculate(last, cache, start, key_start, sampler, k, draft)

    def settle_cycle(self, cycle, cache, sampler):
        """Read a speculative cycle back (Executor.settle_cycle)."""
        with self.lock:
            return self.executor.settle_cycle(cycle, cache, sampler)

    def discard(self, step) -> None:
        """Take back a dispatched step nobody will settle (its successor of a step run again)."""
        if step is None:
            return
        with self.lock:
            if hasattr(step, "next_tokens"):
                self.executor.discard(step)
            else:
                step.res.end_step()

    def put(self, array: np.ndarray, phase: str | None = None) -> jax.Array:
        """A host array on the model's device (one transfer, counted in `phase`, default the current step's)."""
        with self.lock:
            self.stats.count_io(transfers=1, nbytes=array.nbytes, phase=phase)
        return jax.device_put(array, self.placement.replicated)

    def count(self, **io) -> None:
        """Count host interaction a caller had with this model's steps (Stats.count_io)."""
        with self.lock:
            self.stats.count_io(**io)

    def read_tokens(self, tokens, phase: str | None = None) -> np.ndarray:
        """Tokens on the device, read back (one blocking read, counted in `phase`, default the current step's)."""
        with self.lock:
            self.stats.count_io(reads=1, phase=phase)
        return np.asarray(tokens)

    def draft(self, tier: str):
        """The model's own copy at `tier` with every expert resident, for speculative decoding.

        Under a budget it must have been reserved at load (jmoe.load(..., draft=tier)); without
        one it is made on first use."""
        with self.lock:
            if tier in self.drafts:
                return self.drafts[tier]
            validate.choice("speculative draft", tier, TIER_NAMES)
            check_draft(self.manifest, tier)
            if self.device_budget is not None:
                raise InputError(f"speculative draft {tier!r} needs its experts reserved within the device budget: "
                                 f"load the model with draft={tier!r}")
            self.drafts[tier] = make_draft(self.store, tier, self.residency, placement=self.placement)
            return self.drafts[tier]

    @property
    def engine(self) -> Engine:
        return self.executor.engine

    @property
    def stats(self):
        return self.residency.stats

    @property
    def trace(self):
        """What each step did (jmoe.load(..., trace=True)), else None."""
        return self.residency.trace

    def kv_pages(self, rows: int, context: int) -> int:
        """Pages of KV_PAGE slots for a serving engine of `rows` rows of `context` slots: what load()
        reserved for the KV cache where that bounds it (kv_cache given, or a device budget), else
        rows whole contexts."""
        if not self.kv_bounded:
            return rows * -(-context // KV_PAGE)
        return self.memory["kv_cache"] // cache_nbytes(self.config, 1, KV_PAGE, self.kv_dtype)

    def check_batch_fits(self, batch: int, cache_len: int) -> None:
        """Under a budget, the KV cache of a request must fit what load() reserved for it."""
        if self.device_budget is None:
            return
        need = cache_nbytes(self.config, batch, cache_len, self.kv_dtype)
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
            f"compute {jnp.dtype(self.compute_dtype).name}, experts {self.residency.tier}, policy {self.policy.name})"
        )


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
CPU_DOTS = ("float", "int8")


def resolve_compute_dtype(compute_dtype) -> jnp.dtype:
    """The given activation dtype, or the default: bfloat16 on GPU, float32 elsewhere."""
    if compute_dtype is None:
        compute_dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        dtype = jnp.dtype(compute_dtype)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.name not in COMPUTE_DTYPES:
        raise InputError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    return dtype


KV_DTYPES = ("int8", "bfloat16", "float8_e4m3fn")
KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}


NO_PREFIX_CACHE = (None, 0, "0", "none")


def resolve_prefix_cache(prefix_cache, cfg: ModelConfig, max_seq_len: int, kv_dtype) -> int:
    """Bytes of kept prompt blocks: 0 (None, 0, "none"), a size, or "auto" (max_seq_len tokens of KV
    cache: one full-context prompt), rounded down to whole blocks."""
    block = cache_nbytes(cfg, 1, PREFIX_BLOCK, kv_dtype)
    if prefix_cache in NO_PREFIX_CACHE:
        return 0
    if prefix_cache == "auto":
        return cache_nbytes(cfg, 1, max_seq_len, kv_dtype) // block * block
    return parse_size(prefix_cache, "prefix_cache") // block * block


def resolve_kv_cache(kv_cache, cfg: ModelConfig, max_seq_len: int, kv_dtype) -> int | None:
    """Bytes of the KV cache: None for the default (max_batch rows of max_seq_len tokens), else a
    size rounded down to whole pages, at least one max_seq_len row's pages."""
    if kv_cache in (None, "auto"):
        return None
    page = cache_nbytes(cfg, 1, KV_PAGE, kv_dtype)
    nbytes = parse_size(kv_cache, "kv_cache") // page * page
    row = -(-max_seq_len // KV_PAGE) * page
    if nbytes < row:
        raise InputError(f"kv_cache {kv_cache!r} holds fewer than one {max_seq_len}-token context "
                         f"({format_size(row)}); give at least that, or lower max_seq_len")
    return nbytes


def resolve_kv_dtype(kv_dtype, compute_dtype) -> jnp.dtype:
    """The KV cache's dtype: the compute dtype (None), int8 (values rounded per slot and head),
    bfloat16 (half a float32 cache's bytes under a float32 compute dtype) or float8_e4m3fn ("fp8":
    a byte per number, no scale, as GPUs with fp8 convert it natively)."""
    if kv_dtype is None:
        return compute_dtype
    kv_dtype = KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    validate.choice("kv_dtype", kv_dtype, KV_DTYPES)
    return jnp.dtype(kv_dtype)


def resolve_max_seq_len(cfg: ModelConfig, max_seq_len: int | None) -> int:
    if max_seq_len is None:
        return min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    max_seq_len = validate.integer("max_seq_len", max_seq_len, minimum=2)
    if max_seq_len > cfg.max_position_embeddings:
        log.warning("max_seq_len %d is beyond the %d positions the model was trained for", max_seq_len,
                    cfg.max_position_embeddings)
    return max_seq_len


def resolve_tier(manifest: dict[str, Any], tier: str | None) -> str:
    """The tier to run: the one asked for (it must have been converted), else the most precise one."""
    if tier is None:
        return next(iter(manifest["tiers"]))
    validate.choice("tier", tier, TIER_NAMES)
    if tier not in manifest["tiers"]:
        raise FormatError(f"this model was converted without tier {tier!r} (it has {', '.join(manifest['tiers'])})")
    return tier


def all_expert_bytes(cfg: ModelConfig, record_nbytes: int) -> int:
    return record_nbytes * cfg.num_moe_layers * cfg.num_experts


def native_attention(cfg: ModelConfig, tokens: int, kv_dtype) -> bool:
    """Whether a step's attention of `tokens` current tokens a row runs in the native CPU kernel
    here (jmoe/kernels/attention.py), which streams the cached keys and holds no block of scores."""
    query_terms, _ = attention_head_widths(cfg)
    cache_heads = cache_spec(cfg, 0)[0][0]
    return (len(query_terms) == 1 and cpu_kernels.available()
            and jnp.dtype(kv_dtype) in cpu_kernels.ops.ATTENTION_CACHE_DTYPES
            and tokens <= native_tokens(cfg.num_heads // cache_heads, query_terms[0]))


def workspace_nbytes(cfg: ModelConfig, rows: int, tokens: int, cache_len: int, dtype, kv_dtype=None) -> int:
    """Peak activation memory of one step over `tokens` tokens in each of `rows` rows: per row one
    block of attention scores and the block of values they weigh (never the whole context:
    jmoe/layers/attention.py; none where the native CPU kernel runs the attention), the
    activations of the larger of a layer's two halves beside its residual stream, and the logits.

    As compiled (a prefill chunk's temporaries, tests/test_host_memory.py): the attention holds its
    queries and about three float32 copies of its output at once (summed, normalised, moved back to
    token-major), the FFN each routed and shared expert's gate, up and activation rows, and no layer
    holds another's (jmoe/layers/attention.py starts each loop from its own first block)."""
    item = jnp.dtype(dtype).itemsize
    query_terms, output_width = attention_head_widths(cfg)
    scores = attention_scores_nbytes(cfg.num_heads, tokens, cache_len, len(query_terms))
    cache_heads = cache_spec(cfg, 0)[0][0]  # the values' block is gathered (the keys' fuses into the scores)
    value_block = key_block(cfg.num_heads, tokens, cache_len) * cache_heads * output_width * 4
    if native_attention(cfg, tokens, dtype if kv_dtype is None else kv_dtype):
        scores = value_block = 0
    attention = cfg.num_heads * (sum(query_terms) + 3 * output_width)
    routed = 3 * (cfg.top_k * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
    ffn = max(routed, 3 * cfg.dense_intermediate_size)
    acts = tokens * (2 * cfg.hidden_size + max(attention, ffn)) * max(item, 4)
    logits = cfg.vocab_size * 4 * 2
    return rows * (scores + value_block + acts + logits)


def fixed_memory(cfg: ModelConfig, abstract_state, dtype, max_seq_len: int, max_batch: int,
                 kv_dtype=None, kv_bytes: int | None = None) -> dict[str, int]:
    """Device bytes reserved before any expert: dense weights, KV cache (of kv_dtype, default the
    compute dtype: kv_bytes, else max_batch rows of max_seq_len tokens in whole pages), workspace
    (the larger of a batch's prefill step, at most PREFILL_CHUNK prompt tokens in all, and one row's
    prompt chunk, as the server prefills)."""
    batch = workspace_nbytes(cfg, max_batch, min(max_seq_len, prefill_chunk(max_batch)), max_seq_len, dtype, kv_dtype)
    one_row = workspace_nbytes(cfg, 1, min(max_seq_len, PREFILL_CHUNK), max_seq_len, dtype, kv_dtype)
    row_slots = -(-max_seq_len // KV_PAGE) * KV_PAGE
    return {
        "dense": tree_nbytes(abstract_state),
        "kv_cache": kv_bytes if kv_bytes is not None else cache_nbytes(
            cfg, max_batch, row_slots, dtype if kv_dtype is None else kv_dtype),
        "workspace": max(batch, one_row),
    }


def make_draft(store: ExpertStore, tier: str, target, backend: str | None = None,
               placement: Placement | None = None) -> AllResident:
    """A speculative draft: every expert at `tier` resident (on a mesh, each shard its own); its
    steps go into the target's trace."""
    draft = AllResident(store, tier, placement or Placement(), backend=backend or target.backend,
                        int8_dot=target.int8_dot)
    draft.trace, draft.trace_source = target.trace, "draft"
    return draft


def reservations(store: ExpertStore, abstract_state, dtype, max_seq_len: int, max_batch: int, draft: str | None,
                 policy: Policy | None, shards: int = 1, kv_dtype=None, prefix_cache: int = 0,
                 kv_bytes: int | None = None) -> dict[str, int]:
    """Every byte load() reserves besides the experts' pools: dense weights, KV cache, workspace, the
    speculative draft's experts ("draft") and, when `policy` offloads, transfer staging ("staging").
    memory_plan reports exactly these, so a budget computed from it holds the pools it planned.
    On a mesh of `shards` ep shards these are per device (a device holds its shard's draft experts)."""
    cfg = store.config
    memory = fixed_memory(cfg, abstract_state, dtype, max_seq_len, max_batch, kv_dtype, kv_bytes)
    if prefix_cache:
        memory["prefix_cache"] = prefix_cache
    if draft is not None:
        memory["draft"] = all_expert_bytes(cfg, store.record_nbytes(draft)) // shards
    if policy is not None and not policy.everything_resident:
        memory["staging"] = staging_nbytes(store, policy.pools())
        slots = fetch_slots_for(cfg, policy, jax.devices()[0], max_batch, shards, draft=draft)
        if slots is not None:
            memory["fetch"] = slots.extra * sum(slot_nbytes(store, t) for t in policy.pools())
    return memory


def fixed_plan_of(cfg: ModelConfig, policy: Policy) -> Plan | None:
    """The plan of a policy whose plan never changes (Policy.fixed_plan), None for other policies."""
    if not policy.fixed_plan:
        return None
    return policy.plan(StepView(0, "decode", cfg.num_moe_layers, cfg.num_experts,
                                ExpertCounters(cfg.num_moe_layers, cfg.num_experts)))


def fetch_slots_for(cfg: ModelConfig, policy: Policy, device, max_batch: int, shards: int = 1,
                    miss_slots: int | None = None, draft: str | None = None, guarded: bool | None = None):
    """The fetch slots steps get (jmoe/runtime/fetching.py), None where they do not fetch (on a mesh
    every step runs with what is resident and replays). guarded: as fetching.fetch_slots."""
    if shards > 1:
        return None
    return fetch_slots(cfg, policy, device, max_batch, "decode" in policy.degrade_phases, miss_slots,
                       DEFAULT_K_MAX if draft is not None else 0, guarded)


MISS_MODES = ("exact", "degrade")


def apply_miss_mode(policy: Policy, misses: str | None) -> None:
    """misses="exact": every step runs each routed expert at its wanted tier (fetching it); "degrade":
    decode and verification run a missing expert at a lower resident tier, or skip it, and fetch it
    for later steps. None keeps the policy's own choice."""
    if misses == "exact":
        policy.degrade_phases = ()
    elif misses == "degrade":
        policy.degrade_phases = tuple(dict.fromkeys((*policy.degrade_phases, "decode", "verify")))


def memory_plan(path: str | Path, *, tier: str | None = None, compute_dtype: Any = None, max_seq_len: int | None = None,
                max_batch: int = 1, draft: str | None = None, policy: str | Policy | None = None,
                misses: str | None = None, mesh: str | dict | None = None, kv_dtype: str | None = None,
                prefix_cache: int | str | None = None, kv_cache: int | str | None = None) -> dict[str, int]:
    """What load() would reserve besides the expert pools, and the bytes of every expert at `tier`
    (key "all_experts"), without loading anything: for choosing a budget.

    Keys: "dense", "kv_cache" (as load's `kv_cache` sets it), "workspace", "prefix_cache" (with
    `prefix_cache`: kept prompt blocks), "draft" (with `draft`: the speculative draft's experts),
    "staging" (transfers in flight, reserved whenever load offloads: for `policy`, by default the
    offloading default "lru+prefetch"; absent with policy="resident"), "fetch" (the pool slots of
    experts a step fetches and does not keep) and "all_experts". A budget of
    the reservations plus a share of "all_experts" gives pools holding that share. On a CPU-only
    machine the device is the host: every number is host memory (RSS), and the expert files the
    host store reads from are served by the page cache, shared between processes and not counted.
    With `mesh` (as load's), the reservations are one device's ("all_experts" stays the model's).
    """
    root = validate.path("path", path)
    if policy is not None and not isinstance(policy, Policy):
        validate.choice("policy", policy, POLICY_NAMES)
    if misses is not None:
        validate.choice("misses", misses, MISS_MODES)
    manifest = read_manifest(root)
    cfg = ModelConfig.from_dict(manifest["config"])
    dtype = resolve_compute_dtype(compute_dtype)
    kv = resolve_kv_dtype(kv_dtype, dtype)
    tier = resolve_tier(manifest, policy.tier if isinstance(policy, Policy) else tier)
    max_batch = validate.integer("max_batch", max_batch, minimum=1)
    if draft is not None:
        validate.choice("draft", draft, TIER_NAMES)
        check_draft(manifest, draft)
    chosen = policy if isinstance(policy, Policy) else make_policy(policy or "lru+prefetch", tier)
    apply_miss_mode(chosen, misses)
    chosen.check()
    store = ExpertStore(root, manifest, cfg)
    graphdef, abstract_state = abstract_split(cfg, dtype, dense_format(manifest), head_format(manifest))
    threads.limit_threads_if_not_started()  # as load() does, before the device query starts the backend
    placement = Placement.for_mesh(mesh)
    if device_is_host(placement.device):  # as load() holds them there
        _, abstract_state = absorb_up_projections(graphdef, abstract_state, dtype)
    shards = placement.shards
    max_seq_len = resolve_max_seq_len(cfg, max_seq_len)
    plan = reservations(store, abstract_state, dtype, max_seq_len, max_batch, draft, chosen, shards, kv,
                        resolve_prefix_cache(prefix_cache, cfg, max_seq_len, kv),
                        resolve_kv_cache(kv_cache, cfg, max_seq_len, kv))
    plan["all_experts"] = all_expert_bytes(cfg, store.record_nbytes(tier))
    return plan


@collector_paused()  # a load allocates much and frees little (jmoe/runtime/collector.py)
@heap_trimmed_while_loading()  # nor do its threads' heaps keep what they freed (jmoe/runtime/host_memory.py)
def load(
    path: str | Path,
    *,
    device_budget: int | str | None = None,
    policy: str | Policy | None = None,
    tier: str | None = None,
    compute_dtype: Any = None,
    kv_dtype: str | None = None,
    max_seq_len: int | None = None,
    max_batch: int = 1,
    execution: str = "auto",
    kernel_backend: str | None = None,
    cpu_dot: str = "float",
    cpu_critical_tokens: int | None = None,
    verify: bool = False,
    progress: bool | None = None,
    trace: bool = False,
    draft: str | None = None,
    mesh: str | dict | None = None,
    misses: str | None = None,
    miss_slots: int | None = None,
    prefix_cache: int | str | None = None,
    kv_cache: int | str | None = None,
) -> JmoeModel:
    """Load a converted model onto the default device, or expert-parallel over a device mesh.

    Every option is checked (type and range) before anything is read; a bad one raises a
    JmoeError naming it.

    Args:
      path: directory written by `jmoe convert`.
      device_budget: hard cap on device memory ("12GiB", bytes); None = no cap.
      policy: expert residency policy: "resident" (every expert on the device), "ondemand", "lru",
        "lru+prefetch", "lru+cpu", "lru+prefetch+cpu", "dymoe", "dynaexq" (with their defaults; hi =
        `tier` when given), or a `jmoe.policies.Policy` such as DyMoE(hi="int4", lo="int2", r=0.75).
        Default: "resident" when every expert fits the budget, else "lru+prefetch".
      tier: expert precision to run ("bf16", "int8", ...); default the policy's tier, else the most
        precise tier converted.
      compute_dtype: activation dtype; default bfloat16 on GPU, float32 on CPU.
      kv_dtype: the KV cache's dtype: None (the compute dtype), "bfloat16" (half of a float32 cache)
        or "int8" (each cached head's values rounded to int8 with a float32 scale per token: a quarter
        of a float32 cache, about half of a bfloat16 one; attention reads the int8 directly).
      max_seq_len: longest context (prompt + output) to plan memory for; default min(model max, 4096).
      max_batch: prompts per generate call to reserve KV cache for (checked only under a budget);
        a serving engine's rows share the KV cache's pages (see kv_cache).
      execution: how an offloaded step runs: "auto" (decode and verification one executable per
        step that fetches what it lacks itself; prefill layer-wise), "layerwise" (the host between
        layers, fetching as it goes) or "resident" (decode as "auto", prefill in one jit replayed
        after fetching what it lacked). All three give the same tokens (exact mode).
      misses: what an offloaded decode step does with a routed expert that is not resident at its
        wanted tier: "exact" (fetch it inside the step and run it: the resident model's tokens) or
        "degrade" (run it at a lower resident tier, or skip it, and fetch it for later steps, as
        DyMoE and HOBBIT do). Default: the policy's (exact for the baselines, degrade for DyMoE and
        DynaExq).
      miss_slots: in exact mode, how many missing experts a decode step fetches per MoE layer (and
        tier); a step that lacks more is run again once the host has fetched what it lacked (counted
        as a replay). Default: every expert a step's tokens can route to on the CPU (unused ones cost
        nothing there); on an accelerator top_k per token, at most twice top_k (fetched by a chain
        of conditionals: an unused slot moves nothing and costs a predicate read per layer), and in
        degrade mode a quarter of top_k (fixed slots, each moving a record every step).
      kernel_backend: expert kernels: "pallas", "mosaic" (int4 decode on Pallas' Mosaic GPU backend, the
        rest as "pallas"), "interpret", "cpu" (native CPU kernels) or "xla"; default Pallas on GPU, the
        native kernels on CPU (XLA where they are not built).
      cpu_dot: how the CPU multiplies quantized weights (experts at int8/int4/int2, a quantized dense
        tier): "float" (the inputs as they are) or "int8" (the inputs rounded to int8 per weight group,
        as llama.cpp's Q8 dot does, and multiplied in integers where the CPU has AVX-512 VNNI, or AVX2
        for int4/int2 codes: faster for decode, logits within about 1e-2 of "float"). "int8" also
        rounds the inputs of bf16 experts to bf16, as llama.cpp's BF16 dot does, multiplied two
        products a lane where the CPU has AVX-512 BF16 (faster prefill), and those of bf16 dense
        projections alike (not the routers').
      cpu_critical_tokens: with a "+cpu" policy, override the measured critical token count.
      verify: also check every file's sha256 and the manifest's own (reads the whole model once).
      progress: show a progress bar while experts are loaded into host memory (None: on a terminal).
      trace: record per step the expert bytes read, transfers and host waits (model.trace), for
        bench/lib/gpu_model.py to replay with GPU parameters.
      draft: reserve a speculative draft at this tier ("int4", "int2"): every expert at it resident,
        taken from the budget before the pools are sized (jmoe.generate(..., speculative=draft)).
      mesh: expert parallelism, "ep=N" or "ep=N,tp=M" (or {"ep": N, "tp": M}): each of N expert
        shards owns a contiguous range of every layer's experts, with its own pools, residency and
        host-store part, on its M devices; dense weights are replicated. `device_budget` is then per
        device. Under jax.distributed the mesh spans every process's devices.
      prefix_cache: device bytes ("64MiB") for the prompt blocks generate and a serving engine keep
        so that later prompts starting with the same tokens (a system prompt, earlier chat turns)
        reuse them instead of prefilling them again; "auto": max_seq_len tokens' worth. Reserved
        within the budget. Default None: nothing kept.
      kv_cache: device bytes ("256MiB") of KV cache to reserve, at least one max_seq_len context: a
        serving engine's rows take pages of it as their tokens grow, so more rows than it holds
        whole contexts run at once (jmoe serve --kv-cache). Default "auto": max_batch whole contexts.
    """
    root = validate.path("path", path)
    compile_cache.enable()  # before the first compile, so a later process finds the steps compiled
    budget = parse_size(device_budget, "device_budget") if device_budget is not None else None
    if prefix_cache not in (*NO_PREFIX_CACHE, "auto"):
        parse_size(prefix_cache, "prefix_cache")
    if kv_cache not in (None, "auto"):
        parse_size(kv_cache, "kv_cache")
    if policy is not None and not isinstance(policy, Policy):
        validate.choice("policy", policy, POLICY_NAMES)
    max_batch = validate.integer("max_batch", max_batch, minimum=1)
    validate.choice("execution", execution, PATHS)
    if misses is not None:
        validate.choice("misses", misses, MISS_MODES)
    if miss_slots is not None:
        validate.integer("miss_slots", miss_slots, minimum=1, maximum=1 << 20)
    if kernel_backend is not None:
        validate.choice("kernel_backend", kernel_backend, BACKENDS)
    validate.choice("cpu_dot", cpu_dot, CPU_DOTS)
    if cpu_critical_tokens is not None:
        validate.integer("cpu_critical_tokens", cpu_critical_tokens, minimum=0)
    verify = validate.boolean("verify", verify)
    trace = validate.boolean("trace", trace)
    if draft is not None:
        validate.choice("draft", draft, TIER_NAMES)
    if progress is not None:
        validate.boolean("progress", progress)
    # before the first device use starts the CPU backend, which sizes its thread pool once
    # (JMOE_THREADS, else the cores this process may use: jmoe/runtime/threads.py)
    threads.limit_threads_if_not_started()
    placement = Placement.for_mesh(mesh)
    dtype = resolve_compute_dtype(compute_dtype)
    kv = resolve_kv_dtype(kv_dtype, dtype)
    if isinstance(policy, str) and policy not in BASELINES:  # a named dynamic-precision policy: hi = tier
        policy = make_policy(policy, tier)
    if isinstance(policy, Policy):
        policy.check()
        if tier is not None and tier != policy.tier:
            raise InputError(f"tier {tier!r} differs from the policy's tier {policy.tier!r}")
        tier = policy.tier

    manifest = read_manifest(root, verify=verify)
    check_files(root, manifest, verify_checksums=verify)
    cfg = ModelConfig.from_dict(manifest["config"])
    placement.check_experts(cfg.num_experts)
    max_seq_len = resolve_max_seq_len(cfg, max_seq_len)
    tier = resolve_tier(manifest, tier)
    store = ExpertStore(root, manifest, cfg)
    tokenizer = start_tokenizer(root, manifest)
    try:

        device = placement.device
        int8_dot = cpu_dot == "int8" and device_is_host(device)  # the step's own matmuls
        tiled = tiled_kernels(manifest)
        if not device_is_host(device) and (tiled or any(getattr(f, "tiled", False)
                                                        for f in (dense_format(manifest), head_format(manifest)))):
            log.warning("the dense weights were converted with --cpu-layout: on this device they are read through "
                        "the XLA reference's untiling (slower); convert without it for a GPU")
        graphdef, abstract_state = abstract_split(cfg, dtype, dense_format(manifest), head_format(manifest), int8_dot,
                                                  tiled)
        # on the CPU latent attention's up-projections are held as its products read them (jmoe/layers/mla.py)
        absorb = device_is_host(device)
        held = absorb_up_projections(graphdef, abstract_state, dtype)[1] if absorb else abstract_state
        prefix_bytes = resolve_prefix_cache(prefix_cache, cfg, max_seq_len, kv)
        kv_bytes = resolve_kv_cache(kv_cache, cfg, max_seq_len, kv)
        memory = reservations(store, held, dtype, max_seq_len, max_batch,
                              None if draft is None else check_draft(manifest, draft), None, placement.shards, kv,
                              prefix_bytes, kv_bytes)
        all_experts = all_expert_bytes(cfg, store.record_nbytes(tier)) // placement.shards  # per device
        fixed = sum(memory.values())
        if policy is None:
            policy = "resident" if budget is None or fixed + all_experts <= budget else "lru+prefetch"
        chosen = policy if isinstance(policy, Policy) else make_policy(policy, tier)
        apply_miss_mode(chosen, misses)
        chosen.check()
        chosen.shards = placement.shards
        if placement.mesh is not None and chosen.cpu_execution:
            raise InputError(f"policy {chosen.name!r} runs cold experts on the host CPU, which a mesh does not do "
                             "yet: pick a policy without '+cpu'")
        for pool_tier in chosen.pools():
            store.record_nbytes(pool_tier)
        if budget is not None and fixed > budget:
            parts = ", ".join(f"{k} {format_size(v)}" for k, v in memory.items())
            raise BudgetError(
                f"device budget {format_size(budget)} cannot hold the dense weights, KV cache and workspace: needs "
                f"{format_size(fixed)} before any expert ({parts}); raise the budget or lower max_seq_len / max_batch"
            )
        fixed_plan = fixed_plan_of(cfg, chosen)
        whole_tiers = None  # with a fixed plan: the bytes of every expert at every tier it runs
        if fixed_plan is not None:
            whole_tiers = sum(all_expert_bytes(cfg, store.record_nbytes(t))
                              for t in fixed_plan.tiers()) // placement.shards
            if budget is not None and fixed + whole_tiers > budget:
                whole_tiers = None  # they do not all fit: offload
        warn_if_host_too_small(device, budget if budget is not None else
                               fixed + (all_experts if chosen.everything_resident else whole_tiers or 0))
        tracker = BudgetTracker(budget)
        for purpose, nbytes in memory.items():
            tracker.reserve(purpose, nbytes)
        dense = restore_dense(root / manifest["dense"]["dir"], abstract_state, placement.replicated)
        if absorb:
            graphdef, dense = absorb_up_projections(graphdef, dense, dtype)
        if chosen.everything_resident:
            if budget is not None and fixed + all_experts > budget:
                raise BudgetError(
                    f"device budget {format_size(budget)} is too small for policy 'resident' at tier {tier}: needs at least "
                    f"{format_size(fixed + all_experts)} (experts {format_size(all_experts)} + {format_size(fixed)} fixed); "
                    f"raise the budget, lower max_seq_len / max_batch, or pick an offloading policy such as 'lru+prefetch'"
                )
            tracker.reserve("experts", all_experts)
            residency = AllResident(store, tier, placement, backend=kernel_backend, int8_dot=int8_dot)
        elif whole_tiers is not None:  # a fixed plan over tiers that all fit: nothing to offload
            tracker.reserve("experts", whole_tiers)
            residency = AllResident(store, tier, placement, backend=kernel_backend, int8_dot=int8_dot,
                                    plan=fixed_plan)
        else:
            slots = fetch_slots_for(cfg, chosen, device, max_batch, placement.shards, miss_slots, draft)
            plan = plan_pools(store, chosen, fixed, budget, shards=placement.shards,  # staging as reservations() counts it
                              extra=0 if slots is None else slots.extra)
            on_gpu = fetch_slots_for(cfg, chosen, device, max_batch, placement.shards, miss_slots, draft, guarded=False)
            residency = Offloaded(cfg, store, chosen, tracker, plan, placement, dtype, backend=kernel_backend,
                                  cpu_critical_tokens=cpu_critical_tokens, progress=progress, cpu_dot=cpu_dot,
                                  fetch=slots, fetch_on_accelerator=on_gpu)
        if trace:
            residency.trace = Trace()
            if residency.offloading:
                residency.cache.trace = residency.trace
        drafts = {draft: make_draft(store, draft, residency, kernel_backend, placement)} if draft is not None else {}
        memory = dict(tracker.reserved)
    except BaseException:
        wait([tokenizer])  # no thread of a failed load outlives it
        raise
    tokenizer = tokenizer.result()  # its errors are load's
    return JmoeModel(
        path=root,
        config=cfg,
        manifest=manifest,
        tokenizer=tokenizer,
        graphdef=graphdef,
        dense=dense,
        store=store,
        residency=residency,
        executor=Executor(Engine(graphdef), graphdef, dense, residency, execution),
        compute_dtype=dtype,
        kv_dtype=kv,
        max_seq_len=max_seq_len,
        device_budget=budget,
        memory=memory,
        policy=chosen,
        placement=placement,
        drafts=drafts,
        prefixes=PrefixCache(prefix_bytes, cache_nbytes(cfg, 1, PREFIX_BLOCK, kv)) if prefix_bytes else None,
        kv_bounded=kv_bytes is not None or budget is not None,
    )


def use_int8_dot(model, on: bool):
    """Mark every dense projection (and the tied LM head) to multiply through the int8 dot (static
    attributes, so each setting compiles its own step)."""
    if on:
        for _, module in nnx.iter_graph(model):
            if isinstance(module, (Linear, Embed)):
                module.int8_dot = True
    return model


def abstract_split(cfg: ModelConfig, dtype, quant, head_quant, int8_dot: bool = False, tiled: bool = False):
    """(graphdef, state of shapes) of the model: built once per structure, as building it traces every
    parameter's initialiser (0.2-0.3 s at the tiny model, paid by each load); the state is a new
    tree each call, since restoring the weights fills it in place."""
    graphdef, state = _abstract_split(cfg, dtype, quant, head_quant, int8_dot, tiled)
    return graphdef, jax.tree.map(lambda leaf: leaf, state)


@functools.lru_cache(maxsize=8)
def _abstract_split(cfg: ModelConfig, dtype, quant, head_quant, int8_dot: bool, tiled: bool):
    model = use_int8_dot(abstract_model(cfg, dtype, quant, head_quant), int8_dot)
    return nnx.split(use_tiled_kernels(model, tiled))


def start_tokenizer(root: Path, manifest: dict[str, Any]) -> Future:
    """The model's tokenizer, loaded in a thread: importing transformers takes seconds, which reading
    the weights overlaps."""
    future: Future = Future()

    def run():
        try:
            tokenizer = None
            if manifest["tokenizer"] is not None:
                tokenizer_dir = inside(root, manifest["tokenizer"])
                for file in sorted(tokenizer_dir.iterdir()) if tokenizer_dir.is_dir() else []:
                    inside(root, f"{manifest['tokenizer']}/{file.name}")
                tokenizer = load_tokenizer(tokenizer_dir)
            future.set_result(tokenizer)
        except BaseException as e:  # handed to load(), which raises it
            future.set_exception(e)

    threading.Thread(target=run, name="jmoe-tokenizer", daemon=True).start()
    return future


def warn_if_host_too_small(device, nbytes: int) -> None:
    """On a CPU-only machine the device budget is host memory: say so when it exceeds what is available."""
    if not device_is_host(device):
        return
    available = available_memory()
    if available is not None and nbytes > available:
        log.warning("this model needs %s of host memory (the CPU is the device) but %s is available; give a "
                    "device_budget below that so experts are offloaded", format_size(nbytes), format_size(available))


def check_draft(manifest: dict[str, Any], draft: str) -> str:
    if draft not in manifest["tiers"]:
        raise InputError(f"draft {draft!r} was not converted (this model has {', '.join(manifest['tiers'])})")
    return draft


def restore_dense(path: Path, abstract_state, sharding):
    """The dense weights, each array placed by `sharding` (one device's, or replicated over a mesh)."""
    import orbax.checkpoint as ocp

    target = nnx.to_pure_dict(abstract_state)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), target)
    try:
        restored = ocp.StandardCheckpointer().restore(path.absolute(), target)
    except Exception as e:  # orbax raises several types for missing or damaged checkpoints
        raise FormatError(f"dense weights at {path} cannot be restored: {e}") from None
    # Orbax's arrays are still being copied from its numpy buffers (unaligned, so XLA:CPU copies them
    # on its own threads), and those buffers sit in reference cycles that only a collector pass frees,
    # which load holds off: wait for the copies and free the buffers now, not while the experts are read.
    # Everything load allocated is in the youngest generation, so collecting it alone takes ~15 ms.
    jax.block_until_ready(restored)
    gc.collect(0)
    release_free_heap()
    state = abstract_state
    nnx.replace_by_pure_dict(state, restored)
    return state
