"""The serving engine's admission (a mixin of BatchEngine, jmoe/serving/batcher.py): which waiting
requests take a slot and the pages of their prompts, their prefill in chunks between decode steps,
the live rows kept at the front slots, and pages given back by the newest request when the pool
runs short (see batcher.py's module docstring)."""

from __future__ import annotations

import jax
import numpy as np

from jmoe.decoding.engine import KV_PAGE
from jmoe.decoding.generation import RowText
from jmoe.decoding.sampling import Sampler, prompt_history
from jmoe.errors import InputError
from jmoe.serving.kv_pages import NO_PAGE, PagePool
from jmoe.serving.kv_prefixes import PagePrefixes
from jmoe.serving.kv_rows import Prefill, prompt_geometry
from jmoe.serving.logits import token_logprobs
from jmoe.serving.requests import Stream
from jmoe.serving.stepping import Row
from jmoe.serving.structured import Constraint


class Admission:
    """BatchEngine's slots and pages: admission, prefill, compaction and setting rows aside. Reads
    and writes the engine's queues (waiting, set_aside, prefilling), slots and pool."""

    def _new_pool(self) -> PagePool:
        """The rows' kv_pages, and on top the pages the model reserved for kept prompt blocks (the
        engine's prefix store, self.prefixes)."""
        shared = self.model.prefixes
        kept = shared.max_blocks if shared is not None and self.context > KV_PAGE else 0
        pool = PagePool(self.model, self.kv_pages + kept, self.context)
        if pool.row_pages > self.kv_pages:
            raise InputError(f"the KV pool's {self.kv_pages} pages of {pool.page} slots do not hold one "
                             f"{self.context}-token context; give the KV cache more bytes or lower the context")
        self.prefixes = PagePrefixes(pool, kept, shared) if kept else None
        return pool

    @property
    def cache(self):
        """The pool seen through every slot's pages (what a step over all slots runs on)."""
        return self.pool.view(self._table(self.max_batch))

    def _table(self, n: int) -> jax.Array:
        """The first n slots' pages on the device (sent again only after they change)."""
        if n not in self._tables:
            self._tables[n] = self.pool.put_table(self.table[:n])
        return self._tables[n]

    def _compact(self) -> None:
        """Move the live rows to the front slots (in order), so a step runs only the first ones (their
        pages move with them in the table; no slot moves)."""
        live = [b for b, row in enumerate(self.rows) if row is not None]
        for dst, src in enumerate(live):
            if src != dst:
                self.table[[dst, src]] = self.table[[src, dst]]
                self._tables.clear()
                self.rows[dst], self.rows[src] = self.rows[src], None
                self.pos[dst], self.key_start[dst] = self.pos[src], self.key_start[src]
                self.pos[src], self.key_start[src] = 0, self.context

    def _prompt_pages(self, prompt_tokens: int) -> int:
        """Pages promised to a prompt of this many tokens when admitted (its real tokens' slots)."""
        prompt_len, key_start = prompt_geometry(prompt_tokens, self.context)
        return len(self.pool.pages_for(key_start, prompt_len))

    def _admissible(self) -> int:
        """How many waiting requests (after the rows set aside) the next admission starts: oldest
        first, while a slot is free and the pool has pages for the prompt."""
        if not self.waiting:  # (the pool's available pages walk the prefix store: not every step)
            return 0
        free_rows = self.max_batch - self.running - len(self.prefilling)
        free_pages = self.pool.available
        for _, prompt, _ in self.set_aside:
            free_rows -= 1
            free_pages -= self._prompt_pages(len(prompt))
        count = 0
        for stream in self.waiting:
            free_pages -= self._prompt_pages(len(stream.request.prompt))
            if free_rows <= count or free_pages < 0:
                break
            count += 1
        return count

    def _admit(self, limit: int | None = None) -> None:
        """Oldest first, while rows are free and the pool has their prompts' pages: rows set aside
        and then waiting requests (at most `limit` of these) start prefilling; then up to
        prefill_per_step prompt tokens are prefilled, and each prompt that is all in takes a row."""
        self._compact()
        while self.set_aside and self.running + len(self.prefilling) < self.max_batch:
            if not self._start_prefill(*self.set_aside[0]):
                break
            self.set_aside.popleft()
        count = self._admissible() if limit is None else min(limit, self._admissible())
        for _ in range(count):
            with self._wake:
                if not self.waiting:
                    break
                stream = self.waiting.popleft()
            try:
                if not self._start_prefill(stream, stream.request.prompt):  # (_admissible counted its pages)
                    with self._wake:
                        self.waiting.appendleft(stream)
                    break
            except Exception as error:  # noqa: BLE001 - this request fails, not the engine
                self._request_failed(stream, error)
        budget = self.prefill_per_step
        while self.prefilling and budget > 0:
            p = self.prefilling[0]
            try:
                budget -= p.advance()
                if p.done:
                    self.prefilling.popleft()
                    self._start(self.running, p)
            except Exception as error:  # noqa: BLE001 - this request fails, not the engine
                p.release()  # none left once its row holds them
                self._request_failed(p.stream, error)

    def _start_prefill(self, stream: Stream, prompt: list[int], resumed: "Row | None" = None) -> bool:
        """Promise `prompt` the pages of its real tokens and queue its prefill: False (nothing done)
        if the pool has too few."""
        pages = self._prompt_pages(len(prompt))
        if not self.pool.reserve(pages):
            return False
        try:
            self.prefilling.append(Prefill(self.model, stream, self.context, self.pool, self.pool.new_table(1), prompt,
                                           resumed, self.prefixes, reserved=pages))
        except BaseException:
            self.pool.unreserve(pages)
            raise
        return True

    def _start(self, b: int, prefill: Prefill) -> None:
        """A prefilled request takes row b (the first free one) with its pages, and draws its first
        token (a resumed row goes on from the token it had drawn)."""
        stream, decoder, model = prefill.stream, prefill.decoder, self.model
        request = stream.request
        if prefill.resumed is None:
            sampler = Sampler(model.engine, request.sampling,
                              prompt_history([request.prompt], model.config.vocab_size, request.sampling),
                              model.placement.commit_to)
            text = RowText(model.tokenizer, request.stop, request.special_tokens) if request.as_text else None
            constraint = None if request.grammar is None else Constraint(
                request.grammar, model.tokenizer, model.config.vocab_size, self.eos)
            row = Row(stream, sampler, text, prefill.clock, constraint=constraint, order=next(self._admissions))
        else:
            row = prefill.resumed
        self.table[b], prefill.table[0] = prefill.table[0], NO_PAGE  # the row's pages now
        self._tables.clear()
        self.rows[b] = row
        self.pos[b], self.key_start[b] = decoder.pos[0], decoder.key_start[0]
        if prefill.resumed is not None:
            return
        token = self._draw(row, prefill.logits, 0)
        logprob = token_logprobs(prefill.logits, {0: token}, self._wanted([self.rows[b]]))
        self._emit(b, token, logprob.get(0))

    def bucket(self, live: int) -> int:
        """Rows a step runs for `live` live rows (compacted to the front): the smallest power of two
        that holds them, at most max_batch. Each bucket compiles once."""
        return min(self.max_batch, 1 << max(0, live - 1).bit_length())

    def _grow(self, tokens: int) -> None:
        """Give every running row the pages for its next `tokens` slots (to the context's end),
        setting the newest requests aside while the pool is short (see batcher.py's module docstring)."""
        while True:
            short = [b for b, row in enumerate(self.rows) if row is not None
                     and not self._take(b, int(self.pos[b]), min(int(self.pos[b]) + tokens, self.context))]
            if not short:
                return
            if not self._set_aside_newest(keep=short[0]):  # none left to set aside: it has the pool to itself
                self._flush(self.rows[short[0]])
                self._free(short[0], "length")

    def _take(self, b: int, first: int, end: int) -> bool:
        """Slot b's pages for slots [first, end), as PagePool.take (the device's tables sent again if
        it took any)."""
        before = self.table[b].copy()
        taken = self.pool.take(self.table[b], first, end)
        if not np.array_equal(before, self.table[b]):
            self._tables.clear()
        return taken

    def _set_aside_newest(self, keep: int) -> bool:
        """Free the pages of the newest request other than row `keep`'s: a prompt being prefilled
        back to the front of the queue, else a running row set aside to be resumed. False if there is
        none."""
        if self.prefilling:
            p = self.prefilling[-1]
            self._drop_prefill(p)
            self.set_aside.appendleft((p.stream, p.prompt, p.resumed))
        else:
            others = [b for b, row in enumerate(self.rows) if row is not None and b != keep]
            if not others:
                return False
            b = max(others, key=lambda b: self.rows[b].order)
            row, self.rows[b] = self.rows[b], None
            self.pool.release(self.table[b])
            self._tables.clear()
            self.pos[b], self.key_start[b] = 0, self.context
            # the cache held its prompt and every token it drew but the last, which its next step takes
            self.set_aside.appendleft((row.stream, row.stream.request.prompt + row.history[:-1], row))
        self.preemptions += 1
        return True
