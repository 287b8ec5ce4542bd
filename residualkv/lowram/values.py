"""LowRAM's values: amortised by a predictor fitted to the context (seed 003, steps three and five).

Per layer and KV head, f(k) = relu(k W1 + b1) W2 + b2 + k W_lin maps a pre-RoPE key to its value.
W_lin starts at Slim attention's W_K^+ W_V (the best linear map from key to value the weights allow
under GQA) and W2 at zero, so fitting starts from that linear map; Adam (lr 1e-3) then overfits f to
the context's own pairs, all heads (and batch rows) at once as one batch of small matrices. Only the
tokens f predicts worst keep their residual v - f(k); the dense values are dropped.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..backbones import kv_projections, per_model


class Predictor(NamedTuple):
    """One predictor per (row, KV head), stacked on the first dim N."""

    w1: torch.Tensor  # [N, D, F]
    b1: torch.Tensor  # [N, 1, F]
    w2: torch.Tensor  # [N, F, D]
    b2: torch.Tensor  # [N, 1, D]
    w_lin: torch.Tensor  # [N, D, D]

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        """k [N, T, D] -> predicted values [N, T, D] (float32)."""
        w1, b1, w2, b2, w_lin = (t.float() for t in self)
        h = torch.baddbmm(b1, k, w1).relu_()
        return torch.baddbmm(b2, h, w2) + torch.bmm(k, w_lin)

    def to(self, dtype: torch.dtype) -> "Predictor":
        return Predictor(*(t.detach().to(dtype) for t in self))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def slim_init(k_proj: torch.nn.Linear, v_proj: torch.nn.Linear, n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, W_lin = W_K^+ W_V [H, D, D] and the bias b [H, 1, D] that carries the projections'
    biases through it (v = (k - b_K) W_lin + b_V for k = x W_K + b_K)."""
    wk = k_proj.weight.detach().double().view(n_kv, head_dim, -1).mT  # [H, hidden, D]: k = x W_K
    wv = v_proj.weight.detach().double().view(n_kv, head_dim, -1).mT
    w_lin = torch.linalg.pinv(wk) @ wv

    def bias(proj: torch.nn.Linear) -> torch.Tensor:
        b = proj.bias.detach().double() if proj.bias is not None else wk.new_zeros(n_kv * head_dim)
        return b.view(n_kv, 1, head_dim)

    return w_lin.float(), (bias(v_proj) - bias(k_proj) @ w_lin).float()




def slim_starts(model: torch.nn.Module, n_kv: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`slim_init` of every layer of `model`, shared by all its caches (callers must not write into them)."""
    return per_model(model, f"slim:{n_kv}x{head_dim}",
                     lambda: [slim_init(k, v, n_kv, head_dim) for k, v in kv_projections(model)])


def slim_start(w_lin: torch.Tensor, b2: torch.Tensor, hidden: int, generator: torch.Generator | None = None) -> Predictor:
    """The seed's per-context start, one per KV head [H, ...]: W_lin and b2 from Slim (w_lin [H, D, D],
    b2 [H, 1, D]), W2 = 0 so f starts as that linear map, W1 drawn as nn.Linear draws it."""
    H, D, _ = w_lin.shape
    w1 = (torch.rand(H, D, hidden, generator=generator) * 2 - 1).mul_(1.0 / math.sqrt(D))
    return Predictor(w1, w_lin.new_zeros(H, 1, hidden), w_lin.new_zeros(H, hidden, D), b2, w_lin)


def fit_predictor(keys: torch.Tensor, values: torch.Tensor, start: Predictor, *, steps: int, lr: float,
                  on_step: Callable[[int, Predictor], None] | None = None) -> Predictor:
    """Fit f on keys, values [N = rows·H, T, D] (float32, row-major over rows then heads) from `start`
    [H, ...] (one per head, repeated over the rows: a row's fit does not depend on the rows batched with
    it) with `steps` full-batch Adam steps on the mean squared error of each (row, head), summed over them
    so each one's gradient is its own. `on_step(k, f)` sees the predictor after step k, i.e. the fit of k
    steps (one trajectory serves every shorter budget); f's tensors are the live parameters: copy to keep."""
    reps = keys.shape[0] // start.w1.shape[0]
    params = [t.detach().float().repeat(reps, 1, 1).to(keys.device) for t in start]
    if steps == 0:
        return Predictor(*params)
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=lr)
        f = Predictor(*params)
        for k in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            fit_loss(f, keys, values).backward()
            opt.step()
            if on_step is not None:
                with torch.no_grad():
                    on_step(k, f)
    return Predictor(*params).to(torch.float32)


def fit_loss(f: Predictor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The fitting objective: each (row, head)'s mean squared error over its tokens and dims, summed."""
    return (f(keys) - values).pow(2).mean(dim=(-2, -1)).sum()


def worst_predicted(err: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Boolean mask [N, T] of the `n_keep` tokens with the largest error (err [N, T]) in each row: the
    ones that keep a residual (the seed's ablation: error-ranked residuals 98% NIAH, random ones < 40%)."""
    mask = torch.zeros_like(err, dtype=torch.bool)
    if n_keep > 0:
        mask.scatter_(1, err.topk(n_keep, dim=1).indices, True)
    return mask
