"""Reuse of reconstructed tokens between decode steps: the sparse paths' buffers.

Consecutive decode steps choose mostly the same tokens (OmniKV's I_t overlaps ~78% step to step on
SmolLM2 at 8K; LowRAM-SR's chunks ~84%). A buffer keeps what a step reconstructed, in slots: an id keeps
its slot while it stays chosen, and the next step reconstructs only the ids its selection adds, into
slots that hold ids it dropped. Attention does not depend on the order of its columns, so a buffer is
read in slot order next to the map of what each slot holds. A buffer is working memory (it can always be
rebuilt from the stored bytes): reported beside KR, never in it.

`assign` is the slot bookkeeping both buffers share; `TokenBuffer` is ResidualKV + OmniKV's (one per
compressed layer and row group); LowRAM-SR keeps chunks (residualkv/lowram/selective.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .stores import nbytes_of


def assign(held: torch.Tensor, wanted: torch.Tensor, universe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots for a new selection. held [..., n]: the id each slot holds (-1: none); wanted [..., m]: the
    ids to hold now, distinct within each entry, in [0, universe), m <= n.

    Returns (ids [..., j], slots [..., j], visible [..., n]): the ids to rebuild and the slots they go to,
    and which slots hold a wanted id afterwards. Every wanted id no slot holds goes to a slot whose id is
    not wanted; j is the largest such count over the leading entries, and an entry with fewer rebuilds
    ids it holds in their own slots to make up j (so the rebuild stays one batched call). `held` is
    updated in place."""
    dev, n = held.device, held.shape[-1]
    wanted = wanted.long()
    named = torch.where(held >= 0, held, universe)  # empty slots name a dummy id past the universe
    slot_of = torch.full((*held.shape[:-1], universe + 1), -1, dtype=torch.long, device=dev)
    slot_of.scatter_(-1, named, torch.arange(n, device=dev).expand_as(held))
    is_wanted = torch.zeros_like(slot_of, dtype=torch.bool)
    is_wanted.scatter_(-1, wanted, True)
    own = slot_of.gather(-1, wanted)  # [..., m]: the slot holding each wanted id, -1 = none
    found, kept = own >= 0, is_wanted.gather(-1, named)
    j = int((~found).sum(-1).max()) if wanted.numel() else 0
    if j:
        order = torch.argsort(found.to(torch.uint8), dim=-1, stable=True)[..., :j]  # ids not held first
        ids = wanted.gather(-1, order)
        freed = torch.argsort(kept.to(torch.uint8), dim=-1, stable=True)[..., :j]  # slots not wanted first
        slots = torch.where(found.gather(-1, order), own.gather(-1, order), freed)
        held.scatter_(-1, slots, ids)
        kept.scatter_(-1, slots, True)
    else:
        ids = slots = wanted[..., :0]
    return ids, slots, kept


def put(buf: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[..., at[..., i], :] = rows[..., i, :] for contiguous buf [..., N, D], at [..., j], rows [..., j, D]:
    one index_copy_ of whole D-wide rows, ~4x faster on CPU than a scatter_ over an index expanded to D."""
    N, D = buf.shape[-2:]
    lead = at.numel() // max(at.shape[-1], 1)
    idx = (torch.arange(lead, device=at.device)[:, None] * N + at.reshape(lead, -1)).reshape(-1)
    buf.view(-1, D).index_copy_(0, idx, rows.reshape(-1, D).to(buf.dtype))


class TokenBuffer:
    """One row group's reconstructed history tokens kept between decode steps, for a compressed layer
    under OmniKV: K, V [B, H, n, D], keys rotated, and the ordinal each slot holds [B, n] (-1: none).
    K and V are kept in the attention's dtype where it is 16-bit (the bits a fresh read hands it), else
    in FP16 (a float32 model on CPU: half the memory, reads within FP16 rounding of a fresh read, as
    LowRAM-SR's buffer). Tokens read from the FP16 recent window are read again at every step, since
    they are coded when they leave it."""

    def __init__(self):
        self.ids: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.visible: torch.Tensor | None = None  # [B, n] the slot holds a token of the last selection
        self.coded = 0  # ordinals below this were coded at the last read (the rest came from the window)
        # slots the last read left holding no wanted token (the wanted ids are distinct, each in one slot):
        # known on the host, so the attention masks them only where there are any, without asking the device
        self.spare = 0

    def read(self, wanted: torch.Tensor, n_coded: int, n: int,
             rebuild: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, H, slots, D] holding the tokens at ordinals `wanted` [B, S] of a store with n tokens,
        n_coded of them coded; `rebuild(ordinals [B, j])` reconstructs tokens (K, V [B, H, j, D]) for an
        attention in `dtype`. Slots holding tokens not wanted are left in place: `columns` masks them."""
        B, S = wanted.shape
        keep = dtype if dtype.itemsize == 2 else torch.float16
        if self.ids is None:
            self.k, self.v = (t.to(keep).contiguous() for t in rebuild(wanted))
            self.ids, self.visible = wanted.clone().long(), torch.ones_like(wanted, dtype=torch.bool)
        else:
            self.ids.masked_fill_(self.ids >= self.coded, -1)  # window reads: coded since, or read again anyway
            if S > self.ids.shape[1]:  # a ratio budget grows with the history: empty slots at the end
                grow = S - self.ids.shape[1]
                self.ids = torch.cat([self.ids, self.ids.new_full((B, grow), -1)], dim=1)
                pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])], dim=2)  # noqa: E731
                self.k, self.v = pad(self.k), pad(self.v)
            ids, slots, self.visible = assign(self.ids, wanted, n)
            if ids.shape[1]:
                k, v = rebuild(ids)
                at = slots[:, None].expand(B, k.shape[1], -1)
                put(self.k, at, k)
                put(self.v, at, v)
        self.coded = n_coded
        self.spare = self.ids.shape[1] - S
        return self.k, self.v

    def columns(self) -> torch.Tensor:
        """[B, slots] the ordinal each returned column holds, -1 where the attention must not look."""
        return torch.where(self.visible, self.ids, -1)

    def nbytes(self) -> int:
        return nbytes_of(self.ids, self.k, self.v, self.visible)


__all__ = ["TokenBuffer", "assign", "put"]
