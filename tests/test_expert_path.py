"""Routing bookkeeping: slot-sorted row blocks, and routed experts through the handle table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jmoe.layers.experts import (
    ExpertState,
    Routing,
    block_layout,
    padded_rows,
    run_experts,
)
from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES


# jitted, and over a few assignment counts: each (count, block_rows) compiles once, where eager
# ops compiled each of the layout's ~20 operations for every new count (most of this test's time)
jitted_block_layout = jax.jit(block_layout, static_argnums=(2, 3))


@settings(max_examples=60, deadline=None)
@given(
    count=st.sampled_from([1, 2, 5, 16, 40]),
    all_slots=st.lists(st.integers(0, 9), min_size=40, max_size=40),
    inactive=st.lists(st.booleans(), min_size=40, max_size=40),
    block_rows=st.sampled_from([1, 2, 4, 8]),
)
def test_block_layout_places_every_active_assignment_once(count, all_slots, inactive, block_rows):
    slots = all_slots[:count]
    A = len(slots)
    active = ~np.asarray(inactive[:A])
    layout = jitted_block_layout(jnp.asarray(slots, jnp.int32), jnp.asarray(active), block_rows, 10)
    R = padded_rows(A, 10, block_rows)
    row_source, block_slot, dest = (np.asarray(x) for x in layout)
    assert row_source.shape == (R,) and block_slot.shape == (R // block_rows,)
    for a in range(A):
        if active[a]:
            assert row_source[dest[a]] == a
            assert block_slot[dest[a] // block_rows] == slots[a]
        else:
            assert dest[a] == R
    used = row_source[row_source < A]
    assert sorted(used) == sorted(np.flatnonzero(active))
    # every block reads one slot; blocks with no rows read nothing
    for b, slot in enumerate(block_slot):
        rows = row_source[b * block_rows : (b + 1) * block_rows]
        real = rows[rows < A]
        assert (slot == -1) == (len(real) == 0)
        assert all(slots[r] == slot for r in real)


def naive_moe(h, ids, weights, valid, tier, slot, pools):
    """Token by token, expert by expert, in numpy float64."""
    out = np.zeros(h.shape, np.float64)
    names = {code: name for name, code in TIER_CODES.items()}
    for n in range(h.shape[0]):
        if not valid[n]:
            continue
        for j in range(ids.shape[1]):
            e = ids[n, j]
            if tier[e] == 0:
                continue
            pool = pools[names[tier[e]]]
            gu = h[n] @ np.asarray(pool.gate_up[slot[e]], np.float64)
            g, u = np.split(gu, 2)
            out[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * u) @ np.asarray(pool.down[slot[e]], np.float64))
    return out


@pytest.mark.parametrize("tokens", [3, 40])  # decode (one row per assignment) and prefill (row blocks)
def test_routed_experts_follow_the_handle_table(tokens):
    rng = np.random.default_rng(tokens)
    D, F, E, k = 16, 8, 6, 2
    pools = {
        name: ExpertWeights(rng.normal(size=(5, D, 2 * F)).astype(np.float32) * 0.3,
                            rng.normal(size=(5, F, D)).astype(np.float32) * 0.3)
        for name in ("bf16", "int4")
    }
    # experts 0-2 in the bf16 pool, 3-4 in the int4 pool (any pool contents work here), 5 skipped
    tier = np.array([TIER_CODES["bf16"]] * 3 + [TIER_CODES["int4"]] * 2 + [0], np.int32)
    slot = np.array([4, 0, 2, 1, 3, 0], np.int32)
    h = rng.normal(size=(tokens, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random(size=(tokens, k)).astype(np.float32)
    valid = rng.random(tokens) > 0.2
    layer = ExpertState.from_codes(tier[None], slot[None], jax.tree.map(jnp.asarray, pools)).layer(0)
    ours = run_experts(jnp.asarray(h), Routing(jnp.asarray(ids), jnp.asarray(weights)), jnp.asarray(valid), layer)
    np.testing.assert_allclose(np.asarray(ours), naive_moe(h, ids, weights, valid, tier, slot, pools), rtol=1e-5, atol=1e-5)
