"""The sparse block: router, routed experts (reached through the handle table), shared expert."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.experts import (
    LayerExperts,
    Routing,
    expert_activation,
    missing_uses,
    resolve_tiers,
    routed_experts,
    wanted_tiers,
)
from jmoe.layers.mlp import DenseMLP
from jmoe.layers.modules import router_class
from jmoe.layers.linear import Linear


class LayerSignals(NamedTuple):
    """What one MoE layer tells the host, per assignment [N, k]: routed expert ids, combine weights,
    the tier code the selection wanted and the one that ran (0 = none); the count of real
    assignments that ran below their wanted tier (scalar); per expert [3, E] the tokens routed
    to it, its wanted and its chosen code (what the host's books need, in one small array), and
    the gate weight it received [E] (float32)."""

    ids: jax.Array
    weights: jax.Array
    wanted: jax.Array
    chosen: jax.Array
    missing: jax.Array
    per_expert: jax.Array
    gate: jax.Array


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs, quant=None):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.router = router_class(cfg)(cfg, **kw)
        self.activation = expert_activation(cfg)  # static: how the routed experts combine gate and up
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = DenseMLP(cfg.hidden_size, shared, quant=quant, **kw) if shared else None
        gated = shared and cfg.shared_expert_gated
        # The shared expert's gate is a router-like [D, 1] vector: it stays float like the routers.
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, **kw) if gated else None
        self.dtype = dtype

    def route(self, h) -> Routing:
        """h [N, D] -> the family's router's top-k ids and combine weights."""
        return self.router(h)

    def shared_out(self, h):
        """The shared expert(s), behind a sigmoid gate where the family has one (None without)."""
        if self.shared_expert is None:
            return None
        out = self.shared_expert(h)
        return out if self.shared_expert_gate is None else jax.nn.sigmoid(self.shared_expert_gate(h)) * out

    def select(self, routing: Routing, token_valid, token_importance, experts: LayerExperts) -> LayerSignals:
        """This step's wanted tier for each routed assignment, and the resident tier it runs at."""
        wanted = wanted_tiers(routing, token_valid, token_importance, experts)
        return self.resolve(routing, wanted, token_valid, experts)

    @staticmethod
    def resolve(routing: Routing, wanted, token_valid, experts: LayerExperts) -> LayerSignals:
        chosen = resolve_tiers(wanted, routing.ids, experts.slots)
        one_hot = jax.nn.one_hot(routing.ids, experts.hi.shape[0], dtype=jnp.int32) * token_valid[:, None, None]
        per_expert = jnp.stack([one_hot.sum((0, 1)), (one_hot * wanted[..., None]).max((0, 1)),
                                (one_hot * chosen[..., None]).max((0, 1))])  # an expert's assignments agree
        gate = (one_hot * routing.weights[..., None]).sum((0, 1))
        return LayerSignals(routing.ids, routing.weights, wanted, chosen, missing_uses(wanted, chosen, token_valid),
                            per_expert, gate)

    def experts_out(self, h, signals: LayerSignals, token_valid, experts: LayerExperts, *, shared: bool = True):
        """Routed experts at their chosen tiers plus (when `shared`) the shared expert, h [N, D] -> [N, D]."""
        with jax.named_scope("experts"):
            out = routed_experts(h, Routing(signals.ids, signals.weights), signals.chosen, token_valid, experts,
                                 self.activation)
        with jax.named_scope("shared_expert"):
            extra = self.shared_out(h) if shared else None
        return out if extra is None else out + extra

    def __call__(self, h, token_valid, token_importance, experts: LayerExperts, serve=None):
        """Route, select tiers, run: h [N, D] -> ([N, D], LayerSignals). `serve(routing, wanted,
        token_valid, experts)`, when given, returns the experts to run from once it has fetched
        what this step wants (jmoe/layers/fetch.py)."""
        with jax.named_scope("router"):
            routing = self.route(h)
            wanted = wanted_tiers(routing, token_valid, token_importance, experts)
        if serve is not None:
            experts = serve(routing, wanted, token_valid, experts)
        signals = self.resolve(routing, wanted, token_valid, experts)
        return self.experts_out(h, signals, token_valid, experts), signals
