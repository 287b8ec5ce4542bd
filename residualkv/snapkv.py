"""SnapKV (Li et al., 2024) as a `transformers` Cache: static token eviction after the prefill.

After the prompt has been attended to in full, every layer keeps, per KV head, the `window` most recent
prompt tokens (the observation window) plus the prompt tokens that those window queries attend to most
(softmax attention averaged over the window's queries, 1-D average-pooled over neighbouring tokens,
averaged over the query heads that share the KV head), up to a budget. Kept tokens stay FP16; tokens
decoded afterwards are appended unchanged.

Why not kvpress: kvpress' presses would be the reference implementation, but kvpress pins
transformers < 5.3 and this project pins 5.24, so it does not install here. This file follows its
SnapKVPress scoring (mean over window queries, avg-pool kernel 5, mean over the GQA group).

How the window queries reach the cache: a forward pre-hook on every attention module (installed once per
model by `SnapKVCache.from_model`, inert for every other cache type) recomputes the last `window`
queries from the layer input exactly as the attention does (q_proj, optional q_norm, RoPE from the
`position_embeddings` kwarg) and hands them to the layer's cache. The cache's `update` then returns the
full keys and values to the attention, so the prefill's own attention output is unchanged, and stores
only the kept tokens. The prompt must be prefilled in one forward call (the first call compresses).

Positions: the cache reports the *logical* length (tokens seen) through `get_seq_length`, so position ids
of later tokens continue from the prompt length, and `get_mask_sizes` advertises the *stored* length with
an offset, so causal masks stay correct for multi-token steps after eviction.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .rope import apply_rope
from .stores import nbytes_of

_HOOK_FLAG = "_rkv_snapkv_hooks"


class SnapKVLayer(DynamicLayer):
    """One layer: FP16-accounted K/V of the kept prompt tokens plus every later token."""

    def __init__(self, *, window: int, ratio: float | None, budget: int | None, kernel_size: int):
        super().__init__()
        self.window, self.ratio, self.budget, self.kernel_size = window, ratio, budget, kernel_size
        self.cumulative_length = 0  # tokens seen (logical length)
        self.pending_queries: torch.Tensor | None = None  # [B, H_q, w, D] set by the pre-hook
        self.pending_mask: torch.Tensor | None = None  # the prefill's attention mask, set by the pre-hook
        # per row: left-padding slots of the prompt, and how many of them are stored after eviction (a row
        # with fewer real tokens than the kept count keeps them, masked; see _evict)
        self.pads: list[int] | None = None
        self.pads_kept: list[int] | None = None
        self.scaling: float | None = None
        self.compressed = False
        self.prompt_length = 0
        # CR, as accounting.py measures it: history tokens attended / history tokens, over decode steps
        # (one new token per row; the prefill attends densely)
        self.tokens_read = 0
        self.tokens_available = 0

    def n_selected(self, n: int) -> int:
        """Prompt tokens kept outside the observation window for an n-token prompt."""
        w = min(self.window, n)
        if self.budget is not None:
            return max(0, min(self.budget, n - w))
        kept = max(w, int(round(self.ratio * n)))
        return max(0, min(kept, n) - w)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1 and self.cumulative_length > 0:  # a decode step: CR counts these only
            B = key_states.shape[0]  # history tokens per row, left padding not counted
            self.tokens_available += B * self.cumulative_length - sum(self.pads or ())
            self.tokens_read += B * self.keys.shape[-2] - sum(self.pads_kept or ())
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        queries, self.pending_queries = self.pending_queries, None
        mask, self.pending_mask = self.pending_mask, None
        if queries is not None and not self.compressed and self.cumulative_length == key_states.shape[-2]:
            self.keys, self.values = self._evict(queries, full_k, full_v, mask)
            self.compressed = True
            self.prompt_length = full_k.shape[-2]
        else:
            self.keys, self.values = full_k, full_v
        return full_k, full_v  # the step's own attention sees everything

    @torch.no_grad()
    def _evict(self, queries, keys, values, mask: torch.Tensor | None = None):
        """Keep, per row and KV head, the window and the n_sel best-voted prefix tokens.

        Left padding: a padding slot gets no vote and is kept only where a row has fewer real tokens than
        the kept count. Then the row keeps all its real tokens and the padding slots sort first (they lie
        before every real token), so each stored slot j still lines up with column n - kept + j of the
        padding mask that later steps build from `get_mask_sizes`: the padding stays masked. (Under a
        ratio budget, the shorter rows of such a batch keep the count the padded length gives.) KR counts
        those slots (bytes held) over real tokens only; CR counts real tokens read."""
        B, H_kv, n, D = keys.shape
        w = min(self.window, n, queries.shape[-2])
        n_sel = self.n_selected(n)
        prefix = n - w
        real = None
        if mask is not None:  # the last query row of the prefill's mask sees every real key and no padding
            last = mask[:, 0, -1, :n]
            real = last if last.dtype == torch.bool else last == 0
        self.pads = [0] * B if real is None else (~real).sum(-1).tolist()
        self.pads_kept = list(self.pads)
        if n_sel >= prefix:  # nothing to evict
            return keys, values
        from .attention import snapkv_head_scores, snapkv_token_scores

        scale = self.scaling if self.scaling is not None else D ** -0.5
        # the window's queries are the last w positions: causal inside the window, votes on the prefix only
        votes = snapkv_token_scores(queries[..., -w:, :], keys, mask, scale, w)[..., :prefix]
        if real is None:
            scores = snapkv_head_scores(votes, H_kv, self.kernel_size)  # [B, H_kv, prefix]
        else:  # each row pooled over its own tokens only, as it would be alone; padding never wins a vote
            if any(not bool(real[b, p:].all()) for b, p in enumerate(self.pads)):
                raise ValueError("SnapKV: the attention mask pads a row other than on the left; pad prompts on "
                                 "the left (tokenizer.padding_side = 'left'), as generate expects")
            scores = votes.new_full((B, H_kv, prefix), float("-inf"))
            for b, p in enumerate(self.pads):
                if p < prefix:
                    scores[b:b + 1, :, p:] = snapkv_head_scores(votes[b:b + 1, :, p:], H_kv, self.kernel_size)
        top = scores.topk(n_sel, dim=-1).indices.sort(dim=-1).values
        kept = n_sel + w
        self.pads_kept = [max(0, kept - (n - p)) for p in self.pads]
        window_idx = torch.arange(prefix, n, device=keys.device).expand(B, H_kv, w)
        idx = torch.cat([top, window_idx], dim=-1)  # not kept: attention needs only the kept K/V (and bytes)
        gather = idx[..., None].expand(-1, -1, -1, D)
        return keys.gather(2, gather).contiguous(), values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1])).contiguous()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.keys is None or not self.is_initialized else self.keys.shape[-2]
        return stored + query_length, self.cumulative_length - stored

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.pending_queries = self.pending_mask = None
        self.pads = self.pads_kept = None
        self.compressed = False
        self.prompt_length = 0
        self.tokens_read = self.tokens_available = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a SnapKV cache cannot be cropped after eviction; re-run the prefill with a new cache")

    def stored_tokens(self) -> int:
        """Token slots held over the batch: bytes held, so padding slots kept to fill a short row count."""
        return 0 if not self.is_initialized else self.keys.shape[0] * self.keys.shape[-2]

    def seen_tokens(self) -> int:
        """Real tokens seen over the batch: what a full cache would hold for these rows."""
        return 0 if not self.is_initialized else self.keys.shape[0] * self.cumulative_length - sum(self.pads or ())


class SnapKVCache(Cache):
    """Drop-in `past_key_values`/`cache` for one run; build a fresh one per prompt with `from_model`.

    Budget: `budget` prompt tokens chosen by attention *plus* the `window` (kept = budget + window), or,
    when `budget` is None, a total of `max(window, round(ratio * prompt_len))` prompt tokens kept.
    """

    def __init__(self, num_layers: int, *, window: int = 32, ratio: float | None = 0.2, budget: int | None = None,
                 kernel_size: int = 5):
        if budget is None and (ratio is None or not 0 < ratio <= 1):
            raise ValueError(f"SnapKV needs a keep ratio in (0, 1] or a token budget; got ratio={ratio}, budget={budget}")
        if budget is not None and budget < 0:
            raise ValueError(f"SnapKV budget must be >= 0 tokens, got {budget}")
        if window < 1:
            raise ValueError(f"SnapKV observation window must be >= 1 token, got {window}")
        self.window, self.ratio, self.budget, self.kernel_size = window, ratio, budget, kernel_size
        super().__init__(layers=[SnapKVLayer(window=window, ratio=ratio if budget is None else None, budget=budget,
                                             kernel_size=kernel_size) for _ in range(num_layers)])

    @classmethod
    def from_model(cls, model, **kwargs) -> "SnapKVCache":
        attach(model)
        text = model.config.get_text_config()
        cache = cls(text.num_hidden_layers, **kwargs)
        for module in _attention_modules(model):
            cache.layers[module.layer_idx].scaling = getattr(module, "scaling", None)
        return cache


def _attention_modules(model) -> list:
    return [m for name, m in model.named_modules()
            if name.endswith("self_attn") and hasattr(m, "q_proj") and hasattr(m, "layer_idx")]


def attach(model) -> None:
    """Install the window-query pre-hooks once per model (they do nothing unless the cache is a SnapKVCache)."""
    if getattr(model, _HOOK_FLAG, None):
        return
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"SnapKV found no attention modules with q_proj/layer_idx in {type(model).__name__}; "
                         "it supports Llama/Mistral/Qwen-style attention")
    handles = [m.register_forward_pre_hook(_window_queries_hook, with_kwargs=True) for m in modules]
    setattr(model, _HOOK_FLAG, handles)


def detach(model) -> None:
    for h in getattr(model, _HOOK_FLAG, None) or []:
        h.remove()
    if hasattr(model, _HOOK_FLAG):
        delattr(model, _HOOK_FLAG)


def _window_queries_hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, SnapKVCache):
        return None
    layer = cache.layers[module.layer_idx]
    if layer.compressed or layer.cumulative_length > 0:
        return None  # only the prefill (the first call) is compressed
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"]
    w = min(layer.window, hidden.shape[1])
    h = hidden[:, -w:]
    q = module.q_proj(h).view(h.shape[0], w, -1, module.head_dim).transpose(1, 2)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    layer.pending_queries = apply_rope(q, cos[:, -w:], sin[:, -w:]).detach()
    mask = kwargs.get("attention_mask")
    layer.pending_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 4 else None
    return None


def snapkv_report(cache: SnapKVCache) -> dict[str, Any]:
    """Accounting in the shape of `accounting.report`: kept token slots x FP16 over the real tokens seen x FP16
    (left padding is no token; a padding slot a short row keeps is bytes held).

    Nothing else is stored: kept keys are already rotated with their own positions and later positions
    come from the logical length, so no index or position bytes are needed.
    """
    layers = [layer for layer in cache.layers if layer.is_initialized]
    per_token = [2 * layer.keys.shape[1] * layer.keys.shape[-1] * 2 for layer in layers]  # K+V, FP16
    kept = sum(layer.stored_tokens() * b for layer, b in zip(layers, per_token))
    fp16 = sum(layer.seen_tokens() * b for layer, b in zip(layers, per_token))
    per_layer = [layer.tokens_read / layer.tokens_available if layer.tokens_available else 1.0 for layer in cache.layers]
    if layers:
        n, first = layers[0].prompt_length or layers[0].cumulative_length, layers[0]
        decoded = first.cumulative_length - n
        kept_prompt = (first.n_selected(n) + min(first.window, n)) if first.compressed else n
        # every row holds kept_prompt slots (a row with fewer real tokens fills them with masked padding),
        # over the real tokens the rows have seen
        real = [n - p for p in (first.pads or [0] * first.keys.shape[0])]
        seen = sum(r + decoded for r in real)
        formula = len(real) * (kept_prompt + decoded) / seen if seen else 0.0
    else:
        formula = 0.0
    kr = kept / fp16 if fp16 else 0.0
    return {"kr_measured": kr, "kr_formula": formula, "cr": sum(per_layer) / len(per_layer) if per_layer else 1.0,
            "cr_per_layer": per_layer, "cr_scope": "decode steps (one new token per row); prefill attends densely",
            "bytes": {"kept_kv_fp16": kept}, "total_bytes": kept, "fp16_bytes": fp16,
            "held_bytes": sum(nbytes_of(layer.keys, layer.values) for layer in layers),
            "gap": {}, "unexplained": kr - formula,
            "inputs": {"window": cache.window, "ratio": cache.ratio, "budget": cache.budget,
                       "kernel_size": cache.kernel_size}}
