"""A float tensor LowRAM stores in FP16 or packed to a few bits (the key basis, the value residuals,
LowRAM-SR's landmarks), and its bytes per coordinate."""

from __future__ import annotations

import torch

from ..accounting import q_bits
from ..quant import Packed, dequantize, quantize
from ..stores import nbytes_of


class Quantised:
    """A float tensor stored in FP16, or packed `bits` along its last dim in groups (None = FP16)."""

    def __init__(self, x: torch.Tensor, bits: int | None, group: int):
        # a last dim the groups do not divide (a basis narrower than one group), or nothing to store: FP16
        packable = bits is not None and x.shape[-1] % group == 0 and x.numel() > 0
        self.bits, self.group = (bits if packable else None), group
        self.shape = tuple(x.shape)
        self.data = x.to(torch.float16) if self.bits is None else quantize(x, self.bits, group)

    def read(self) -> torch.Tensor:
        if self.bits is None:
            return self.data.float()
        return dequantize(self.data, self.bits, self.group)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx [N, n] of a stored [N, M, F] tensor, float32 [N, n, F]; only those are decoded."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return t.gather(1, idx[..., None].expand(-1, -1, t.shape[-1]))
        if self.bits is None:
            return take(self.data).float()
        return dequantize(Packed(*(take(t) for t in self.data)), self.bits, self.group)

    def nbytes(self) -> int:
        return self.data.nbytes() if isinstance(self.data, Packed) else nbytes_of(self.data)


def bytes_per_coord(bits: int | None, group: int) -> float:
    return 2.0 if bits is None else 2 * q_bits(bits, group)


def head_group(cfg, head_dim: int) -> int:
    """A group of a per-head vector (a value residual, a landmark) never spans two heads: heads narrower
    than group_size take one group each."""
    return min(cfg.group_size, head_dim)
