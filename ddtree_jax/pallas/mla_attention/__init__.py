"""Absorbed-MLA attention over a latent cache plus a block of new tokens."""

from ddtree_jax.pallas.mla_attention.api import mla_attention

__all__ = ["mla_attention"]
