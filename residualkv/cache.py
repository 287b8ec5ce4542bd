"""The ResidualKV cache: a `transformers` Cache made of small layer objects (seed §2.1–2.7).

Compressed layers keep, per token, either an FP8 reference or a packed b-bit latent code plus the
indices of the k references it was encoded against. Full-attention layers keep KIVI-style 4-bit keys
(per channel) and values (per token) with a short FP16 window. Nothing is kept as floats.

Batching: a row's tokens are counted by their ordinal in that row (0 = first real token). Rows that
start at the same slot (the same amount of left padding) share one ordinal layout and are stored
together as a `group`, so a padded row is stored and reconstructed exactly as it would be alone.
Padding slots are not stored; they read back as zeros (the attention mask hides them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .codec import CodecError, LayerCodec, ResidualCodec, model_shape
from .config import ResidualKVConfig
from .quant import Packed, decode_ref, dequantize, encode_ref, quantize
from .retrieval import mean_of_refs, topk_refs
from .rope import RopeTable, apply_rope, invert_rope
from .schedule import ReferenceSchedule


# ---------------------------------------------------------------------------------------------
# Row layout shared by all layers: where each row starts, its RoPE positions, the schedule.


@dataclass
class Group:
    start: int  # slot of ordinal 0 for these rows
    rows: torch.Tensor  # batch indices


@dataclass
class RowLayout:
    schedule: ReferenceSchedule
    n_slots: int = 0
    positions: torch.Tensor | None = None  # [B, n_slots] int32, RoPE position of every slot
    groups: list[Group] = field(default_factory=list)

    def append(self, position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device) -> None:
        if position_ids is None:
            position_ids = torch.arange(self.n_slots, self.n_slots + length, device=device)[None]
        pos = position_ids.to(device=device, dtype=torch.int32).expand(batch, length)
        if self.n_slots == 0:
            # generate() gives left padding position 0, like the first real token: a row starts at
            # its last position-0 slot
            is_zero = pos == 0
            idx = torch.arange(length, device=device).expand(batch, length)
            starts = torch.where(is_zero, idx, -1).amax(dim=1).clamp(min=0).tolist()
            for s in sorted(set(starts)):
                rows = torch.tensor([b for b, v in enumerate(starts) if v == s], device=device)
                self.groups.append(Group(start=int(s), rows=rows))
            self.positions = pos.clone()
        else:
            if pos.shape[0] != self.positions.shape[0]:
                raise ValueError(f"batch size changed from {self.positions.shape[0]} to {pos.shape[0]} mid-sequence; "
                                 "start a new ResidualKVCache for a new batch")
            self.positions = torch.cat([self.positions, pos], dim=1)
        self.n_slots += length

    def valid_tokens(self) -> int:
        """Real (non-padding) tokens summed over rows."""
        return sum(int(g.rows.numel()) * (self.n_slots - g.start) for g in self.groups)

    def nbytes(self) -> int:
        return 0 if self.positions is None else self.positions.numel() * self.positions.element_size()


# ---------------------------------------------------------------------------------------------
# Per-group stores: the bytes.


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ResidualStore:
    """References + packed latent residual codes for one layer and one row group, in ordinal order."""

    def __init__(self, codec: LayerCodec, cfg: ResidualKVConfig, schedule: ReferenceSchedule):
        self.codec, self.cfg, self.schedule = codec, cfg, schedule
        self.n = 0
        self.refs: torch.Tensor | None = None  # [B, R, d] uint8 (fp8 bytes) or fp16
        self.codes: Packed | None = None  # fields [B, C, ...]
        self.ref_idx: torch.Tensor | None = None  # [B, C, k] int16 (int32 past 32767 refs), -1 = unused

    @property
    def n_refs(self) -> int:
        return 0 if self.refs is None else self.refs.shape[1]

    def decoded_refs(self) -> torch.Tensor | None:
        return None if self.refs is None else decode_ref(self.refs, self.cfg.ref_format)

    def write(self, kv: torch.Tensor) -> torch.Tensor:
        """Store new tokens kv [B, T, 2·d_k] (pre-RoPE keys ‖ values); return their reconstruction.

        The returned values equal what later reads decode from the stored bytes; gradients pass
        straight through the FP8 and b-bit rounding so the same path trains the codec.
        """
        cfg = self.cfg
        B, T, d = kv.shape
        kv = kv.float()
        is_ref = self.schedule.is_ref(self.n, self.n + T).to(kv.device)
        out = kv.new_empty(B, T, d)

        new_refs = kv[:, is_ref]
        stored = encode_ref(new_refs.detach(), cfg.ref_format)
        refs_hat = new_refs + (decode_ref(stored, cfg.ref_format) - new_refs).detach()
        out[:, is_ref] = refs_hat
        old = self.decoded_refs()
        all_refs = refs_hat if old is None else torch.cat([old, refs_hat], dim=1)
        self.refs = _cat(self.refs, stored)

        is_code = ~is_ref
        if bool(is_code.any()):
            x = kv[:, is_code]
            # references strictly before each token: the old ones plus those earlier in this chunk
            n_avail = (self.n_refs - int(is_ref.sum())) + torch.cumsum(is_ref.long(), 0)[is_code]
            idx = topk_refs(x.detach(), all_refs.detach(), n_avail, cfg.k)
            mean = mean_of_refs(all_refs, idx)
            z = self.codec.encode(x, mean).float()
            packed = quantize(z.detach(), cfg.bits, cfg.group_size)
            z_hat = z + (dequantize(packed, cfg.bits, cfg.group_size) - z).detach()
            out[:, is_code] = self.codec.decode(z_hat).float() + mean
            self.codes = packed if self.codes is None else Packed(*(torch.cat([a, b], 1) for a, b in zip(self.codes, packed)))
            idx_dtype = torch.int16 if self.n_refs <= torch.iinfo(torch.int16).max else torch.int32
            if self.ref_idx is not None and self.ref_idx.dtype != idx_dtype:
                self.ref_idx = self.ref_idx.to(idx_dtype)
            self.ref_idx = _cat(self.ref_idx, idx.to(idx_dtype))
        self.n += T
        return out

    def read(self) -> torch.Tensor:
        """Reconstruct every stored token: [B, n, 2·d_k] float32."""
        cfg = self.cfg
        refs = self.decoded_refs()
        if refs is None:
            return torch.empty(0)
        B, _, d = refs.shape
        out = refs.new_empty(B, self.n, d)
        is_ref = self.schedule.is_ref(0, self.n).to(refs.device)
        out[:, is_ref] = refs
        if self.codes is not None:
            mean = mean_of_refs(refs, self.ref_idx.long())
            z = dequantize(self.codes, cfg.bits, cfg.group_size)
            out[:, ~is_ref] = self.codec.decode(z).float() + mean
        return out

    def nbytes(self) -> dict[str, int]:
        c = self.codes
        return {
            "references": _nbytes(self.refs),
            "latent_codes": _nbytes(c.codes) if c else 0,
            "latent_mins_scales": _nbytes(c.mins, c.scales) if c else 0,
            "reference_indices": _nbytes(self.ref_idx),
        }


class KiviStore:
    """KIVI-style full-attention layer: keys quantised per channel over groups of tokens, values per
    token; the newest tokens wait in an FP16 window until a whole group can be quantised."""

    def __init__(self, cfg: ResidualKVConfig):
        self.cfg = cfg
        self.n = 0
        self.kq: Packed | None = None  # fields [B, H, G, D, ...]: per-channel groups of tokens
        self.vq: Packed | None = None  # fields [B, H, n_q, ...]: per-token groups of channels
        self.win_k: torch.Tensor | None = None  # [B, H, w, D] fp16
        self.win_v: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cfg, g = self.cfg, self.cfg.full_group_size
        self.win_k = _cat(self.win_k, k.detach().to(torch.float16), dim=2)
        self.win_v = _cat(self.win_v, v.detach().to(torch.float16), dim=2)
        self.n += k.shape[2]
        w = self.win_k.shape[2]
        if w < cfg.full_window:
            return
        m = ((w - cfg.full_window) // g + 1) * g  # leaves between window-g and window-1 tokens in FP16
        fk, fv = self.win_k[:, :, :m].float(), self.win_v[:, :, :m].float()
        self.win_k, self.win_v = self.win_k[:, :, m:].contiguous(), self.win_v[:, :, m:].contiguous()
        B, H, _, D = fk.shape
        kq = quantize(fk.reshape(B, H, m // g, g, D).transpose(-1, -2), cfg.full_bits, g)
        vq = quantize(fv, cfg.full_bits, self.value_group(D))
        self.kq = kq if self.kq is None else Packed(*(torch.cat([a, b], 2) for a, b in zip(self.kq, kq)))
        self.vq = vq if self.vq is None else Packed(*(torch.cat([a, b], 2) for a, b in zip(self.vq, vq)))

    def value_group(self, head_dim: int) -> int:
        """Values are grouped along head_dim; a head smaller than a group is one group."""
        return min(self.cfg.full_group_size, head_dim)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        ks, vs = [], []
        if self.kq is not None:
            k = dequantize(self.kq, cfg.full_bits, cfg.full_group_size)  # [B, H, G, D, g]
            B, H, G, D, g = k.shape
            ks.append(k.transpose(-1, -2).reshape(B, H, G * g, D))
            vs.append(dequantize(self.vq, cfg.full_bits, self.value_group(D)))
        ks.append(self.win_k.float())
        vs.append(self.win_v.float())
        return torch.cat(ks, 2).to(dtype), torch.cat(vs, 2).to(dtype)

    def nbytes(self) -> dict[str, int]:
        return {
            "full_layer_codes": _nbytes(self.kq.codes, self.vq.codes) if self.kq else 0,
            "full_layer_mins_scales": _nbytes(self.kq.mins, self.kq.scales, self.vq.mins, self.vq.scales) if self.kq else 0,
            "full_layer_window_fp16": _nbytes(self.win_k, self.win_v),
        }


# ---------------------------------------------------------------------------------------------
# Cache layers: slot space (what attention sees) <-> per-group ordinal space (what is stored).


class _GroupedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.n_slots = 0
        self.stores: list = []
        self.tokens_read = 0  # history tokens that took part in attention, summed over steps (for CR)
        self.tokens_available = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.n_slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_slots + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def update(self, key_states, value_states, rows: RowLayout, *args, **kwargs):
        self.is_initialized = True
        B, H, T, D = key_states.shape
        s0, s1 = self.n_slots, self.n_slots + T
        outs = []
        for gi, grp in enumerate(rows.groups):
            if gi == len(self.stores):
                self.stores.append(self._new_store())
            lo = max(0, grp.start - s0)
            sel = slice(None) if len(rows.groups) == 1 else grp.rows
            pos = rows.positions[sel, grp.start : s1]
            k, v = self._write_and_read(self.stores[gi], key_states[sel, :, lo:], value_states[sel, :, lo:], pos)
            outs.append((grp, k, v))
        self.n_slots = s1
        self.tokens_available += s1
        self.tokens_read += max(k.shape[2] + grp.start for grp, k, _ in outs)
        if len(outs) == 1 and outs[0][0].start == 0:
            return outs[0][1], outs[0][2]
        out_k = key_states.new_zeros(B, H, s1, D)
        out_v = value_states.new_zeros(B, H, s1, value_states.shape[-1])
        for grp, k, v in outs:
            out_k[grp.rows, :, grp.start :] = k
            out_v[grp.rows, :, grp.start :] = v
        return out_k, out_v

    def reset(self) -> None:
        _GroupedLayer.__init__(self)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a ResidualKV cache cannot be cropped: tokens are compressed against each other; "
                         "re-run the prefill with a new cache instead")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("beam search is not supported by the ResidualKV cache; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("num_return_sequences > 1 is not supported by the ResidualKV cache; repeat the prompt instead")

    def batch_select_indices(self, indices) -> None:
        raise ValueError("selecting batch rows is not supported by the ResidualKV cache")


class ResidualLayer(_GroupedLayer):
    def __init__(self, codec: LayerCodec, cfg: ResidualKVConfig, schedule: ReferenceSchedule, rope: RopeTable):
        self.codec, self.cfg, self.schedule, self.rope = codec, cfg, schedule, rope
        self.rec_terms: list[torch.Tensor] | None = None  # training hook, see ResidualKVCache.collect_rec_loss
        super().__init__()

    def _new_store(self) -> ResidualStore:
        return ResidualStore(self.codec, self.cfg, self.schedule)

    def _write_and_read(self, store: ResidualStore, k, v, pos):
        B, H, T, D = k.shape
        history = store.read() if store.n else None
        n_new = T
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        k_pre = invert_rope(k.float(), cos[:, -n_new:], sin[:, -n_new:])
        kv = torch.cat([_flat(k_pre), _flat(v.float())], dim=-1)
        new = store.write(kv)
        if self.rec_terms is not None:
            self.rec_terms.append((new - kv).pow(2).sum())
        full = new if history is None else torch.cat([history, new], dim=1)
        k_hat, v_hat = _unflat(full, H, D)
        k_hat = apply_rope(k_hat, cos, sin)
        return k_hat.to(k.dtype), v_hat.to(v.dtype)

    def nbytes(self) -> dict[str, int]:
        return _sum_dicts(s.nbytes() for s in self.stores)


class KiviLayer(_GroupedLayer):
    def __init__(self, cfg: ResidualKVConfig):
        self.cfg = cfg
        super().__init__()

    def _new_store(self) -> KiviStore:
        return KiviStore(self.cfg)

    def _write_and_read(self, store: KiviStore, k, v, pos):
        store.write(k, v)
        return store.read(k.dtype)

    def nbytes(self) -> dict[str, int]:
        return _sum_dicts(s.nbytes() for s in self.stores)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H·D]"""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def _unflat(kv: torch.Tensor, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, _ = kv.shape
    k, v = kv.split(H * D, dim=-1)
    return k.reshape(B, T, H, D).transpose(1, 2), v.reshape(B, T, H, D).transpose(1, 2)


def _sum_dicts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


# ---------------------------------------------------------------------------------------------


class ResidualKVCache(Cache):
    """Drop-in `cache=` (or legacy `past_key_values=`) for `model.generate` (batch >= 1, left padding included).

    Standalone mode: every history token is reconstructed for attention (CR = 100%).
    """

    def __init__(self, codec: ResidualCodec | None, config: ResidualKVConfig, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, rope: RopeTable | None):
        config.check_model(num_layers)
        compressed = [i for i in range(num_layers) if i not in config.full_attention_layers]
        if compressed:
            if codec is None:
                raise CodecError("layers outside full_attention_layers need a codec: pass a trained ResidualCodec "
                                 "(or ResidualCodec.for_model(..., kind='identity') for ResidualKV†)")
            if sorted(codec.layer_ids) != compressed:
                raise CodecError(f"codec covers layers {codec.layer_ids} but this cache compresses {compressed}; "
                                 "use the full_attention_layers the codec was trained with")
            if codec.dims.d_kv != 2 * num_kv_heads * head_dim:
                raise CodecError(f"codec input size {codec.dims.d_kv} != 2*num_kv_heads*head_dim = "
                                 f"{2 * num_kv_heads * head_dim}; this codec is for another model")
            if rope is None:
                raise ValueError("compressed layers need the model's RoPE: pass rope=RopeTable.from_model(model)")
        self.config = config
        self.codec = codec
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows = RowLayout(ReferenceSchedule(config.n_sink, config.stride, config.stride_alpha))
        layers = [KiviLayer(config) if i in config.full_attention_layers
                  else ResidualLayer(codec.layer(i), config, self.rows.schedule, rope) for i in range(num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_model(cls, model, codec: ResidualCodec | None, config: ResidualKVConfig | None = None, **changes):
        """Build a cache for `model`; `config` defaults to the codec's, `changes` override single fields."""
        config = config or (codec.config if codec is not None else None)
        if config is None:
            raise ValueError("pass a ResidualKVConfig or a codec that carries one")
        if changes:
            config = config.replace(**changes)
        if codec is not None:
            codec.check_compatible(model.config)
            codec.to(model.device)
        n_layers, n_kv, head_dim = model_shape(model.config)
        return cls(codec, config, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim,
                   rope=RopeTable.from_model(model))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.n_slots == self.rows.n_slots:  # the first layer to see this step's tokens
            self.rows.append(_position_ids(args, kwargs), key_states.shape[0], key_states.shape[2], key_states.device)
        return layer.update(key_states, value_states, self.rows)

    def reset(self):
        super().reset()
        self.rows = RowLayout(ReferenceSchedule(self.config.n_sink, self.config.stride, self.config.stride_alpha))
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.schedule = self.rows.schedule

    def collect_rec_loss(self) -> list[torch.Tensor]:
        """Training hook for the seed's L_rec (§2.9). From now on every write to a compressed layer
        appends the summed squared error between the true pre-RoPE kv it was given and its
        reconstruction (a differentiable scalar) to the returned list."""
        terms: list[torch.Tensor] = []
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.rec_terms = terms
        return terms

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held, by component (see accounting.py for KR/CR)."""
        out = _sum_dicts(layer.nbytes() for layer in self.layers)
        out["positions"] = self.rows.nbytes()
        return out

    def fp16_bytes(self) -> int:
        """Bytes an FP16 full cache would hold for the same real tokens."""
        return self.rows.valid_tokens() * len(self.layers) * 2 * self.num_kv_heads * self.head_dim * 2


def _position_ids(args, kwargs) -> torch.Tensor | None:
    inner = kwargs.get("kwargs") or {}
    if inner.get("position_ids") is not None:
        return inner["position_ids"]
    if kwargs.get("position_ids") is not None:
        return kwargs["position_ids"]
    for a in args:  # legacy `cache_kwargs` dict
        if isinstance(a, dict) and a.get("position_ids") is not None:
            return a["position_ids"]
    return None
