"""Quantise-and-pack of new latents on write (seed §2.4), bit-exact with `residualkv.quant.quantize`.

Reference: `residualkv.quant.quantize(x, bits, group)` - the library's own CPU path - with its FP16
minimum rounded toward -inf and scale toward +inf (`quant._round_fp16`); tests/test_kernels.py checks
the kernel's bytes against it.

The last dim is cut into groups of `group` coordinates that never cross tokens, so a contiguous
[..., d] tensor is simply M = numel / group groups laid end to end: the kernel sees a [M, group]
matrix and each program quantises BLOCK_M whole groups. Per group, exactly as the reference does:

    x    = clamp(x, ±FP16_MAX/4)                (float32)
    mn   = min(x) rounded DOWN to an FP16 value
    s    = ((max(x) - mn) / (2^b - 1)) rounded UP to an FP16 value
    q    = round_half_even((x - mn) / s), 0 where s == 0 (a constant group), clamped to [0, 2^b - 1]
    byte = q[j*per_byte + 0] | q[j*per_byte + 1] << b | ...     (little end first)

How the FP16 directed roundings are reproduced: convert to FP16 with round-to-nearest (what both
torch and Triton do), and where that landed on the wrong side of the float32 value step the FP16 bit
pattern by one toward -inf (for the minimum) or +inf (for the scale). Stepping an IEEE half by one
ulp on its bits: positive values move by -1/+1 on the raw bits, negative values the other way, and
both zeros step to the smallest subnormal of the required sign - the same values torch.nextafter
gives in the reference. The division uses `div_rn` (correctly rounded, like torch), not Triton's
default approximate fp32 division, and round-half-even uses the 1.5·2^23 trick, exact for the
0 <= v < 2^22 this code ever rounds.
"""

from __future__ import annotations

import torch

from residualkv.quant import FP16_MAX, Packed, quantize

from ._common import LazyKernel, cdiv, tl, use_triton

SUPPORTED_BITS = (2, 4, 8)


def _quant_pack_kernel(x_ptr, codes_ptr, mins_ptr, scales_ptr, M,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CLAMP: tl.constexpr):
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE  # packed bytes per group
    LEVELS: tl.constexpr = (1 << BITS) - 1

    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # group ids
    rmask = rows < M
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + rows[:, None] * GROUP + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    x = tl.minimum(tl.maximum(x, -CLAMP), CLAMP)

    # minimum, rounded down to FP16
    lo = tl.min(x, axis=1)
    h = lo.to(tl.float16)
    hb = h.to(tl.int16, bitcast=True)
    below = tl.where(hb > 0, hb - 1, tl.where(hb == 0, -32767, hb + 1)).to(tl.int16)  # -32767 = 0x8001
    mn = tl.where(h.to(tl.float32) > lo, below.to(tl.float16, bitcast=True), h)

    # scale, rounded up to FP16 (its float32 value is >= 0, but the step handles either sign)
    raw = tl.math.div_rn(tl.max(x, axis=1) - mn.to(tl.float32), tl.full([BLOCK_M], LEVELS, tl.float32))
    h = raw.to(tl.float16)
    hb = h.to(tl.int16, bitcast=True)
    above = tl.where(hb >= 0, hb + 1, tl.where(hb == -32768, 1, hb - 1)).to(tl.int16)
    scale = tl.where(h.to(tl.float32) < raw, above.to(tl.float16, bitcast=True), h)

    s = scale.to(tl.float32)[:, None]
    pos = s > 0
    v = tl.math.div_rn(x - mn.to(tl.float32)[:, None], tl.where(pos, s, 1.0))
    v = tl.where(pos, v, 0.0)
    v = (v + 12582912.0) - 12582912.0  # round half to even (1.5 * 2^23), like torch.round
    q = tl.minimum(tl.maximum(v, 0.0), LEVELS).to(tl.int32)

    # pack: PER_BYTE consecutive codes per byte, the first in the lowest bits
    q = tl.reshape(q, [BLOCK_M, NB, PER_BYTE])
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(q << shifts[None, None, :], axis=2)  # disjoint bit fields: the sum is an OR
    nb = tl.arange(0, NB)
    tl.store(codes_ptr + rows[:, None] * NB + nb[None, :], packed.to(tl.uint8), mask=rmask[:, None])
    tl.store(mins_ptr + rows, mn, mask=rmask)
    tl.store(scales_ptr + rows, scale, mask=rmask)


_kernel = LazyKernel(_quant_pack_kernel)


def quantize_pack(x: torch.Tensor, bits: int, group: int = 32, *, impl: str = "auto", block_m: int = 64) -> Packed:
    """Same contract as `residualkv.quant.quantize`: x [..., d] -> Packed(codes [..., d*bits/8] uint8,
    mins [..., d/group] fp16, scales [..., d/group] fp16)."""
    shape_ok = bits in SUPPORTED_BITS and not x.shape[-1] % group and not group & (group - 1) and group >= 8 // bits
    if not use_triton(impl, x) or (impl == "auto" and not shape_ok):  # "auto": the kernel where it applies
        return quantize(x, bits, group)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits}: the kernel packs {SUPPORTED_BITS}-bit codes")
    if x.shape[-1] % group or group & (group - 1) or group < 8 // bits:
        raise ValueError(f"last dim {x.shape[-1]} must be a multiple of group_size={group}, a power of two "
                         "(the kernel tiles one group per row)")
    lead = x.shape[:-1]
    d = x.shape[-1]
    xf = x.contiguous()
    if xf.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        xf = xf.float()
    M = xf.numel() // group
    codes = torch.empty(*lead, d * bits // 8, dtype=torch.uint8, device=x.device)
    mins = torch.empty(*lead, d // group, dtype=torch.float16, device=x.device)
    scales = torch.empty_like(mins)
    if M:
        _kernel[(cdiv(M, block_m),)](xf, codes, mins, scales, M, BITS=bits, GROUP=group, BLOCK_M=block_m,
                                           CLAMP=FP16_MAX / 4)
    return Packed(codes, mins, scales)


def bytes_moved(x: torch.Tensor, bits: int, group: int) -> tuple[int, int]:
    """(bytes read, bytes written) by one call: the latents in, codes + FP16 min/scale out."""
    n = x.numel()
    return n * x.element_size(), n * bits // 8 + 2 * 2 * (n // group)
