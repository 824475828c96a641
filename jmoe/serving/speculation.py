"""The serving engine's speculative cycle: k drafted tokens per row with the model's low-precision
copy, one verification pass of the target, and each plain greedy row keeps the drafts the target
agrees with (jmoe/decoding/acceptance.py's jitted acceptance, as speculative generation accepts)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.decoding.sampling import HISTORY_DTYPE, SamplingOptions
from jmoe.decoding.speculative import SpeculativeOptions, accept, padded
from jmoe.serving.logits import greedy_jit, logprobs_jit, row_jit, token_logprobs

DEFAULT_ENGINE_DRAFT_K = 3  # drafted tokens per cycle when speculative k is "auto" (a fixed k: few shapes)
NOT_DRAFTED = -1  # a verification block's padding past the drafts: no token, so never accepted


class Speculation:
    """A BatchEngine's speculative decoding: the draft's experts and the fixed k it drafts per cycle.
    step() and warm_up() take the engine, whose batch cache, rows and step they run."""

    def __init__(self, model, options: SpeculativeOptions):
        self.draft = model.draft(options.draft)
        self.k = options.k or DEFAULT_ENGINE_DRAFT_K
        # what the acceptance takes for a plain greedy row: no bias or penalty, an empty history
        self._params = SamplingOptions().device_params(model.config.vocab_size, model.placement.commit_to)
        self._rng = jax.random.key(0)  # unused by greedy acceptance
        self._seen: dict[int, jax.Array] = {}  # rows -> an empty history [rows, V]

    def widths(self, context: int) -> list[int]:
        """The verification block widths a cycle may run (k + 1 tokens padded; 2 near the context's end)."""
        return sorted({2, padded(np.zeros((1, self.k + 1)), context).shape[1]})

    def _accept(self, verify, drafted: np.ndarray):
        """Per row: the drafts the target's argmax agrees with (accepted [n]), and its next token [n]."""
        n, vocab = verify.shape[0], verify.shape[-1]
        if n not in self._seen:
            self._seen[n] = jnp.zeros((n, vocab), HISTORY_DTYPE)
        accepted, nxt, _, _ = accept(verify, drafted, None, self._seen[n], self._rng, self._params, greedy=True)
        return accepted, nxt

    def warm_up(self, engine, n: int) -> None:
        """Compile a cycle's executables for a step of n rows: a draft step and, at each width, the
        verification, its acceptance, a sampled row's draw and the logprobs."""
        pad, context = engine.pad, engine.context
        engine._run_step(np.full(n, pad, np.int32), np.zeros(n, np.int32), np.full(n, context, np.int32),
                         residency=self.draft)
        for width in self.widths(context):
            verify = engine._run_step(np.full((n, width), pad, np.int32), np.zeros(n, np.int32),
                                      np.full(n, context, np.int32), last_only=False, phase="verify")
            self._accept(verify, np.full((n, width - 1), NOT_DRAFTED, np.int32))
            row_jit(verify[:, 0], np.int32(0))
            logprobs_jit(verify.reshape(-1, verify.shape[-1]), np.zeros(n * width, np.int32))

    def step(self, engine) -> None:
        """One speculative cycle over the engine's first bucket(live) slots: the draft decodes k tokens
        per row, the target verifies them with each row's last token in one pass, and each row emits
        what it keeps (a plain step when no row is plain greedy or there is no room to draft)."""
        engine._grow(1 << self.k.bit_length())  # pages for the verification block (k + 1 tokens padded)
        engine._compact()
        if engine.running == 0:
            return
        n = engine.bucket(engine.running)
        rows = engine.rows[:n]
        live = np.asarray([r is not None for r in rows])
        greedy = [b for b, r in enumerate(rows) if r is not None and r.plain_greedy]
        pos = np.where(live, engine.pos[:n], 0).astype(np.int32)
        need = max(r.stream.request.max_tokens - r.generated for r in rows if r is not None)
        k = min(self.k, engine.context - 1 - int(pos[live].max()), need - 1)
        if not greedy or k <= 0:
            return engine._step()
        started = time.perf_counter()
        key_start = engine.key_start[:n].copy()
        last = np.asarray([r.token if r is not None else engine.pad for r in rows], np.int32)
        drafts = [last]
        for j in range(k):
            logits = engine._run_step(drafts[-1], pos + j, key_start, residency=self.draft)
            drafts.append(np.asarray(greedy_jit(logits), np.int32))
        block = np.stack(drafts, axis=1)  # [n, k + 1]: each row's last token, then its drafts
        block = padded(block, engine.context - int(pos.max()))
        verify = engine._run_step(block, pos, key_start, last_only=False, phase="verify")  # [n, W, V]
        drafted = block[:, 1:].copy()
        drafted[:, k:] = NOT_DRAFTED
        accepted, nxt = (np.asarray(a) for a in self._accept(verify, drafted))
        engine.steps += 1
        if engine.observer is not None:
            engine.observer.step(time.perf_counter() - started, engine.running)
        emitted, kept = {}, []
        for b, row in enumerate(rows):
            if row is None:
                continue
            if row.plain_greedy:
                kept.append(int(accepted[b]))
                emitted[b] = [int(t) for t in block[b, 1:kept[-1] + 1]] + [int(nxt[b])]
            elif (token := engine._draw_or_end(row, verify[:, 0], b)) is not None:
                emitted[b] = [token]
        engine.model.stats.spec.count(k, np.asarray(kept))
        width = verify.shape[1]
        flat = {b * width + j: t for b, tokens in emitted.items() for j, t in enumerate(tokens)}
        wanted = {b * width + j: k_top for b, k_top in engine._wanted(rows).items() for j in range(len(emitted[b]))}
        logprobs = token_logprobs(verify.reshape(n * width, -1), flat, wanted)
        for b, tokens in emitted.items():
            for j, t in enumerate(tokens):
                if engine.rows[b] is None:  # ended on an earlier token of its block
                    break
                engine.pos[b] += 1
                engine._emit(b, t, logprobs.get(b * width + j))
