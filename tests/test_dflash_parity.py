"""Parity with the published DFlash PyTorch model (PyPI `dflash`, run in the HF environment by
tests/dflash_reference.py), on tiny random drafters exported by `save_drafter_hf`.

- Drafter alone: rounds of context + block through one kept cache, with and without YaRN,
  with sliding windows (causal by DFlash's rule, and bidirectional when the config says so).
- End to end with the tap convention: HF's DeepseekV3 target feeds the reference drafter its
  `hidden_states[i + 1]` (the last layer after the final norm); our engine's prefill, taps and
  draft give the same logits.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import checkpoint, model
from ddtree_jax.cache import KVCache
from ddtree_jax.config import YarnConfig
from ddtree_jax.drafters import as_drafter, dflash
from ddtree_jax.drafters.dflash import DrafterCache, DrafterConfig
from tests.conftest import random_target, run_hf_reference, tiny
from tests.test_drafter import CFG, random_params

# test_drafter's config, with a third layer, a longer block and room for YaRN's long positions.
BASE = dataclasses.replace(CFG, num_hidden_layers=3, block_size=8, max_position_embeddings=256)
YARN = YarnConfig(factor=8.0, original_max_position_embeddings=32)
SLIDING = dataclasses.replace(
    BASE, layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=10
)
CONFIGS = {
    "full": BASE,
    "yarn": dataclasses.replace(BASE, rope_scaling=YARN),
    "sliding": SLIDING,  # sliding layers causal among the block (DFlash's rule when is_causal is unset)
    "sliding-bidirectional": dataclasses.replace(SLIDING, is_causal=False),
    "all-causal": dataclasses.replace(BASE, is_causal=True),
    "yarn-sliding-mqa": dataclasses.replace(SLIDING, rope_scaling=YARN, rope_theta=50000.0, num_key_value_heads=1),
}
CONTEXT_ENDS = np.array([13, 22, 37])  # three rounds; the window of 10 hides early context


def _inputs(cfg: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    blocks = np.full((len(CONTEXT_ENDS), cfg.block_size), cfg.mask_token_id, np.int32)
    blocks[:, 0] = rng.integers(0, v - 1, size=len(CONTEXT_ENDS))
    return {
        "features": rng.normal(size=(1, CONTEXT_ENDS[-1], cfg.n_taps * h)).astype(np.float32),
        "embed": rng.normal(size=(v, h)).astype(np.float32),
        "lm_head": (0.15 * rng.normal(size=(v, h))).astype(np.float32),
        "blocks": blocks,
        "context_ends": CONTEXT_ENDS,
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Both parts' reference cases (the drafter alone, then end to end) in one run of
    dflash_reference.py: torch, transformers and dflash start once (~6 s)."""
    root = tmp_path_factory.mktemp("dflash")
    runs, cases = {}, []
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        params, inputs = random_params(cfg, seed=i), _inputs(cfg, i)
        dflash.save_drafter_hf(params, root / name)
        np.savez(root / f"{name}.npz", **inputs)
        runs[name] = (dflash.load_drafter(root / name), inputs)
        cases.append({"drafter": str(root / name), "inputs": str(root / f"{name}.npz")})
    cases.append(_end_to_end_case(root / "taps"))
    *refs, end_to_end_ref = run_hf_reference(cases, str(root), "dflash_reference.py")
    drafters = {name: (*run, ref) for (name, run), ref in zip(runs.items(), refs, strict=True)}
    taps = root / "taps"
    return drafters, (checkpoint.load_target(taps / "target"), dflash.load_drafter(taps / "drafter"), end_to_end_ref)


@pytest.fixture(scope="module")
def drafter_parity(references):
    return references[0]


extend = jax.jit(dflash.extend_context)
draft = jax.jit(dflash.draft)


def _our_rounds(params, inputs) -> list[np.ndarray]:
    """The engine's drafter over the same rounds: extend the cache with each context piece, draft."""
    cfg = params.config
    cache = DrafterCache.init(cfg, 1, int(CONTEXT_ENDS[-1]) + cfg.block_size)
    start, out = 0, []
    for block, end in zip(inputs["blocks"], CONTEXT_ENDS, strict=True):
        pos = jnp.arange(start, end, dtype=jnp.int32)[None]
        cache = extend(params, cache, inputs["features"][:, start:end], pos, jnp.ones(pos.shape, bool))
        block_pos = jnp.arange(end, end + cfg.block_size, dtype=jnp.int32)[None]
        lg = draft(params, cache, inputs["embed"], inputs["lm_head"].T, block[None], block_pos)
        out.append(np.asarray(lg[0]))
        start = end
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_drafter_matches_published_dflash(drafter_parity, name):
    params, inputs, ref = drafter_parity[name]
    for r, got in enumerate(_our_rounds(params, inputs)):
        want = ref[f"logits_{r}"]
        assert np.abs(want).max() > 1.0, "reference logits too flat to test anything"
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0, err_msg=f"round {r}")


def test_each_variant_changes_the_logits(drafter_parity):
    """Case a's weights under case b's config leave a's reference: each case tests its feature."""
    for a, b in (("full", "yarn"), ("sliding", "sliding-bidirectional"), ("full", "all-causal"), ("full", "sliding")):
        params, inputs, ref = drafter_parity[a]
        swapped = _our_rounds(params.replace(config=CONFIGS[b]), inputs)[2]
        assert np.abs(swapped - ref["logits_2"]).max() > 1e-2, (a, b)


# ----------------------------------------------------------------------------------
# End to end: HF target -> hidden_states[i + 1] -> reference drafter


PROMPT = [5, 17, 42, 9, 200, 31, 77, 3, 120, 64, 18, 250, 7]


def _end_to_end_case(root) -> dict:
    """A random tiny target and a drafter tapping it, saved under root; their reference case."""
    tcfg = tiny()
    last = tcfg.num_hidden_layers - 1
    # Taps on an inner layer and on the last one, where the convention matters.
    dcfg = dataclasses.replace(
        BASE, vocab_size=tcfg.vocab_size, target_layer_ids=(1, last), num_target_layers=tcfg.num_hidden_layers
    )
    checkpoint.save_hf(random_target(tcfg, seed=3), root / "target")
    dflash.save_drafter_hf(random_params(dcfg, seed=4), root / "drafter")
    return {"drafter": str(root / "drafter"), "target": str(root / "target"), "prompt": PROMPT}


@pytest.fixture(scope="module")
def end_to_end(references):
    return references[1]


def _engine_draft(target, params):
    """Prefill through the drafter protocol, as `generate` does, then one draft of the next block."""
    drafter = as_drafter(params, None)
    n, cap = len(PROMPT), len(PROMPT) + params.config.block_size
    out, cache = model.append(
        target,
        KVCache.init(target.config, 1, cap),
        jnp.asarray([PROMPT], jnp.int32),
        jnp.asarray([n], jnp.int32),
        tap_layers=drafter.tap_layers,
        tap_final_norm=drafter.tap_final_norm,
    )
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    state = drafter.observe(drafter.init_state(target, 1, cap), out.taps, pos, jnp.ones((1, n), bool))
    root = jnp.argmax(model.logits(target, out.hidden[:, -1]), axis=-1).astype(jnp.int32)
    return int(root[0]), np.asarray(drafter.propose(state, target, cache, root, jax.random.PRNGKey(0))[0])


def test_engine_draft_equals_reference_fed_by_hf_target(end_to_end):
    target, params, ref = end_to_end
    root, got = _engine_draft(target, params)
    assert root == int(ref["root"])
    assert np.abs(ref["logits"]).max() > 1.0
    np.testing.assert_allclose(got, ref["logits"], atol=2e-4, rtol=0)


def test_raw_last_layer_taps_are_a_different_drafter(end_to_end):
    """tap_final_norm=False (the shipped drafter's convention) feeds the raw last layer: the
    reference, which always feeds hidden_states[i + 1], then disagrees."""
    target, params, ref = end_to_end
    raw = params.replace(config=dataclasses.replace(params.config, tap_final_norm=False))
    _, got = _engine_draft(target, raw)
    assert np.abs(got - ref["logits"]).max() > 1e-2
