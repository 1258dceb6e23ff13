"""Kernel references: absorbed MLA vs expanded attention; routed-expert paths vs the dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.pallas.mla_attention import mla_attention
from ddtree_jax.pallas.moe import moe_experts
from ddtree_jax.pallas.moe.reference import moe_experts_reference


def expanded_attention(q_nope, q_pe, ckv, kpe, w_uk, w_uv, visible, scale):
    """Textbook MLA: per-head keys [W_UK c; k_pe] and values W_UV c (float64)."""
    f = np.float64
    k_nope = np.einsum("ndr,bsr->bnsd", w_uk.astype(f), ckv.astype(f))
    v = np.einsum("nvr,bsr->bnsv", w_uv.astype(f), ckv.astype(f))
    s = np.einsum("btnd,bnsd->bnts", q_nope.astype(f), k_nope) + np.einsum(
        "btnp,bsp->bnts", q_pe.astype(f), kpe.astype(f)
    )
    s = np.where(visible[:, None], s * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsv->btnv", p, v)


@pytest.mark.parametrize(("b", "t", "s", "n"), [(1, 1, 7, 4), (2, 5, 9, 3), (3, 4, 1, 2)])
def test_absorbed_mla_equals_expanded(b, t, s, n):
    rng = np.random.default_rng(b * 100 + t)
    d, dv, r, p = 8, 6, 16, 4
    q_nope = rng.normal(size=(b, t, n, d)).astype(np.float32)
    q_pe = rng.normal(size=(b, t, n, p)).astype(np.float32)
    w_uk = rng.normal(size=(n, d, r)).astype(np.float32) / 3
    w_uv = rng.normal(size=(n, dv, r)).astype(np.float32)
    cache_ckv = rng.normal(size=(b, s, r)).astype(np.float32)
    cache_kpe = rng.normal(size=(b, s, p)).astype(np.float32)
    new_ckv = rng.normal(size=(b, t, r)).astype(np.float32)
    new_kpe = rng.normal(size=(b, t, p)).astype(np.float32)
    cache_len = rng.integers(0, s + 1, size=b).astype(np.int32)
    new_mask = rng.random((b, t, t)) < 0.5
    new_mask |= np.eye(t, dtype=bool)[None]
    scale = 0.3
    q_lat = np.einsum("btnd,ndr->btnr", q_nope, w_uk)
    o_lat = mla_attention(
        jnp.asarray(q_lat),
        jnp.asarray(q_pe),
        jnp.asarray(cache_ckv),
        jnp.asarray(cache_kpe),
        jnp.asarray(cache_len),
        jnp.asarray(new_ckv),
        jnp.asarray(new_kpe),
        jnp.asarray(new_mask),
        scale=scale,
    )
    got = np.einsum("btnr,nvr->btnv", np.asarray(o_lat), w_uv)
    visible = np.concatenate(
        [np.broadcast_to((np.arange(s)[None, :] < cache_len[:, None])[:, None], (b, t, s)), new_mask], axis=-1
    )
    want = expanded_attention(
        q_nope,
        q_pe,
        np.concatenate([cache_ckv, new_ckv], 1),
        np.concatenate([cache_kpe, new_kpe], 1),
        w_uk,
        w_uv,
        visible,
        scale,
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_mla_attention_checks_shapes_and_implementation():
    z = jnp.zeros
    args = (
        z((1, 2, 3, 8)),
        z((1, 2, 3, 4)),
        z((1, 5, 8)),
        z((1, 5, 4)),
        z((1,), jnp.int32),
        z((1, 2, 8)),
        z((1, 2, 4)),
    )
    with pytest.raises(AssertionError):
        mla_attention(*args, z((1, 2, 3), bool), scale=1.0)
    with pytest.raises(ValueError, match="'cuda'"):
        mla_attention(*args, z((1, 2, 2), bool), scale=1.0, implementation="cuda")


@pytest.mark.parametrize("dense_max", [0, 64])
@pytest.mark.parametrize(("t", "k", "e"), [(1, 2, 8), (3, 2, 8), (4, 2, 8), (9, 3, 8), (33, 8, 16)])
def test_moe_xla_paths_equal_dense_reference(t, k, e, dense_max, monkeypatch):
    """T*K <= E takes the weight gather; larger takes ragged_dot (dense_max 0) or, up to
    DENSE_MAX_TOKENS tokens, the dense pass: each must equal the oracle."""
    from ddtree_jax.pallas.moe import reference

    monkeypatch.setattr(reference, "DENSE_MAX_TOKENS", dense_max)
    key = jax.random.split(jax.random.PRNGKey(t * 10 + k), 6)
    h, i = 12, 10
    x = jax.random.normal(key[0], (t, h))
    idx = jnp.argsort(jax.random.uniform(key[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)  # distinct experts
    w = jax.random.uniform(key[2], (t, k))
    gate, up = jax.random.normal(key[3], (e, h, i)), jax.random.normal(key[4], (e, h, i))
    down = jax.random.normal(key[5], (e, i, h))
    want = moe_experts_reference(x, idx, w, gate, up, down)
    got = moe_experts(x, idx, w, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_flat_dense_pass_drops_other_shards_pairs_and_unchosen_experts():
    """The dense pass as flat GEMMs (reference.DENSE_FLAT): pairs with ids >= E (another
    shard's) add nothing, an unchosen expert's non-finite gate / up weights do not reach the
    output, and in bf16 it stays within bf16 rounding of the float32 oracle."""
    from ddtree_jax.pallas.moe import reference

    t, k, e, h, i = 13, 2, 16, 24, 8
    key = jax.random.split(jax.random.PRNGKey(7), 6)
    x = jax.random.normal(key[0], (t, h))
    idx = jnp.argsort(jax.random.uniform(key[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    idx = idx.at[::3, 1].set(e)  # dropped pairs
    w = jax.random.uniform(key[2], (t, k))
    gate, up = jax.random.normal(key[3], (e, h, i)), jax.random.normal(key[4], (e, h, i))
    down = jax.random.normal(key[5], (e, i, h))
    unchosen = int(np.setdiff1d(np.arange(e), np.asarray(idx))[0])
    gate = gate.at[unchosen].set(jnp.nan)
    up = up.at[unchosen].set(jnp.inf)
    want = moe_experts_reference(x, idx, w, gate, up, down)
    assert reference.DENSE_FLAT and t * k > e and t <= reference.DENSE_MAX_TOKENS  # the flat dense pass runs
    got = reference.moe_experts_xla(x, idx, w, gate, up, down)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    bf = [a.astype(jnp.bfloat16) for a in (x, gate, up, down)]
    got16 = reference.moe_experts_xla(bf[0], idx, w, *bf[1:])
    want32 = moe_experts_reference(
        *(a.astype(jnp.float32) for a in bf[:1]), idx, w, *(a.astype(jnp.float32) for a in bf[1:])
    )
    np.testing.assert_allclose(
        np.asarray(got16, np.float32), want32, rtol=0.05, atol=0.05 * float(jnp.abs(want32).max())
    )
