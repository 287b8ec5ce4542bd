"""LowRAM's keys: a low-rank basis shared by adjacent layers (xKV; seed 003, step two).

The pre-RoPE keys of G adjacent layers side by side, M [T, G·H·D], are stored as A [T, k] (shared by
the group, grows with the context) times B [k, G·H·D] (one block per layer, fixed size). The rank comes
from the target ratio: A and B together hold 1/ratio of the keys' FP16 bytes, k = m n / (r (m + n)) in
FP16. The basis is found by a randomised range finder orthonormalised with Cholesky-QR, as the seed
does in place of an exact SVD.
"""

from __future__ import annotations

import torch


def rank_for_ratio(m: int, n: int, ratio: float, a_bytes: float, multiple: int = 1, reserved: float = 0.0) -> int:
    """Largest rank whose A [m, k] (`a_bytes` per coordinate) and FP16 B [k, n] fit 2·m·n/ratio bytes
    less `reserved` (other key-side state held in the same budget), rounded down to a multiple of
    `multiple` (A's quantisation groups); at least one group, at most min(m, n) (a full-rank basis
    already reproduces M)."""
    k = int((2 * m * n / ratio - reserved) // (m * a_bytes + 2 * n))
    k -= k % multiple
    return max(min(k, m, n), min(multiple, m, n), 1)


def _cholesky_qr(y: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning y [..., m, l]. CholeskyQR2: the second pass restores the
    orthogonality the Gram matrix's conditioning costs the first; a rank-deficient y (repeated tokens,
    fewer tokens than columns) has no Cholesky factor and falls back to Householder QR."""
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(y.mT @ y)
        if bool(info.any()):
            return torch.linalg.qr(y).Q
        y = torch.linalg.solve_triangular(chol, y.mT, upper=False).mT  # y L^-T
    return y


def low_rank_basis(m: torch.Tensor, k: int, *, oversample: int = 8, power_iters: int = 1,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """An orthonormal basis U [..., T, k] of the dominant column space of m [..., T, n] (randomised
    range finder with `power_iters` power iterations, then the exact SVD of the small projection).
    In float64: the Gram matrices square the condition number."""
    md = m.double()
    cols = min(k + oversample, m.shape[-2], m.shape[-1])
    omega = torch.randn(m.shape[-1], cols, generator=generator, dtype=torch.float64).to(md.device)
    q = _cholesky_qr(md @ omega)
    for _ in range(power_iters):
        q = _cholesky_qr(md @ (md.mT @ q))
    u_small = torch.linalg.svd(q.mT @ md, full_matrices=False).U
    return (q @ u_small[..., :k]).float()


def fit_layer_factors(m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B [..., k, n] minimising |A B - M| for the A the cache really stores (its quantised or FP16
    reading), so B absorbs A's rounding instead of assuming an exact orthonormal basis."""
    return torch.linalg.lstsq(a.double(), m.double()).solution.float()
