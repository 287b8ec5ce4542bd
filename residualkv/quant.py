"""Group quantisation with really packed storage, and FP8 reference storage (seed §2.4, §3.3).

A group is `group` consecutive coordinates of the last dimension. Each group stores b-bit codes
packed into uint8 plus an FP16 minimum and FP16 scale, so the storage per coordinate is
b/16 + 2/group of FP16 (q_4 = 31.25%, q_2 = 18.75% at g = 32). The minimum is rounded down and the
scale up when stored in FP16, so every coordinate, including each group's maximum, stays on the grid
the decoder will use: the rounding error is at most half a step of the stored scale.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from .growing import take_rows

FP16_MAX = 65504.0
FP8_E4M3_MAX = 448.0


class Packed(NamedTuple):
    """b-bit codes packed along the last dim, with per-group FP16 minimum and scale."""

    codes: torch.Tensor  # uint8 [..., d * bits / 8]
    mins: torch.Tensor  # float16 [..., d / group]
    scales: torch.Tensor  # float16 [..., d / group]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) along the last dim into uint8; little end first."""
    per_byte = 8 // bits
    if q.shape[-1] % per_byte:
        raise ValueError(f"last dim {q.shape[-1]} must be a multiple of {per_byte} to pack {bits}-bit codes")
    q = q.to(torch.uint8).reshape(*q.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
    return (q << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    # one shift per code in a byte, stacked: ~2x faster on CPU than broadcasting a tensor of shifts
    mask = (1 << bits) - 1
    parts = [packed >> s if s + bits == 8 else (packed >> s) & mask for s in range(0, 8, bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)


def _round_fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round float32 to the neighbouring FP16 value towards `direction` (-inf: down, +inf: up).

    nextafter steps towards its second argument, so it must be ±inf, not ±1; it steps in FP16 itself
    (a float32 step from an FP16 value would round straight back to it)."""
    h = x.to(torch.float16)
    off = (h.float() < x) if direction > 0 else (h.float() > x)
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction)), h)


def _grid(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} must be a multiple of group_size={group}; "
                         "choose sizes (latent d_c, head_dim) that are multiples of the group size")
    g = x.float().clamp(-FP16_MAX / 4, FP16_MAX / 4).reshape(*x.shape[:-1], -1, group)
    levels = (1 << bits) - 1
    mn = _round_fp16(g.amin(dim=-1), float("-inf"))
    scale = _round_fp16((g.amax(dim=-1) - mn.float()) / levels, float("inf"))
    return g, mn, scale


def quantize(x: torch.Tensor, bits: int, group: int) -> Packed:
    """Quantise the last dim of `x` in groups; returns really packed bytes."""
    g, mn, scale = _grid(x, bits, group)
    s = scale.float().unsqueeze(-1)
    # constant groups have scale 0: their code is 0 and they decode to the stored minimum
    q = torch.where(s > 0, (g - mn.float().unsqueeze(-1)) / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return Packed(pack_bits(q.reshape(*x.shape[:-1], -1), bits), mn, scale)


def dequantize(p: Packed, bits: int, group: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes * scale + minimum, in float32 (then `dtype`). `out`, a float32 tensor (a strided view of
    a larger buffer is fine) shaped like the decoded values, receives them without a copy."""
    q = unpack_bits(p.codes, bits)
    q = q.view(*q.shape[:-1], -1, group)
    if out is None:
        x = q.float()
    elif out.dtype != torch.float32:
        raise ValueError(f"dequantize(out=...) writes float32, got {out.dtype}")
    else:
        x = out.unflatten(-1, (-1, group))
        x.copy_(q)
    # in place: on CPU fresh large temporaries cost more than the arithmetic
    x.mul_(p.scales.float().unsqueeze(-1)).add_(p.mins.float().unsqueeze(-1))
    return x.reshape(*x.shape[:-2], -1).to(dtype) if out is None else out


def quant_error_bound(z: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed §2.8: ||e_q|| <= sqrt(sum_G |G| range_G^2) / (2(2^b-1)) <= sqrt(g/2)/(2^b-1) ||z||."""
    g = z.float().reshape(*z.shape[:-1], -1, group)
    rng = g.amax(-1) - g.amin(-1)
    levels = (1 << bits) - 1
    tight = (group * rng.pow(2)).sum(-1).sqrt() / (2 * levels)
    loose = (group / 2) ** 0.5 / levels * z.float().norm(dim=-1)
    return tight, loose


# ---- reference indices: k per code, each as few bits as the references held need ----

class PackedIndices(NamedTuple):
    """The k reference indices of each code (seed §2.3), `bits` each: index j of a row fills bits
    j·bits .. (j+1)·bits − 1 of the row's little-endian bytes, stored + 1 so that 0 means an unused slot
    (a code that saw fewer than k references). ceil(k·bits / 8) bytes per code; a row never shares a
    byte with the next, so one code's indices can be read alone."""

    data: torch.Tensor  # uint8 [..., ceil(k * bits / 8)]
    bits: int
    k: int

    def unpack(self) -> torch.Tensor:
        return unpack_indices(self.data, self.bits, self.k)

    def rows(self, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """The indices [N, k] (long, −1 = unused) of the codes at (batch row b, code c) pairs."""
        return unpack_indices(take_rows(self.data, b, c), self.bits, self.k)


def index_bits(n_refs: int) -> int:
    """Bits an index needs to name any of `n_refs` references, or none (stored + 1: 0 .. n_refs)."""
    return max(1, int(n_refs).bit_length())


def index_row_bytes(k: int, bits: int) -> int:
    """Bytes of one code's k indices of `bits` bits: a row never shares a byte with the next."""
    return (k * bits + 7) // 8


def index_span(bits: int) -> int:
    """Bytes one index can touch: it may start at bit 7 of a byte."""
    return (7 + bits + 7) // 8


def _one_word(k: int, bits: int) -> bool:
    """A row of indices fits one int64, read in the machine's (little-endian) byte order."""
    return k * bits <= 64 and sys.byteorder == "little"


def _index_layout(k: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    start = torch.arange(k, device=device) * bits
    return start // 8, start % 8, index_span(bits)


def pack_indices(idx: torch.Tensor, bits: int, check: bool = True) -> PackedIndices:
    """idx [..., k] integers in [−1, 2^bits − 1) (−1 = unused) -> PackedIndices. `check=False` skips the
    range check (two device syncs) where the indices are in range by construction (the store's writes)."""
    k = idx.shape[-1]
    if bits > 56:  # the shifts below work in int64
        raise ValueError(f"{bits}-bit reference indices: at most 56 bits are supported")
    v = idx.long() + 1
    if check and v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"reference indices must lie in [-1, {(1 << bits) - 1}) to be stored in {bits} bits")
    nb = index_row_bytes(k, bits)
    if _one_word(k, bits):  # the row's bits as one little-endian int64 (no overlap: the sum is the or)
        word = (v << (torch.arange(k, device=idx.device) * bits)).sum(-1, keepdim=True)
        return PackedIndices(word.view(torch.uint8)[..., :nb].contiguous(), bits, k)
    b0, sh, span = _index_layout(k, bits, idx.device)
    out = torch.zeros(*idx.shape[:-1], nb + span, dtype=torch.int64, device=idx.device)
    shifted = v << sh
    for t in range(span):
        # the indices' bits never overlap, so adding the parts of a shared byte is or-ing them
        out.scatter_add_(-1, (b0 + t).expand_as(v), (shifted >> (8 * t)) & 0xFF)
    return PackedIndices(out[..., :nb].to(torch.uint8), bits, k)


def unpack_indices(data: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """uint8 [..., nb] (see `PackedIndices`) -> long [..., k], −1 = unused."""
    nb = data.shape[-1]
    if nb != index_row_bytes(k, bits):
        raise ValueError(f"{nb} bytes per code do not hold {k} indices of {bits} bits")
    if _one_word(k, bits):  # ~6x faster on CPU than the byte gathers below (an 8K read unpacks 30K indices)
        word = data.new_zeros(*data.shape[:-1], 8)
        word[..., :nb] = data
        shifts = torch.arange(k, device=data.device) * bits
        return ((word.view(torch.int64) >> shifts) & ((1 << bits) - 1)) - 1
    b0, sh, span = _index_layout(k, bits, data.device)
    padded = torch.nn.functional.pad(data, (0, span)).long()  # an index near the end reads zeros past it
    v = padded[..., b0]
    for t in range(1, span):
        v |= padded[..., b0 + t] << (8 * t)
    return ((v >> sh) & ((1 << bits) - 1)) - 1


# ---- FP8 / FP16 reference storage ----

def encode_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Store references: FP8 e4m3 (saturating, as raw uint8 bytes) or FP16."""
    if fmt == "fp8":
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    if fmt == "fp16":
        return x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    raise ValueError(f"unknown ref_format {fmt!r}; choose 'fp8' or 'fp16'")


def decode_ref(stored: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if fmt == "fp8":
        if stored.device.type == "cpu":
            return _fp8_bits_to(stored, dtype)
        return stored.view(torch.float8_e4m3fn).to(dtype)
    return stored.to(dtype)


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _fp8_bits_to(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3fn bytes -> `dtype` by looking each byte up in a 256-entry table made by torch's own
    conversion (so bit-exact, NaN and -0 included): on CPU torch converts FP8 element by element, ~20x
    slower than one int32 index_select (and ~8x slower than decoding the bits with integer ops)."""
    table = _FP8_TABLES.get((dtype, b.device))
    if table is None:
        every_byte = torch.arange(256, dtype=torch.int16, device=b.device).to(torch.uint8)
        table = _FP8_TABLES[(dtype, b.device)] = every_byte.view(torch.float8_e4m3fn).to(dtype)
    return table.index_select(0, b.reshape(-1).int()).view(b.shape)


def ref_roundtrip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return decode_ref(encode_ref(x, fmt), fmt, x.dtype)
