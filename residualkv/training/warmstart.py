"""Warm start: fit every layer's codec to reconstruct the backbone's true KV, before joint training.

The joint objective (seed §2.9) runs the whole backbone forward and backward for every step; on a CPU
that is a few hundred steps an hour, far too few to move a randomly initialised codec. The KV a
codec has to reconstruct can instead be captured once (forward only, no gradients) and the codecs
fitted to it with L_rec alone, through the exact write path of the cache (same schedule, FP8
references, retrieval, encode-then-subtract, b-bit rounding with a straight-through gradient). The
joint L_rec + L_ntp phase then starts from codecs that already reconstruct well. Captured KV comes
from the uncompressed model, so it differs slightly from what layer l sees behind compressed layers
< l; the joint phase corrects for that.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import DynamicCache

from ..cache import ResidualStore, _flat
from ..codec import ResidualCodec
from ..rope import RopeTable, invert_rope
from ..schedule import ReferenceSchedule


@torch.no_grad()
def capture_kv(model, blocks: torch.Tensor, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """True pre-RoPE key‖value of `blocks` [N, T] for each layer: {layer: [N, T, 2·d_k]}."""
    rope = RopeTable.from_model(model)
    out: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    for ids in blocks.split(1):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = rope.cos_sin(pos, torch.float32)
        for i in layer_ids:
            layer = cache.layers[i]
            k_pre = invert_rope(layer.keys.float(), cos, sin)
            out[i].append(torch.cat([_flat(k_pre), _flat(layer.values.float())], dim=-1))
    return {i: torch.cat(v) for i, v in out.items()}


def warm_start(model, codec: ResidualCodec, blocks: torch.Tensor, *, steps: int, lr: float = 1e-3,
               seed: int = 0, on_metrics: Callable[[int, dict[str, float]], None] | None = None,
               progress: bool = True) -> dict[str, float]:
    """Fit `codec` to the true KV of `blocks` with the mean-squared reconstruction error; returns stats."""
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    kv = capture_kv(model, blocks, codec.layer_ids)
    cfg = codec.config.replace(mode="standalone")
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
