"""Routed-expert dispatch: tokens x top-k experts -> weighted SwiGLU outputs."""

from ddtree_jax.pallas.moe.api import moe_experts

__all__ = ["moe_experts"]
