"""LowRAM-E (seed 003, Table 3): SnapKV eviction before LowRAM factorises the prompt.

During the prefill each layer attends over its exact prompt as usual; the attention function also hands
the cache SnapKV's votes (residualkv.attention, hand-off "observe"): the softmax attention of the last
`evict_window` queries averaged over them, average-pooled over `evict_pool` neighbours and over the
query heads of each KV head, as the SnapKV baseline scores. Once the last layer of an xKV group has
voted, each row keeps its `evict_window` newest prompt tokens plus the best-voted others,
max(window, round(evict_keep x T)) in all, and the rest are dropped before the key basis, the
predictors and the residuals are fitted. The group's layers share one basis A whose rows are tokens,
so they keep one token set: scored by the max over their layers and KV heads (a token survives if any
of them wants it, as ResidualKV + SnapKV takes the max over heads). Irreversible.

Stored for it: which of the T prompt tokens were kept, one bit each per row and xKV group (their RoPE
positions are the row's, already held). The ratio then applies to the kept tokens' FP16 bytes, so the
predictors' fixed cost weighs more: the seed's reason LowRAM-E loses where eviction goes far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import select_tokens, snapkv_head_scores, snapkv_token_scores
from ..config import LowRAMConfig
from ..quant import pack_bits, unpack_bits
from ..stores import nbytes_of


def kept_count(T: int, cfg: LowRAMConfig) -> int:
    """Prompt tokens a row keeps out of T (the SnapKV baseline's rule: the window counts toward it)."""
    return min(T, max(min(cfg.evict_window, T), round(cfg.evict_keep * T)))


def record_votes(stores: list, groups: list, query: torch.Tensor, key: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float, cfg: LowRAMConfig) -> None:
    """One layer's prefill attention inputs -> each row group's store gets SnapKV scores per KV head
    [R, Hkv, T] over its own tokens (pooled inside the group, never across its left padding)."""
    votes = snapkv_token_scores(query, key, attention_mask, scaling, cfg.evict_window)  # [B, Hq, L]
    for grp, store in zip(groups, stores):
        store.votes = snapkv_head_scores(votes[grp.rows.to(votes.device), :, grp.start:], key.shape[1],
                                         cfg.evict_pool)


@dataclass
class Kept:
    """Which prompt tokens an xKV group kept, per row: a bit mask over the T tokens it saw."""

    bits: torch.Tensor  # uint8 [R, ceil(T/8)]
    n_seen: int  # T

    def ordinals(self) -> torch.Tensor:
        """[R, n] ascending ordinals of the kept tokens (every row keeps the same count)."""
        has = unpack_bits(self.bits, 1)[:, :self.n_seen].bool()
        return has.nonzero()[:, 1].view(has.shape[0], -1)

    def nbytes(self) -> int:
        return nbytes_of(self.bits)


def evict(stores: list, cfg: LowRAMConfig) -> Kept:
    """Keep the best-voted tokens of one xKV group's held prompts (one row group), in place: each store's
    exact keys, values (and LowRAM-SR's post-RoPE keys) shrink to the kept tokens."""
    R, H, T, D = stores[0].shape
    n, w = kept_count(T, cfg), min(cfg.evict_window, T)
    scores = torch.stack([s.votes for s in stores]).amax(dim=0).amax(dim=1)  # [R, T]
    keep = select_tokens(scores, 0, w, n - w)  # [R, n] ascending
    bits = torch.zeros(R, (T + 7) // 8 * 8, dtype=torch.uint8, device=keep.device)
    bits.scatter_(1, keep, 1)
    kept = Kept(pack_bits(bits, 1), T)
    at = keep[:, None, :, None]

    def take(t: torch.Tensor) -> torch.Tensor:  # [R, H, T, X] -> the kept tokens [R, H, n, X]
        return t.gather(2, at.to(t.device).expand(R, H, n, t.shape[-1]))

    for s in stores:
        s.pending = tuple(take(t) for t in s.pending)
        if s.k_post is not None:
            s.k_post = take(s.k_post)
        s.shape, s.n, s.n_prompt, s.kept, s.votes = (R, H, n, D), n, n, kept, None
    return kept
