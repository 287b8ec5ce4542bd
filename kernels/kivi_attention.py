"""Decode attention over a KIVI-quantised full-attention layer, dequantisation fused (seed §4.5).

Reference: `KiviStore.read(dtype)` (dequantise the whole history to floats) followed by
`F.scaled_dot_product_attention` with GQA - what the library does on CPU. The seed names exactly
that materialisation as why quantised ResidualKV decodes slower than unquantised; the kernel reads
the packed bytes and never writes the FP16 history anywhere.

Storage (see `residualkv.stores.KiviStore`), per batch row b and KV head h:
  keys    codes [B, H, G, D, g·bits/8], mins/scales [B, H, G, D, 1]: channel d of token group G
          (g = full_group_size consecutive tokens) is one quantisation group along the tokens
  values  codes [B, H, n_q, D·bits/8], mins/scales [B, H, n_q, D/gv]: per token, groups along D
  window  win_k, win_v [B, H, w, D] FP16: the newest tokens, not yet a whole key group

Split-K ("flash-decoding"): program (b, h, split) runs an online softmax over a contiguous range of
key groups for all Hq/H query heads that share KV head h (GQA: they reuse the dequantised tiles);
one extra split handles the FP16 window. A second small kernel merges the partial (max, sum, acc)
of the splits. A key group is exactly one [D, g] tile, already in the K^T layout q @ K^T needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import LazyKernel, cdiv, interpret_mode, next_pow2, tl, use_triton


def kivi_decode_attention_reference(q: torch.Tensor, store, scale: float | None = None) -> torch.Tensor:
    k, v = store.read(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _kivi_attn_kernel(q_ptr, kc_ptr, kmin_ptr, ksc_ptr, vc_ptr, vmin_ptr, vsc_ptr, wk_ptr, wv_ptr,
                      acc_ptr, m_ptr, l_ptr,
                      G, W, blocks_per_split, n_split, sm_scale,
                      s_kc, s_km, s_vc, s_vm,
                      HKV: tl.constexpr, QPG: tl.constexpr, QP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                      BITS: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # b * HKV + h
    split = tl.program_id(1)
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    NBK: tl.constexpr = KG * BITS // 8  # key bytes per channel per group
    NBV: tl.constexpr = D * BITS // 8  # value bytes per token
    NVG: tl.constexpr = D // VG  # value groups per token
    LOG2E: tl.constexpr = 1.4426950408889634

    qi = tl.arange(0, QP)
    d = tl.arange(0, DP)
    t = tl.arange(0, KG)
    qmask = qi < QPG
    dmask = d < D
    # the QPG query heads of this KV head are consecutive in q [B, Hq, 1, D]
    qrow = bh * QPG + qi
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:  # Triton's interpreter multiplies bf16 operands as raw integers: compute in fp32 there
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E  # softmax in base 2

    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, DP], tl.float32)

    # one pass over this split's blocks of KG tokens: its quantised key groups, then (last split only) the
    # FP16 window, whose final block is masked at W; the window split's g_lo clamps to G (no groups)
    g_lo = tl.minimum(split * blocks_per_split, G)
    g_hi = tl.minimum(g_lo + blocks_per_split, G)
    n_win = tl.where(split == n_split - 1, tl.cdiv(W, KG), 0)
    for blk in range(g_lo, g_hi + n_win):
        if blk < g_hi:
            # keys: tile [D, KG] of group blk, channel-major (per-channel min/scale)
            # s_*: elements between consecutive (b, h) in each tensor (the stores keep spare capacity)
            kb = tl.load(kc_ptr + bh * s_kc + (blk * D + d[:, None]) * NBK + t[None, :] // PER_BYTE,
                         mask=dmask[:, None], other=0)
            kq = (kb.to(tl.int32) >> ((t[None, :] % PER_BYTE) * BITS)) & LEVELS
            kmn = tl.load(kmin_ptr + bh * s_km + blk * D + d, mask=dmask, other=0.0).to(tl.float32)
            ksc = tl.load(ksc_ptr + bh * s_km + blk * D + d, mask=dmask, other=0.0).to(tl.float32)
            kt = (kq.to(tl.float32) * ksc[:, None] + kmn[:, None]).to(q.dtype)
            # values: tile [KG, D], per-token groups along D
            tok = blk * KG + t
            vb = tl.load(vc_ptr + bh * s_vc + tok[:, None] * NBV + d[None, :] // PER_BYTE, mask=dmask[None, :],
                         other=0)
            vq = (vb.to(tl.int32) >> ((d[None, :] % PER_BYTE) * BITS)) & LEVELS
            vmn = tl.load(vmin_ptr + bh * s_vm + tok[:, None] * NVG + d[None, :] // VG, mask=dmask[None, :],
                          other=0.0).to(tl.float32)
            vsc = tl.load(vsc_ptr + bh * s_vm + tok[:, None] * NVG + d[None, :] // VG, mask=dmask[None, :],
                          other=0.0).to(tl.float32)
            vt = (vq.to(tl.float32) * vsc + vmn).to(q.dtype)
            tmask = t < KG
        else:
            tw = (blk - g_hi) * KG + t
            tmask = tw < W
            wrow = bh * W + tw
            kt = tl.load(wk_ptr + wrow[None, :] * D + d[:, None], mask=dmask[:, None] & tmask[None, :],
                         other=0.0).to(q.dtype)
            vt = tl.load(wv_ptr + wrow[:, None] * D + d[None, :], mask=tmask[:, None] & dmask[None, :],
                         other=0.0).to(q.dtype)

        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, kt) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vt)
        m_i = m_new

    # partial results [B*Hq, n_split, ...]; an empty split leaves m = -inf, l = 0, acc = 0
    prow = qrow * n_split + split
    tl.store(m_ptr + prow, m_i, mask=qmask)
    tl.store(l_ptr + prow, l_i, mask=qmask)
    tl.store(acc_ptr + prow[:, None] * D + d[None, :], acc, mask=qmask[:, None] & dmask[None, :])


def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, n_split, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * Hq + query head
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    smask = s < n_split
    m = tl.load(m_ptr + row * n_split + s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row * n_split + s, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (row * n_split + s[:, None]) * D + d[None, :], mask=smask[:, None] & (d[None, :] < D),
                  other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.math.exp2(m - m_all)  # empty splits: exp2(-inf) = 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


_attn = LazyKernel(_kivi_attn_kernel)
_merge = LazyKernel(_merge_kernel)


def kernel_fits(full_group_size: int) -> bool:
    """The kernel tiles one key group as a power-of-two block of at least 16 tokens; the config accepts
    any multiple of 8, and other sizes run the reference."""
    return full_group_size >= 16 and not full_group_size & (full_group_size - 1)


def kivi_decode_attention(q: torch.Tensor, store, *, scale: float | None = None, impl: str = "auto",
                          n_splits: int | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D] (one decode step; Hq a multiple of the store's KV heads) attending over every
    token of a `KiviStore` (packed history + FP16 window) -> [B, Hq, 1, D] in q's dtype. Under impl
    "auto" a key group the kernel cannot tile (kernel_fits) runs the reference; "triton" refuses it."""
    win_k, win_v = store.win_k, store.win_v
    kq, vq = store.kq, store.vq
    if not use_triton(impl, q, win_k) or (impl == "auto" and not kernel_fits(store.cfg.full_group_size)):
        return kivi_decode_attention_reference(q, store, scale)
    B, Hq, Tq, D = q.shape
    if Tq != 1:
        raise ValueError(f"kivi_decode_attention is for one decode step; got {Tq} query positions")
    H = win_k.shape[1]
    if Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    cfg = store.cfg
    bits, kg = cfg.full_bits, cfg.full_group_size
    vg = store.value_group(D)
    G = 0 if kq is None else kq.codes.shape[2]
    W = win_k.shape[2]
    if G * kg + W == 0:
        raise ValueError("the KIVI store is empty: nothing to attend to")
    if not kernel_fits(kg):
        raise ValueError(f"full_group_size={kg}: the kernel tiles one key group as a power-of-two block >= 16")
    dev = q.device
    if n_splits is None:
        # enough programs to fill the device (about 4 waves of 132 SMs), at least one group each
        n_splits = max(1, min(G, cdiv(528, B * H))) if G else 1
    bps = cdiv(G, n_splits) if G else 0
    n_q_splits = cdiv(G, bps) if G else 0
    nsplit = n_q_splits + 1  # + the window split
    u8 = torch.zeros(1, dtype=torch.uint8, device=dev)
    f16 = torch.zeros(1, dtype=torch.float16, device=dev)
    if G:
        (kc, kmn, ksc), (vc, vmn, vsc) = _by_head(kq), _by_head(vq)
        strides = (kc.stride(1), kmn.stride(1), vc.stride(1), vmn.stride(1))
    else:  # the window alone: placeholders, never read
        kc, kmn, ksc, vc, vmn, vsc, strides = u8, f16, f16, u8, f16, f16, (0, 0, 0, 0)
    wk = win_k.contiguous() if W else f16
    wv = win_v.contiguous() if W else f16
    qc = q.contiguous()
    upcast = interpret_mode() and q.dtype == torch.bfloat16
    part_acc = torch.empty(B * Hq, nsplit, D, dtype=torch.float32, device=dev)
    part_m = torch.empty(B * Hq, nsplit, dtype=torch.float32, device=dev)
    part_l = torch.empty(B * Hq, nsplit, dtype=torch.float32, device=dev)
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qpg = Hq // H
    # the split count is a runtime argument: it changes as the history grows, a constexpr would recompile
    _attn[(B * H, nsplit)](qc, kc, kmn, ksc, vc, vmn, vsc, wk, wv, part_acc, part_m, part_l,
                           G, W, max(bps, 1), nsplit, sm_scale,
                           *strides,
                           HKV=H, QPG=qpg, QP=max(16, next_pow2(qpg)), D=D, DP=max(16, next_pow2(D)),
                           BITS=bits, KG=kg, VG=vg, IEEE=upcast or q.dtype == torch.float32, UPCAST=upcast)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=dev)
    _merge[(B * Hq,)](part_acc, part_m, part_l, out, nsplit, D=D, DP=max(16, next_pow2(D)),
                      SP=max(2, next_pow2(nsplit)))
    return out


def _by_head(packed) -> list[torch.Tensor]:
    """The fields of a packed store [B, H, n, ...] as the kernel reads them: each (b, h) block dense,
    consecutive (b, h) one stride apart (`stride(1)`), and mins and scales with the same strides, as in
    the filled prefix of a store grown in place. Anything else is copied into that layout."""
    out = []
    for t in packed:
        ok = t[0, 0].is_contiguous() and (t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1))
        out.append(t if ok else t.contiguous())
    if out[1].stride() != out[2].stride():
        out[1:] = [t.contiguous() for t in out[1:]]
    return out


def bytes_read(q: torch.Tensor, store) -> int:
    """Packed keys and values, their mins/scales, the FP16 window and q: all of it, once."""
    tensors = [q, store.win_k, store.win_v]
    for p in (store.kq, store.vq):
        if p is not None:
            tensors.extend(p)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
