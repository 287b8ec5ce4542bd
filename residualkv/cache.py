"""The ResidualKV cache: a `transformers` Cache made of small layer objects (seed §2.1–2.7).

Compressed layers keep, per token, either an FP8 reference or a packed b-bit latent code plus the
indices of the k references it was encoded against. Full-attention layers keep KIVI-style 4-bit keys
(per channel) and values (per token) with a short FP16 window. Nothing is kept as floats.

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

from .codec import CodecError, LayerCodec, ResidualCodec, model_shape
from .config import ConfigError, ResidualKVConfig
from .growing import Growing, grown
from .quant import Packed, decode_ref, dequantize, encode_ref, quantize
from .retrieval import mean_of_refs
from .rope import RopeTable, apply_rope, invert_rope
from .schedule import ReferenceSchedule

# the Triton kernels for the hot paths; each runs its torch reference (the code above) unless
# cfg.kernel_impl and the tensors' device say otherwise
from kernels import quantize_pack, reconstruct_selected, topk_l2
from kernels.reconstruct import fused_group_ok
from kernels._common import use_triton


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
        return _nbytes(self.positions)

    def spare_bytes(self) -> int:
        return self._positions.spare_bytes()


# ---------------------------------------------------------------------------------------------
# Per-group stores: the bytes.


Rope = tuple  # (cos [B, n, D], sin [B, n, D], number of KV heads H): RoPE at the positions of the tokens read


def _rotate_rest(kv: torch.Tensor, rope: Rope, rotated: torch.Tensor | None):
    """Flat kv [B, n, 2·d_k] -> K, V [B, H, n, D], applying RoPE to the keys of the tokens not yet
    rotated (`rotated` [B, n] bool marks those the fused kernel already rotated; None = none)."""
    cos, sin, H = rope
    k, v = _unflat(kv, H, kv.shape[-1] // (2 * H))
    if rotated is None:
        return apply_rope(k, cos, sin), v
    k = k.clone()
    todo = ~rotated
    rows = k.transpose(1, 2)[todo]  # [N, H, D]: the keys still pre-RoPE, each as a one-token sequence
    k.transpose(1, 2)[todo] = apply_rope(rows[:, :, None], cos[todo][:, None], sin[todo][:, None])[:, :, 0]
    return k, v


def _row_rope(rope: Rope | None, i: int) -> Rope | None:
    return None if rope is None else (rope[0][i : i + 1], rope[1][i : i + 1], rope[2])


def _stack(parts: list):
    """Per-row reads (flat tensors, or (K, V) pairs) -> one batch."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ResidualStore:
    """References + packed latent residual codes for one layer and one row group, in ordinal order."""

    # grown in place along the token axis (residualkv.growing): a step appends, it does not copy
    refs = grown("_refs")  # [B, R, d] uint8 (fp8 bytes) or fp16
    codes = grown("_codes")  # Packed, fields [B, C, ...]
    ref_idx = grown("_ref_idx")  # [B, C, k] int16 (int32 past 32767 refs), -1 = unused
    # After a SnapKV eviction (`evict`, one row per store) the kept tokens are no longer every
    # ordinal: their ordinals are listed, and references kept only because codes need them are
    # hidden from attention. None = the dense layout (ordinal i is token i, refs from the schedule).
    ref_ord = grown("_ref_ord")  # [R] int32 ordinals of the kept references
    code_ord = grown("_code_ord")  # [C] int32 ordinals of the kept codes
    ref_visible = grown("_ref_visible")  # [R] bool: the reference takes part in attention

    def __init__(self, codec: LayerCodec, cfg: ResidualKVConfig, schedule: ReferenceSchedule):
        self.codec, self.cfg, self.schedule = codec, cfg, schedule
        self.n_coded = 0  # ordinals 0..n_coded-1 are coded (references + codes)
        # cfg.recent_window > 0: the newest tokens wait here exact, and are coded as they leave it, so
        # the coded bytes are the ones an unwindowed store would hold (references strictly before a
        # token are all coded by then); ordinals n_coded..n-1
        self.win: torch.Tensor | None = None  # [B, w, d] fp16 pre-RoPE keys ‖ values
        self._refs, self._codes, self._ref_idx = Growing(dim=1), Growing(dim=1), Growing(dim=1)
        self._ref_ord, self._code_ord, self._ref_visible = Growing(dim=0), Growing(dim=0), Growing(dim=0)
        self.evicted_refs = 0
        self.evicted_codes = 0
        # instrumentation (what reads really reconstructed): latent codes decoded, references read
        self.codes_decoded = 0
        self.refs_decoded = 0
        self._layout: tuple | None = None  # cached (n, is_ref [n], ref ordinals [R]) of the schedule
        # training only (ResidualKVCache.keep_grad_history): the differentiable reconstructions `write`
        # returned, read back in place of decoding the stored (detached) bytes so that a later call's
        # loss reaches the encoder too; equal to the decoded bytes up to float rounding
        self.keep_grad = False
        self.grad_history: torch.Tensor | None = None

    @property
    def n(self) -> int:
        """Tokens held (ordinals): the coded ones, then the recent window's."""
        return self.n_coded + self.n_win

    @property
    def n_win(self) -> int:
        return 0 if self.win is None else self.win.shape[1]

    @property
    def n_refs(self) -> int:
        return 0 if self.refs is None else self.refs.shape[1]

    def decoded_refs(self) -> torch.Tensor | None:
        return None if self.refs is None else decode_ref(self.refs, self.cfg.ref_format)

    def write(self, kv: torch.Tensor) -> torch.Tensor:
        """Store new tokens kv [B, T, 2·d_k] (pre-RoPE keys ‖ values); return their reconstruction.

        The returned values equal what later reads decode from the stored bytes; gradients pass
        straight through the FP8 and b-bit rounding so the same path trains the codec. With a recent
        window, the newest `recent_window` tokens are held in FP16 and come back at that precision.
        """
        W = self.cfg.recent_window
        if not W:
            return self._code(kv)
        held = self.n_win
        self.win = _cat(self.win, kv.detach().to(torch.float16))
        out = self.win[:, held:].float()
        leaving = self.n_win - W
        if leaving > 0:
            coded = self._code(self.win[:, :leaving].float())
            self.win = self.win[:, leaving:].contiguous()
            mine = max(0, leaving - held)  # this write's own tokens among those just coded: its oldest ones
            out[:, :mine] = coded[:, leaving - mine:]
        return out

    def _code(self, kv: torch.Tensor) -> torch.Tensor:
        """Code tokens kv [B, T, 2·d_k] at ordinals n_coded.. (the paper's write); their reconstruction."""
        cfg = self.cfg
        B, T, d = kv.shape
        kv = kv.float()
        is_ref = self.schedule.is_ref(self.n_coded, self.n_coded + T).to(kv.device)
        out = kv.new_empty(B, T, d)

        new_refs = kv[:, is_ref]
        stored = encode_ref(new_refs.detach(), cfg.ref_format)
        refs_hat = new_refs + (decode_ref(stored, cfg.ref_format) - new_refs).detach()
        out[:, is_ref] = refs_hat
        r_old = self.n_refs
        self._refs.append(stored)

        is_code = ~is_ref
        if bool(is_code.any()):
            x = kv[:, is_code]
            # references strictly before each token: the old ones plus those earlier in this chunk
            n_avail = r_old + torch.cumsum(is_ref.long(), 0)[is_code]
            # the search reads the stored bytes (the kernel decodes them in registers): a decode step
            # must not decode, copy or convert the whole reference history
            idx = topk_l2(x.detach(), self.refs, n_avail, cfg.k, ref_format=cfg.ref_format, impl=cfg.kernel_impl)
            mean = self._mean_of_chosen(idx, refs_hat, r_old)
            z = self.codec.encode(x, mean).float()
            packed = quantize_pack(z.detach(), cfg.bits, cfg.group_size, impl=cfg.kernel_impl)
            z_hat = z + (dequantize(packed, cfg.bits, cfg.group_size) - z).detach()
            out[:, is_code] = self.codec.decode(z_hat).float() + mean
            self._codes.append(packed)
            idx_dtype = torch.int16 if self.n_refs <= torch.iinfo(torch.int16).max else torch.int32
            if self.ref_idx is not None and self.ref_idx.dtype != idx_dtype:
                self.ref_idx = self.ref_idx.to(idx_dtype)
            self._ref_idx.append(idx.to(idx_dtype))
        if self.ref_ord is not None:  # evicted layout: list the new tokens' ordinals
            new_ord = torch.arange(self.n_coded, self.n_coded + T, dtype=self.ref_ord.dtype, device=self.ref_ord.device)
            m = is_ref.to(new_ord.device)
            self._ref_ord.append(new_ord[m])
            self._ref_visible.append(m.new_ones(int(m.sum())))
            self._code_ord.append(new_ord[~m])
        if self.keep_grad:
            self.grad_history = _cat(self.grad_history, out)
        self.n_coded += T
        return out

    def _ref_table(self, b: torch.Tensor, r: torch.Tensor, fresh: torch.Tensor | None = None,
                   r_old: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode each reference named by the pairs (b, r) once: (table [M, d] float32 in (row, reference)
        order, the table row of each pair). References from `r_old` on are this write's, taken from `fresh`
        [B, R_new, d], which carries the straight-through gradient; the rest come from their bytes."""
        R = max(self.n_refs, 1)
        rows, slot = torch.unique(b * R + r, return_inverse=True)
        ub, ur = rows // R, rows % R
        old = ur < (self.n_refs if r_old is None else r_old)
        table = torch.empty(rows.numel(), self.refs.shape[-1], device=self.refs.device)
        table[old] = decode_ref(self.refs[ub[old], ur[old]], self.cfg.ref_format)
        if fresh is not None:
            table[~old] = fresh[ub[~old], ur[~old] - r_old]
        return table, slot

    def _mean_of_chosen(self, idx: torch.Tensor, refs_hat: torch.Tensor, r_old: int) -> torch.Tensor:
        """Mean of the references `idx` [B, T, k] (-1 = unused) picked for new tokens, decoding only those
        (each once). Same rows in the same order as `mean_of_refs` over every reference, so the same bits."""
        B, T, k = idx.shape
        valid = idx >= 0
        table, slot = self._ref_table(torch.arange(B, device=idx.device)[:, None, None].expand_as(idx)[valid],
                                      idx[valid], refs_hat, r_old)
        local = torch.full_like(idx, -1)
        local[valid] = slot
        return mean_of_refs(table[None], local.reshape(1, B * T, k))[0].reshape(B, T, -1)

    def read(self, rope: Rope | None = None):
        """Reconstruct every stored token (after an eviction: every visible one): [B, n, 2·d_k] float32
        pre-RoPE keys ‖ values; with `rope` = (cos, sin [B, n, D] of the tokens' positions, H heads), the
        K, V [B, H, n, D] attention reads, keys rotated (on the kernel, inside the fused reconstruction)."""
        cfg = self.cfg
        if self.ref_ord is not None:
            return self.read_selected(self.visible_ordinals(), rope)
        if self.grad_history is not None:  # training: nothing decoded, the kept reconstruction is read
            return self.grad_history if rope is None else _rotate_rest(self.grad_history, rope, None)
        if self.n == 0:
            return torch.empty(0)
        like = self.win if self.refs is None else self.refs
        B, d, dev = like.shape[0], like.shape[-1], like.device
        out = torch.empty(B, self.n, d, device=dev)
        coded = torch.arange(self.n, device=dev) < self.n_coded
        is_ref = self.schedule.is_ref(0, self.n).to(dev) & coded
        is_code = ~is_ref & coded
        if self.win is not None:
            out[:, ~coded] = self.win.float()
        rotated = None
        if self.refs is not None:
            refs = self.decoded_refs()
            self.refs_decoded += refs.shape[0] * refs.shape[1]
            out[:, is_ref] = refs
        if self.codes is not None:
            self.codes_decoded += self.codes.codes.shape[0] * self.codes.codes.shape[1]
            if self._use_kernel():
                C = self.codes.codes.shape[1]
                sel = torch.arange(C, device=dev)[None].expand(B, C)
                code_rope = None if rope is None else (rope[0][:, is_code], rope[1][:, is_code], rope[2])
                out[:, is_code], fused = self._reconstruct_kernel(sel, code_rope)
                rotated = is_code.expand(B, -1) if fused else None
            else:
                mean = mean_of_refs(refs, self.ref_idx.long())
                z = dequantize(self.codes, cfg.bits, cfg.group_size)
                out[:, is_code] = self.codec.decode(z).float() + mean
        return out if rope is None else _rotate_rest(out, rope, rotated)

    def _use_kernel(self) -> bool:
        return use_triton(self.cfg.kernel_impl, self.refs) and fused_group_ok(self.cfg.group_size)

    def _fuses_rope(self, heads: int) -> bool:
        """The kernel rotates a key head in registers as two [n, D/2] halves: heads up to 128 wide."""
        D = self.refs.shape[-1] // (2 * heads)
        return D % 2 == 0 and D <= 128

    def _reconstruct_kernel(self, sel: torch.Tensor, rope: Rope | None = None) -> tuple[torch.Tensor, bool]:
        """Codes at `sel` [B, n] (indices along the codes, -1 = padding) -> (kv [B, n, 2·d_k], whether its
        keys are rotated) via the fused gather + dequantise + W_d + mean-of-refs (+ RoPE) kernel. With `rope`
        (cos, sin [B, n, D] at the selected codes, H heads) the keys come back rotated where the heads fit
        the kernel's tile; otherwise pre-RoPE."""
        cfg = self.cfg
        half = self.refs.shape[-1] // 2
        n = sel.shape[1]
        fused = rope is not None and self._fuses_rope(rope[2])
        if fused:
            cos, sin, heads = rope
        else:
            # with the identity rotation any split of the features into "heads" returns the same flat rows:
            # pick the fewest heads whose width stays within a 128-wide tile (the kernel's register budget)
            heads = next(h for h in range(1, half + 1) if half % h == 0 and (half // h) % 2 == 0 and half // h <= 128)
            cos = torch.ones(1, n, half // heads, device=sel.device)
            sin = torch.zeros_like(cos)
        k, v = reconstruct_selected(self.codes, self.ref_idx, self.refs, self.codec, sel, cos, sin,
                                    bits=cfg.bits, group=cfg.group_size, num_kv_heads=heads, ref_format=cfg.ref_format,
                                    impl=cfg.kernel_impl)
        return torch.cat([flat_heads(k), flat_heads(v)], dim=-1), fused

    # ---- selective reads (OmniKV) and eviction (SnapKV), seed §2.7 ----

    def _schedule_layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_ref [n] bool, reference ordinals [R] long) of the schedule over this store's coded ordinals."""
        n = self.n_coded
        if self._layout is None or self._layout[0] != n or self._layout[1].device != device:
            self._layout = (n, self.schedule.is_ref(0, n).to(device), self.schedule.ref_ordinals(n).to(device))
        return self._layout[1], self._layout[2]

    def _locate(self, ordinals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Coded ordinals [B, S] -> (is_ref [B, S], index into refs where is_ref else into codes)."""
        is_ref_of, sched_refs = self._schedule_layout(ordinals.device)
        if bool(((ordinals < 0) | (ordinals >= self.n_coded)).any()):
            raise IndexError(f"coded ordinals must lie in [0, {self.n_coded})")
        is_ref = is_ref_of[ordinals]
        if self.ref_ord is None:
            ridx = torch.searchsorted(sched_refs, ordinals)
            cidx = ordinals - ridx  # a code's index = its ordinal minus the references before it
        else:
            ref_ord, code_ord = self.ref_ord.long(), self.code_ord.long()
            ridx = torch.searchsorted(ref_ord, ordinals).clamp(max=max(len(ref_ord) - 1, 0))
            cidx = torch.searchsorted(code_ord, ordinals).clamp(max=max(len(code_ord) - 1, 0))
            found = torch.where(is_ref, ref_ord[ridx] if len(ref_ord) else ordinals + 1,
                                code_ord[cidx] if len(code_ord) else ordinals + 1) == ordinals
            if not bool(found.all()):
                raise IndexError("asked for a token that SnapKV evicted: eviction is irreversible")
        return is_ref, torch.where(is_ref, ridx, cidx)

    def read_selected(self, ordinals: torch.Tensor, rope: Rope | None = None):
        """Reconstruct only the tokens at `ordinals` [B, S] (each row its own ordinals): selected
        references are read as references; selected codes are dequantised and decoded, and only the
        references their means need are read (each needed reference once). Returns [B, S, 2·d_k]
        float32, equal to the same columns of `read()`; with `rope` (cos, sin [B, S, D], H), K, V
        [B, H, S, D] with the keys rotated, as `read` does."""
        cfg = self.cfg
        B, S = ordinals.shape
        like = self.refs if self.refs is not None else self.win
        if like is None or S == 0:
            out = torch.zeros(B, S, self.codec.dims.d_kv, device=ordinals.device)
            return out if rope is None else _rotate_rest(out, rope, None)
        dev = like.device
        ordinals = ordinals.to(device=dev, dtype=torch.long)
        rows = torch.arange(B, device=dev)[:, None].expand(B, S)
        in_win = ordinals >= self.n_coded
        if bool((ordinals >= self.n).any()):
            raise IndexError(f"ordinals must lie in [0, {self.n})")
        is_ref = torch.zeros_like(in_win)
        pos = torch.zeros_like(ordinals)
        if not bool(in_win.all()):
            is_ref[~in_win], pos[~in_win] = (t[0] for t in self._locate(ordinals[~in_win][None]))
        is_code = ~is_ref & ~in_win
        out = torch.empty(B, S, like.shape[-1], device=dev)
        if self.win is not None:
            out[in_win] = self.win[rows[in_win], ordinals[in_win] - self.n_coded].float()
        rb, rp = rows[is_ref], pos[is_ref]
        cb, cp = rows[is_code], pos[is_code]
        rotated = None
        if rb.numel() or cb.numel():
            # which references are read: the selected ones and those the selected codes average, each once
            idx = self.ref_idx[cb, cp].long() if cb.numel() else cb.new_empty(0, cfg.k)  # [N, k], -1 = unused
            ok = idx >= 0
            table, slot = self._ref_table(torch.cat([rb, cb[:, None].expand_as(idx)[ok]]), torch.cat([rp, idx[ok]]))
            self.refs_decoded += int(table.shape[0])
            out[is_ref] = table[slot[: rb.numel()]]
        if cb.numel() and self._use_kernel():
            # per row, its selected codes in order: rank of each within its row, padded with -1
            rank = torch.cumsum(is_code, dim=1) - 1
            sel = torch.full((B, int(is_code.sum(1).max())), -1, dtype=torch.long, device=dev)
            sel[cb, rank[is_code]] = cp
            code_rope = None
            if rope is not None:  # cos/sin in the same ragged layout as sel (padding rows: zeros)
                cos = rope[0].new_zeros(B, sel.shape[1], rope[0].shape[-1])
                sin = torch.zeros_like(cos)
                cos[cb, rank[is_code]], sin[cb, rank[is_code]] = rope[0][is_code], rope[1][is_code]
                code_rope = (cos, sin, rope[2])
            kv, fused = self._reconstruct_kernel(sel, code_rope)
            out[is_code] = kv[cb, rank[is_code]]
            rotated = is_code if fused else None
            self.codes_decoded += int(cb.numel())
        elif cb.numel():
            mean_idx = torch.full_like(idx, -1)
            mean_idx[ok] = slot[rb.numel():]
            mean = mean_of_refs(table[None], mean_idx[None])[0]
            c = self.codes
            z = dequantize(Packed(c.codes[cb, cp], c.mins[cb, cp], c.scales[cb, cp]), cfg.bits, cfg.group_size)
            out[is_code] = self.codec.decode(z).float() + mean
            self.codes_decoded += int(cb.numel())
        return out if rope is None else _rotate_rest(out, rope, rotated)

    def visible_ordinals(self) -> torch.Tensor:
        """[B, S] ordinals that take part in attention: all of them, or a SnapKV row's survivors."""
        like = self.refs if self.refs is not None else self.win
        if self.ref_ord is None:
            B = like.shape[0] if like is not None else 1
            return torch.arange(self.n, device=like.device if like is not None else None).expand(B, self.n)
        window = torch.arange(self.n_coded, self.n, device=self.ref_ord.device)
        vis = torch.cat([self.ref_ord[self.ref_visible].long(), self.code_ord.long()]).sort().values
        return torch.cat([vis, window])[None]

    def split_rows(self) -> list["ResidualStore"]:
        """One store per batch row (eviction keeps different tokens in different rows)."""
        out = []
        for b in range(self.refs.shape[0]):
            s = ResidualStore(self.codec, self.cfg, self.schedule)
            s.n_coded = self.n_coded
            s.refs = self.refs[b : b + 1].clone()
            s.win = None if self.win is None else self.win[b : b + 1].clone()
            if self.codes is not None:
                s.codes = Packed(*(t[b : b + 1].clone() for t in self.codes))
                s.ref_idx = self.ref_idx[b : b + 1].clone()
            for name in ("ref_ord", "code_ord", "ref_visible"):
                setattr(s, name, getattr(self, name))
            out.append(s)
        return out

    def evict(self, keep: torch.Tensor) -> dict[str, int]:
        """SnapKV eviction of a one-row store (seed §2.7): keep the tokens at ordinals `keep` and the
        references their codes need (kept, hidden from attention); free everything else. Irreversible.
        The recent window (exact, not yet coded) is kept whole, whatever `keep` says of it."""
        if self.refs is None or self.refs.shape[0] != 1:
            raise ValueError("evict() works on one row: split a batch store with split_rows() first")
        if self.ref_ord is not None:
            raise ValueError("this store was already evicted once; SnapKV evicts once, after the prompt")
        dev = self.refs.device
        keep = torch.unique(keep.to(device=dev, dtype=torch.long))
        keep = keep[keep < self.n_coded]
        is_ref, pos = self._locate(keep[None])
        is_ref, pos = is_ref[0], pos[0]
        _, sched_refs = self._schedule_layout(dev)
        R = self.n_refs
        C = 0 if self.codes is None else self.codes.codes.shape[1]
        visible = torch.zeros(R, dtype=torch.bool, device=dev)
        visible[pos[is_ref]] = True
        kept_refs = visible.clone()
        code_pos = pos[~is_ref]
        if C:
            idx = self.ref_idx[0, code_pos].long()
            kept_refs[idx[idx >= 0]] = True
            remap = torch.where(kept_refs, torch.cumsum(kept_refs.long(), 0) - 1, -1)
            new_idx = torch.where(idx >= 0, remap[idx.clamp(min=0)], -1)
            if bool((new_idx[idx >= 0] < 0).any()):  # cannot happen: every needed reference is kept
                raise RuntimeError("eviction would leave a code pointing at an evicted reference")
            self.codes = Packed(*(t[:, code_pos] for t in self.codes))
            self.ref_idx = new_idx[None].to(self.ref_idx.dtype)
        self.refs = self.refs[:, kept_refs]
        self.ref_ord = sched_refs[kept_refs].to(torch.int32)
        self.ref_visible = visible[kept_refs]
        self.code_ord = keep[~is_ref].to(torch.int32)
        self.evicted_refs = R - int(kept_refs.sum())
        self.evicted_codes = C - int(code_pos.numel())
        return {"evicted_refs": self.evicted_refs, "evicted_codes": self.evicted_codes,
                "hidden_refs": int(kept_refs.sum() - visible.sum())}

    def nbytes(self) -> dict[str, int]:
        c = self.codes
        out = {
            "references": _nbytes(self.refs),
            "latent_codes": _nbytes(c.codes) if c else 0,
            "latent_mins_scales": _nbytes(c.mins, c.scales) if c else 0,
            "reference_indices": _nbytes(self.ref_idx),
            "recent_window_fp16": _nbytes(self.win),
        }
        if self.ref_ord is not None:
            out["eviction_ordinals"] = _nbytes(self.ref_ord, self.code_ord, self.ref_visible)
        return out

    def spare_bytes(self) -> int:
        return sum(g.spare_bytes() for g in (self._refs, self._codes, self._ref_idx, self._ref_ord, self._code_ord,
                                             self._ref_visible))


class _RowStores:
    """One ResidualStore per row of a group, after SnapKV kept different tokens in each row. Every row
    keeps the same number of visible tokens, so their reads stack into one batch."""

    def __init__(self, stores: list[ResidualStore]):
        self.stores = stores

    n = property(lambda self: self.stores[0].n)
    codes_decoded = property(lambda self: sum(s.codes_decoded for s in self.stores))
    refs_decoded = property(lambda self: sum(s.refs_decoded for s in self.stores))
    evicted_refs = property(lambda self: sum(s.evicted_refs for s in self.stores))
    evicted_codes = property(lambda self: sum(s.evicted_codes for s in self.stores))

    def write(self, kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.write(kv[i : i + 1]) for i, s in enumerate(self.stores)])

    def read(self, rope: Rope | None = None):
        return _stack([s.read(_row_rope(rope, i)) for i, s in enumerate(self.stores)])

    def read_selected(self, ordinals: torch.Tensor, rope: Rope | None = None):
        return _stack([s.read_selected(ordinals[i : i + 1], _row_rope(rope, i)) for i, s in enumerate(self.stores)])

    def visible_ordinals(self) -> torch.Tensor:
        return torch.cat([s.visible_ordinals() for s in self.stores])

    def nbytes(self) -> dict[str, int]:
        return _sum_dicts(s.nbytes() for s in self.stores)

    def spare_bytes(self) -> int:
        return sum(s.spare_bytes() for s in self.stores)


class KiviStore:
    """KIVI-style full-attention layer: keys quantised per channel over groups of tokens, values per
    token; the newest tokens wait in an FP16 window until a whole group can be quantised. The window
    is never emptied, so the token a step writes is read back exact (new_kv "exact") on every path,
    the fused decode attention included, which reads only the stores."""

    kq = grown("_kq")  # Packed, fields [B, H, G, D, ...]: per-channel groups of tokens
    vq = grown("_vq")  # Packed, fields [B, H, n_q, ...]: per-token groups of channels

    def __init__(self, cfg: ResidualKVConfig):
        self.cfg = cfg
        self.n = 0
        self._kq, self._vq = Growing(dim=2), Growing(dim=2)
        self.win_k: torch.Tensor | None = None  # [B, H, w, D] fp16
        self.win_v: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cfg, g = self.cfg, self.cfg.full_group_size
        self.win_k = _cat(self.win_k, k.detach().to(torch.float16), dim=2)
        self.win_v = _cat(self.win_v, v.detach().to(torch.float16), dim=2)
        self.n += k.shape[2]
        w = self.win_k.shape[2]
        if w <= cfg.full_window:
            return
        m = ((w - cfg.full_window - 1) // g + 1) * g  # leaves between window-g+1 and window tokens in FP16
        fk, fv = self.win_k[:, :, :m].float(), self.win_v[:, :, :m].float()
        self.win_k, self.win_v = self.win_k[:, :, m:].contiguous(), self.win_v[:, :, m:].contiguous()
        B, H, _, D = fk.shape
        kq = quantize(fk.reshape(B, H, m // g, g, D).transpose(-1, -2), cfg.full_bits, g)
        vq = quantize(fv, cfg.full_bits, self.value_group(D))
        self._kq.append(kq)
        self._vq.append(vq)

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

    def spare_bytes(self) -> int:
        return self._kq.spare_bytes() + self._vq.spare_bytes()


# ---------------------------------------------------------------------------------------------
# Cache layers: slot space (what attention sees) <-> per-group ordinal space (what is stored).


class _GroupedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.n_slots = 0
        self.stores: list = []
        # CR instrumentation, decode steps only (query length 1; prefill attends densely everywhere):
        # history tokens that took part in attention / history tokens, summed over rows and steps
        self.tokens_read = 0
        self.tokens_available = 0
        # one (history, attended, codes decoded, references read) tuple per decode step, summed over rows
        self.decode_log: list[tuple[int, int, int, int]] = []

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

    def update(self, key_states, value_states, rows: RowLayout, *args, **kwargs):
        self.is_initialized = True
        B, H, T, D = key_states.shape
        s0, s1 = self.n_slots, self.n_slots + T
        before = self._decoded()
        outs = []
        for grp, store, sel, k_new, v_new in self._groups(key_states, value_states, rows):
            k, v = self._write_and_read(store, k_new, v_new, rows.positions[sel, grp.start : s1])
            outs.append((grp, k, v))
        self.n_slots = s1
        self._count(rows, s0, T, before, None)
        if len(outs) == 1 and outs[0][0].start == 0:
            return outs[0][1], outs[0][2]
        out_k = key_states.new_zeros(B, H, s1, D)
        out_v = value_states.new_zeros(B, H, s1, value_states.shape[-1])
        for grp, k, v in outs:
            out_k[grp.rows, :, grp.start :] = k
            out_v[grp.rows, :, grp.start :] = v
        return out_k, out_v

    def update_selected(self, key_states, value_states, rows: RowLayout, select: list[torch.Tensor | None]):
        """Like `update`, but group g's history is read only at the ordinals select[g] ([rows of g, S_g],
        sorted; None = all of it): the sparse path of seed §2.7. The new tokens are written as usual
        and returned after the selected ones. Returns K, V [B, H, L, D] with L = max_g(S_g + new) and
        `slots` [B, L]: the slot (column of the model's attention mask) each returned column holds,
        -1 for padding columns, which the attention must mask."""
        self.is_initialized = True
        B, H, T, D = key_states.shape
        s0, s1 = self.n_slots, self.n_slots + T
        dev = key_states.device
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
            k, v = self._write_and_read(store, k_new, v_new, pos, ordinals=ords)
            slots = torch.cat([hist, torch.arange(first_new, s1, device=dev).expand(n_rows, -1)], dim=1)
            parts.append((grp, k, v, slots))
            read += n_rows * hist.shape[1]
        self.n_slots = s1
        self._count(rows, s0, T, before, read)
        if len(parts) == 1:
            return parts[0][1], parts[0][2], parts[0][3]
        L = max(k.shape[2] for _, k, _, _ in parts)
        out_k = key_states.new_zeros(B, H, L, D)
        out_v = value_states.new_zeros(B, H, L, value_states.shape[-1])
        out_s = torch.full((B, L), -1, dtype=torch.long, device=dev)
        for grp, k, v, slots in parts:
            out_k[grp.rows, :, : k.shape[2]] = k
            out_v[grp.rows, :, : k.shape[2]] = v
            out_s[grp.rows, : k.shape[2]] = slots
        return out_k, out_v, out_s

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

    def _decoded(self) -> tuple[int, int]:
        return (sum(getattr(s, "codes_decoded", 0) for s in self.stores),
                sum(getattr(s, "refs_decoded", 0) for s in self.stores))

    def _count(self, rows: RowLayout, s0: int, T: int, before: tuple[int, int], read: int | None) -> None:
        """Record a decode step (one new token per row) for CR and the per-step reconstruction counts."""
        if T != 1 or s0 == 0:
            return
        history = sum(int(g.rows.numel()) * max(s0 - g.start, 0) for g in rows.groups)
        read = history if read is None else read
        after = self._decoded()
        self.tokens_available += history
        self.tokens_read += read
        self.decode_log.append((history, read, after[0] - before[0], after[1] - before[1]))

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


class ResidualLayer(_GroupedLayer):
    def __init__(self, codec: LayerCodec, cfg: ResidualKVConfig, schedule: ReferenceSchedule, rope: RopeTable):
        self.codec, self.cfg, self.schedule, self.rope = codec, cfg, schedule, rope
        self.rec_terms: list[torch.Tensor] | None = None  # training hook, see ResidualKVCache.collect_rec_loss
        self.keep_grad = False  # training hook, see ResidualKVCache.keep_grad_history
        super().__init__()

    def _new_store(self) -> ResidualStore:
        store = ResidualStore(self.codec, self.cfg, self.schedule)
        store.keep_grad = self.keep_grad
        return store

    def _write_and_read(self, store: ResidualStore, k, v, pos, ordinals=None):
        """`pos` holds the RoPE positions of the returned tokens: the history read (all of it, or the
        tokens at `ordinals` [B, S]) followed by the new tokens."""
        B, H, T, D = k.shape
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        # the history comes back with its keys rotated (inside the fused reconstruction on the kernel)
        hist_rope = (cos[:, :-T], sin[:, :-T], H)
        if ordinals is None:
            history = store.read(hist_rope) if store.n else None
        else:
            history = store.read_selected(ordinals, hist_rope)
        k_pre = invert_rope(k.float(), cos[:, -T:], sin[:, -T:])
        kv = torch.cat([flat_heads(k_pre), flat_heads(v.float())], dim=-1)
        new = store.write(kv)
        if self.rec_terms is not None:
            self.rec_terms.append((new - kv).pow(2).sum())
        if self.cfg.new_kv == "exact":
            k_hat, v_hat = k, v
        else:
            k_hat, v_hat = _unflat(new, H, D)
            k_hat = apply_rope(k_hat, cos[:, -T:], sin[:, -T:])
        if history is not None:
            k_hat, v_hat = torch.cat([history[0], k_hat], dim=2), torch.cat([history[1], v_hat], dim=2)
        return k_hat.to(k.dtype), v_hat.to(v.dtype)

    def nbytes(self) -> dict[str, int]:
        return _sum_dicts(s.nbytes() for s in self.stores)


class KiviLayer(_GroupedLayer):
    def __init__(self, cfg: ResidualKVConfig):
        self.cfg = cfg
        super().__init__()

    def _new_store(self) -> KiviStore:
        return KiviStore(self.cfg)

    def _write_and_read(self, store: KiviStore, k, v, pos, ordinals=None):
        if ordinals is not None:
            raise ValueError("full-attention (KIVI) layers always read their whole history")
        store.write(k, v)
        hk, hv = store.read(k.dtype)
        T = k.shape[2]
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
        return _sum_dicts(s.nbytes() for s in self.stores)


def flat_heads(x: torch.Tensor) -> torch.Tensor:
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
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows = RowLayout(ReferenceSchedule(config.n_sink, config.stride, config.stride_alpha))
        layers = [KiviLayer(config) if i in config.full_attention_layers
                  else ResidualLayer(codec.layer(i), config, self.rows.schedule, rope) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.sparse = _controller(self)
        self.fused_full = None  # residualkv.attention.FusedFullDecode, see attach_fused_full_decode (from_model calls it)

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
        cache = cls(codec, config, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim,
                    rope=RopeTable.from_model(model))
        _install_if_sparse(model, config)
        cache.attach_fused_full_decode(model)
        return cache

    def attach_fused_full_decode(self, model) -> None:
        """Decode the full-attention (KIVI) layers on the fused kernel where it runs for `model` (its
        device, plain softmax attention): installs residualkv's attention function on the model."""
        if self.config.full_attention_layers and _fused_full_decode_ok(model, self.config):
            from .attention import FusedFullDecode, install

            install(model)
            self.fused_full = FusedFullDecode(self)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.n_slots == self.rows.n_slots:  # the first layer to see this step's tokens
            self.rows.append(_position_ids(args, kwargs), key_states.shape[0], key_states.shape[2], key_states.device)
            if self.sparse is not None:
                self.sparse.begin_step(key_states.shape[2])
        if self.fused_full is not None:
            self.fused_full.check()
            if self.fused_full.applies(layer_idx, key_states):
                return self.fused_full.update(layer_idx, key_states, value_states)
        if self.sparse is not None:  # omnikv / snapkv: residualkv.attention decides what each layer reads
            return self.sparse.update(layer_idx, key_states, value_states)
        return layer.update(key_states, value_states, self.rows)

    def reset(self):
        super().reset()
        self.rows = RowLayout(ReferenceSchedule(self.config.n_sink, self.config.stride, self.config.stride_alpha))
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                layer.schedule = self.rows.schedule
        self.sparse = _controller(self)
        if self.fused_full is not None:
            self.fused_full = type(self.fused_full)(self)

    READ_FIELDS = ("mode", "select_budget", "select_ratio", "n_recent", "select_pool", "new_kv")

    def fork(self, **changes) -> "ResidualKVCache":
        """An independent copy of the stored tokens that reads them under other read settings (`mode`
        "standalone"/"omnikv", selection budget...): one prefill, several deployments side by side.
        Bytes are copied; the codec and RoPE modules are shared. SnapKV evicts during the prompt, so
        forking into or out of it is refused, as are changes to how tokens are stored."""
        import copy

        bad = set(changes) - set(self.READ_FIELDS)
        if bad:
            raise ValueError(f"fork() changes only read settings {self.READ_FIELDS}, not {sorted(bad)}")
        cfg = self.config.replace(**changes)
        if "snapkv" in (cfg.mode, self.config.mode):
            raise ValueError("SnapKV eviction happens during the prompt: build a snapkv cache and prefill it")
        memo = {id(m): m for m in (self.codec.modules() if self.codec is not None else [])}
        for layer in self.layers:
            if isinstance(layer, ResidualLayer):
                memo[id(layer.rope)] = layer.rope
        sparse, fused, self.sparse, self.fused_full = self.sparse, self.fused_full, None, None
        try:
            new = copy.deepcopy(self, memo)
        finally:
            self.sparse, self.fused_full = sparse, fused
        new.config = cfg
        new.sparse = _controller(new)
        new.fused_full = type(fused)(new) if fused is not None else None
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
        out = _sum_dicts(layer.nbytes() for layer in self.layers)
        out["positions"] = self.rows.nbytes()
        return out

    def spare_bytes(self) -> int:
        """Bytes allocated past the stored ones: capacity the stores grow into (residualkv.growing), at
        most about an eighth of what they hold; memory, not data, so outside `nbytes` and KR."""
        return sum(layer.spare_bytes() for layer in self.layers) + self.rows.spare_bytes()

    def fp16_bytes(self) -> int:
        """Bytes an FP16 full cache would hold for the same real tokens."""
        return self.rows.valid_tokens() * len(self.layers) * 2 * self.num_kv_heads * self.head_dim * 2


def _no_window_in_training(cfg: ResidualKVConfig) -> None:
    if cfg.recent_window:
        raise ConfigError(f"invalid recent_window={cfg.recent_window}: train with recent_window=0; the FP16 window "
                          "is a serving setting and would hide the codec's error from the loss")


class DenseStore:
    """Exact keys and values of one row group (the model's dtype; accounted as FP16): OmniKV's baseline."""

    k = grown("_k")  # [B, H, n, D]
    v = grown("_v")

    def __init__(self):
        self.n = 0
        self._k, self._v = Growing(dim=2), Growing(dim=2)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k.append(k.detach())
        self._v.append(v.detach())
        self.n += k.shape[2]

    def read_selected(self, ordinals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, _, D = self.k.shape
        idx = ordinals.to(device=self.k.device, dtype=torch.long)[:, None, :, None]
        return (self.k.gather(2, idx.expand(B, H, -1, D)), self.v.gather(2, idx.expand(B, H, -1, self.v.shape[-1])))

    def nbytes(self) -> dict[str, int]:
        return {"kv_fp16": 0 if self.k is None else (self.k.numel() + self.v.numel()) * 2}

    def spare_bytes(self) -> int:
        return self._k.spare_bytes() + self._v.spare_bytes()


class DenseLayer(_GroupedLayer):
    """An uncompressed layer in the row-group layout, so OmniKV selection works on it with batches."""

    def _new_store(self) -> DenseStore:
        return DenseStore()

    def _write_and_read(self, store: DenseStore, k, v, pos, ordinals=None):
        had = store.n
        store.write(k, v)
        if ordinals is None:
            return store.k, store.v
        if not had:
            return k, v
        hk, hv = store.read_selected(ordinals)
        return torch.cat([hk, k], dim=2), torch.cat([hv, v], dim=2)

    def nbytes(self) -> dict[str, int]:
        return _sum_dicts(s.nbytes() for s in self.stores)


class OmniKVCache(ResidualKVCache):
    """OmniKV without compression (a baseline, KR = 100%): every layer keeps exact keys and values; with
    mode "omnikv" the filter layers (config.full_attention_layers) choose, at each decode step, the
    tokens the following layers attend over. Mode "standalone" makes it a plain full cache."""

    def __init__(self, config: ResidualKVConfig, *, num_layers: int, num_kv_heads: int, head_dim: int):
        config.check_model(num_layers)
        if config.mode == "snapkv":
            raise ValueError("OmniKVCache supports mode 'omnikv' (or 'standalone'); SnapKV eviction belongs to its own baseline")
        self.config, self.codec = config, None
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rows = RowLayout(ReferenceSchedule(config.n_sink, config.stride, config.stride_alpha))
        Cache.__init__(self, layers=[DenseLayer() for _ in range(num_layers)])
        self.sparse = _controller(self)
        self.fused_full = None

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


def _fused_full_decode_ok(model, config: ResidualKVConfig) -> bool:
    """Whether full-attention layers decode on the fused KIVI kernel: where the kernels run on this
    model's device and its attention is plain softmax attention (no sliding window, no soft-capping)."""
    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    if getattr(cfg, "attn_logit_softcapping", None):
        return False
    return use_triton(config.kernel_impl, next(model.parameters()))


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
