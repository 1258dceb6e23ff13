"""The Pallas MLA attention kernel (interpret mode on the CPU) against the pure-jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.pallas.mla_attention import mla_attention
from ddtree_jax.pallas.mla_attention.kernel import MLATiles, mla_attention_pallas
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.tree import build_ddtree


def case(rng, b, t, n, r, p, s, lens, mask, dtype=jnp.float32):
    def f(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return (
        f(b, t, n, r),
        f(b, t, n, p),
        f(b, s, r),
        f(b, s, p),
        jnp.asarray(lens, jnp.int32),
        f(b, t, r),
        f(b, t, p),
        mask,
    )


@pytest.mark.parametrize(
    ("b", "t", "n", "s", "lens", "block_q", "block_k", "splits"),
    [
        (2, 5, 3, 70, [33, 0], 8, 16, 3),  # empty cache row; S and Q not multiples of the blocks
        (1, 1, 4, 16, [16], 64, 16, None),  # AR decode: one token, full cache
        (3, 9, 2, 40, [40, 1, 17], 4, 8, 5),  # splits past every cache_len
    ],
)
def test_kernel_matches_reference(b, t, n, s, lens, block_q, block_k, splits):
    rng = np.random.default_rng(b * 10 + t)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
    args = case(rng, b, t, n, 16, 8, s, lens, mask)
    want = mla_attention_reference(*args, 0.3)
    tiles = MLATiles(block_q=block_q, block_k=block_k, num_splits=splits)
    got = mla_attention_pallas(*args, scale=0.3, tiles=tiles, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_kernel_with_a_real_tree_mask_and_bf16():
    rng = np.random.default_rng(7)
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11))
    tree = build_ddtree(logits, jnp.zeros((2,), jnp.int32), 12)  # 13 slots, budget 12
    t = tree.tokens.shape[1]
    args = case(rng, 2, t, 4, 32, 16, 50, [50, 21], tree.visibility, jnp.bfloat16)
    want = mla_attention_reference(*args, 0.2)
    for block_k in (16, 4):  # the 13 tree tokens in one block, or in four
        got = mla_attention_pallas(*args, scale=0.2, tiles=MLATiles(block_q=16, block_k=block_k), interpret=True)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def test_kernel_rows_whose_keys_all_lie_in_later_blocks():
    """A diagonal mask: new token t sees only itself, so its first tree blocks are all masked."""
    rng = np.random.default_rng(3)
    t = 12
    args = case(rng, 2, t, 2, 16, 8, 20, [0, 9], jnp.eye(t, dtype=bool)[None].repeat(2, 0))
    want = mla_attention_reference(*args, 0.4)
    got = mla_attention_pallas(*args, scale=0.4, tiles=MLATiles(block_q=8, block_k=4), interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_dispatch_and_generate_with_pallas():
    from ddtree_jax.drafters import OracleDrafter
    from ddtree_jax.generate import generate
    from tests.conftest import random_target, tiny

    rng = np.random.default_rng(1)
    mask = jnp.ones((1, 2, 2), bool)
    args = case(rng, 1, 2, 2, 8, 4, 6, [3], mask)
    np.testing.assert_allclose(
        mla_attention(*args, scale=0.5, implementation="pallas"), mla_attention(*args, scale=0.5), atol=1e-5
    )
    params = random_target(tiny(), seed=2)
    prompts = [[5, 17, 33, 2], [9]]
    xla = generate(params, prompts, max_new_tokens=6).to_lists()
    assert generate(params, prompts, max_new_tokens=6, implementation="pallas").to_lists() == xla
    tree = generate(
        params,
        OracleDrafter(block_size=3),
        prompts,
        method="ddtree",
        tree_budget=4,
        max_new_tokens=6,
        implementation="pallas",
    )
    assert tree.to_lists() == xla


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.mla_attention import bench

    bench.main(["--smoke", "--reps", "1", "--shapes", "kimi_k2_tp8_tree16"])
    out = capsys.readouterr().out
    assert "| kimi_k2_tp8_tree16 | xla |" in out and "| kimi_k2_tp8_tree16 | pallas |" in out


def test_tiles_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_k must be a power of two, got 24"):
        MLATiles(block_k=24)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        MLATiles(num_stages=0)
    with pytest.raises(ValueError, match="num_splits"):
        MLATiles(num_splits=0)
