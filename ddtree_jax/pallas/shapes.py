"""Named real shapes, one table read by the kernels' benches and by their tests.

Kimi-K2 attention: kv_lora_rank R = 512, rope P = 64, 64 query heads, or the 8 of
one GPU of a tensor-parallel split over 8; a 32K-token latent cache. Its routed
experts: H = 7168, I = 2048, top-8, the 48 of one GPU of an 8-way expert-parallel
split of 384. Trees of 16 / 32 / 64 / 128 nodes verify 17 / 33 / 65 / 129 tokens
(the root included); an AR step verifies one. `kimi_k2_ep8_top1_tree32` routes each
token to one local expert, as `experiments/k2_shard.py`'s shard model does.

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
