"""Warm starts: give every layer's codec a good starting point before the joint L_rec + L_ntp phase.

The joint objective (seed §2.9) runs the whole backbone forward and backward for every step; on a CPU
that is a few hundred steps an hour, far too few to move a randomly initialised codec. The KV a codec
has to reconstruct can instead be captured once and the codecs fitted to it offline. Two ways:

* `rec-warmstart` fits L_rec alone on the captured KV through the exact write path of the cache (same
  schedule, FP8 references, retrieval, encode-then-subtract, b-bit rounding with a straight-through
  gradient).
* `fisher-pca` solves for the decoder in closed form, then fits the encoder to it. The decoder is
  linear, so whatever the encoder does, every reconstruction lies in mean_ref + span(W_d); the best
  span is the one that loses least of what the *next-token loss* cares about. To second order the loss
  grows by eᵀFe for a reconstruction error e, with F = E[g gᵀ] the Fisher of L_ntp w.r.t. the layer's
  pre-RoPE key‖value (captured with one backward pass per block). W_d is therefore the top-d_c principal
  subspace of the residuals r = kv − mean_ref in the F-weighted metric (mixed with a little of the plain
  metric, `alpha`, so directions the few captured gradients never saw are not dropped outright), and
  the SwiGLU encoder is fitted so that f_c(kv) − f_c(mean_ref) ≈ the matching coordinates of r. The
  regression is cheap (no backbone in the loop) and the bias-free SwiGLU fits a linear map on the data
  to about 1% relative error, because f_c(x) − f_c(m) is dominated by its Jacobian at the data.

Captured KV comes from the uncompressed model, so it differs slightly from what layer l sees behind
compressed layers < l; the joint phase corrects for that.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from transformers import DynamicCache

from ..stores import ResidualStore, flat_heads
from ..codec import LayerCodec, ResidualCodec
from ..config import CodecDims
from ..rope import RopeTable, invert_rope
from ..schedule import ReferenceSchedule


class _CaptureCache(DynamicCache):
    """A one-pass cache that hands attention leaf tensors, so the loss can be differentiated w.r.t. the
    exact K/V the attention of each layer reads (post-norm, post-RoPE), for any model using the Cache API."""

    def __init__(self, config, layer_ids: list[int], grad: bool):
        super().__init__(config=config)
        self.layer_ids, self.grad = set(layer_ids), grad
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.layer_ids:
            key_states = key_states.detach().float().requires_grad_(self.grad)
            value_states = value_states.detach().float().requires_grad_(self.grad)
            self.leaves[layer_idx] = (key_states, value_states)
        return key_states, value_states  # nothing is kept: each capture is a single full-sequence pass


def capture(model, blocks: torch.Tensor, layer_ids: list[int], fisher: bool = False, progress: bool = False
            ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor] | None]:
    """True pre-RoPE key‖value of `blocks` [N, T] per layer ({layer: [N, T, 2·d_k]}) and, with `fisher`,
    the unnormalised Fisher Σ g gᵀ of the next-token loss w.r.t. them ({layer: [2·d_k, 2·d_k]})."""
    from tqdm.auto import tqdm

    rope = RopeTable.from_model(model)
    kv: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    fim = {i: None for i in layer_ids} if fisher else None
    for ids in tqdm(blocks.split(1), desc="capture KV" + (" + Fisher" if fisher else ""), disable=not progress):
        cache = _CaptureCache(model.config, layer_ids, grad=fisher)
        with torch.set_grad_enabled(fisher):
            out = model(input_ids=ids, cache=cache, use_cache=True, labels=ids if fisher else None,
                        logits_to_keep=0 if fisher else 1)
        cos, sin = rope.cos_sin(torch.arange(ids.shape[1])[None], torch.float32)
        leaves = [cache.leaves[i] for i in layer_ids]
        grads = torch.autograd.grad(out.loss, [t for pair in leaves for t in pair]) if fisher else None
        for j, i in enumerate(layer_ids):
            k, v = leaves[j]
            kv[i].append(torch.cat([flat_heads(invert_rope(k.detach(), cos, sin)), flat_heads(v.detach())], -1))
            if fisher:
                # K = R·k_pre with R orthogonal (up to the rope scaling, a constant per model), so ∂L/∂k_pre = Rᵀ ∂L/∂K
                g = torch.cat([flat_heads(invert_rope(grads[2 * j], cos, sin)), flat_heads(grads[2 * j + 1])], -1)
                g = g.reshape(-1, g.shape[-1]).double()
                fim[i] = g.T @ g if fim[i] is None else fim[i] + g.T @ g
    return {i: torch.cat(v) for i, v in kv.items()}, fim


def capture_kv(model, blocks: torch.Tensor, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """True pre-RoPE key‖value of `blocks` [N, T] for each layer: {layer: [N, T, 2·d_k]}."""
    return capture(model, blocks, layer_ids)[0]


class _PairRecorder(LayerCodec):
    """Records (kv, mean_ref) of every coded token as the cache's write path forms them."""

    def __init__(self, d_kv: int):
        super().__init__(CodecDims(d_kv=d_kv, d_c=d_kv, d_ff=1, kind="identity"))
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def encode(self, kv: torch.Tensor, mean_ref: torch.Tensor) -> torch.Tensor:
        self.pairs.append((kv.detach().reshape(-1, kv.shape[-1]), mean_ref.detach().reshape(-1, kv.shape[-1])))
        return kv - mean_ref


def coding_config(config):
    """The cache config training codes with: standalone (every token reconstructed, whatever mode serves
    the codec) and no FP16 recent window, a serving setting a codec's config may carry that would hide
    the codec's error on the newest tokens from the loss."""
    return config.replace(mode="standalone", recent_window=0)


def residual_pairs(kv: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, mean_ref) of every coded token of the sequences kv [N, T, d], through the cache's own write path."""
    rec = _PairRecorder(kv.shape[-1])
    # the recorder keeps each pair before the store quantises its 2·d_k-wide "latent", so the group size
    # only has to divide 2·d_k (a codec's group divides its d_c, e.g. 80 for d_c 160, not always 384)
    cfg = coding_config(config).replace(group_size=math.gcd(config.group_size, kv.shape[-1]))
    with torch.no_grad():
        for seq in kv.split(1):
            ResidualStore(rec, cfg, ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha)).write(seq)
    return torch.cat([p[0] for p in rec.pairs]), torch.cat([p[1] for p in rec.pairs])


def weighted_pca(residuals: torch.Tensor, fisher: torch.Tensor, d_c: int, alpha: float, value_weight: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Encoder map E [d, d_c] and decoder W_d [d, d_c] (nn.Linear layout) minimising E[eᵀ M e] over rank-d_c
    linear codes, M = D((1 − alpha)·F/mean(diag F) + alpha·I)D with D = 1 on the key half and
    √value_weight on the value half (errors in values count value_weight times); also the share of
    M-weighted energy kept."""
    d = residuals.shape[1]
    m = fisher.double() / (fisher.double().trace() / d)
    m = (1 - alpha) * m + alpha * torch.eye(d, dtype=torch.float64)
    if value_weight != 1.0:
        scale = torch.ones(d, dtype=torch.float64)
        scale[d // 2:] = value_weight ** 0.5
        m = scale[:, None] * m * scale[None, :]
    ev, q = torch.linalg.eigh(m)
    ev = ev.clamp(min=1e-8 * float(ev.max()))
    m_half, m_inv_half = q @ torch.diag(ev.sqrt()) @ q.T, q @ torch.diag(ev.rsqrt()) @ q.T
    r = residuals.double()
    cov = m_half @ (r.T @ r / r.shape[0]) @ m_half
    energy, u = torch.linalg.eigh(cov)
    energy, u = energy.flip(0), u.flip(1)[:, :d_c]
    kept = float(energy[:d_c].sum() / energy.sum().clamp(min=1e-30))
    return (m_half @ u).float(), (m_inv_half @ u).float(), kept


def fit_encoder(codec: LayerCodec, x: torch.Tensor, m: torch.Tensor, target: torch.Tensor, *, steps: int,
                batch: int, lr: float, generator: torch.Generator) -> float:
    """Fit codec's SwiGLU so that f_c(x) − f_c(m) ≈ target; returns the relative error on held-back pairs."""
    n = x.shape[0]
    n_val = min(2048, n // 10)
    n_fit = n - n_val
    params = [codec.w_c1.weight, codec.w_c2.weight, codec.w_c3.weight]
    opt = torch.optim.Adam(params, lr=lr)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, max(0.02, 1 - s / steps)))
    scale = target[:n_fit].pow(2).mean().clamp(min=1e-30)
    for _ in range(steps):
        idx = torch.randint(0, n_fit, (min(batch, n_fit),), generator=generator)
        loss = (codec.f_c(x[idx]) - codec.f_c(m[idx]) - target[idx]).pow(2).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        val = slice(n_fit, n)
        return float((codec.f_c(x[val]) - codec.f_c(m[val]) - target[val]).pow(2).mean() / target[val].pow(2).mean())


def fisher_pca_init(model, codec: ResidualCodec, blocks: torch.Tensor, *, alpha: float = 0.1, value_weight: float = 1.0,
                    steps: int = 150,
                    batch: int = 512, lr: float = 3e-3, seed: int = 0,
                    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
                    progress: bool = True) -> dict[str, float]:
    """Closed-form Fisher-weighted decoder + regressed encoder for every layer (module docstring)."""
    from tqdm.auto import tqdm

    if codec.dims.kind == "identity":  # ResidualKV† has nothing to fit
        return {"warmstart/steps": 0}
    t0 = time.monotonic()
    kv, fim = capture(model, blocks, codec.layer_ids, fisher=True, progress=progress)
    g = torch.Generator().manual_seed(seed)
    kept, errors = [], []
    bar = tqdm(codec.layer_ids, desc="fisher-pca: fit each layer's codec", disable=not progress)
    for i in bar:
        x, m = residual_pairs(kv.pop(i), codec.config)
        layer = codec.layer(i)
        enc, dec, share = weighted_pca(x - m, fim[i], layer.dims.d_c, alpha, value_weight)
        with torch.no_grad():
            layer.w_d.weight.copy_(dec)
        dtype = layer.w_c1.weight.dtype
        x, m = x.to(dtype), m.to(dtype)
        err = fit_encoder(layer, x, m, ((x - m) @ enc.to(dtype)), steps=steps, batch=batch, lr=lr, generator=g)
        kept.append(share)
        errors.append(err)
        bar.set_postfix(kept=f"{share:.3f}", fit_err=f"{err:.4f}")
        if on_metrics:
            on_metrics(0, {f"warmstart/layer{i}_kept": share, f"warmstart/layer{i}_fit_err": err})
    return {"warmstart/steps": steps, "warmstart/blocks": int(blocks.shape[0]),
            "warmstart/fisher_energy_kept": sum(kept) / len(kept), "warmstart/encoder_fit_rel_err": sum(errors) / len(errors),
            "warmstart/seconds": time.monotonic() - t0}


def warm_start(model, codec: ResidualCodec, blocks: torch.Tensor, *, steps: int, lr: float = 1e-3,
               seed: int = 0, on_metrics: Callable[[int, dict[str, float]], None] | None = None,
               progress: bool = True) -> dict[str, float]:
    """Fit `codec` to the true KV of `blocks` with the mean-squared reconstruction error; returns stats."""
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    kv = capture_kv(model, blocks, codec.layer_ids)
    cfg = coding_config(codec.config)
    params = [p for p in codec.parameters() if p.requires_grad]
    if not params:  # the identity codec has nothing to fit
        return {"warmstart/steps": 0}
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 50)) * max(0.0, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    n = blocks.shape[0]
    history: list[float] = []
    bar = tqdm(range(steps), desc="warm start (L_rec on captured KV)", disable=not progress)
    for step in bar:
        b = int(torch.randint(n, (1,), generator=g))
        loss = 0.0
        for i in codec.layer_ids:
            store = ResidualStore(codec.layer(i), cfg, ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha))
            x = kv[i][b : b + 1]
            loss = loss + (store.write(x) - x).pow(2).mean()
        loss = loss / len(codec.layer_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(rec_mse=f"{sum(history[-10:]) / len(history[-10:]):.4f}")
        if on_metrics and (step + 1) % 50 == 0:
            on_metrics(step + 1, {"warmstart/rec_mse": sum(history[-50:]) / len(history[-50:])})
    first = sum(history[:10]) / max(1, len(history[:10]))
    last = sum(history[-10:]) / max(1, len(history[-10:]))
    return {"warmstart/steps": steps, "warmstart/blocks": n, "warmstart/rec_mse_first": first,
            "warmstart/rec_mse_last": last, "warmstart/seconds": time.monotonic() - t0}
