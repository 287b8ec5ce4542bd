"""Dynamic token selection (OmniKV) and the sparse attention path (seed §2.7, §3.3, §4.7).

Decode step t under mode "omnikv" (prefill stays dense everywhere, as in OmniKV):

1. a filter layer (a full-attention layer of the config) attends over its whole history; at the last
   filter layer of each run of adjacent ones, the attention also scores every history token: raw q.k
   logits, averaged over the step's query positions, max-pooled over the query heads of each KV group
   and then over the KV heads (the authors' recipe). I_t = the `select_budget` best tokens
   (or ceil(select_ratio x history)) + the n_sink first + the n_recent newest, per row;
2. the following sparse layers, up to the next filter layer, gather and reconstruct only I_t (selected
   references read as references; selected codes decoded with only the references they need) and
   attend over them plus the current token:  o = softmax(q K_I^T / sqrt(D)) V_I; with `select_reuse`
   each keeps what it reconstructed and reconstructs only the tokens of I_t it lacks (residualkv/reuse.py);
3. the new token is stored as usual (reference or code). Layers before the first filter layer read all.

Mode "snapkv": during the prompt, each compressed layer's attention also computes SnapKV's votes (the
last `snapkv_window` queries' softmax attention averaged over those queries, average-pooled over
neighbouring tokens and over the query heads of each KV head, as the SnapKV baseline in
residualkv/snapkv.py scores; then max over KV heads, since a ResidualKV token carries all heads) and
evicts the layer's tokens to the survivors (the best `select_budget` + sinks + the observation window)
plus the references the surviving codes need. Irreversible; later steps read the survivors and every
new token.

How it plugs into transformers without copying modeling files. The query is only visible to the
attention function, the cache only to `cache.update`; the hand-off between the two:

* `ResidualKVCache.update` (via `SparseController.update`) returns either the usual K/V or, for a
  sparse layer, only the selected K/V with a `slots` map; it leaves a `Handoff` (layer, kind, the K
  tensor it returned) in a context variable;
* `sparse_attention_forward`, registered in `AttentionInterface` as "residualkv_sparse", picks the
  hand-off up when it is for the very K tensor it receives, then: "sparse" -> gathers the model's mask
  at the returned slots (and masks padding columns); "score" -> attends densely and stores I_t on
  the controller; "snap" -> attends densely and evicts; "kivi" (`FusedFullDecode`, any mode, where the
  kernels run) -> the cache returned zero-length K/V and the function attends over the full layer's
  packed stores with kernels/kivi_attention.py; "latent" (`LatentValues`, any mode, decode steps on the
  torch path) -> the values came back without the decoder's term and the function adds it after the
  softmax (a "sparse" hand-off can carry the same latents); "attend" (LowRAMCache with `selective`)
  -> the cache returned zero-length K/V and its callback computes the attention from the query,
  choosing which prompt chunks to rebuild (residualkv/lowram/selective.py), or, LowRAM-E, reading the
  prompt tokens eviction kept; "observe" (LowRAMCache with `evict_keep`, prefill) -> attends densely and
  hands the query and keys back for SnapKV's votes (residualkv/lowram/evict.py). With no hand-off it is exactly
  transformers' SDPA, so installing it on a model changes nothing for other caches.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kernels.kivi_attention import kernel_fits, kivi_decode_attention
from kernels._common import use_triton

from .cache import KiviLayer, ResidualLayer, RowLayout
from .stores import Latents, RowStores

ATTN_IMPLEMENTATION = "residualkv_sparse"


@dataclass
class Handoff:
    controller: "SparseController | None"  # None for "kivi" and "latent"
    layer_idx: int
    kind: str  # "score" | "sparse" | "snap" | "kivi" | "latent" | "attend" | "observe"
    key: torch.Tensor  # the K tensor cache.update returned: the attention call must receive this object
    slots: torch.Tensor | None  # "sparse": [B, L] mask column of each returned K column, -1 = padding
    # "sparse": whether `slots` may hold -1 (False: the host knows it does not, so nothing asks the device)
    padded: bool = True
    consumed: bool = False
    layer: KiviLayer | None = None  # "kivi": the full-attention layer whose packed stores the kernel reads
    rows: RowLayout | None = None  # "kivi": its row groups (one store per group)
    # "latent", or a "sparse" read whose values came back latent: (Latents over the L columns, W_v [Hkv·D, d_c]),
    # the attention adds (P Z) W_v^T to P V (LatentValues)
    latent: "tuple[Latents, torch.Tensor] | None" = None
    # "attend": the cache computes the attention itself from the query (attend(query, scaling) -> [B, 1, Hq, D]);
    # LowRAM-SR, whose stores choose what to rebuild from the query
    attend: "Callable[[torch.Tensor, float | None], torch.Tensor] | None" = None
    # "observe": the function attends densely, then hands (query, key, mask, scaling) to the cache; LowRAM-E's
    # prefill, whose stores evict by SnapKV's votes
    observe: "Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float], None] | None" = None

    def release(self) -> None:
        """Let go of the tensors once the attention has run: the owner keeps its last hand-off until its
        next layer checks it, which after a step's last layer is the next step (residualkv.memory)."""
        self.key = self.slots = self.layer = self.rows = self.latent = self.attend = self.observe = None


_HANDOFF: contextvars.ContextVar[Handoff | None] = contextvars.ContextVar("residualkv_handoff", default=None)


# ---------------------------------------------------------------------------------------------
# Scores and selection (pure functions, tested on their own)


def omnikv_token_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """query [B, Hq, T, D], key [B, Hkv, L, D] -> [B, L]: raw q.k logits averaged over the T query
    positions, max over the query heads of each KV group, then max over KV heads."""
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = Hq // Hkv
    q = query.float().reshape(B, Hkv, G * T, D)  # query head h reads KV head h // G (repeat_kv)
    logits = (q @ key.float().transpose(-1, -2)).view(B, Hkv, G, T, L)
    return logits.mean(dim=3).amax(dim=2).amax(dim=1)


def snapkv_token_scores(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float, window: int) -> torch.Tensor:
    """SnapKV votes per query head [B, Hq, L]: softmax attention of the last `window` queries over all
    keys (causal and padding masked), averaged over those queries. Query heads are KV-group major."""
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G, w = Hq // Hkv, min(window, T)
    q = query[:, :, -w:].float().reshape(B, Hkv, G * w, D)
    logits = (q @ key.float().transpose(-1, -2)).view(B, Hkv, G, w, L) * scaling
    if attention_mask is not None:
        m = attention_mask[..., -w:, :]
        allowed = m if m.dtype == torch.bool else m == 0
        allowed = allowed.expand(B, -1, w, L)[:, :, None]  # [B, 1|H, 1, w, L]
    else:  # causal: the queries are the last w slots
        q_slot = torch.arange(L - w, L, device=key.device)
        allowed = torch.arange(L, device=key.device)[None, :] <= q_slot[:, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a padding query that sees nothing votes 0
    return probs.mean(dim=3).reshape(B, Hq, L)


def snapkv_head_scores(votes: torch.Tensor, n_kv_heads: int, pool: int) -> torch.Tensor:
    """votes [r, Hq, n] over a prompt prefix -> SnapKV scores per KV head [r, Hkv, n]: average-pooled over
    neighbouring tokens (count_include_pad=False), then averaged over the query heads sharing a KV head."""
    r, Hq, n = votes.shape
    if pool > 1 and n > 0:
        votes = F.avg_pool1d(votes.reshape(r * Hq, 1, n), pool, stride=1, padding=pool // 2,
                             count_include_pad=False).reshape(r, Hq, -1)[..., :n]
    return votes.reshape(r, n_kv_heads, Hq // n_kv_heads, n).mean(dim=2)


def snapkv_aggregate(votes: torch.Tensor, n_kv_heads: int, pool: int) -> torch.Tensor:
    """votes [r, Hq, n] -> token scores [r, n]: the SnapKV baseline's per-KV-head scores (residualkv.snapkv),
    then max over KV heads, because a ResidualKV token holds every KV head: it survives if any head wants it."""
    return snapkv_head_scores(votes, n_kv_heads, pool).amax(dim=1)


def _pool(scores: torch.Tensor, width: int) -> torch.Tensor:
    if width <= 1:
        return scores
    return F.max_pool1d(scores[:, None], kernel_size=width, stride=1, padding=width // 2)[:, 0]


def token_budget(cfg, n: int) -> int:
    """Scored tokens chosen for a row with n history tokens (besides the sinks and the recent window)."""
    if cfg.select_ratio is not None:
        return int(math.ceil(cfg.select_ratio * n))
    return int(cfg.select_budget)


def select_tokens(scores: torch.Tensor, n_sink: int, n_recent: int, budget: int) -> torch.Tensor:
    """scores [r, n] over history ordinals -> [r, S] sorted ordinals: the n_sink first, the n_recent
    last and the `budget` best-scored of the others. S is the same for every row."""
    r, n = scores.shape
    ords = torch.arange(n, device=scores.device)
    forced = (ords < n_sink) | (ords >= n - n_recent)
    # |forced| counted on the host: the two ranges cover min(n, n_sink + n_recent) ordinals
    k = min(n, min(n, max(n_sink, 0) + max(n_recent, 0)) + max(budget, 0))
    if k == n:
        return ords.expand(r, n).clone()
    s = scores.float().nan_to_num(float("-inf")).masked_fill(forced, float("inf"))
    return s.topk(k, dim=-1).indices.sort(dim=-1).values


# ---------------------------------------------------------------------------------------------
# The controller: what each layer of a sparse-mode cache reads, step by step


class SparseController:
    """Per-cache state of the sparse modes; `ResidualKVCache.update` delegates to `update`."""

    def __init__(self, cache):
        self.cache = cache
        self.cfg = cache.config
        n_layers = len(cache.layers)
        self.filters = frozenset(self.cfg.full_attention_layers)
        if self.cfg.mode == "omnikv" and not self.filters:
            raise ValueError("mode 'omnikv' needs filter layers: set full_attention_layers (the backbone YAML's)")
        # a run of adjacent filter layers chooses once, at its last layer (the authors' "obs" layers)
        self.choosers = frozenset(i for i in self.filters if i + 1 < n_layers and i + 1 not in self.filters)
        self.selection: list[torch.Tensor | None] | None = None  # per row group: [rows, S] ordinals this step
        # when I_t is a group's whole history (budget >= history), read it by the plain full path
        # (same tokens, no gather overhead); tests turn this off to exercise the gather path
        self.full_read_shortcut = True
        self.decode = False
        self.prompt = False
        self.evicted: dict[int, dict[str, int]] = {}  # snapkv: layer -> counts
        self.pending: Handoff | None = None

    # -- called by the cache --

    def begin_step(self, n_new: int) -> None:
        self._check_pending()
        s0 = self.cache.rows.n_slots - n_new
        self.selection = None
        self.decode = n_new == 1 and s0 > 0
        self.prompt = s0 == 0

    def update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, latent: bool = False):
        """The layer's K, V (and Z where its values come back latent, see LatentValues)."""
        self._check_pending()
        layer, rows = self.cache.layers[layer_idx], self.cache.rows
        if self.cfg.mode == "omnikv":
            if self.decode and layer_idx not in self.filters and self.selection is not None:
                read = layer.update_selected(key_states, value_states, rows, self.selection, latent=latent,
                                             reuse=self.cfg.select_reuse)
                # padding columns: where row groups read different lengths, or a reuse buffer holds tokens
                # the step did not choose
                padded = len(rows.groups) > 1 or any(buf.spare for buf in layer.buffers.values())
                return self._sparse(layer_idx, read, padded)
            out = layer.update(key_states, value_states, rows, latent=latent)
            if self.decode and layer_idx in self.choosers:
                self._hand(layer_idx, "score", out[0], None)
            return out
        # snapkv
        if isinstance(layer, ResidualLayer) and layer_idx in self.evicted:
            select = [store.visible_ordinals() for store in layer.stores]
            return self._sparse(layer_idx, layer.update_selected(key_states, value_states, rows, select, latent=latent),
                                len(rows.groups) > 1)
        out = layer.update(key_states, value_states, rows, latent=latent)
        if self.prompt and isinstance(layer, ResidualLayer):
            self._hand(layer_idx, "snap", out[0], None)
        return out

    def _sparse(self, layer_idx: int, read: tuple, padded: bool) -> tuple:
        *out, slots = read
        self._hand(layer_idx, "sparse", out[0], slots, padded)
        return tuple(out)

    # -- called by the attention function --

    def choose(self, h: Handoff, scores: torch.Tensor) -> None:
        """I_t for every row group, from the filter layer's scores over slots [B, L]."""
        cfg, rows = self.cfg, self.cache.rows
        s0 = rows.n_slots - 1
        sel = []
        for grp in rows.groups:  # pool inside each group's own history (never across its padding)
            n = s0 - grp.start
            sc = _pool(scores[grp.rows.to(scores.device), grp.start : s0], cfg.select_pool)
            # the FP16 window costs no reconstruction: always read it
            chosen = select_tokens(sc, cfg.n_sink, max(cfg.n_recent, cfg.recent_window), token_budget(cfg, n))
            sel.append(None if self.full_read_shortcut and chosen.shape[1] == n else chosen)
        self.selection = None if all(s is None for s in sel) else sel

    def evict(self, h: Handoff, votes: torch.Tensor, n_kv_heads: int) -> None:
        """SnapKV: keep each row's survivors (and the references their codes need) in layer h.layer_idx.
        Survivors: the n_sink first tokens, the observation window (last snapkv_window prompt tokens)
        and the `select_budget` best-voted others; with select_ratio, max(window, round(ratio x n))
        prompt tokens in all (the SnapKV baseline's ratio), sinks included when they fit."""
        cfg, rows = self.cfg, self.cache.rows
        layer = self.cache.layers[h.layer_idx]
        s1 = rows.n_slots
        counts = {"evicted_refs": 0, "evicted_codes": 0, "hidden_refs": 0}
        for gi, grp in enumerate(rows.groups):
            n = s1 - grp.start
            w = min(max(cfg.snapkv_window, cfg.recent_window), n)  # the FP16 window is never evicted
            prefix = n - w
            sinks = min(cfg.n_sink, prefix)
            budget = (max(0, round(cfg.select_ratio * n) - w - sinks) if cfg.select_ratio is not None
                      else cfg.select_budget)
            if sinks + budget >= prefix:
                continue
            r_idx = grp.rows.to(votes.device)
            scores = snapkv_aggregate(votes[r_idx, :, grp.start : grp.start + prefix], n_kv_heads, cfg.snapkv_pool)
            chosen = select_tokens(scores, cfg.n_sink, 0, budget)
            window = torch.arange(prefix, n, device=chosen.device).expand(chosen.shape[0], w)
            keep = torch.cat([chosen, window], dim=1)
            store = layer.stores[gi]
            if store.refs.shape[0] > 1:
                store = layer.stores[gi] = RowStores(store.split_rows())
            for i, one in enumerate(store.stores if isinstance(store, RowStores) else [store]):
                for key, val in one.evict(keep[i]).items():
                    counts[key] += val
        if counts["evicted_refs"] + counts["evicted_codes"]:
            self.evicted[h.layer_idx] = counts

    # -- hand-off --

    def _hand(self, layer_idx: int, kind: str, key: torch.Tensor, slots: torch.Tensor | None,
              padded: bool = True) -> None:
        hand_off(self, Handoff(self, layer_idx, kind, key, slots, padded=padded))

    def _check_pending(self) -> None:
        check_handed_off(self, f"the {self.cfg.mode} selection could not be made")


def hand_off(owner, h: Handoff) -> None:
    owner.pending = h
    _HANDOFF.set(h)


def check_handed_off(owner, consequence: str) -> None:
    """Called by the owner before its next layer: the attention function must have taken the hand-off."""
    h, owner.pending = owner.pending, None
    if h is not None and not h.consumed:
        _HANDOFF.set(None)
        raise RuntimeError(
            f"layer {h.layer_idx}'s attention did not run through {ATTN_IMPLEMENTATION!r}, so {consequence}; "
            "call residualkv.attention.install(model) (caches built with from_model do this) and keep the model "
            "on that attention implementation")


# ---------------------------------------------------------------------------------------------
# Full-attention layers on the fused KIVI decode kernel


class FusedFullDecode:
    """Decode steps of the full-attention (KIVI) layers on kernels/kivi_attention.py (seed §4.5): the
    layer stores the new token and hands its packed stores to the attention function, which attends over
    the packed bytes; the FP16 history is never materialised. Only where the kernel runs (CUDA, or
    kernel_impl "triton" under TRITON_INTERPRET), without gradients, one query position per row, and
    not at OmniKV's choosing layers (they score every history key, so they read K anyway)."""

    def __init__(self, cache):
        self.cache = cache
        sparse = cache.sparse
        self.skip = sparse.choosers if sparse is not None and cache.config.mode == "omnikv" else frozenset()
        self.pending: Handoff | None = None
        self.steps = 0  # layer-steps served by the kernel (tests and benchmarks check the path was taken)

    def check(self) -> None:
        check_handed_off(self, "the fused KIVI decode attention did not run")

    def applies(self, layer_idx: int, key_states: torch.Tensor) -> bool:
        return (isinstance(self.cache.layers[layer_idx], KiviLayer) and key_states.shape[2] == 1
                and layer_idx not in self.skip and not torch.is_grad_enabled()
                and kernel_fits(self.cache.config.full_group_size)
                and use_triton(self.cache.config.kernel_impl, key_states))

    def update(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        layer = self.cache.layers[layer_idx]
        layer.write(key_states, value_states, self.cache.rows)
        B, H, _, D = key_states.shape
        # zero-length stand-ins: the attention function recognises the K object and reads the stores
        k, v = key_states.new_empty(B, H, 0, D), value_states.new_empty(B, H, 0, value_states.shape[-1])
        hand_off(self, Handoff(None, layer_idx, "kivi", k, None, layer=layer, rows=self.cache.rows))
        self.steps += 1
        return k, v


def _kivi_attention(module, query: torch.Tensor, h: Handoff, kwargs: dict) -> torch.Tensor:
    """Decode attention of one KIVI layer on its packed stores -> [B, 1, Hq, D] (the layout transformers'
    attention functions return). Each row group attends over its own store, which holds exactly that
    group's real tokens, so the padding mask needs no columns; a one-token query needs no causal mask."""
    _plain_softmax_only(kwargs, "the fused KIVI decode attention",
                        "build the cache with kernel_impl='torch' for this model")
    scale, impl = kwargs.get("scaling"), h.layer.cfg.kernel_impl
    if len(h.layer.stores) == 1:
        out = kivi_decode_attention(query, h.layer.stores[0], scale=scale, impl=impl)
    else:
        out = torch.empty_like(query)
        for grp, store in zip(h.rows.groups, h.layer.stores):
            r = grp.rows.to(query.device)
            out[r] = kivi_decode_attention(query[r], store, scale=scale, impl=impl)
    return out.transpose(1, 2).contiguous()


def _plain_softmax_only(kwargs: dict, what: str, fix: str) -> None:
    if kwargs.get("dropout") or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{what} supports plain softmax attention only (no dropout, soft-capping or sliding "
                         f"window); {fix}")


# ---------------------------------------------------------------------------------------------
# Compressed layers' values decoded after the softmax


class LatentValues:
    """Decode steps of compressed layers on the torch path apply the values' decoder after the softmax.

    The decoder is linear, so for a query head attending with weights p_i over tokens i whose values are
    codes (v_i = W_v z_i + m_i, m_i the mean of their references) or whole (references, window and new
    tokens: v_i as stored, z_i = 0):  o = sum_i p_i v_i = sum_i p_i m_i' + W_v (sum_i p_i z_i).  The cache
    returns V with m_i in the codes' columns and the codes' latents Z with their columns (`Latents`,
    ResidualStore.read with `latent`); the attention adds (P[:, cols] Z) W_v^T. The W_v product over every
    token read (half the decoder's GEMM) becomes one d_c x D product per query head; keys are decoded as
    before (RoPE sits between them and q)."""

    def __init__(self, cache):
        self.cache = cache
        self.pending: Handoff | None = None
        self.steps = 0  # layer-steps whose values came back latent (tests and benchmarks check the path)

    def check(self) -> None:
        check_handed_off(self, "the values' decoder term would be missing from the attention output")

    def hand(self, layer_idx: int, key: torch.Tensor, z: Latents, sparse: "SparseController | None") -> None:
        """Give the attention of layer `layer_idx` the latents `z` of the K/V just returned: on the sparse
        path's own hand-off when there is one for this K, else on a "latent" one."""
        latent = (z, self.cache.layers[layer_idx].codec.value_decoder())
        self.steps += 1
        h = None if sparse is None else sparse.pending
        if h is not None and h.key is key and not h.consumed:
            h.latent = latent
        else:
            hand_off(self, Handoff(None, layer_idx, "latent", key, None, latent=latent))


def latent_value_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                           z: Latents, w_v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """softmax(q K^T·scaling + mask) (V + Z W_v^T) for one query position, computed as
    P V + (P[:, cols] Z) W_v^T over the codes' columns only (Z is zero in the others).
    query [B, Hq, 1, D], key/value [B, Hkv, L, D], mask [B, 1|Hq, 1, L] (bool: True = attend, or additive),
    z: Latents (cols [B, C] of the L, z [B, C, d_c]), w_v [Hkv·D, d_c] -> [B, 1, Hq, D] (the layout
    transformers' attention functions return)."""
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if T != 1:
        raise ValueError(f"latent values are read by decode steps (one query position), not {T}")
    G = Hq // Hkv
    q = query.float().reshape(B, Hkv, G, D) * (D**-0.5 if scaling is None else scaling)  # head h reads KV head h // G
    logits = q @ key.float().transpose(-1, -2)  # [B, Hkv, G, L]
    if mask is not None:
        m = mask.expand(B, -1, 1, L).reshape(B, -1, L)
        m = m[:, None] if m.shape[1] == 1 else m.reshape(B, Hkv, G, L)
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
    p = torch.softmax(logits, dim=-1)
    out = p @ value.float()  # [B, Hkv, G, D]
    p_codes = p.reshape(B, Hq, L).gather(-1, z.cols[:, None].expand(B, Hq, -1))  # [B, Hq, C]
    pz = (p_codes @ z.z.float()).reshape(B, Hkv, G, -1)  # [B, Hkv, G, d_c]
    out = out + pz @ w_v.float().reshape(Hkv, D, -1).transpose(-1, -2)
    return out.reshape(B, Hq, 1, D).transpose(1, 2).to(query.dtype)


# ---------------------------------------------------------------------------------------------
# The attention function


def sparse_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function "residualkv_sparse": SDPA, plus the hand-off described above."""
    h = _HANDOFF.get()
    if h is None or h.consumed or h.key is not key or getattr(module, "layer_idx", h.layer_idx) != h.layer_idx:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    h.consumed = True
    _HANDOFF.set(None)
    try:
        return _attend_handed(module, query, key, value, attention_mask, h, kwargs)
    finally:
        h.release()


def _attend_handed(module, query, key, value, attention_mask, h: Handoff, kwargs: dict):
    if h.kind == "kivi":
        return _kivi_attention(module, query, h, kwargs), None
    if h.kind == "attend":
        _plain_softmax_only(kwargs, "LowRAM-SR's decode attention", "build the cache without selective")
        return h.attend(query, kwargs.get("scaling")), None
    mask = gather_mask(attention_mask, h.slots, query, h.padded) if h.kind == "sparse" else attention_mask
    if h.latent is not None:
        _plain_softmax_only(kwargs, "the latent-value decode attention", "set cache.latent = None for this model")
        return latent_value_attention(query, key, value, mask, *h.latent, kwargs.get("scaling")), None
    if h.kind == "sparse":
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    with torch.no_grad():
        if h.kind == "score":
            h.controller.choose(h, omnikv_token_scores(query, key))
        elif h.kind == "observe":
            h.observe(query, key, attention_mask, scaling)
        elif h.kind == "snap":
            votes = snapkv_token_scores(query, key, attention_mask, scaling, h.controller.cfg.snapkv_window)
            h.controller.evict(h, votes, key.shape[1])
    return out


def gather_mask(attention_mask: torch.Tensor | None, slots: torch.Tensor, query: torch.Tensor,
                padded: bool = True) -> torch.Tensor | None:
    """The model's mask [B, 1, T, kv] restricted to the returned columns `slots` [B, L]; -1 columns masked
    (`padded` False: there are none, known without asking the device). Where columns may be padding, the
    mask is returned even if none is: asking the device whether any is would be a host sync."""
    valid = slots >= 0
    B, L = slots.shape
    if attention_mask is None:
        return valid[:, None, None, :] if padded else None
    T = attention_mask.shape[-2]
    m = attention_mask.expand(B, -1, -1, -1)
    idx = slots.clamp(min=0)[:, None, None, :].expand(B, m.shape[1], T, L)
    g = m.gather(-1, idx)
    if not padded:
        return g
    if g.dtype == torch.bool:
        return g & valid[:, None, None, :]
    return g.masked_fill(~valid[:, None, None, :], torch.finfo(g.dtype).min)


def register() -> None:
    """Make "residualkv_sparse" a valid `attn_implementation` (attention and mask functions)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sparse_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def install(model) -> None:
    """Route `model`'s attention through "residualkv_sparse" (exactly SDPA unless a sparse cache hands
    off a selection). Idempotent."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


__all__ = ["ATTN_IMPLEMENTATION", "FusedFullDecode", "Handoff", "check_handed_off", "hand_off", "LatentValues", "SparseController", "latent_value_attention", "gather_mask", "install", "omnikv_token_scores", "register",
           "select_tokens", "snapkv_aggregate", "snapkv_head_scores", "snapkv_token_scores", "sparse_attention_forward", "token_budget"]
