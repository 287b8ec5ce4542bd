"""Fused reconstruct-selected (seed §2.5, §2.7): rebuild only the tokens attention will read.

For each selected latent-code token i of a batch row:

    z~_i      = dequantize(codes_i, mins_i, scales_i)                     (b-bit, groups of g)
    mean_i    = mean of decode_fp8(refs[j]) over the valid j in ref_idx_i  (k_i <= k references; the
                indices bit-packed, quant.PackedIndices, and unpacked in registers)
    kv^_i     = z~_i W_d + mean_i           (W_d: nn.Linear weight [2·d_k, d_c]; identity codec: z~_i)
    K_i | V_i = split(kv^_i);  K_i = RoPE(K_i, position of token i)
    written as K, V [B, H, n_sel, D]

`reconstruct_selected_reference` composes exactly the library functions the cache uses
(`quant.dequantize` -> `LayerCodec.decode` / `F.linear` -> `retrieval.mean_of_refs` on
`quant.decode_ref` -> `rope.apply_rope`); `reconstruct_selected` runs the Triton kernel on CUDA and
that reference elsewhere.

Kernel layout: one program per (batch row, block of BLOCK_N selected tokens, output head), where
heads 0..H-1 are the key heads and H..2H-1 the value heads of the concatenated kv vector. A key
head needs both halves of its D columns at once (rotate_half pairs column j with j + D/2), so each
program computes the two halves as separate [BLOCK_N, D/2] accumulators. The latent is dequantised
straight from the packed bytes one quantisation group (g coordinates) at a time and fed to tl.dot
against the matching W_d slice; the FP8 references are gathered and decoded in registers. Nothing
intermediate touches memory.

Selection rows may be ragged: pad `sel` with -1; padded slots come back as zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from residualkv.quant import Packed, PackedIndices, decode_ref, dequantize, index_span, unpack_indices
from residualkv.retrieval import mean_of_refs
from residualkv.rope import apply_rope

from ._common import LazyKernel, cdiv, interpret_mode, next_pow2, tl, use_triton


def fused_group_ok(group: int) -> bool:
    """The kernel feeds one quantisation group per tl.dot step: powers of two >= 16 only."""
    return group >= 16 and not group & (group - 1)


def _weight_of(decoder) -> torch.Tensor | None:
    """The decoder as a weight matrix [2·d_k, d_c], or None for the identity codec (ResidualKV†)."""
    if decoder is None or isinstance(decoder, torch.Tensor):
        return decoder
    if getattr(decoder.dims, "kind", "swiglu") == "identity":
        return None
    return decoder.w_d.weight


def _decode(decoder, z: torch.Tensor) -> torch.Tensor:
    if decoder is None:
        return z
    if isinstance(decoder, torch.Tensor):  # what nn.Linear(bias=False).forward computes, see LayerCodec.decode
        return F.linear(z.to(decoder.dtype), decoder)
    return decoder.decode(z)


def rope_params(rope) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention_scaling) of a `RopeTable` or a transformers rotary module."""
    rotary = getattr(rope, "rotary", rope)
    return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))


def rope_from_positions(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos, sin [B, n, D] exactly as LlamaRotaryEmbedding.forward builds them (what RopeTable.cos_sin returns)."""
    freqs = positions[..., None].float() * inv_freq.float().to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def reconstruct_selected_reference(codes: Packed, ref_idx: PackedIndices, refs: torch.Tensor, decoder,
                                   sel: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                                   *, bits: int, group: int, num_kv_heads: int, ref_format: str = "fp8",
                                   positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                                   rope_scale: float = 1.0, out_dtype: torch.dtype = torch.float32,
                                   out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Torch reference: see `reconstruct_selected` for the arguments."""
    if cos is None:
        cos, sin = rope_from_positions(positions, inv_freq, rope_scale)
    k, v = _reference(codes, ref_idx, refs, decoder, sel, cos, sin, bits, group, num_kv_heads, ref_format, out_dtype)
    if out is None:
        return k, v
    out[0].copy_(k)
    out[1].copy_(v)
    return out


def _reference(codes, ref_idx, refs, decoder, sel, cos, sin, bits, group, num_kv_heads, ref_format, out_dtype):
    sel = sel.expand(refs.shape[0], -1)
    B, n = sel.shape
    H = num_kv_heads
    D = refs.shape[-1] // (2 * H)
    if n == 0:  # the library's unpack cannot reshape zero tokens
        empty = refs.new_zeros(B, H, 0, D, dtype=out_dtype)
        return empty, empty.clone()
    valid = sel >= 0
    s = sel.clamp(min=0).long()
    rows = torch.arange(B, device=sel.device)[:, None]
    picked = Packed(codes.codes[rows, s], codes.mins[rows, s], codes.scales[rows, s])
    z = dequantize(picked, bits, group)  # [B, n, d_c]
    mean = mean_of_refs(decode_ref(refs, ref_format), unpack_indices(ref_idx.data[rows, s], ref_idx.bits, ref_idx.k))
    kv = _decode(decoder, z).float() + mean
    kv = kv * valid[..., None]
    k, v = kv.split(H * D, dim=-1)
    k = k.reshape(B, n, H, D).transpose(1, 2)
    v = v.reshape(B, n, H, D).transpose(1, 2)
    k = apply_rope(k, cos.float(), sin.float())
    return k.to(out_dtype), v.to(out_dtype)


def _reconstruct_kernel(codes_ptr, mins_ptr, scales_ptr, ridx_ptr, refs_ptr, w_ptr, sel_ptr, cos_ptr, sin_ptr,
                        pos_ptr, invf_ptr, rope_scale, k_ptr, v_ptr, n_sel,
                        s_cb, s_cc, s_mb, s_mc, s_ib, s_ic, s_rb, s_rr, s_sb, s_csb, s_csn, s_pb,
                        s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                        H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, BITS: tl.constexpr,
                        GROUP: tl.constexpr, KREF: tl.constexpr, IDX_BITS: tl.constexpr, IDX_BYTES: tl.constexpr,
                        IDX_SPAN: tl.constexpr, REF_FP8: tl.constexpr, HAS_W: tl.constexpr,
                        ROPE_POS: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, HALF_P: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: key heads, H..2H-1: value heads
    b = tl.program_id(2).to(tl.int64)  # 64-bit offsets: B·H·n_sel·D passes 2^31 at long contexts
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = D // 2
    NG: tl.constexpr = DC // GROUP  # groups per token

    n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok = tl.load(sel_ptr + b * s_sb + n, mask=n < n_sel, other=-1)
    live = tok >= 0
    tok = tl.where(live, tok, 0).to(tl.int64)
    j = tl.arange(0, HALF_P)
    jmask = j < HALF
    col_lo = head * D + j  # kv columns of this head's first half; the second half is + HALF
    col_hi = col_lo + HALF

    code_row = codes_ptr + b * s_cb + tok * s_cc
    mins_row = mins_ptr + b * s_mb + tok * s_mc
    scales_row = scales_ptr + b * s_mb + tok * s_mc
    acc_lo = tl.zeros([BLOCK_N, HALF_P], tl.float32)
    acc_hi = tl.zeros([BLOCK_N, HALF_P], tl.float32)
    if HAS_W:
        # one quantisation group per step: its min/scale are per-token scalars, its codes one byte row
        NBG: tl.constexpr = GROUP // PER_BYTE
        jb = tl.arange(0, NBG)
        c = tl.arange(0, GROUP)
        for g in range(0, NG):
            bt = tl.load(code_row[:, None] + g * NBG + jb[None, :], mask=live[:, None], other=0).to(tl.int32)
            # unpack [BLOCK_N, NBG] bytes to [BLOCK_N, GROUP] codes in storage order (lowest bits first)
            if PER_BYTE == 1:
                qv = bt
            elif PER_BYTE == 2:
                qv = tl.interleave(bt & LEVELS, bt >> 4)
            else:  # 2-bit codes s0..s3 at bits 0, 2, 4, 6: interleave(interleave(s0, s2), interleave(s1, s3))
                qv = tl.interleave(tl.interleave(bt & 3, (bt >> 4) & 3), tl.interleave((bt >> 2) & 3, (bt >> 6) & 3))
            mn = tl.load(mins_row + g, mask=live, other=0.0).to(tl.float32)
            sc = tl.load(scales_row + g, mask=live, other=0.0).to(tl.float32)
            z = (qv.to(tl.float32) * sc[:, None] + mn[:, None]).to(w_ptr.dtype.element_ty)  # LayerCodec.decode's cast
            cc = g * GROUP + c
            w_lo = tl.load(w_ptr + col_lo[:, None] * DC + cc[None, :], mask=jmask[:, None], other=0.0)
            w_hi = tl.load(w_ptr + col_hi[:, None] * DC + cc[None, :], mask=jmask[:, None], other=0.0)
            if UPCAST:  # Triton's interpreter multiplies bf16 operands as raw integers: widen them first
                z = z.to(tl.float32)
                w_lo = w_lo.to(tl.float32)
                w_hi = w_hi.to(tl.float32)
            if IEEE:
                acc_lo += tl.dot(z, tl.trans(w_lo), input_precision="ieee")
                acc_hi += tl.dot(z, tl.trans(w_hi), input_precision="ieee")
            else:
                acc_lo += tl.dot(z, tl.trans(w_lo))
                acc_hi += tl.dot(z, tl.trans(w_hi))
    else:  # identity codec: the latent is the kv residual itself; dequantise just these columns
        m2 = live[:, None] & jmask[None, :]
        for half in tl.static_range(2):
            c = col_lo + half * HALF
            byte = tl.load(code_row[:, None] + c[None, :] // PER_BYTE, mask=m2, other=0).to(tl.int32)
            qv = (byte >> ((c[None, :] % PER_BYTE) * BITS)) & LEVELS
            mn = tl.load(mins_row[:, None] + c[None, :] // GROUP, mask=m2, other=0.0).to(tl.float32)
            sc = tl.load(scales_row[:, None] + c[None, :] // GROUP, mask=m2, other=0.0).to(tl.float32)
            if half == 0:
                acc_lo = qv.to(tl.float32) * sc + mn
            else:
                acc_hi = qv.to(tl.float32) * sc + mn

    # mean of the token's stored references over its valid (>= 0) indices
    sum_lo = tl.zeros([BLOCK_N, HALF_P], tl.float32)
    sum_hi = tl.zeros([BLOCK_N, HALF_P], tl.float32)
    count = tl.zeros([BLOCK_N], tl.float32)
    ridx_row = ridx_ptr + b * s_ib + tok * s_ic
    for kk in tl.static_range(KREF):
        # index kk fills bits kk·IDX_BITS .. of the code's little-endian index bytes, stored + 1 (0 = unused)
        v = tl.zeros([BLOCK_N], tl.int64)
        for t in tl.static_range(IDX_SPAN):
            if (kk * IDX_BITS) // 8 + t < IDX_BYTES:
                v |= tl.load(ridx_row + (kk * IDX_BITS) // 8 + t, mask=live, other=0).to(tl.int64) << (8 * t)
        ri = ((v >> ((kk * IDX_BITS) % 8)) & ((1 << IDX_BITS) - 1)) - 1
        ok = ri >= 0
        rm = ok[:, None] & jmask[None, :]
        ref_row = refs_ptr + b * s_rb + tl.where(ok, ri, 0)[:, None] * s_rr
        r_lo = tl.load(ref_row + col_lo[None, :], mask=rm, other=0)
        r_hi = tl.load(ref_row + col_hi[None, :], mask=rm, other=0)
        if REF_FP8:
            # e4m3fn bytes decoded with integer ops (as in topk_l2): tl.float8e4nv compiles only from sm_89,
            # and this runs on any GPU. Normal: exponent e-7 re-biased to f32's 127, mantissa moved up 20
            # bits; subnormal (e = 0): m * 2^-9. The encoder saturates, so the NaN byte never occurs.
            for half in tl.static_range(2):
                bi = (r_lo if half == 0 else r_hi).to(tl.int32)
                e = (bi >> 3) & 15
                mag = tl.where(e > 0, (((e + 120) << 23) | ((bi & 7) << 20)).to(tl.float32, bitcast=True),
                               (bi & 7).to(tl.float32) * 0.001953125)
                if half == 0:
                    r_lo = tl.where(bi >= 128, -mag, mag)
                else:
                    r_hi = tl.where(bi >= 128, -mag, mag)
        sum_lo += r_lo.to(tl.float32)
        sum_hi += r_hi.to(tl.float32)
        count += ok.to(tl.float32)
    inv = 1.0 / tl.maximum(count, 1.0)
    x_lo = acc_lo + sum_lo * inv[:, None]
    x_hi = acc_hi + sum_hi * inv[:, None]

    out_mask = (n[:, None] < n_sel) & jmask[None, :]
    keep = live[:, None]
    if head < H:
        # RoPE at the token's own position: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x_hi, x_lo)
        if ROPE_POS:  # angles from positions, as LlamaRotaryEmbedding: cat(f, f) with f = pos * inv_freq
            p = tl.load(pos_ptr + b * s_pb + n, mask=n < n_sel, other=0).to(tl.float32)
            f = tl.load(invf_ptr + j, mask=jmask, other=0.0)
            ang = p[:, None] * f[None, :]
            cos_lo = tl.cos(ang) * rope_scale
            sin_lo = tl.sin(ang) * rope_scale
            cos_hi = cos_lo
            sin_hi = sin_lo
        else:
            cs = b * s_csb + n[:, None] * s_csn
            cmask = out_mask & keep
            cos_lo = tl.load(cos_ptr + cs + j[None, :], mask=cmask, other=0.0).to(tl.float32)
            cos_hi = tl.load(cos_ptr + cs + HALF + j[None, :], mask=cmask, other=0.0).to(tl.float32)
            sin_lo = tl.load(sin_ptr + cs + j[None, :], mask=cmask, other=0.0).to(tl.float32)
            sin_hi = tl.load(sin_ptr + cs + HALF + j[None, :], mask=cmask, other=0.0).to(tl.float32)
        y_lo = x_lo * cos_lo - x_hi * sin_lo
        y_hi = x_hi * cos_hi + x_lo * sin_hi
        base = k_ptr + b * s_kb + head * s_kh + n[:, None] * s_kn
    else:
        y_lo = x_lo
        y_hi = x_hi
        base = v_ptr + b * s_vb + (head - H) * s_vh + n[:, None] * s_vn
    y_lo = tl.where(keep, y_lo, 0.0)
    y_hi = tl.where(keep, y_hi, 0.0)
    tl.store(base + j[None, :], y_lo.to(k_ptr.dtype.element_ty), mask=out_mask)
    tl.store(base + HALF + j[None, :], y_hi.to(k_ptr.dtype.element_ty), mask=out_mask)


_kernel = LazyKernel(_reconstruct_kernel)


def reconstruct_selected(codes: Packed, ref_idx: PackedIndices, refs: torch.Tensor, decoder, sel: torch.Tensor,
                         cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *, bits: int, group: int,
                         num_kv_heads: int, ref_format: str = "fp8", positions: torch.Tensor | None = None,
                         inv_freq: torch.Tensor | None = None, rope_scale: float = 1.0,
                         out_dtype: torch.dtype = torch.float32, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         impl: str = "auto", block_n: int = 32, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild the selected latent-code tokens of one layer and one row group of a ResidualStore.

    codes: Packed with fields [B, C, d_c*bits/8] uint8, [B, C, d_c/group] fp16 (mins, scales)
    ref_idx: PackedIndices, data [B, C, ceil(k·bits/8)] uint8     refs: [B, R, 2·d_k] stored (uint8 FP8 bytes or fp16)
    decoder: a `LayerCodec`, its W_d weight [2·d_k, d_c], or None (identity codec)
    sel: [B or 1, n_sel] code ordinals (indices along C), -1 = padding; n_sel may be 0
    RoPE at each selected token's own position, either
      cos, sin: [B or 1, n_sel, D] (`RopeTable.cos_sin` of the positions), or
      positions [B or 1, n_sel] int with inv_freq [D/2] and rope_scale (`rope_params(rope_table)`):
      the kernel then computes the angles itself and reads 4 bytes per token instead of 2·D floats
    out: optional (K, V) views [B, H, n_sel, D] with unit stride on D to write into (e.g. a slice of
      a preallocated attention buffer); otherwise new tensors in out_dtype
    -> K, V [B, num_kv_heads, n_sel, D] (padding slots are zeros)
    """
    if (cos is None) == (positions is None) or (positions is not None and inv_freq is None):
        raise ValueError("give RoPE as cos and sin, or as positions with inv_freq")
    w = _weight_of(decoder)
    if not use_triton(impl, codes.codes, refs, sel):
        return reconstruct_selected_reference(codes, ref_idx, refs, decoder, sel, cos, sin, bits=bits, group=group,
                                              num_kv_heads=num_kv_heads, ref_format=ref_format, positions=positions,
                                              inv_freq=inv_freq, rope_scale=rope_scale, out_dtype=out_dtype, out=out)
    sel = sel.expand(refs.shape[0], -1)
    B, n_sel = sel.shape
    H = num_kv_heads
    d_kv = refs.shape[-1]
    D = d_kv // (2 * H)
    if D * 2 * H != d_kv or D % 2:
        raise ValueError(f"refs have {d_kv} features: not 2 * num_kv_heads({H}) * an even head_dim")
    d_c = codes.mins.shape[-1] * group
    if w is not None and tuple(w.shape) != (d_kv, d_c):
        raise ValueError(f"W_d has shape {tuple(w.shape)}, expected [{d_kv}, {d_c}] (nn.Linear(d_c, 2·d_k) weight)")
    if w is None and d_c != d_kv:
        raise ValueError(f"identity codec needs d_c == 2·d_k, got {d_c} and {d_kv}")
    if (ref_format == "fp8") != (refs.dtype == torch.uint8):
        raise ValueError(f"ref_format={ref_format!r} does not match stored refs of dtype {refs.dtype}")
    if out is None:
        k_out = torch.empty(B, H, n_sel, D, dtype=out_dtype, device=refs.device)
        v_out = torch.empty_like(k_out)
    else:
        k_out, v_out = out
        if k_out.shape != (B, H, n_sel, D) or v_out.shape != k_out.shape or k_out.stride(-1) != 1 or v_out.stride(-1) != 1:
            raise ValueError(f"out must be two [B, H, n_sel, D] = {(B, H, n_sel, D)} views with unit stride on D")
    if n_sel == 0 or B == 0:
        return k_out, v_out
    # strided views are fine (e.g. the filled prefix of a preallocated store); only the last dim must
    # be dense, and mins/scales share one set of strides
    c, mins, scales = (_dense_last(t) for t in codes)
    if mins.stride() != scales.stride():
        mins, scales = mins.contiguous(), scales.contiguous()
    ridx = _dense_last(ref_idx.data)
    r = _dense_last(refs)
    s = _dense_last(sel.expand(B, n_sel))
    if cos is not None:
        cos = cos.expand(B, n_sel, D)
        sin = sin.expand(B, n_sel, D)
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        pos, invf, s_pb = s, mins, 0  # unused pointers (never read when ROPE_POS is off)
    else:
        pos = positions.expand(B, n_sel)
        if pos.stride(-1) != 1:
            pos = pos.contiguous()
        invf = inv_freq.to(device=refs.device, dtype=torch.float32).contiguous()
        if invf.numel() != D // 2:
            raise ValueError(f"inv_freq has {invf.numel()} entries, expected head_dim/2 = {D // 2}")
        cos = sin = mins  # unused
        s_pb = pos.stride(0)
    w_arg = w.contiguous() if w is not None else mins  # any pointer: never read without HAS_W
    if w is not None and not fused_group_ok(group):
        raise ValueError(f"group_size={group}: the kernel feeds one group per tl.dot step (a power of two >= 16)")
    upcast = interpret_mode() and w is not None and w.dtype == torch.bfloat16
    grid = (cdiv(n_sel, block_n), 2 * H, B)
    rope_pos = positions is not None
    _kernel[grid](c, mins, scales, ridx, r, w_arg, s, cos, sin, pos, invf, float(rope_scale), k_out, v_out, n_sel,
                  c.stride(0), c.stride(1), mins.stride(0), mins.stride(1), ridx.stride(0), ridx.stride(1),
                  r.stride(0), r.stride(1), s.stride(0),
                  0 if rope_pos else cos.stride(0), 0 if rope_pos else cos.stride(1), s_pb,
                  k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
                  H=H, D=D, DC=d_c, BITS=bits, GROUP=group, KREF=ref_idx.k, IDX_BITS=ref_idx.bits,
                  IDX_BYTES=ridx.shape[-1], IDX_SPAN=index_span(ref_idx.bits), REF_FP8=r.dtype == torch.uint8,
                  HAS_W=w is not None, ROPE_POS=rope_pos, IEEE=upcast or (w is not None and w.dtype == torch.float32), UPCAST=upcast,
                  HALF_P=max(16, next_pow2(D // 2)), BLOCK_N=block_n, num_warps=num_warps)
    return k_out, v_out


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def bytes_moved(codes: Packed, ref_idx: PackedIndices, refs: torch.Tensor, decoder, sel: torch.Tensor,
                rope: torch.Tensor, out_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes read, bytes written) that one call must move at least.

    Read: each selected token's codes, mins, scales and ref_idx row; every *distinct* reference row
    those tokens use (a reference shared by many tokens is counted once - the conservative choice);
    W_d once; the RoPE input (`rope`: the cos tensor - counted twice, with sin - or the positions).
    Written: K and V."""
    sel = sel.expand(refs.shape[0], -1)
    B, n = sel.shape
    valid = sel >= 0
    s = sel.clamp(min=0).long()
    rows = torch.arange(B, device=sel.device)[:, None]
    per_tok = (codes.codes.shape[-1] * 1 + 2 * codes.mins.shape[-1] * 2 + ref_idx.data.shape[-1])
    read = int(valid.sum()) * per_tok
    idx = unpack_indices(ref_idx.data[rows, s], ref_idx.bits, ref_idx.k)
    idx = torch.where(valid[..., None] & (idx >= 0), idx, -1)
    distinct = sum(int(torch.unique(idx[b][idx[b] >= 0]).numel()) for b in range(B))
    read += distinct * refs.shape[-1] * refs.element_size()
    w = _weight_of(decoder)
    if w is not None:
        read += w.numel() * w.element_size()
    if rope.is_floating_point():  # cos and sin
        read += 2 * rope.shape[0] * n * rope.shape[-1] * rope.element_size()
    else:  # positions
        read += rope.shape[0] * n * rope.element_size()
    d_kv = refs.shape[-1]
    written = B * n * d_kv * torch.empty(0, dtype=out_dtype).element_size()
    return read, written
