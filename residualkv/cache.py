"""The ResidualKV cache: a `transformers` Cache made of small layer objects (seed §2.1–2.7).

Compressed layers store their tokens in `ResidualStore`s (FP8 references and packed b-bit latent
residual codes), full-attention layers in `KiviStore`s (KIVI-style 4-bit keys and values): the bytes
live in `residualkv.stores`; this file maps the model's calls and slots onto them.

Batching: a row's tokens are counted by their ordinal in that row (0 = first real token). Rows that
start at the same slot (the same amount of left padding) share one ordinal layout and are stored
together as a `group`, so a padded row is stored and reconstructed exactly as it would be alone.
Padding slots are not stored; they read back as zeros (the attention mask hides them).

What attention reads: the history comes back reconstructed from the stored bytes; the tokens a forward
call writes are read as stored too (`new_kv` "reconstructed", the default: how the codec is trained, one
teacher-forced forward over reconstructions), or exact (`new_kv` "exact", as a serving engine's prefill
attends over the fresh chunk and stores it compressed; the codec-free baselines run this way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kernels._common import use_triton

from .codec import CodecError, LayerCodec, ResidualCodec, model_shape
from .config import ConfigError, ResidualKVConfig, check_group_size
from .growing import Growing, grown
from .reuse import TokenBuffer
from .rope import RopeTable, apply_rope, invert_rope
from .schedule import ReferenceSchedule
from .stores import DenseStore, KiviStore, Latents, ResidualStore, flat_heads, kernel_reads, nbytes_of, sum_bytes, unflat_heads


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
    _positions: Growing = field(default_factory=lambda: Growing(dim=1))
    groups: list[Group] = field(default_factory=list)
    positions = grown("_positions")  # [B, n_slots] int32, RoPE position of every slot

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
            self._positions.append(pos)
        self.n_slots += length

    def valid_tokens(self) -> int:
        """Real (non-padding) tokens summed over rows."""
        return sum(int(g.rows.numel()) * (self.n_slots - g.start) for g in self.groups)

    def nbytes(self) -> int:
        return nbytes_of(self.positions)

    def spare_bytes(self) -> int:
        return self._positions.spare_bytes()

    def bookkeeping_bytes(self) -> int:
        """Row indices of each group and the schedule's ordinals (accounting's `bookkeeping_bytes`)."""
        return sum(nbytes_of(g.rows) for g in self.groups) + (self.schedule.nbytes() if self.schedule else 0)


# ---------------------------------------------------------------------------------------------
# Cache layers: slot space (what attention sees) <-> per-group ordinal space (what is stored).


class _GroupedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    can_reuse = False  # whether selected reads can keep a reuse buffer: layers that reconstruct (ResidualLayer)

    def __init__(self):
        super().__init__()
        self.n_slots = 0
        self.stores: list = []
        self.buffers: dict[int, TokenBuffer] = {}  # row group -> its buffer of sparse reads (ResidualLayer, select_reuse)
        # CR instrumentation, decode steps only (query length 1; prefill attends densely everywhere):
        # history tokens that took part in attention / history tokens, summed over rows and steps
        self.tokens_read = 0
        self.tokens_available = 0
        # one (history, attended, codes decoded, references read) tuple per decode step, summed over rows;
        # the kernel path's reference counts stay on the device until `decode_log` is read
        self._decode_log: list[tuple] = []
        self._pending: list[int] = []  # entries whose count is still a device tensor

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.n_slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_slots + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _groups(self, key_states, value_states, rows: RowLayout):
        """Per row group: (group, its store, the row selector, its new keys, its new values)."""
        s0 = self.n_slots
        for gi, grp in enumerate(rows.groups):
            if gi == len(self.stores):
                self.stores.append(self._new_store())
            lo = max(0, grp.start - s0)
            sel = slice(None) if len(rows.groups) == 1 else grp.rows
            yield grp, self.stores[gi], sel, key_states[sel, :, lo:], value_states[sel, :, lo:]

    def reads_latent(self, latent: bool, key_states) -> bool:
        """Whether this update's read returns its values latent (K, V, Z; see ResidualStore.read): only
        compressed layers can (ResidualLayer)."""
        return False

    def buffer_bytes(self) -> int:
        """Working memory kept between decode steps (reuse buffers): not stored bytes, outside KR."""
        return sum(b.nbytes() for b in self.buffers.values())

    def update(self, key_states, value_states, rows: RowLayout, *args, latent: bool = False, **kwargs):
        """Store the step's tokens, read the history: K, V [B, H, slots, D]; with `latent` and where
        `reads_latent` allows, also the codes' Latents (their values without the decoder's term)."""
        self.is_initialized = True
        B, H, T, D = key_states.shape
        s0, s1 = self.n_slots, self.n_slots + T
        latent = self.reads_latent(latent, key_states)
        before = self._decoded()
        outs = []
        for grp, store, sel, k_new, v_new in self._groups(key_states, value_states, rows):
            # the same slots in every layer of the step: named for the RoPE table (RopeTable.cos_sin's key)
            key = ("all", rows, grp.start, s1)
            outs.append((grp, self._write_and_read(store, k_new, v_new, rows.positions[sel, grp.start : s1], latent=latent,
                                                   pos_key=key)))
        self.n_slots = s1
        self._count(rows, s0, T, before, None)
        if len(outs) == 1 and outs[0][0].start == 0:
            return outs[0][1]
        return _batch([(grp.rows, ts) for grp, ts in outs], B, s1, right_aligned=True)

    def update_selected(self, key_states, value_states, rows: RowLayout, select: list[torch.Tensor | None],
                        latent: bool = False, reuse: bool = False):
        """Like `update`, but group g's history is read only at the ordinals select[g] ([rows of g, S_g],
        sorted; None = all of it): the sparse path of seed §2.7. The new tokens are written as usual
        and returned after the selected ones. Returns K, V [B, H, L, D] (and Z, as `update` does) with
        L = max_g(S_g + new) and `slots` [B, L]: the slot (column of the model's attention mask) each
        returned column holds, -1 for padding columns, which the attention must mask. With `reuse`
        (select_reuse) a compressed layer reads its selection through its reuse buffer, in the buffer's
        column order."""
        self.is_initialized = True
        B, H, T, D = key_states.shape
        s0, s1 = self.n_slots, self.n_slots + T
        dev = key_states.device
        reuse = reuse and self.can_reuse and not torch.is_grad_enabled()
        latent = self.reads_latent(latent, key_states) and not reuse  # a buffer holds whole values
        before = self._decoded()
        parts, read = [], 0
        for gi, (grp, store, sel, k_new, v_new) in enumerate(self._groups(key_states, value_states, rows)):
            n_rows, first_new = int(grp.rows.numel()), max(s0, grp.start)
            ords = select[gi]
            if ords is None:
                hist = torch.arange(grp.start, first_new, device=dev).expand(n_rows, -1)
            else:
                hist = grp.start + ords.to(device=dev, dtype=torch.long)
            pos_all = rows.positions[sel]
            pos = torch.cat([pos_all.gather(1, hist), pos_all[:, first_new:s1]], dim=1)
            read += n_rows * hist.shape[1]
            key = ("selected", rows, grp.start, s1, ords)  # one selection is read by a run of sparse layers
            if reuse and ords is not None:  # the buffer's columns come in its slot order
                buf = self.buffers.get(gi) or self.buffers.setdefault(gi, TokenBuffer())
                ts = self._write_and_read(store, k_new, v_new, pos, ordinals=ords, buffer=buf, pos_key=key)
                cols = buf.columns()
                hist = torch.where(cols >= 0, grp.start + cols, -1)
            else:
                ts = self._write_and_read(store, k_new, v_new, pos, ordinals=ords, latent=latent, pos_key=key)
            slots = torch.cat([hist, torch.arange(first_new, s1, device=dev).expand(n_rows, -1)], dim=1)
            parts.append((grp, ts, slots))
        self.n_slots = s1
        self._count(rows, s0, T, before, read)
        if len(parts) == 1:
            return (*parts[0][1], parts[0][2])
        L = max(slots.shape[1] for _, _, slots in parts)
        out = _batch([(grp.rows, ts) for grp, ts, _ in parts], B, L, right_aligned=False)
        out_s = torch.full((B, L), -1, dtype=torch.long, device=dev)
        for grp, _, slots in parts:
            out_s[grp.rows, : slots.shape[1]] = slots
        return (*out, out_s)

    def write(self, key_states, value_states, rows: RowLayout) -> None:
        """Store a step's tokens without reading the history back (the fused KIVI decode attention
        reads the packed stores itself, see residualkv.attention.FusedFullDecode). Counted as a read
        of the whole history, which that attention attends over."""
        self.is_initialized = True
        s0, T = self.n_slots, key_states.shape[2]
        before = self._decoded()
        for _, store, _, k_new, v_new in self._groups(key_states, value_states, rows):
            store.write(k_new, v_new)
        self.n_slots = s0 + T
        self._count(rows, s0, T, before, None)

    @property
    def decode_log(self) -> list[tuple[int, int, int, int]]:
        """(history, attended, codes decoded, references read) per decode step, summed over rows. Counts a
        step left on the device are read here, all at once (one host sync for the report, none per step)."""
        if self._pending:
            counts = torch.stack([self._decode_log[i][3] for i in self._pending]).tolist()
            for i, n in zip(self._pending, counts):
                self._decode_log[i] = (*self._decode_log[i][:3], int(n))
            self._pending = []
        return self._decode_log

    def _decoded(self) -> tuple[int, int | torch.Tensor]:
        return (sum(getattr(s, "codes_decoded", 0) for s in self.stores),
                sum(getattr(s, "refs_count", 0) for s in self.stores))

    def _count(self, rows: RowLayout, s0: int, T: int, before: tuple[int, int], read: int | None) -> None:
        """Record a decode step (one new token per row) for CR and the per-step reconstruction counts."""
        if T != 1 or s0 == 0:
            return
        history = sum(int(g.rows.numel()) * max(s0 - g.start, 0) for g in rows.groups)
        read = history if read is None else read
        after = self._decoded()
        self.tokens_available += history
        self.tokens_read += read
        refs = after[1] - before[1]
        if isinstance(refs, torch.Tensor):
            self._pending.append(len(self._decode_log))
        self._decode_log.append((history, read, after[0] - before[0], refs))

    def reset(self) -> None:
        _GroupedLayer.__init__(self)

    def spare_bytes(self) -> int:
        return sum(s.spare_bytes() for s in self.stores)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a ResidualKV cache cannot be cropped: tokens are compressed against each other; "
                         "re-run the prefill with a new cache instead")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("beam search is not supported by the ResidualKV cache; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("num_return_sequences > 1 is not supported by the ResidualKV cache; repeat the prompt instead")

    def batch_select_indices(self, indices) -> None:
        raise ValueError("selecting batch rows is not supported by the ResidualKV cache")


def _rope_at(rope: tuple, ordinals: torch.Tensor, some: torch.Tensor) -> tuple:
    """RoPE (cos, sin [B, S, D], H) given at the sorted `ordinals` [B, S] -> at `some` [B, j] of them."""
    at = torch.searchsorted(ordinals, some)[..., None].expand(-1, -1, rope[0].shape[-1])
    return rope[0].gather(1, at), rope[1].gather(1, at), rope[2]


def _batch(parts: list[tuple[torch.Tensor, tuple]], B: int, L: int, right_aligned: bool) -> tuple:
    """Row groups' reads (batch rows, tensors [rows, X, l, F], and Latents) -> tensors [B, X, L, F],
    each group's l columns at the end (`right_aligned`: slot order, padding first) or at the start;
    zeros elsewhere."""
    offset = [L - ts[0].shape[2] if right_aligned else 0 for _, ts in parts]  # each group's first column
    out = []
    for i, first in enumerate(parts[0][1]):
        if isinstance(first, Latents):
            out.append(Latents.place([(rows, ts[i], off) for (rows, ts), off in zip(parts, offset)], B))
            continue
        o = first.new_zeros(B, first.shape[1], L, first.shape[-1])
        for (rows, ts), off in zip(parts, offset):
            o[rows, :, off : off + ts[i].shape[2]] = ts[i]
        out.append(o)
    return tuple(out)


class ResidualLayer(_GroupedLayer):
    can_reuse = True

    def __init__(self, codec: LayerCodec, cfg: ResidualKVConfig, schedule: ReferenceSchedule, rope: RopeTable):
        self.codec, self.cfg, self.schedule, self.rope = codec, cfg, schedule, rope
        self.rec_terms: list[torch.Tensor] | None = None  # training hook, see ResidualKVCache.collect_rec_loss
        self.keep_grad = False  # training hook, see ResidualKVCache.keep_grad_history
        super().__init__()

    def _new_store(self) -> ResidualStore:
        store = ResidualStore(self.codec, self.cfg, self.schedule)
        store.keep_grad = self.keep_grad
        return store

    def reads_latent(self, latent: bool, key_states) -> bool:
        # decode steps on the torch path only: prefill attends densely (SDPA), training needs the plain
        # reading for its gradients, and the fused kernel decodes the values in registers anyway
        return (latent and key_states.shape[2] == 1 and self.n_slots > 0 and not torch.is_grad_enabled()
                and self.codec.absorbable and not kernel_reads(self.cfg, key_states))

    def _write_and_read(self, store: ResidualStore, k, v, pos, ordinals=None, latent=False, buffer=None, pos_key=None):
        """`pos` holds the RoPE positions of the returned tokens: the history read (all of it, or the
        tokens at `ordinals` [B, S]) followed by the new tokens. Returns K, V (and Z with `latent`).
        With a reuse `buffer` the history comes back in the buffer's slots (TokenBuffer.columns)."""
        B, H, T, D = k.shape
        cos, sin = self.rope.cos_sin(pos, torch.float32, pos_key)
        # the history comes back with its keys rotated (inside the fused reconstruction on the kernel)
        hist_rope = (cos[:, :-T], sin[:, :-T], H)
        if ordinals is None:
            history = store.read(hist_rope, latent) if store.n else None
        elif buffer is not None:
            history = buffer.read(ordinals, store.n_coded, store.n,
                                  lambda new: store.read_selected(new, _rope_at(hist_rope, ordinals, new), check=False),
                                  k.dtype)
        else:  # the cache's own selection: valid by construction, so unchecked (no host-device syncs)
            history = store.read_selected(ordinals, hist_rope, latent, check=False)
        k_pre = invert_rope(k.float(), cos[:, -T:], sin[:, -T:])
        kv = torch.cat([flat_heads(k_pre), flat_heads(v.float())], dim=-1)
        new = store.write(kv)
        if self.rec_terms is not None:
            self.rec_terms.append((new - kv).pow(2).sum())
        if self.cfg.new_kv == "exact":
            k_hat, v_hat = k, v
        else:
            k_hat, v_hat = unflat_heads(new, H, D)
            k_hat = apply_rope(k_hat, cos[:, -T:], sin[:, -T:])
        if history is not None:
            k_hat, v_hat = torch.cat([history[0], k_hat], dim=2), torch.cat([history[1], v_hat], dim=2)
        if not latent:
            return k_hat.to(k.dtype), v_hat.to(v.dtype)
        # the new tokens' values are whole and come after the history: its Latents' columns stand
        lat = history[2] if history is not None else Latents.empty(B, self.codec.dims.d_c, k.device)
        return k_hat.to(k.dtype), v_hat.to(v.dtype), lat

    def nbytes(self) -> dict[str, int]:
        return sum_bytes(s.nbytes() for s in self.stores)


class KiviLayer(_GroupedLayer):
    def __init__(self, cfg: ResidualKVConfig):
        self.cfg = cfg
        super().__init__()

    def _new_store(self) -> KiviStore:
        return KiviStore(self.cfg)

    def _write_and_read(self, store: KiviStore, k, v, pos, ordinals=None, latent=False, pos_key=None):
        if ordinals is not None:
            raise ValueError("full-attention (KIVI) layers always read their whole history")
        store.write(k, v)
        hk, hv = store.read(k.dtype)
        T = k.shape[2]
        if T <= store.win_k.shape[2] and not (k.requires_grad or v.requires_grad):
            # (decode steps) the newest tokens sit in the FP16 window, where both readings below give
            # the stored values bit for bit (fp16(k) - k is exact, so k + (fp16(k) - k) == fp16(k));
            # skipping them saves two copies of the history per step
            return hk, hv
        if self.cfg.new_kv == "exact":
            # at the FP16 window's precision (bit-exact for fp16/bf16 models): what the fused decode
            # attention reads for a step's token, which sits in the window
            k, v = k.to(torch.float16).to(k.dtype), v.to(torch.float16).to(v.dtype)
            return torch.cat([hk[:, :, :-T], k], dim=2), torch.cat([hv[:, :, :-T], v], dim=2)
        # the newest tokens' stored values, with a straight-through gradient so training sees the
        # quantisation but still reaches earlier layers' codecs through these keys and values
        hk = torch.cat([hk[:, :, :-T], k + (hk[:, :, -T:] - k).detach()], dim=2)
        hv = torch.cat([hv[:, :, :-T], v + (hv[:, :, -T:] - v).detach()], dim=2)
        return hk, hv

    def nbytes(self) -> dict[str, int]:
        return sum_bytes(s.nbytes() for s in self.stores)


# ---------------------------------------------------------------------------------------------


class ResidualKVCache(Cache):
    """Drop-in `cache=` (or legacy `past_key_values=`) for `model.generate` (batch >= 1, left padding included).

    `config.mode` chooses how compressed layers read their history (seed §2.7):
    "standalone" reconstructs every history token (CR = 100%); "omnikv" reconstructs, at each decode
    step, only the tokens the last full-attention (filter) layer chose; "snapkv" evicts compressed
    layers' tokens once after the prompt. The two sparse modes need the model's attention to run
    through `residualkv.attention` (`from_model` installs it; see attention.install).
    """

    def __init__(self, codec: ResidualCodec | None, config: ResidualKVConfig, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, rope: RopeTable | None):
        config.check_model(num_layers)
        compressed = config.coded_layers(num_layers)
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
        self.rope = rope  # shared by the compressed layers
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows = RowLayout(ReferenceSchedule(config.n_sink, config.stride, config.stride_alpha))
        layers = [KiviLayer(config) if i in config.full_attention_layers
                  else ResidualLayer(codec.layer(i), config, self.rows.schedule, rope) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.sparse = _controller(self)
        self.fused_full = None  # residualkv.attention.FusedFullDecode, see attach_fused_full_decode (from_model calls it)
        self.latent = None  # residualkv.attention.LatentValues, see attach_latent_values (from_model calls it)

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
            codec.check_weights(model)
            codec.to(model.device)
            check_group_size(config.group_size, (codec.layer(i).dims.d_c for i in codec.layer_ids))
        n_layers, n_kv, head_dim = model_shape(model.config)
        cache = cls(codec, config, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim,
                    rope=RopeTable.from_model(model))
        _install_if_sparse(model, config)
        cache.attach_fused_full_decode(model)
        cache.attach_latent_values(model)
        return cache

    def attach_fused_full_decode(self, model) -> None:
        """Decode the full-attention (KIVI) layers on the fused kernel where it runs for `model` (its
        device, plain softmax attention): installs residualkv's attention function on the model."""
        if (self.config.full_attention_layers and _plain_softmax(model)
                and use_triton(self.config.kernel_impl, next(model.parameters()))):
            from .attention import FusedFullDecode, install

            install(model)
            self.fused_full = FusedFullDecode(self)

    def attach_latent_values(self, model) -> None:
        """Let decode steps of compressed layers hand their values over without the decoder's term, which
        `model`'s attention then applies once per query head (residualkv.attention.LatentValues): where
        the codec's decoder is linear and the attention plain softmax. Installs residualkv's attention
        function on the model. Each step still decides (ResidualLayer.reads_latent)."""
        if (self.codec is not None and any(self.codec.layer(i).absorbable for i in self.codec.layer_ids)
                and _plain_softmax(model)):
            from .attention import LatentValues, install

            install(model)
            self.latent = LatentValues(self)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        out = self._update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == len(self.layers) - 1:  # the step's last layer: what only this step needed goes
            if self.rope is not None:
                self.rope.forget()
            if self.sparse is not None:
                self.sparse.selection = None
            self.rows.schedule.selection_plan = None
        return out

    def _update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.n_slots == self.rows.n_slots:  # the first layer to see this step's tokens
            self.rows.append(_position_ids(args, kwargs), key_states.shape[0], key_states.shape[2], key_states.device)
            if self.sparse is not None:
                self.sparse.begin_step(key_states.shape[2])
        if self.latent is not None:
            self.latent.check()
        if self.fused_full is not None:
            self.fused_full.check()
            if self.fused_full.applies(layer_idx, key_states):
                return self.fused_full.update(layer_idx, key_states, value_states)
        latent = self.latent is not None
        if self.sparse is not None:  # omnikv / snapkv: residualkv.attention decides what each layer reads
            out = self.sparse.update(layer_idx, key_states, value_states, latent)
        else:
            out = layer.update(key_states, value_states, self.rows, latent=latent)
        if len(out) == 3:  # values without the decoder's term: the attention function adds it
            self.latent.hand(layer_idx, out[0], out[2], self.sparse)
        return out[0], out[1]

    def reset(self):
        super().reset()
        if self.rope is not None:  # a step cut short leaves its answer kept
            self.rope.forget()
        self.rows = RowLayout(ReferenceSchedule(self.config.n_sink, self.config.stride, self.config.stride_alpha))
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.schedule = self.rows.schedule
        self.sparse = _controller(self)
        if self.fused_full is not None:
            self.fused_full = type(self.fused_full)(self)
        if self.latent is not None:
            self.latent = type(self.latent)(self)

    READ_FIELDS = ("mode", "select_budget", "select_ratio", "n_recent", "select_pool", "select_reuse", "new_kv")

    def fork(self, **changes) -> "ResidualKVCache":
        """An independent copy of the stored tokens that reads them under other read settings (`mode`
        "standalone"/"omnikv", selection budget...): one prefill, several deployments side by side.
        Bytes are copied; the codec and RoPE modules are shared. SnapKV evicts during the prompt, so
        forking into or out of it is refused (a SnapKV cache forks into a copy of itself, survivors and
        all), as are changes to how tokens are stored."""
        import copy

        bad = set(changes) - set(self.READ_FIELDS)
        if bad:
            raise ValueError(f"fork() changes only read settings {self.READ_FIELDS}, not {sorted(bad)}")
        cfg = self.config.replace(**changes)
        if "snapkv" in (cfg.mode, self.config.mode) and cfg.mode != self.config.mode:
            raise ValueError("SnapKV eviction happens during the prompt: build a snapkv cache and prefill it")
        memo = {id(m): m for m in (self.codec.modules() if self.codec is not None else [])}
        if self.rope is not None:
            memo[id(self.rope)] = self.rope
        sparse, fused, latent = self.sparse, self.fused_full, self.latent
        self.sparse = self.fused_full = self.latent = None
        try:
            new = copy.deepcopy(self, memo)
        finally:
            self.sparse, self.fused_full, self.latent = sparse, fused, latent
        new.config = cfg
        new.sparse = _controller(new)
        if cfg.mode == "snapkv" and sparse is not None:  # the evicted layers go on reading their survivors only
            new.sparse.evicted = copy.deepcopy(sparse.evicted)
        new.fused_full = type(fused)(new) if fused is not None else None
        new.latent = type(latent)(new) if latent is not None else None
        return new

    def collect_rec_loss(self) -> list[torch.Tensor]:
        """Training hook for the seed's L_rec (§2.9). From now on every write to a compressed layer
        appends the summed squared error between the true pre-RoPE kv it was given and its
        reconstruction (a differentiable scalar) to the returned list."""
        _no_window_in_training(self.config)
        terms: list[torch.Tensor] = []
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.rec_terms = terms
        return terms

    def keep_grad_history(self) -> None:
        """Training hook for a loss taken in a later call than the one that wrote the history (a prompt
        prefilled, then a continuation read through the cache, as served): compressed layers read their
        history back from the differentiable reconstructions their writes returned instead of decoding
        the stored bytes (the same values up to float rounding), so that loss reaches the encoder as well
        as the decoder. Call it before the first write; it keeps an extra float copy of the history."""
        _no_window_in_training(self.config)
        if any(layer.n_slots for layer in self.layers):
            raise ValueError("keep_grad_history() must be called on an empty cache, before the first write")
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.keep_grad = True

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held, by component (see accounting.py for KR/CR)."""
        out = sum_bytes(layer.nbytes() for layer in self.layers)
        out["positions"] = self.rows.nbytes()
        return out

    def spare_bytes(self) -> int:
        """Bytes allocated past the stored ones: capacity the stores grow into (residualkv.growing), about
        an eighth of what a long store holds (at least MIN_GROW rows); memory, not data, so outside `nbytes` and KR."""
        return sum(layer.spare_bytes() for layer in self.layers) + self.rows.spare_bytes()

    def fp16_bytes(self) -> int:
        """Bytes an FP16 full cache would hold for the same real tokens."""
        return self.rows.valid_tokens() * len(self.layers) * 2 * self.num_kv_heads * self.head_dim * 2


def _no_window_in_training(cfg: ResidualKVConfig) -> None:
    if cfg.recent_window:
        raise ConfigError(f"invalid recent_window={cfg.recent_window}: train with recent_window=0; the FP16 window "
                          "is a serving setting and would hide the codec's error from the loss")


class DenseLayer(_GroupedLayer):
    """An uncompressed layer in the row-group layout, so OmniKV selection works on it with batches."""

    def _new_store(self) -> DenseStore:
        return DenseStore()

    def _write_and_read(self, store: DenseStore, k, v, pos, ordinals=None, latent=False, pos_key=None):
        had = store.n
        store.write(k, v)
        if ordinals is None:
            return store.k, store.v
        if not had:
            return k, v
        hk, hv = store.read_selected(ordinals)
        return torch.cat([hk, k], dim=2), torch.cat([hv, v], dim=2)

    def nbytes(self) -> dict[str, int]:
        return sum_bytes(s.nbytes() for s in self.stores)


class OmniKVCache(ResidualKVCache):
    """OmniKV without compression (a baseline, KR = 100%): every layer keeps exact keys and values; with
    mode "omnikv" the filter layers (config.full_attention_layers) choose, at each decode step, the
    tokens the following layers attend over. Mode "standalone" makes it a plain full cache."""

    def __init__(self, config: ResidualKVConfig, *, num_layers: int, num_kv_heads: int, head_dim: int):
        config.check_model(num_layers)
        if config.mode == "snapkv":
            raise ValueError("OmniKVCache supports mode 'omnikv' (or 'standalone'); SnapKV eviction belongs to its own baseline")
        self.config, self.codec, self.rope = config, None, None
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows = RowLayout(ReferenceSchedule(config.n_sink, config.stride, config.stride_alpha))
        Cache.__init__(self, layers=[DenseLayer() for _ in range(num_layers)])
        self.sparse = _controller(self)
        self.fused_full = self.latent = None

    @classmethod
    def from_model(cls, model, config: ResidualKVConfig | None = None, **changes):
        config = (config or ResidualKVConfig(mode="omnikv")).replace(**changes)
        n_layers, n_kv, head_dim = model_shape(model.config)
        cache = cls(config, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim)
        _install_if_sparse(model, config)
        return cache


def _controller(cache):
    if cache.config.mode == "standalone":
        return None
    from .attention import SparseController

    return SparseController(cache)


def _install_if_sparse(model, config: ResidualKVConfig) -> None:
    if config.mode != "standalone":
        from .attention import install

        install(model)


def _plain_softmax(model) -> bool:
    """Whether `model`'s attention is plain softmax attention (no sliding window, no soft-capping): what
    residualkv's own decode attention (fused KIVI, latent values) computes."""
    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    return not getattr(cfg, "attn_logit_softcapping", None)


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
