"""The serving engine's KV cache: one pool of pages that every row, and every prompt being
prefilled, draws from (jmoe/layers/attention.py describes the paged layout).

A row holds the pages its slots have reached, no more: a prompt is counted the pages of its real
tokens (left padding takes none) when it is admitted and takes them when its prefill starts
(fewer where it shares kept ones), and a row takes its next page when its position reaches it. So
the bytes load() reserves for the KV cache ("kv_cache") bound the tokens held by all
rows together, not max_batch full contexts. Pages are handed out lowest first and every decision
is a function of the engine's own state, so the processes of a job (jmoe/serving/mirror.py) hold
the same pages for the same rows.

A page may have several holders: rows whose prompts start with the same kept blocks read the
same pages, and the engine's prefix store (jmoe/serving/kv_prefixes.py) holds the pages of the
blocks it keeps. A page is counted by its holders and goes back to the pool when the last one lets
go; a shared page is never written (a row writes only past its shared prefix). When the pool has
too few free pages, take() first asks the store to let go of pages only it holds.

The pool's arrays are donated to every step that runs over them (a prefill chunk of one prompt, a
decode step of the batch) and come back as its output: `layers` is always the newest.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import jax
import numpy as np

from jmoe.decoding.engine import KV_PAGE, new_pool
from jmoe.layers.attention import KVCache, read_slots

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
        self._holders = np.zeros(pages, np.int32)  # rows and the prefix store holding each page
        self.store = None  # the prefix store whose pages take() may reclaim (kv_prefixes.PagePrefixes)
        self.reserved = 0  # pages promised to admitted prompts whose prefill has not started

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Pages take() can hand out: the free ones and those only the prefix store holds, less
        those reserved."""
        return self.free + (self.store.reclaimable() if self.store is not None else 0) - self.reserved

    def reserve(self, pages: int) -> bool:
        """Promise `pages` pages to a prompt whose prefill starts later: False (nothing promised)
        if fewer are available. take() hands out no promised page until unreserve()."""
        if pages > self.available:
            return False
        self.reserved += pages
        return True

    def unreserve(self, pages: int) -> None:
        self.reserved -= pages
        assert self.reserved >= 0

    def holders(self, page: int) -> int:
        return int(self._holders[page])

    def pages_for(self, first: int, end: int) -> range:
        """The page indices (within a row) holding slots [first, end)."""
        return range(first // self.page, -(-end // self.page)) if end > first else range(0)

    def take(self, table_row: np.ndarray, first: int, end: int) -> bool:
        """Give table_row the pages it lacks for slots [first, end): False (nothing taken) if the
        pool has too few, even with the prefix store's own pages given back."""
        missing = [j for j in self.pages_for(first, end) if table_row[j] == NO_PAGE]
        if len(missing) > self._spare() and self.store is not None:
            self.store.reclaim(len(missing) - self._spare())
        if len(missing) > self._spare():
            return False
        for j in missing:
            table_row[j] = self._pop()
        return True

    def spare_page(self) -> int | None:
        """A free, unpromised page for one holder, None if there is none (nothing reclaimed)."""
        return self._pop() if self._spare() > 0 else None

    def _spare(self) -> int:
        return len(self._free) - self.reserved

    def _pop(self) -> int:
        page = self._free.pop()
        self._holders[page] = 1
        return page

    def share(self, table_row: np.ndarray, j: int, page: int) -> None:
        """Page j of a row is `page`, held by someone already (a kept prefix block)."""
        assert table_row[j] == NO_PAGE and self._holders[page] > 0
        table_row[j] = page
        self.hold(page)

    def hold(self, page: int) -> None:
        self._holders[page] += 1

    def drop(self, page: int) -> None:
        """One holder lets go of `page`: free once none is left."""
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._free.append(page)
            self._free.sort(reverse=True)

    def release(self, table_row: np.ndarray) -> None:
        """Every page of table_row let go (free where no one else holds it); the row holds none after."""
        for page in table_row[table_row != NO_PAGE].tolist():
            self.drop(page)
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

    def copy_page(self, source: int, target: int) -> None:
        """Page `target` holds what page `source` holds."""
        self.layers = _copy_page(self.layers, np.int32(source), np.int32(target))

    def copy_slots(self, table_row: np.ndarray, slot: int, target: int) -> None:
        """Page `target` holds the row's slots [slot, slot + page) (the row's pages: table_row)."""
        self.layers = _copy_slots(self.layers, self.put_table(table_row[None]), np.int32(slot), np.int32(target))

    def check(self, tables) -> None:
        """Every page is free, or held by as many rows of `tables` and the prefix store as count it;
        raises AssertionError if not."""
        held = np.concatenate([np.asarray(t).reshape(-1) for t in tables] or [np.zeros(0, np.int32)])
        holders = Counter(held[held != NO_PAGE].tolist())
        if self.store is not None:
            holders.update(self.store.pages())
        for page in range(self.pages):
            assert holders[page] == self._holders[page], (
                f"page {page} has {holders[page]} holders (rows, prefix store) but counts {self._holders[page]}")
        assert len(self._free) == len(set(self._free)), "a page is free twice"
        assert all(self._holders[page] == 0 for page in self._free), "a held page is also free"
        leaked = self.pages - len(self._free) - int(np.count_nonzero(self._holders))
        assert leaked == 0, f"{leaked} pages leaked"
        assert self.reserved >= 0 and self.available >= 0, "more pages promised than the pool can hand out"


@partial(jax.jit, donate_argnums=0)
def _copy_page(layers, source, target):
    return jax.tree.map(lambda a: a.at[target].set(a[source]), layers)


@partial(jax.jit, donate_argnums=0)
def _copy_slots(layers, table, slot, target):
    return jax.tree.map(lambda a: a.at[target].set(read_slots(a, table, slot, a.shape[2])[0]), layers)
