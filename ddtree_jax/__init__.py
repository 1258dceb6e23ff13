"""ddtree_jax: DDTree speculative decoding in JAX/Pallas."""
