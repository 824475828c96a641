"""The serving engine's shared prompt prefixes: kept prompt blocks that are pages of its KV pool
(jmoe/serving/kv_pages.py), read in place by every later prompt that starts with them.

The blocks are kept in the tree of jmoe/decoding/prefixes.py (keyed by token blocks, least
recently used leaf first out), a block being one pool page. A prompt that finds kept blocks is
placed from slot 0 (no left padding: its blocks then fall on page boundaries) and its row shares
their pages: those the prefill does not reach are shared, the page holding the slot the prefill
starts from is copied (its first slots come from the kept block, the rest are prefilled), and the
rest of the prompt takes pages of its own. Once all in, the prompt's full blocks are kept: in
place where they sit on page boundaries (the row and the store then share the page; the row
writes only past its prompt), else copied onto a free page. The store holds at most the pages
load() reserved for kept prompt blocks ("prefix_cache", on top of the rows' "kv_cache"); the pool
takes back those only the store holds when rows need them.

`generate` keeps its own copies in the model's store (it has no pool); the two count into the
same statistics.
"""

from __future__ import annotations

import numpy as np

from jmoe.decoding.engine import prefill_chunk
from jmoe.decoding.prefixes import PrefixCache, first_slot_to_prefill
from jmoe.serving.kv_pages import PagePool


class PagePrefixes:
    """Kept prompt blocks as at most `blocks` pages of `pool`, counted in the model's store's
    statistics (`shared`: that store)."""

    def __init__(self, pool: PagePool, blocks: int, shared: PrefixCache):
        self.pool = pool
        # the tree's capacity counted in blocks (a block a page), not bytes
        self.tree = PrefixCache(capacity=blocks, block_nbytes=1, block=pool.page, stats=shared.stats,
                                on_evict=pool.drop)
        self.tree.lock = shared.lock  # one lock for the statistics both count into
        pool.store = self

    def pages(self) -> list[int]:
        """The pages of every kept block (one holder each: the store)."""
        return self.tree.blocks()

    def _only_mine(self, page: int) -> bool:
        return self.pool.holders(page) == 1

    def reclaimable(self) -> int:
        """Pages that reclaim() could give back: those only the store holds, as far as they can go."""
        return self.tree.evictable(self._only_mine)

    def reclaim(self, pages: int) -> None:
        """Give back up to `pages` pages only the store holds, least recently used first."""
        for _ in range(pages):
            if not self.tree.evict(self._only_mine):
                return

    def clear(self) -> None:
        self.tree.clear()

    def place(self, prompt: list[int], table_row: np.ndarray) -> int:
        """Look `prompt` up; where kept blocks save a prefill chunk, give table_row (which holds no
        page) the pages of the prompt placed from slot 0, kept ones shared: the slot its prefill
        starts from, else 0 (table_row untouched)."""
        page = self.pool.page
        pages = self.tree.lookup(prompt)
        chunk = min(len(prompt), prefill_chunk(1))
        first = first_slot_to_prefill(len(pages) * page, len(prompt), chunk)
        self.tree.count(len(prompt), -(-first // page))
        if first == 0:
            return 0
        whole, part = divmod(first, page)
        for j in range(whole):
            self.pool.share(table_row, j, pages[j])
        # the promise covers the shared pages and the row's own, not the copied block's page too:
        # take() may give that page back to the pool (and even to this row), which leaves its
        # contents as they are until a step writes it, and no step runs before the copy
        if not self.pool.take(table_row, first, len(prompt)):
            raise RuntimeError("a prompt placed on kept pages found fewer pages than it was promised")
        if part:  # its first slots are the kept block's, the rest the prefill's
            self.pool.copy_page(pages[whole], int(table_row[whole]))
        return first

    def keep(self, prompt: list[int], table_row: np.ndarray, key_start: int) -> None:
        """Keep the full blocks of a prompt prefilled into table_row from slot key_start."""
        page = self.pool.page

        def block(j: int):
            slot = key_start + j * page
            if slot % page == 0:  # in place
                self.pool.hold(int(table_row[slot // page]))
                return int(table_row[slot // page])
            copy = self.pool.spare_page()
            if copy is not None:
                self.pool.copy_slots(table_row, slot, copy)
            return copy

        self.tree.keep(prompt, block)

