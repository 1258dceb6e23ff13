"""Named real shapes, one table read by the kernels' benches and by their tests.

Kimi-K2 attention: kv_lora_rank R = 512, rope P = 64, 64 query heads, or the 8 of
one GPU of a tensor-parallel split over 8; a 32K-token latent cache. Its routed
experts: H = 7168, I = 2048, top-8, the 48 of one GPU of an 8-way expert-parallel
split of 384. Trees of 16 / 32 / 64 / 128 nodes verify 17 / 33 / 65 / 129 tokens
(the root included); an AR step verifies one. `kimi_k2_ep8_top1_tree32` routes each
token to one local expert, as `experiments/k2_shard.py`'s shard model does.

The DFlash drafter's block attention: 16 block queries over a context cache, the shipped
drafter's heads and Kimi-K2.5-DFlash's. The drafter layer's QKV projection: a block of 16 rows
a batch row, the shipped drafter's widths and Kimi-K2.5-DFlash's.

`shrink` scales a shape down for the CPU (interpret mode) while keeping its
structure: the same token counts and head / expert counts, smaller widths.
"""

from __future__ import annotations

import dataclasses

TREE_TOKENS = {"ar": 1, "tree16": 17, "tree32": 33, "tree64": 65, "tree128": 129}


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """One absorbed-MLA attention call: B rows, T new tokens, N heads, S cached tokens."""

    batch: int
    tokens: int
    heads: int
    cache: int
    kv_lora_rank: int = 512
    rope_dim: int = 64

    def shrink(self) -> MLAShape:
        """The CPU version: cache / 64 (at least 2 blocks), latent widths / 8."""
        return dataclasses.replace(
            self, cache=max(self.cache // 64, 64), kv_lora_rank=self.kv_lora_rank // 8, rope_dim=self.rope_dim // 8
        )


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One routed-experts call: T tokens, each to K of E local experts of width H -> I -> H."""

    tokens: int
    experts: int = 48
    top_k: int = 8
    hidden: int = 7168
    inter: int = 2048

    def shrink(self) -> MoEShape:
        """The CPU version: H and I / 32."""
        return dataclasses.replace(self, hidden=self.hidden // 32, inter=self.inter // 32)


@dataclasses.dataclass(frozen=True)
class DrafterAttentionShape:
    """One drafter layer's block attention: B rows, T block tokens, Nq / Nkv heads of width hd,
    a context cache of S slots of which `length` are filled, a sliding window (None: full)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    cache: int
    length: int
    window: int | None
    tokens: int = 16

    def shrink(self) -> DrafterAttentionShape:
        """The CPU version: cache and length / 64 (at least 64 and 48 slots), window / 4."""
        window = None if self.window is None else max(self.window // 4, self.tokens)
        return dataclasses.replace(
            self, cache=max(self.cache // 64, 64), length=max(self.length // 64, 48), window=window
        )


MLA_SHAPES: dict[str, MLAShape] = {
    **{f"kimi_k2_tp8_{k}": MLAShape(1, t, 8, 32768) for k, t in TREE_TOKENS.items()},
    "kimi_k2_64heads_ar": MLAShape(1, 1, 64, 32768),
    "kimi_k2_64heads_tree64": MLAShape(1, 65, 64, 32768),
}
MOE_SHAPES: dict[str, MoEShape] = {
    **{f"kimi_k2_ep8_{k}": MoEShape(t) for k, t in TREE_TOKENS.items()},
    "kimi_k2_ep8_tree64_batch8": MoEShape(520),
    # experiments/k2_shard.py's routing: one local expert a token (its 33-token verify crashed)
    "kimi_k2_ep8_top1_tree32": MoEShape(33, top_k=1),
    "kimi_k2_ep8_prefill8192": MoEShape(8192),
}
DRAFTER_ATTENTION_SHAPES: dict[str, DrafterAttentionShape] = {
    # the shipped drafter (6 query heads, 1 KV head of 64, window 128) in the decode loop
    "shipped_ctx512": DrafterAttentionShape(1, 6, 1, 64, 512, 384, 128),
    "shipped_ctx32k": DrafterAttentionShape(1, 6, 1, 64, 32768, 32000, 128),
    "shipped_ctx512_batch8": DrafterAttentionShape(8, 6, 1, 64, 512, 384, 128),
    # z-lab/Kimi-K2.5-DFlash's shape (64 / 8 heads of 128, full attention), whole and one TP-8 shard
    **{
        f"kimi_k25_dflash{tp}_{k}": DrafterAttentionShape(1, heads, kv, 128, cache, cache - 768, None)
        for k, cache in (("4k", 4096), ("32k", 32768), ("128k", 131072))
        for tp, heads, kv in (("", 64, 8), ("_tp8", 8, 1))
    },
}


@dataclasses.dataclass(frozen=True)
class DrafterLayerShape:
    """One drafter layer's QKV projection: B x T rows of width H; Nq / Nkv heads of hd."""

    batch: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int = 16

    def shrink(self) -> DrafterLayerShape:
        """The CPU version: H / 16 (at least 128), heads / 8 (at least 1)."""
        return dataclasses.replace(
            self, hidden=max(self.hidden // 16, 128), heads=max(self.heads // 8, 1), kv_heads=max(self.kv_heads // 8, 1)
        )


DRAFTER_LAYER_SHAPES: dict[str, DrafterLayerShape] = {
    "shipped": DrafterLayerShape(1, 384, 6, 1, 64),
    "shipped_batch8": DrafterLayerShape(8, 384, 6, 1, 64),
    "kimi_k25_dflash": DrafterLayerShape(1, 7168, 64, 8, 128),
}


@dataclasses.dataclass(frozen=True)
class DraftTopKShape:
    """One tree's top-K: B x D rows of V drafter logits, K ranks kept."""

    batch: int
    vocab: int
    k: int
    depths: int = 15

    def shrink(self) -> DraftTopKShape:
        """The CPU version: V / 8."""
        return dataclasses.replace(self, vocab=self.vocab // 8)


DRAFT_TOPK_SHAPES: dict[str, DraftTopKShape] = {
    "shipped_budget8": DraftTopKShape(1, 8192, 8),
    "shipped_budget12": DraftTopKShape(1, 8192, 12),
    "shipped_budget16": DraftTopKShape(1, 8192, 16),
    "shipped_budget32": DraftTopKShape(1, 8192, 32),
    "shipped_budget12_batch8": DraftTopKShape(8, 8192, 12),
}
