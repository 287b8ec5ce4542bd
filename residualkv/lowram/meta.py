"""Learning LowRAM's predictor starts once per backbone (seed 003, step four and the meta-init).

Fitting each context's value predictors from Slim's linear map takes 150-300 Adam steps per layer,
most of LowRAM's prefill. Two starts are learnt offline from contexts of held-out-free training text:
- warm: the predictors fitted to many contexts pooled (seed: 25 Adam steps); a context's own fit then
  starts there;
- meta: first-order MAML from the warm start, so that K = 2 inner Adam steps (lr 1e-3, fresh state)
  on a new context already predict it well. The outer gradient is each context's loss gradient at its
  adapted weights (the first-order approximation), averaged over 8 contexts, applied by AdamW (3e-4).
The pairs are what the cache fits on: keys as LowRAM stores them (the xKV basis of `config`) and the
exact values, every layer and KV head of a context at once ([L·H, T, D]); each (layer, head) learns
its own start.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import DynamicCache

from ..backbones import fingerprint
from ..codec import model_shape
from ..config import LowRAMConfig
from ..rope import RopeTable, invert_rope
from .cache import factorise_keys, group_generator, stored_keys
from .starts import PredictorStarts, kv_digest
from .values import Predictor, fit_loss, fit_predictor, slim_start
from .values import slim_starts as shared_slim_maps  # meta.slim_starts below stacks them into one start


@torch.no_grad()
def capture_pairs(model, ids: torch.Tensor, config: LowRAMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (as LowRAM stores them) and exact values of every layer and KV head for each row of ids [S, T]:
    two float32 tensors [S, L·H, T, D], layer-major."""
    n_layers, H, D = model_shape(model.config)
    rope = RopeTable.from_model(model)
    G = config.layer_group
    keys, values = [], []
    for row in ids:
        cache = DynamicCache(config=model.config)
        model(input_ids=row[None], cache=cache, use_cache=True, logits_to_keep=1)
        T = row.shape[0]
        cos, sin = rope.cos_sin(torch.arange(T)[None], torch.float32)
        k_pre = [invert_rope(cache.layers[i].keys.float(), cos, sin) for i in range(n_layers)]
        k_read = []
        for first in range(0, n_layers, G):
            group = k_pre[first:first + G]
            basis, factors, _ = factorise_keys(group, config, group_generator(config, first))
            k_read += [stored_keys(basis, factors[..., j * H * D:(j + 1) * H * D], (1, H, T, D)) for j in range(len(group))]
        keys.append(torch.cat(k_read).reshape(n_layers * H, T, D))
        values.append(torch.cat([cache.layers[i].values.float() for i in range(n_layers)]).reshape(n_layers * H, T, D))
    return torch.stack(keys), torch.stack(values)


def slim_starts(model, config: LowRAMConfig, generator: torch.Generator) -> Predictor:
    """Every layer's Slim start stacked [L·H, ...] (the online fit's start without learnt starts)."""
    n_layers, H, D = model_shape(model.config)
    hidden = max(1, round(config.hidden_factor * D))
    # torch.cat below copies the shared maps: they are never written
    per_layer = [slim_start(w_lin, b2, hidden, generator) for w_lin, b2 in shared_slim_maps(model, H, D)]
    return Predictor(*(torch.cat(ts) for ts in zip(*per_layer)))


def pooled(x: torch.Tensor) -> torch.Tensor:
    """[S, N, T, D] -> [N, S·T, D]: each (layer, head) sees all S contexts' tokens as one."""
    S, N, T, D = x.shape
    return x.permute(1, 0, 2, 3).reshape(N, S * T, D)


def warm_start(keys: torch.Tensor, values: torch.Tensor, start: Predictor, *, steps: int, lr: float) -> Predictor:
    """Fit `start` [L·H, ...] to all contexts' pairs [S, L·H, T, D] pooled (seed step four)."""
    return fit_predictor(pooled(keys), pooled(values), start, steps=steps, lr=lr)


def meta_train(keys: torch.Tensor, values: torch.Tensor, start: Predictor, *, outer_steps: int, inner_steps: int = 2,
               inner_lr: float = 1e-3, outer_lr: float = 3e-4, accumulate: int = 8, seed: int = 0,
               resume: dict[str, Any] | None = None, on_step: Callable[[int, float, Callable[[], dict]], None] | None = None
               ) -> Predictor:
    """FOMAML from `start` [L·H, ...] over contexts [S, L·H, T, D]. After each outer step
    `on_step(step, mean adapted loss, state)` is called; `state()` is what `resume=` continues from."""
    phi = [t.detach().float().clone().requires_grad_(True) for t in start]
    # no weight decay: it would pull W_lin, the Slim map the start is built on, towards zero
    outer = torch.optim.AdamW(phi, lr=outer_lr, weight_decay=0.0)
    first = 0
    if resume is not None:
        with torch.no_grad():
            for p, saved in zip(phi, resume["phi"]):
                p.copy_(saved)
        outer.load_state_dict(resume["optimizer"])
        first = resume["step"]
    # the context order depends only on the seed, so a resumed run meets the contexts it would have met
    order = torch.randperm(keys.shape[0], generator=torch.Generator().manual_seed(seed)).tolist()
    for step in range(first, outer_steps):
        grads = [torch.zeros_like(p) for p in phi]
        total = 0.0
        for a in range(accumulate):
            s = order[(step * accumulate + a) % len(order)]
            adapted = fit_predictor(keys[s], values[s], Predictor(*phi), steps=inner_steps, lr=inner_lr)
            with torch.enable_grad():
                params = [t.requires_grad_(True) for t in adapted]
                loss = fit_loss(Predictor(*params), keys[s], values[s])
                for g, dg in zip(grads, torch.autograd.grad(loss, params)):
                    g.add_(dg, alpha=1.0 / accumulate)
            total += loss.item() / accumulate
        for p, g in zip(phi, grads):
            p.grad = g
        outer.step()
        if on_step is not None:
            on_step(step + 1, total, lambda: {"step": step + 1, "phi": [p.detach().clone() for p in phi],
                                               "optimizer": outer.state_dict()})
    return Predictor(*phi).to(torch.float32)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes() + str(tuple(t.shape)).encode()).hexdigest()


def _save_checkpoint(path: str | Path | None, state: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # the previous checkpoint stays whole until this one is


def _load_checkpoint(path: str | Path | None, settings: dict[str, Any], meta_steps: int, say) -> dict[str, Any] | None:
    """The checkpoint at `path` when it was written by the same settings, data and model; a run asking for
    more outer steps than it has goes on from it, one asking for fewer starts afresh."""
    if path is None or not Path(path).is_file():
        return None
    state = torch.load(path, weights_only=True)
    done = state["meta"]["step"] if state["meta"] else 0
    if state["settings"] != settings or done > meta_steps:
        say(f"{path} was written with other settings, data or more outer steps: starting afresh")
        return None
    say(f"resuming from {path}: warm start done, meta-init at step {done}")
    return state


@torch.no_grad()
def relative_error(f: Predictor, keys: torch.Tensor, values: torch.Tensor) -> float:
    """Mean over (layer, head) of |f(k) - v|^2 / |v|^2 on one context's pairs [L·H, T, D]."""
    return ((f(keys) - values).pow(2).sum((-2, -1)) / values.pow(2).sum((-2, -1)).clamp_min(1e-12)).mean().item()


def heldout_errors(starts: dict[str, Predictor], keys: torch.Tensor, values: torch.Tensor, steps: list[int],
                   lr: float) -> dict[str, dict[str, float]]:
    """{start: {k: mean relative value error after k online steps}} over held-out contexts [S, L·H, T, D]
    (one fit of max(steps) per start and context, read at each k)."""
    out: dict[str, dict[str, float]] = {}
    for name, start in starts.items():
        sums = dict.fromkeys(sorted(steps), 0.0)
        for s in range(keys.shape[0]):
            def record(k: int, f: Predictor) -> None:
                if k in sums:
                    sums[k] += relative_error(f, keys[s], values[s]) / keys.shape[0]

            record(0, fit_predictor(keys[s], values[s], start, steps=0, lr=lr))
            fit_predictor(keys[s], values[s], start, steps=max(steps), lr=lr, on_step=record)
        out[name] = {str(k): e for k, e in sums.items()}
    return out


def learn_starts(model, train_ids: torch.Tensor, heldout_ids: torch.Tensor, config: LowRAMConfig | None = None, *,
                 warm_steps: int = 25, meta_steps: int = 50, inner_steps: int = 2, accumulate: int = 8,
                 outer_lr: float = 3e-4, eval_steps: tuple[int, ...] = (0, 2), seed: int = 0,
                 backbone: str = "", progress: bool = True, checkpoint: str | Path | None = None,
                 checkpoint_every: int = 5) -> PredictorStarts:
    """The warm start and the meta-init for `model` from training contexts train_ids [S, T], with the
    online fit's error from each start (and from Slim's) measured on held-out contexts [S', T].

    With `checkpoint` (a file), the warm start and every `checkpoint_every` outer steps are saved there,
    and a rerun with the same inputs continues from them (a crash costs the pairs' capture and at most
    `checkpoint_every` steps); the caller removes the file once the starts are saved."""
    config = config or LowRAMConfig()
    say = (lambda msg: print(f"[lowram-init] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    digest = kv_digest(model)
    settings = {"train": _digest(train_ids), "warm_steps": warm_steps, "inner_steps": inner_steps, "accumulate": accumulate,
                "outer_lr": outer_lr, "seed": seed, "kv_digest": digest, "config": repr(config)}
    saved = _load_checkpoint(checkpoint, settings, meta_steps, say)
    t0 = time.perf_counter()
    keys, values = capture_pairs(model, train_ids, config)
    hk, hv = capture_pairs(model, heldout_ids, config)
    say(f"captured {train_ids.shape[0]} training and {heldout_ids.shape[0]} held-out contexts of "
        f"{train_ids.shape[1]} tokens ({time.perf_counter() - t0:.0f} s)")
    slim = slim_starts(model, config, torch.Generator().manual_seed(seed))
    t1 = time.perf_counter()
    if saved is not None:
        warm = Predictor(*saved["warm"])
    else:
        warm = warm_start(keys, values, slim, steps=warm_steps, lr=config.lr)
        say(f"warm start: {warm_steps} steps on the pooled contexts ({time.perf_counter() - t1:.0f} s)")
        saved = {"settings": settings, "warm": list(warm), "meta": None, "losses": []}
        _save_checkpoint(checkpoint, saved)

    from tqdm.auto import tqdm

    resume = saved["meta"]
    losses: list[float] = list(saved["losses"])
    bar = tqdm(total=meta_steps, initial=resume["step"] if resume else 0, desc="meta-init (FOMAML)", unit="step",
               disable=not progress, file=sys.stderr)

    def on_step(step: int, loss: float, state: Callable[[], dict]) -> None:
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(adapted_loss=f"{loss:.4g}")
        if step % checkpoint_every == 0 or step == meta_steps:
            _save_checkpoint(checkpoint, saved | {"meta": state(), "losses": losses})

    t2 = time.perf_counter()
    meta = meta_train(keys, values, warm, outer_steps=meta_steps, inner_steps=inner_steps, inner_lr=config.lr,
                      outer_lr=outer_lr, accumulate=accumulate, seed=seed, resume=resume, on_step=on_step)
    bar.close()
    meta_s = time.perf_counter() - t2
    errors = heldout_errors({"slim": slim, "warm": warm, "meta": meta}, hk, hv, sorted(set(eval_steps) | {inner_steps}),
                            config.lr)
    say("held-out relative value error after k online steps: " +
        "; ".join(f"{name} " + ", ".join(f"k={k}: {e:.4f}" for k, e in errs.items()) for name, errs in errors.items()))
    n_layers, H, _ = model_shape(model.config)

    def per_layer(p: Predictor) -> list[Predictor]:
        return [Predictor(*(t[i * H:(i + 1) * H].clone() for t in p)) for i in range(n_layers)]

    info: dict[str, Any] = {
        "backbone": backbone, "fingerprint": fingerprint(model.config), "kv_digest": digest,
        "lowram_config": {"ratio": config.ratio, "layer_group": config.layer_group, "key_bits": config.key_bits,
                          "hidden_factor": config.hidden_factor, "lr": config.lr},
        "contexts": {"train": train_ids.shape[0], "heldout": heldout_ids.shape[0], "tokens": train_ids.shape[1]},
        "warm_steps": warm_steps, "meta": {"outer_steps": meta_steps, "inner_steps": inner_steps, "inner_lr": config.lr,
                                           "outer_lr": outer_lr, "accumulate": accumulate, "adapted_loss": losses},
        "heldout_relative_error": errors, "seconds": {"total": time.perf_counter() - t0, "meta": meta_s}, "seed": seed,
    }
    return PredictorStarts({"warm": per_layer(warm), "meta": per_layer(meta)}, info)
