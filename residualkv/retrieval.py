"""Causal L2 top-k retrieval of references (seed §2.2).

For each non-reference token, the k_i = min(k, #refs before it) stored references with the smallest
squared L2 distance, and their arithmetic mean. References are given in ordinal order, so "the
references before token t" are the first `n_avail[t]` of them. Distances and the mean use the
*stored* reference values (after their FP8/FP16 round trip), exactly what the decoder will see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 2048  # queries per distance block: bounds the [B, chunk, R] distance matrix


def topk_refs(queries: torch.Tensor, refs: torch.Tensor, n_avail: torch.Tensor, k: int) -> torch.Tensor:
    """queries [B, T, d], refs [B, R, d], n_avail [T] -> indices [B, T, k] into refs, -1 where k_i < k."""
    B, T, _ = queries.shape
    R = refs.shape[1]
    out = torch.full((B, T, k), -1, dtype=torch.long, device=queries.device)
    if R == 0 or T == 0:
        return out
    kk = min(k, R)
    r = refs.float()
    r_sq = r.pow(2).sum(-1)  # [B, R]
    cols = torch.arange(R, device=queries.device)
    for s in range(0, T, CHUNK):
        q = queries[:, s : s + CHUNK].float()
        # ||q||^2 is the same for every candidate of a query, so it cannot change the ranking
        d = r_sq.unsqueeze(1) - 2 * q @ r.transpose(1, 2)  # [B, t, R]
        avail = n_avail[s : s + CHUNK].to(queries.device)
        d = d.masked_fill(cols[None, None, :] >= avail[None, :, None], float("inf"))
        idx = d.topk(kk, dim=-1, largest=False).indices  # [B, t, kk]
        valid = torch.arange(kk, device=queries.device)[None, None, :] < avail[None, :, None]
        out[:, s : s + CHUNK, :kk] = torch.where(valid, idx, -1)
    return out


def mean_of_refs(refs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """refs [B, R, d] (decoded), idx [B, T, k] with -1 padding -> mean [B, T, d] over the valid entries.

    embedding_bag sums the k rows without materialising the [B, T, k, d] gather (~10x faster on CPU;
    same order of additions, so the same bits forward; its backward rounds differently, ~1e-8), and it is
    differentiable in `refs` for training. Padding
    entries read row 0 with weight 0 (adding +0 changes no sum) rather than being found and masked out:
    asking whether any entry is padding would be a host-device sync on a GPU.
    """
    B, R, d = refs.shape
    T, k = idx.shape[1], idx.shape[2]
    valid = idx >= 0
    if R == 0:  # no reference yet: every entry is padding
        return refs.new_zeros(B, T, d)
    flat = (idx.clamp(min=0) + (torch.arange(B, device=idx.device) * R)[:, None, None]).reshape(B * T, k)
    total = F.embedding_bag(flat, refs.reshape(B * R, d), mode="sum",
                            per_sample_weights=valid.reshape(B * T, k).to(refs.dtype))
    # in place: a fresh [B, T, d] result costs more than the division on CPU (embedding_bag's backward
    # does not keep its output, so training is unaffected)
    return total.reshape(B, T, d).div_(valid.sum(-1, keepdim=True).clamp(min=1).to(refs.dtype))
