"""Shared prompt prefixes: the KV of prompt blocks already prefilled, reused by later prompts that
start with the same tokens (a system prompt, earlier chat turns).

A prompt's full blocks of PREFIX_BLOCK tokens are kept after its prefill, in a tree keyed by
token blocks: a block's node is found from its parent's node and its own tokens, so a node stands
for the whole prefix up to its block. A new prompt walks the tree from the root; the blocks it
finds are copied into its own cache row and only the rest of the prompt is prefilled. Keys and
values depend on a token's position, not on its cache slot (RoPE turns slot minus the row's first
slot into a position), so a block prefilled behind one amount of left padding serves a prompt
behind another. Blocks are immutable once kept and evicted least recently used, leaves first,
within the bytes load() reserved for them ("prefix_cache"; jmoe.load(..., prefix_cache=...)). The
serving engine (jmoe/serving/kv_rows.py) looks prompts up and keeps their blocks; jmoe.stats reports
the counts.

With a policy that picks experts' precision from the whole prefill chunk (DyMoE's importance), a
kept block holds what its first prompt's chunk decided; every other policy's prefill is exact, so
a reused block holds what the new prompt's own prefill would have computed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket, prefill_chunk
from jmoe.layers.attention import read_slots

PREFIX_BLOCK = 64  # tokens per kept block: the unit prompts share


@partial(jax.jit, static_argnums=2)
def take_block(cache, slot, size: int, row):
    """Slots [slot, slot + size) of row `row` of a cache, every layer's arrays [1, heads, size,
    width] (a new tree of arrays)."""
    table = jax.lax.dynamic_slice_in_dim(cache.table, row, 1, axis=0)
    return jax.tree.map(lambda a: read_slots(a, table, slot, size), cache.layers)


@partial(jax.jit, donate_argnums=0)
def put_block(cache, block, slot, row):
    """The cache with `block` (what take_block took) written into row `row` from `slot`."""
    start = jnp.reshape(slot, (1,)).astype(jnp.int32)
    table = jax.lax.dynamic_slice_in_dim(cache.table, row, 1, axis=0)
    return cache._replace(layers=jax.tree.map(lambda a, b: cpu_kernels.write_rows(a, b, start, table),
                                              cache.layers, block))


def first_slot_to_prefill(covered: int, prompt_len: int, chunk: int) -> int:
    """The slot prefilling starts from when every row's slots before `covered` hold its prompt (a
    kept prefix copied in, or padding): the rest is prefilled in the chunk shapes a prompt of its
    length gets (a bucket, or whole chunks), so a few covered slots may be computed again; 0 when
    those shapes would not fit."""
    rest = prompt_len - covered
    span = bucket(rest, MIN_PROMPT_BUCKET, chunk) if rest <= chunk else -(-rest // chunk) * chunk
    return 0 if covered <= 0 or span > prompt_len else prompt_len - span


def copy_in(decoder, store: PrefixCache, prompts: list[list[int]]) -> int:
    """Copy into each row of `decoder` the kept blocks its prompt starts with: the slot its prefill
    starts from (0: nothing kept, or too little to skip a chunk). Every row's slots before it hold
    that row's prompt, so the start is bounded by the row that found the least."""
    found = [store.lookup(p) for p in prompts]
    pads = [int(pad) for pad in decoder.key_start]
    covered = min(pad + len(blocks) * store.block for pad, blocks in zip(pads, found))
    chunk = min(decoder.prompt_len, prefill_chunk(len(prompts)))
    first = first_slot_to_prefill(covered if any(found) else 0, decoder.prompt_len, chunk)
    for row, (prompt, pad, blocks) in enumerate(zip(prompts, pads, found)):
        used = blocks[:max(0, -(-(first - pad) // store.block))]
        for j, block in enumerate(used):
            decoder.cache = put_block(decoder.cache, block, np.int32(pad + j * store.block), np.int32(row))
        store.count(len(prompt), len(used))
    return first


def keep_prompts(decoder, store: PrefixCache, prompts: list[list[int]]) -> None:
    """Keep the full blocks of each row's prompt (prefilled in `decoder`) for later prompts."""
    for row, prompt in enumerate(prompts):
        pad = int(decoder.key_start[row])
        store.keep(prompt, lambda j, pad=pad, row=row: take_block(decoder.cache, np.int32(pad + j * store.block),
                                                                  store.block, np.int32(row)))


def prefill(decoder, store: PrefixCache | None, prompts: list[list[int]]):
    """Decoder.prefill with the kept prefixes the prompts start with copied in (when there is a
    store), and their blocks kept after: logits of each row's last token [B, V]."""
    logits = decoder.prefill(copy_in(decoder, store, prompts) if store is not None else 0)
    if store is not None:
        keep_prompts(decoder, store, prompts)
    return logits


@dataclass(eq=False)  # nodes compare by identity
class _Node:
    key: tuple  # (parent node's id, the block's tokens)
    id: int
    block: object  # the block's KV: take_block's tree
    children: int = 0
    used: int = 0  # the store's clock when it was last found or kept


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts that looked for a kept prefix
    hits: int = 0  # of those, prompts that found at least one block
    reused_tokens: int = 0  # prompt tokens copied from kept blocks instead of prefilled
    prompt_tokens: int = 0  # prompt tokens of every lookup
    kept_blocks: int = 0
    evicted_blocks: int = 0

    def summary(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "prompt_tokens": self.prompt_tokens, "kept_blocks": self.kept_blocks,
                "evicted_blocks": self.evicted_blocks,
                "token_hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None}


@dataclass
class PrefixCache:
    """Kept prompt blocks within `capacity` bytes (each block `block_nbytes`)."""

    capacity: int
    block_nbytes: int
    block: int = PREFIX_BLOCK
    stats: PrefixStats = field(default_factory=PrefixStats)
    # told of each block dropped (a serving engine's store gives its page back)
    on_evict: Callable[[object], None] | None = None

    def __post_init__(self):
        self.lock = threading.RLock()  # engines on one model share its store (and its stats)
        self._nodes: dict[tuple, _Node] = {}
        self._by_id: dict[int, _Node] = {}
        self._clock = 0
        self._ids = 0

    @property
    def max_blocks(self) -> int:
        return self.capacity // self.block_nbytes

    @property
    def nbytes(self) -> int:
        return len(self._nodes) * self.block_nbytes

    def _key(self, prompt: list[int], j: int, parent: int) -> tuple:
        """Block j of the prompt, found under its parent block's node (id 0: the root)."""
        return parent, tuple(prompt[j * self.block:(j + 1) * self.block])

    def _blocks(self, prompt: list[int], limit: int):
        """The nodes of the prompt's first `limit` blocks, as far as they are kept."""
        parent = 0
        for j in range(limit):
            node = self._nodes.get(self._key(prompt, j, parent))
            if node is None:
                return
            yield node
            parent = node.id

    def lookup(self, prompt: list[int]) -> list:
        """The kept blocks the prompt starts with (their KV, first block first), leaving at least its
        last token to prefill (its logits give the first new token). count() says what was used."""
        with self.lock:
            found = list(self._blocks(prompt, (len(prompt) - 1) // self.block))
            self._touch(found)
            return [node.block for node in found]

    def count(self, prompt_tokens: int, reused_blocks: int) -> None:
        with self.lock:
            self.stats.lookups += 1
            self.stats.prompt_tokens += prompt_tokens
            self.stats.hits += reused_blocks > 0
            self.stats.reused_tokens += reused_blocks * self.block

    def keep(self, prompt: list[int], take) -> None:
        """Keep the prompt's full blocks that are not kept yet; take(j) gives block j's KV."""
        with self.lock:
            self._keep(prompt, take)

    def _keep(self, prompt: list[int], take) -> None:
        if self.max_blocks == 0:
            return
        parent, path = 0, []
        for j in range(len(prompt) // self.block):
            key = self._key(prompt, j, parent)
            node = self._nodes.get(key)
            if node is None:
                if len(self._nodes) >= self.max_blocks and not self._evict(protect=path):
                    break
                block = take(j)
                if block is None:  # no room for its copy
                    break
                self._ids += 1
                node = self._nodes[key] = self._by_id[self._ids] = _Node(key, self._ids, block)
                if parent:
                    self._by_id[parent].children += 1
                self.stats.kept_blocks += 1
            path.append(node)
            parent = node.id
        self._touch(path)

    def _touch(self, path: list[_Node]) -> None:
        """Mark a path used, its last block first: a block is then never older than a block after
        it, so the least recently used block is always a leaf."""
        for node in reversed(path):
            self._clock += 1
            node.used = self._clock

    def blocks(self) -> list:
        """Every kept block."""
        with self.lock:
            return [node.block for node in self._nodes.values()]

    def clear(self) -> None:
        """Drop every kept block."""
        with self.lock:
            while self._evict(protect=[]):
                pass

    def evictable(self, can_go: Callable[[object], bool]) -> int:
        """How many blocks evict(can_go) would drop, one after another, until none is left: those
        that can go with every block kept after them (a block goes only once it is a leaf)."""
        with self.lock:
            stuck = set()
            for node in self._nodes.values():
                if not can_go(node.block):
                    while node is not None and node.id not in stuck:  # it and every block before it
                        stuck.add(node.id)
                        node = self._by_id.get(node.key[0])
            return len(self._nodes) - len(stuck)

    def evict(self, can_go: Callable[[object], bool]) -> bool:
        """Drop the least recently used leaf whose block can go: False if there is none."""
        with self.lock:
            return self._evict(protect=[], can_go=can_go)

    def _evict(self, protect: list[_Node], can_go: Callable[[object], bool] | None = None) -> bool:
        """Drop the least recently used leaf outside `protect` (whose block can go): False if there is none."""
        leaves = [n for n in self._nodes.values() if n.children == 0 and n not in protect
                  and (can_go is None or can_go(n.block))]
        if not leaves:
            return False
        victim = min(leaves, key=lambda n: n.used)
        del self._nodes[victim.key], self._by_id[victim.id]
        if victim.key[0]:
            self._by_id[victim.key[0]].children -= 1
        self.stats.evicted_blocks += 1
        if self.on_evict is not None:
            self.on_evict(victim.block)
        return True
