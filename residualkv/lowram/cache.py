"""The LowRAM cache (seed 003): a `transformers` Cache whose prompt is stored as key factors, a value
predictor and sparse residuals, fitted to that prompt during the prefill.

Prefill: each layer attends over its exact keys and values (as a serving engine's prefill) and holds
them until the last layer of its xKV group has run; then the group's pre-RoPE keys get one shared
basis A and per-layer factors B (keys.py), and each layer of the group fits its value predictor on the
keys as the cache will read them back, A B, and keeps the residuals of the tokens it predicts worst
(values.py). The dense prompt is then dropped. Decode: every step rebuilds the prompt's keys (A B,
rotated) and values (f(A B) + residuals) and attends over all of them (CR = 100%); tokens written after
the prompt are kept exact in FP16, as the seed does. With `selective` (LowRAM-SR, selective.py) a decode
step rebuilds only the prompt chunks its query selects; the attention function then reads them
through a hand-off (residualkv.attention), as the query is not visible to `Cache.update`. With
`evict_keep` (LowRAM-E, evict.py) each xKV group first keeps only SnapKV's survivors of the prompt, from
the votes its layers' prefill attention hands over, and decode reads the survivors through `attend`.

Every stored tensor is what is counted: A in FP16 or packed `key_bits`, B and the predictors in FP16,
the residuals in FP16 or packed `residual_bits`, and which tokens have one as a bit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from .. import attention
from ..cache import RowLayout, _GroupedLayer, _position_ids
from ..codec import model_shape
from ..config import ConfigError, LowRAMConfig
from ..growing import Growing, grown
from ..quant import pack_bits, unpack_bits
from ..rope import RopeTable, apply_rope, invert_rope
from ..stores import flat_heads, nbytes_of, sum_bytes
from .evict import Kept, evict, record_votes
from .keys import fit_layer_factors, low_rank_basis, rank_for_ratio
from .quantised import Quantised, bytes_per_coord, head_group
from .selective import Selective, chunks_selected, extra_bytes, tokens_chosen
from .starts import PredictorStarts
from .values import Predictor, fit_predictor, slim_start, slim_starts, worst_predicted


class LowRAMStore:
    """One layer's tokens for one row group [R rows]: the prompt as factors, predictor and residuals
    (once `compress_group` has run), then the exact tail."""

    k_tail = grown("_k_tail")  # [R, H, t, D] FP16, post-RoPE
    v_tail = grown("_v_tail")

    def __init__(self):
        self.n = 0  # tokens stored (prompt + tail)
        self.n_prompt = 0
        self.shape: tuple[int, int, int, int] | None = None  # R, H, T, D of the prompt
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # exact pre-RoPE keys, values until compressed
        self.basis: Quantised | None = None  # A [R, T, k], shared with the other layers of the xKV group
        self.factors: torch.Tensor | None = None  # B [R, k, H·D] FP16
        self.predictor: Predictor | None = None  # [R·H, ...] FP16
        self.mask: torch.Tensor | None = None  # uint8 [R·H, ceil(T/8)]: bit t set = token t has a residual
        self.residuals: Quantised | None = None  # [R·H, n_keep, D], in token order
        self.n_keep = 0  # residuals per (row, head)
        self.selective: Selective | None = None  # LowRAM-SR's landmarks and exact tokens, where it engages
        self.k_post: torch.Tensor | None = None  # exact post-RoPE prompt keys until compressed (LowRAM-SR)
        self.votes: torch.Tensor | None = None  # LowRAM-E: SnapKV scores [R, H, T] until the xKV group evicts
        self.kept: Kept | None = None  # LowRAM-E: which prompt tokens survived (shared by the xKV group)
        self._k_tail, self._v_tail = Growing(dim=2), Growing(dim=2)

    def hold(self, k_pre: torch.Tensor, v: torch.Tensor, k_post: torch.Tensor | None = None) -> None:
        self.pending = (k_pre.detach().float(), v.detach().float())
        self.k_post = None if k_post is None else k_post.detach()
        self.shape = tuple(k_pre.shape)
        self.n = self.n_prompt = k_pre.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k_tail.append(k.detach().to(torch.float16))
        self._v_tail.append(v.detach().to(torch.float16))
        self.n += k.shape[2]

    def prompt_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """The stored prompt tokens' RoPE positions [R, T] from the rows' positions [R, >= prompt seen]."""
        if self.kept is None:
            return pos[:, :self.n_prompt]
        return pos.gather(1, self.kept.ordinals().to(pos.device))

    def prompt_keys(self) -> torch.Tensor:
        """The prompt's pre-RoPE keys as stored, A B: [R, H, T, D] float32."""
        return stored_keys(self.basis, self.factors, self.shape)

    def read(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated with cos, sin [R, T, D] of the prompt's positions) and values of every stored
        token, float32 [R, H, n, D]."""
        kp = self.prompt_keys()
        R, H, T, D = kp.shape
        v = self.predictor(kp.reshape(R * H, T, D))
        has = unpack_bits(self.mask, 1)[:, :T].bool()
        v[has] += self.residuals.read().reshape(-1, D)
        k, v = apply_rope(kp, cos, sin), v.view(R, H, T, D)
        if self.selective is not None:
            self.selective.overwrite(k, v)
        return self._with_tail(k, v)

    def read_selected(self, query: torch.Tensor, positions: torch.Tensor, rope: RopeTable, n_select: int,
                      scaling: float, reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """LowRAM-SR: keys and values [R, H, L, D] float32 of the exact chunks, the `n_select` chunks the
        queries [R, Hq, 1, D] select (rebuilt; with `reuse` only those the buffer does not hold yet),
        the exact window and the tail."""
        sr = self.selective
        chunks = sr.choose_chunks(query, n_select, scaling)
        k, v = sr.gather(chunks, lambda tok: self._rebuild(tok, positions, rope), reuse)
        k = torch.cat([sr.out_k.float(), k, sr.win_k.float()], dim=2)
        v = torch.cat([sr.out_v.float(), v, sr.win_v.float()], dim=2)
        return self._with_tail(k, v)

    def _rebuild(self, tok: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (A B rotated at their `positions`) and values (f + their residuals) [R, H, n, D] float32 of
        prompt tokens `tok` [R, H, n]: only those rows of A and of the residuals are decoded."""
        R, H, T, D = self.shape
        n = tok.shape[-1]
        a = self.basis.rows(tok.reshape(R, H * n)).view(R, H, n, -1)
        kp = a @ self.factors.float().view(R, -1, H, D).transpose(1, 2)  # [R, H, n, D]
        cos, sin = rope.cos_sin(positions.gather(1, tok.reshape(R, H * n)), torch.float32)
        k = apply_rope(kp.reshape(R * H, 1, n, D), cos.reshape(R * H, n, D), sin.reshape(R * H, n, D))
        tok = tok.reshape(R * H, n)
        v = self.predictor(kp.reshape(R * H, n, D))
        if self.n_keep:
            has = unpack_bits(self.mask, 1)[:, :T]
            rank = has.cumsum(1, dtype=torch.int32).sub_(1).gather(1, tok).clamp_(min=0).long()
            v += self.residuals.rows(rank) * has.gather(1, tok)[..., None]
        return k.view(R, H, n, D), v.view(R, H, n, D)

    def _with_tail(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n > self.n_prompt:
            k = torch.cat([k, self.k_tail.float()], dim=2)
            v = torch.cat([v, self.v_tail.float()], dim=2)
        return k, v

    def nbytes(self) -> dict[str, int]:
        if self.pending is not None:
            return {"prompt_pending_fp16": (self.pending[0].numel() + self.pending[1].numel()) * 2}
        if self.factors is None:
            return {}
        out = {"key_layer_factors": nbytes_of(self.factors), "value_predictors": self.predictor.nbytes(),
               "value_residuals": self.residuals.nbytes(), "residual_mask": nbytes_of(self.mask),
               "exact_tail_fp16": nbytes_of(self.k_tail, self.v_tail)}
        return out if self.selective is None else {**out, **self.selective.nbytes()}

    def spare_bytes(self) -> int:
        return self._k_tail.spare_bytes() + self._v_tail.spare_bytes()


def residual_count(T: int, H: int, D: int, fixed_bytes: int, cfg: LowRAMConfig) -> int:
    """Residuals per (row, head) that fit the values' share of the budget, T·H·D·2/ratio bytes per row,
    after the row's predictors and residual mask (`fixed_bytes`). 0 when the predictors alone overrun it:
    short prompts (the seed: amortisation pays off only after 2-3K tokens); the report shows the overrun."""
    per = D * bytes_per_coord(cfg.residual_bits, head_group(cfg, D))
    spare = T * H * D * 2 / cfg.ratio - fixed_bytes
    return max(0, min(T, int(spare // (H * per))))


def group_generator(cfg: LowRAMConfig, first_layer: int) -> torch.Generator:
    """The random draws of the xKV group starting at `first_layer` (its range finder, then Slim's W1)."""
    return torch.Generator().manual_seed(cfg.seed * 100_003 + first_layer)


def _basis_rank_step(cfg: LowRAMConfig) -> tuple[float, int]:
    """Bytes per coordinate of the stored basis A, and the multiple its rank comes in (A's groups)."""
    return bytes_per_coord(cfg.key_bits, cfg.group_size), cfg.group_size if cfg.key_bits is not None else 1


def predictor_bytes(H: int, D: int, cfg: LowRAMConfig) -> int:
    """FP16 bytes of one row's predictors in one layer (w1, b1, w2, b2, w_lin per KV head)."""
    F = max(1, round(cfg.hidden_factor * D))
    return H * (2 * D * F + F + D + D * D) * 2


def selective_bytes(T: int, H: int, D: int, G: int, cfg: LowRAMConfig) -> tuple[int, int]:
    """Per row and layer, the (keys' side, values' side) bytes selective reconstruction holds for a
    T-token prompt of an xKV group of G layers, or (0, 0) where it does not engage: off, selection would
    skip nothing, or the shares cannot pay (the keys' must leave the basis one rank step after the
    landmarks and exact keys, the values' must hold the exact values after the predictors and the mask)."""
    key_extra, value_extra = extra_bytes(T, H, D, cfg)
    if not key_extra:
        return 0, 0
    n = G * H * D
    a_bytes, multiple = _basis_rank_step(cfg)
    keys_left = 2 * T * n / cfg.ratio - G * key_extra
    values_left = T * H * D * 2 / cfg.ratio - predictor_bytes(H, D, cfg) - H * ((T + 7) // 8) - value_extra
    fits = keys_left >= multiple * (T * a_bytes + 2 * n) and values_left >= 0
    return (key_extra, value_extra) if fits else (0, 0)


def factorise_keys(k_pre: list[torch.Tensor], cfg: LowRAMConfig, generator: torch.Generator,
                   reserved: float = 0.0) -> tuple[Quantised, torch.Tensor, int]:
    """One xKV group's pre-RoPE keys (one [R, H, T, D] per layer) as the shared basis A (stored as `cfg`
    says), the layers' factors B side by side [R, k, G·H·D] FP16, and the rank; `reserved` bytes per row
    of the keys' share are held by other key-side state (LowRAM-SR's landmarks and exact keys)."""
    T = k_pre[0].shape[2]
    m = torch.cat([flat_heads(k) for k in k_pre], dim=-1)  # [R, T, G·H·D]
    a_bytes, multiple = _basis_rank_step(cfg)
    rank = rank_for_ratio(T, m.shape[-1], cfg.ratio, a_bytes, multiple=multiple, reserved=reserved)
    # the orthonormal basis scaled by sqrt(T): its entries are then O(1) and B's the size of the keys'.
    # Unscaled, B = A^T M grows with sqrt(T) and leaves FP16's range on long prompts (a key channel of
    # 600 at 16K tokens is 600 x 128 = 77K > 65504: inf). B is fitted to the stored A, so nothing else changes.
    basis = Quantised(low_rank_basis(m, rank, oversample=cfg.oversample, power_iters=cfg.power_iters,
                                     generator=generator) * T**0.5, cfg.key_bits, cfg.group_size)
    return basis, fit_layer_factors(m, basis.read()).to(torch.float16), rank


def stored_keys(basis: Quantised, factors: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """One layer's pre-RoPE keys as the cache reads them back, A B: [R, H, T, D] float32."""
    R, H, T, D = shape
    return (basis.read() @ factors.float()).view(R, T, H, D).transpose(1, 2)


def compress_group(stores: list[LowRAMStore], starts: list[Predictor | tuple[torch.Tensor, torch.Tensor]],
                   cfg: LowRAMConfig, generator: torch.Generator) -> int:
    """Turn the held prompts of one xKV group's layers (one row group) into factors, predictors and
    residuals; returns the key rank. `starts` holds, per layer, a saved start [H, ...] or Slim's
    (w_lin, b2), from which W1 is drawn here."""
    if cfg.evict_keep is not None:
        evict(stores, cfg)
    R, H, T, D = stores[0].shape
    key_extra, value_extra = selective_bytes(T, H, D, len(stores), cfg)
    basis, factors, rank = factorise_keys([s.pending[0] for s in stores], cfg, generator,
                                          reserved=len(stores) * key_extra)
    hidden = max(1, round(cfg.hidden_factor * D))
    for j, (store, start) in enumerate(zip(stores, starts)):
        store.basis, store.factors = basis, factors[..., j * H * D:(j + 1) * H * D].contiguous()
        v = store.pending[1].reshape(R * H, T, D)
        keys = store.prompt_keys().reshape(R * H, T, D)  # what decode will feed the predictor
        if not isinstance(start, Predictor):
            start = slim_start(*start, hidden, generator)
        f = fit_predictor(keys, v, start, steps=cfg.fit_steps, lr=cfg.lr).to(torch.float16)
        resid = v - f(keys)
        err = resid.pow(2).sum(-1)
        if key_extra:
            store.selective = Selective.build(store.k_post, store.pending[1], cfg)
            err.view(R, H, T).scatter_(2, store.selective.exact_tokens(), 0.0)  # stored exact: no residual
        mask_bytes = H * ((T + 7) // 8)
        n_keep = residual_count(T, H, D, f.nbytes() // R + mask_bytes + value_extra, cfg)
        keep = worst_predicted(err, n_keep)
        bits = torch.zeros(R * H, (T + 7) // 8 * 8, dtype=torch.uint8, device=v.device)
        bits[:, :T] = keep.to(torch.uint8)
        store.predictor, store.mask, store.n_keep = f, pack_bits(bits, 1), n_keep
        store.residuals = Quantised(resid[keep].view(R * H, n_keep, D), cfg.residual_bits, head_group(cfg, D))
        store.pending = store.k_post = None
    return rank


class LowRAMLayer(_GroupedLayer):
    def __init__(self, rope: RopeTable, config: LowRAMConfig):
        self.rope, self.config = rope, config
        super().__init__()
        self.rebuilt_log: list[int] = []  # per selective decode step: prompt tokens rebuilt, summed over rows

    def reset(self) -> None:
        super().reset()
        self.rebuilt_log = []

    def _new_store(self) -> LowRAMStore:
        return LowRAMStore()

    def _write_and_read(self, store: LowRAMStore, k, v, pos, ordinals=None, latent=False, pos_key=None):
        if ordinals is not None:
            raise ValueError("LowRAM layers read their whole history (no sparse selection)")
        cos, sin = self.rope.cos_sin(pos, torch.float32, pos_key)
        if store.n == 0:  # the prompt: attended exactly, held until its xKV group compresses it
            store.hold(invert_rope(k.float(), cos, sin), v, k if self.config.selective else None)
            return k, v
        if store.pending is not None:
            raise RuntimeError("a LowRAM layer was written twice before its xKV group compressed the prompt")
        if store.kept is not None:
            raise ValueError("LowRAM-E evicted prompt tokens, so the model's mask no longer matches the stored ones: "
                             "after the prompt, feed one token per row without gradients (as generate() decodes), "
                             "or build the cache with evict_keep=None")
        T = store.n_prompt
        hk, hv = store.read(cos[:, :T], sin[:, :T])
        store.append(k, v)
        return torch.cat([hk.to(k.dtype), k], dim=2), torch.cat([hv.to(v.dtype), v], dim=2)

    def reads_itself(self, key_states: torch.Tensor) -> bool:
        """Whether this update is a LowRAM-SR or LowRAM-E decode step: one new token per row after the
        compressed prompt, no gradients; the attention function then reads the stores itself (`attend`):
        the chunks LowRAM-SR rebuilds depend on the query, and LowRAM-E holds fewer tokens than the model's
        mask has columns."""
        own_read = self.config.selective or self.config.evict_keep is not None
        return (own_read and key_states.shape[2] == 1 and not torch.is_grad_enabled()
                and bool(self.stores) and all(s.n_prompt and s.pending is None for s in self.stores))

    def write(self, key_states, value_states, rows: RowLayout) -> None:
        """Append a decode step's token to every row group's exact tail, counting what `attend` will read."""
        s0 = self.n_slots
        read = 0
        for _, store, _, k_new, v_new in self._groups(key_states, value_states, rows):
            store.append(k_new, v_new)
            sr = store.selective
            if sr is not None:
                R = k_new.shape[0]
                read += R * (sr.out_k.shape[2] + tokens_chosen(self.config) + sr.win_k.shape[2]
                             + store.n - 1 - store.n_prompt)
            else:
                read += k_new.shape[0] * (store.n - 1)
        self.n_slots = s0 + 1
        self._count(rows, s0, 1, (0, 0), read)

    def attend(self, query: torch.Tensor, rows: RowLayout, scaling: float | None) -> torch.Tensor:
        """The decode step's attention [B, 1, Hq, D] (transformers' layout): each row group over its
        selected prompt chunks (or its whole prompt where selection does not engage) and its tail. A
        group's store holds only its real tokens, so no padding mask is needed; one query, no causal one."""
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = torch.empty_like(query)
        rebuilt = 0
        for grp, store in zip(rows.groups, self.stores):
            r = grp.rows.to(query.device)
            q = query[r]
            pos = rows.positions[r, grp.start:]
            R, _, T, _ = store.shape
            prompt_pos = store.prompt_positions(pos)
            if store.selective is not None:
                k, v = store.read_selected(q, prompt_pos, self.rope, chunks_selected(self.config), scaling,
                                           reuse=self.config.sr_reuse)
                rebuilt += R * store.selective.rebuilt
            else:
                cos, sin = self.rope.cos_sin(prompt_pos, torch.float32)
                k, v = store.read(cos, sin)
                rebuilt += R * T
            out[r] = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scaling, enable_gqa=True)
        self.rebuilt_log.append(rebuilt)
        return out.transpose(1, 2).contiguous()

    def nbytes(self) -> dict[str, int]:
        return sum_bytes(s.nbytes() for s in self.stores)

    def buffer_bytes(self) -> int:
        """LowRAM-SR's reuse buffers: working memory, not stored bytes (see selective.py)."""
        return sum(s.selective.buffer_bytes() for s in self.stores if s.selective is not None)


class LowRAMCache(Cache):
    """Drop-in `cache=` for `model.generate` (batch >= 1, left padding included: each row's prompt is
    fitted on its own tokens). The first forward call's tokens are the compressed prompt; later calls
    append exactly (periodic re-compression of long generations is the seed's future work)."""

    def __init__(self, config: LowRAMConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 rope: RopeTable, starts: list[Predictor | tuple[torch.Tensor, torch.Tensor]]):
        packs_heads = config.residual_bits is not None or config.sr_landmark_bits is not None
        if packs_heads and head_dim % head_group(config, head_dim):
            raise ConfigError(f"invalid group_size={config.group_size}: quantised residuals and landmarks need a group "
                              f"size that divides head_dim={head_dim}")
        self.config, self.rope = config, rope
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.starts = starts  # per layer: a learnt start [H, ...], or Slim's (w_lin, b2)
        self.rows = RowLayout(schedule=None)  # LowRAM has no reference schedule; rows and positions only
        G = config.layer_group
        self.xkv_groups = [list(range(i, min(i + G, num_layers))) for i in range(0, num_layers, G)]
        self.key_ranks: list[int] = []
        self.pending = None  # LowRAM-SR: the last layer's hand-off to the attention function
        super().__init__(layers=[LowRAMLayer(rope, config) for _ in range(num_layers)])

    @classmethod
    def from_model(cls, model, config: LowRAMConfig | None = None, **changes) -> "LowRAMCache":
        config = (config or LowRAMConfig()).replace(**changes)
        n_layers, n_kv, head_dim = model_shape(model.config)
        if config.start == "slim":
            starts = slim_starts(model, n_kv, head_dim)
        else:
            saved = PredictorStarts.resolve(config.starts_path, model, config)
            starts = [saved.start(config.start, i) for i in range(n_layers)]
            hidden = max(1, round(config.hidden_factor * head_dim))
            if starts[0].w1.shape[-1] != hidden:
                raise ConfigError(f"invalid hidden_factor={config.hidden_factor}: the starts in "
                                  f"{saved.meta['path']} have hidden width {starts[0].w1.shape[-1]}, not {hidden}")
        if config.selective or config.evict_keep is not None:
            attention.install(model)
        return cls(config, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim,
                   rope=RopeTable.from_model(model), starts=starts)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        out = self._update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == len(self.layers) - 1:  # the step's last layer: its cos/sin are not asked for again
            self.rope.forget()
        return out

    def _update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.n_slots == self.rows.n_slots:  # the first layer to see this call's tokens
            self.rows.append(_position_ids(args, kwargs), key_states.shape[0], key_states.shape[2], key_states.device)
        attention.check_handed_off(self, "LowRAM-SR's or LowRAM-E's step did not run as built")
        if layer.reads_itself(key_states):
            layer.write(key_states, value_states, self.rows)
            B, H, _, D = key_states.shape
            # zero-length stand-ins: the attention function recognises the K object and calls layer.attend
            k, v = key_states.new_empty(B, H, 0, D), value_states.new_empty(B, H, 0, value_states.shape[-1])
            rows, last = self.rows, layer_idx == len(self.layers) - 1

            def attend(q, scaling):
                out = layer.attend(q, rows, scaling)
                if last:  # this read comes after update() returned: the step ends here
                    self.rope.forget()
                return out
            attention.hand_off(self, attention.Handoff(None, layer_idx, "attend", k, None, attend=attend))
            return k, v
        out = layer.update(key_states, value_states, self.rows)
        group = next(g for g in self.xkv_groups if layer_idx in g)
        if not any(s.pending is not None for s in layer.stores):
            return out
        if self.config.evict_keep is not None:  # LowRAM-E: compress once the group's last layer has voted
            rows = self.rows

            def observe(query, key, attention_mask, scaling):
                record_votes(layer.stores, rows.groups, query, key, attention_mask, scaling, self.config)
                if layer_idx == group[-1]:
                    self._compress(group)
            attention.hand_off(self, attention.Handoff(None, layer_idx, "observe", out[0], None, observe=observe))
        elif layer_idx == group[-1]:
            self._compress(group)
        return out

    def _compress(self, group: list[int]) -> None:
        for gi in range(len(self.layers[group[0]].stores)):
            # the same draws for every row group: a row compresses as it would alone
            stores = [self.layers[j].stores[gi] for j in group]
            self.key_ranks.append(compress_group(stores, [self.starts[j] for j in group], self.config,
                                                 group_generator(self.config, group[0])))

    def reset(self) -> None:
        super().reset()
        self.rows = RowLayout(schedule=None)
        self.key_ranks = []
        self.pending = None

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by component; each xKV group's shared basis counted once."""
        out = sum_bytes(layer.nbytes() for layer in self.layers)
        bases = {id(s.basis): s.basis for layer in self.layers for s in layer.stores if s.basis is not None}
        out["key_basis"] = sum(b.nbytes() for b in bases.values())
        kept = {id(s.kept): s.kept for layer in self.layers for s in layer.stores if s.kept is not None}
        if kept:
            out["evict_kept_mask"] = sum(k.nbytes() for k in kept.values())
        out["positions"] = self.rows.nbytes()
        return out

    def spare_bytes(self) -> int:
        return sum(layer.spare_bytes() for layer in self.layers) + self.rows.spare_bytes()

    def fp16_bytes(self) -> int:
        return self.rows.valid_tokens() * len(self.layers) * 2 * self.num_kv_heads * self.head_dim * 2
