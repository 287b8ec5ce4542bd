"""Blockwise causal L2 top-k retrieval of references for a block of new tokens (seed §2.2).

Reference: `residualkv.retrieval.topk_refs(queries, refs, n_avail, k)` with refs decoded from their
stored bytes (`residualkv.quant.decode_ref`).

Each program takes BLOCK_T queries of one batch row and streams its share of the references (all of
them, or one of several contiguous ranges when there are few queries - a decode step - so that the
GPU has enough programs; the splits' lists are then merged with two small sorts) in tiles of BLOCK_R,
accumulating q·r and ||r||² over BLOCK_D slices of the feature dim (fp32 dot, IEEE precision: TF32
would reorder near neighbours). The ranking key is ||r||² - 2 q·r, as in the reference (||q||² is
common to every candidate of a query). Only the first n_avail[t] references are candidates for
query t (causality), so the loop stops at the largest n_avail of the block.

The running best-k list lives in registers: after each tile, k rounds of "take the smallest
(distance, index) pair among the current list and the tile" rebuild it in ascending order.

Tie rule: equal distances are ordered by the smaller reference index. torch.topk does not promise
an order among exact ties, and the kernel sums the dot product in a different order than the
reference's matmul (last-bit differences), so the two agree on indices only when the k-th and
(k+1)-th distances are not within rounding of each other; the tests use data with clear gaps.
"""

from __future__ import annotations

import torch

from residualkv.quant import decode_ref
from residualkv.retrieval import topk_refs

from ._common import LazyKernel, cdiv, next_pow2, tl, use_triton


def _topk_l2_kernel(q_ptr, r_ptr, navail_ptr, dist_ptr, idx_ptr, T, R, D, r_per_split, n_splits,
                    s_qb, s_qt, s_rb, s_rr,
                    K: tl.constexpr, KP: tl.constexpr, REF_FP8: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B·T·d can pass 2^31
    split = tl.program_id(2)  # this program's share of the references (decode: few queries, many refs)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    navail = tl.minimum(tl.load(navail_ptr + t, mask=tmask, other=0), R)
    r_lo = split * r_per_split
    r_hi = tl.minimum(tl.max(navail, axis=0), r_lo + r_per_split)  # causal: no query here looks further
    BIG: tl.constexpr = 2147483647
    INF: tl.constexpr = float("inf")

    kcol = tl.arange(0, KP)
    best_d = tl.full([BLOCK_T, KP], INF, tl.float32)
    best_i = tl.full([BLOCK_T, KP], BIG, tl.int32)
    q_base = q_ptr + b * s_qb + t[:, None] * s_qt
    r_base = r_ptr + b * s_rb
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        dot = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        r_sq = tl.zeros([BLOCK_R], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dmask = dd < D
            qt = tl.load(q_base + dd[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            rt = tl.load(r_base + r[:, None] * s_rr + dd[None, :], mask=(r[:, None] < R) & dmask[None, :], other=0)
            if REF_FP8:
                # stored e4m3fn bytes decoded in registers with integer ops (tl.float8e4nv compiles only from
                # sm_89): normal = exponent re-biased by 120 and mantissa moved up 20 bits into an f32;
                # subnormal = m * 2^-9; the encoder saturates, so the NaN byte never occurs
                bi = rt.to(tl.int32)
                e = (bi >> 3) & 15
                mag = tl.where(e > 0, (((e + 120) << 23) | ((bi & 7) << 20)).to(tl.float32, bitcast=True),
                               (bi & 7).to(tl.float32) * 0.001953125)
                rt = tl.where(bi >= 128, -mag, mag)
            rt = rt.to(tl.float32)
            dot += tl.dot(qt, tl.trans(rt), input_precision="ieee")
            r_sq += tl.sum(rt * rt, axis=1)
        dist = r_sq[None, :] - 2.0 * dot
        dist = tl.where((r[None, :] < navail[:, None]) & (r[None, :] < r_hi), dist, INF)

        # merge: K rounds of extracting the smallest (distance, index) from list ∪ tile
        new_d = tl.full([BLOCK_T, KP], INF, tl.float32)
        new_i = tl.full([BLOCK_T, KP], BIG, tl.int32)
        for j in tl.static_range(K):
            m = tl.minimum(tl.min(dist, axis=1), tl.min(best_d, axis=1))
            i_tile = tl.min(tl.where(dist == m[:, None], r[None, :], BIG), axis=1)
            i_best = tl.min(tl.where(best_d == m[:, None], best_i, BIG), axis=1)
            i = tl.minimum(i_tile, i_best)
            new_d = tl.where(kcol[None, :] == j, m[:, None], new_d)
            new_i = tl.where(kcol[None, :] == j, i[:, None], new_i)
            dist = tl.where(r[None, :] == i[:, None], INF, dist)
            best_d = tl.where(best_i == i[:, None], INF, best_d)
        best_d = new_d
        best_i = new_i

    # this split's sorted best-K [B, T, n_splits, K]; infinite distance = no candidate (k_i < k)
    o = ((b * T + t[:, None]) * n_splits + split) * K + kcol[None, :]
    m = tmask[:, None] & (kcol[None, :] < K)
    tl.store(dist_ptr + o, best_d, mask=m)
    tl.store(idx_ptr + o, best_i, mask=m)


_kernel = LazyKernel(_topk_l2_kernel)


def topk_l2(queries: torch.Tensor, refs: torch.Tensor, n_avail: torch.Tensor, k: int, *,
            ref_format: str | None = None, impl: str = "auto",
            block_t: int = 16, block_r: int = 32, block_d: int = 32, r_splits: int | None = None) -> torch.Tensor:
    """queries [B, T, d]; refs [B, R, d] either decoded floats or stored bytes (`ref_format` 'fp8' for
    uint8 e4m3 bytes, 'fp16'); n_avail [T] -> indices [B, T, k] int64 into refs, -1 where k_i < k.

    Same contract as `residualkv.retrieval.topk_refs` (which takes decoded refs)."""
    if ref_format is None and refs.dtype == torch.uint8:
        raise ValueError("refs are raw bytes: pass ref_format='fp8'")
    if not use_triton(impl, queries, refs):
        decoded = refs.float() if ref_format is None else decode_ref(refs, ref_format)
        return topk_refs(queries, decoded, n_avail, k)
    B, T, d = queries.shape
    R = refs.shape[1]
    if not (R and T):
        return torch.full((B, T, k), -1, dtype=torch.long, device=queries.device)
    # strided views are fine (e.g. the filled prefix of a preallocated store): the last dim must be dense
    q = queries if queries.stride(-1) == 1 else queries.contiguous()
    r = refs if refs.stride(-1) == 1 else refs.contiguous()
    fp8 = r.dtype == torch.uint8
    if not fp8 and r.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        r = r.float()
    navail = n_avail.to(device=queries.device, dtype=torch.int32).contiguous()
    block_d = min(block_d, max(16, next_pow2(d)))
    t_blocks = cdiv(T, block_t)
    if r_splits is None:
        # few queries (a decode step) leave the GPU idle: split the references over ~512 programs,
        # each at least 4 reference tiles long
        r_splits = max(1, min(cdiv(R, 4 * block_r), cdiv(512, B * t_blocks)))
    per = cdiv(cdiv(R, r_splits), block_r) * block_r
    r_splits = cdiv(R, per)
    dist = torch.empty(B, T, r_splits, k, dtype=torch.float32, device=queries.device)
    idx = torch.empty(B, T, r_splits, k, dtype=torch.int32, device=queries.device)
    # the split count is a runtime argument: it changes as references accumulate, and a constexpr
    # would recompile the kernel each time
    _kernel[(t_blocks, B, r_splits)](q, r, navail, dist, idx, T, R, d, per, r_splits,
                                     q.stride(0), q.stride(1), r.stride(0), r.stride(1),
                                     K=k, KP=max(2, next_pow2(k)), REF_FP8=fp8,
                                     BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_D=block_d)
    if r_splits > 1:  # merge the splits' lists: order by (distance, index), the kernel's tie rule
        dist, idx = dist.reshape(B, T, -1), idx.reshape(B, T, -1)
        idx, order = idx.sort(dim=-1)
        dist, order = dist.gather(-1, order).sort(dim=-1, stable=True)
        idx = idx.gather(-1, order)
    dist, idx = dist.reshape(B, T, -1)[..., :k], idx.reshape(B, T, -1)[..., :k]
    # slots without a finite candidate (k_i < k) are -1, like the reference's padding
    return torch.where(torch.isfinite(dist), idx.long(), -1)


def bytes_read(queries: torch.Tensor, refs: torch.Tensor, n_avail: torch.Tensor) -> int:
    """Queries once, plus every reference row that some query may consider (refs are re-read per
    query block, from cache; this counts the unique bytes)."""
    R = min(int(n_avail.max()) if n_avail.numel() else 0, refs.shape[1])
    return queries.numel() * queries.element_size() + refs.shape[0] * R * refs.shape[2] * refs.element_size()
