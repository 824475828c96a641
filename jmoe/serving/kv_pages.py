"""The serving engine's KV cache: one pool of pages that every row, and every prompt being
prefilled, draws from (jmoe/layers/attention.py describes the paged layout).

A row holds the pages its slots have reached, no more: a prompt takes the pages of its real tokens
(left padding takes none) when it is admitted, and a row takes its next page when its position
reaches it. So the bytes load() reserves for the KV cache ("kv_cache") bound the tokens held by all
rows together, not max_batch full contexts. Pages are handed out lowest first and every decision
is a function of the engine's own state, so the processes of a job (jmoe/serving/mirror.py) hold
the same pages for the same rows.

The pool's arrays are donated to every step that runs over them (a prefill chunk of one prompt, a
decode step of the batch) and come back as its output: `layers` is always the newest.
"""

from __future__ import annotations

import jax
import numpy as np

from jmoe.decoding.engine import KV_PAGE, new_pool
from jmoe.layers.attention import KVCache

NO_PAGE = -1


class PagePool:
    """`pages` pages of `page` slots for rows of up to `context` slots (row_pages pages each)."""

    def __init__(self, model, pages: int, context: int, page: int = KV_PAGE):
        self.page, self.pages = page, pages
        self.row_pages = -(-context // page)
        empty = new_pool(model.config, pages, page, 1, self.row_pages, model.kv_dtype)
        self.layers = jax.device_put(empty.layers, model.placement.replicated)
        self._placement = model.placement.replicated
        self._free = list(range(pages - 1, -1, -1))  # a stack: the lowest free page is taken first

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, first: int, end: int) -> range:
        """The page indices (within a row) holding slots [first, end)."""
        return range(first // self.page, -(-end // self.page)) if end > first else range(0)

    def take(self, table_row: np.ndarray, first: int, end: int) -> bool:
        """Give table_row the pages it lacks for slots [first, end): False (nothing taken) if the
        pool has too few free."""
        missing = [j for j in self.pages_for(first, end) if table_row[j] == NO_PAGE]
        if len(missing) > len(self._free):
            return False
        for j in missing:
            table_row[j] = self._free.pop()
        return True

    def release(self, table_row: np.ndarray) -> None:
        """Every page of table_row back to the pool; the row holds none after."""
        held = table_row[table_row != NO_PAGE]
        self._free.extend(held.tolist())
        self._free.sort(reverse=True)
        table_row[:] = NO_PAGE

    def new_table(self, rows: int) -> np.ndarray:
        return np.full((rows, self.row_pages), NO_PAGE, np.int32)

    def view(self, table) -> KVCache:
        """The pool seen through a page table (a device array [B, row_pages]): a step's cache."""
        return KVCache(self.layers, table)

    def put_table(self, table: np.ndarray):
        """`table` on the device, from a copy: on the CPU a device array may share the host array's
        memory, and the engine edits its tables while steps that read them still run."""
        return jax.device_put(np.array(table, np.int32, copy=True), self._placement)

    def check(self, tables) -> None:
        """Every page is free or held by exactly one row of `tables`; raises AssertionError if not."""
        held = np.concatenate([np.asarray(t).reshape(-1) for t in tables] or [np.zeros(0, np.int32)])
        held = held[held != NO_PAGE]
        assert len(held) == len(set(held.tolist())), "a page is held by two rows"
        assert not set(held.tolist()) & set(self._free), "a held page is also free"
        assert len(held) + len(self._free) == self.pages, f"{self.pages - len(held) - len(self._free)} pages leaked"
