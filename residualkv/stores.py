"""The bytes of the ResidualKV cache: one store per layer and row group (seed §2.1–2.7).

`ResidualStore` (compressed layers) keeps, per token, either an FP8 reference or a packed b-bit latent
code plus the indices of the k references it was encoded against, and reconstructs all of its tokens
(`read`) or only some (`read_selected`, OmniKV), or evicts them for good (`evict`, SnapKV).
`KiviStore` (full-attention layers) keeps KIVI-style 4-bit keys (per channel) and values (per token)
with a short FP16 window. `DenseStore` keeps exact keys and values (the OmniKV-on-FP16 baseline).
Nothing is kept as floats but the FP16 windows, and the stored tensors grow in place
(residualkv.growing). Tokens are addressed by their ordinal within the group's rows (0 = the first
real token); `residualkv.cache` maps the model's slots onto them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .codec import LayerCodec
from .config import ResidualKVConfig
from .growing import Growing, grown, take_rows
from .quant import Packed, PackedIndices, decode_ref, dequantize, encode_ref, index_bits, pack_indices, quantize
from .retrieval import mean_of_refs
from .rope import apply_rope
from .schedule import ReferenceSchedule

# the Triton kernels for the hot paths; each runs its torch reference (the code in this file) unless
# cfg.kernel_impl and the tensors' device say otherwise
from kernels import quantize_pack, reconstruct_selected, topk_l2
from kernels.reconstruct import fused_group_ok
from kernels._common import use_triton


Rope = tuple  # (cos [B, n, D], sin [B, n, D], number of KV heads H): RoPE at the positions of the tokens read


def _rotate_rest(kv: torch.Tensor, rope: Rope, todo: torch.Tensor | None):
    """Flat kv [B, n, 2·d_k] -> K, V [B, H, n, D], applying RoPE to the keys not yet rotated: all of them
    (`todo` None), or those at `todo`, flat indices into the B·n tokens (the rest the fused kernel
    rotated). Indices, not a mask: a boolean mask is a host-device sync on a GPU."""
    cos, sin, H = rope
    k, v = unflat_heads(kv, H, kv.shape[-1] // (2 * H))
    if todo is None:
        # rotating a head-major copy is ~4x faster than rotating the strided view of the flat rows (CPU,
        # thousands of keys), copy included; the same products, so the same bits
        return apply_rope(k.contiguous(), cos, sin), v
    B, _, n, D = k.shape
    rows = k.transpose(1, 2).contiguous().view(B * n, H, D)  # a copy: kv holds the values beside the keys
    at = lambda t: t.reshape(B * n, -1).index_select(0, todo)[:, None]  # noqa: E731
    rows.index_copy_(0, todo, apply_rope(rows.index_select(0, todo)[:, :, None], at(cos), at(sin))[:, :, 0])
    return rows.view(B, n, H, D).transpose(1, 2), v


def kernel_reads(cfg: ResidualKVConfig, like: torch.Tensor) -> bool:
    """Whether a compressed layer's reads run on the fused reconstruction kernel (else the torch code)."""
    return use_triton(cfg.kernel_impl, like) and fused_group_ok(cfg.group_size)


class Latents(NamedTuple):
    """The Z of a latent read (residualkv.attention.LatentValues), held compactly: the values in column
    cols[b, j] of the K/V returned lack the decoder's term W_v z[b, j]; every other column's values are
    whole. Only codes have entries, so a read never builds (and the attention never multiplies) zeros for
    references, window and new tokens. Rows with fewer codes than others are padded with z = 0."""

    cols: torch.Tensor  # [B, C] long: columns of the returned K/V
    z: torch.Tensor  # [B, C, d_c] float32

    @staticmethod
    def empty(B: int, d_c: int, device) -> "Latents":
        return Latents(torch.zeros(B, 0, dtype=torch.long, device=device), torch.zeros(B, 0, d_c, device=device))

    @staticmethod
    def place(parts: list[tuple], B: int) -> "Latents":
        """(batch rows, Latents of those rows, column offset) for each part -> one Latents of B rows."""
        C = max(lat.cols.shape[1] for _, lat, _ in parts)
        first = parts[0][1]
        cols = first.cols.new_zeros(B, C)
        z = first.z.new_zeros(B, C, first.z.shape[-1])
        for rows, lat, offset in parts:
            c = lat.cols.shape[1]
            cols[rows, :c] = lat.cols + offset
            z[rows, :c] = lat.z
        return Latents(cols, z)

    def dense(self, n: int) -> torch.Tensor:
        """Z as [B, 1, n, d_c] with zeros in the whole columns (the reading LatentValues' docs use)."""
        B, C, d = self.z.shape
        out = self.z.new_zeros(B, n, d)
        return out.scatter_add_(1, self.cols[..., None].expand(B, C, d), self.z)[:, None]  # padding adds 0


def _with_latent(kv, rope: Rope | None, todo: torch.Tensor | None, latent: Latents | None):
    """A read's return: flat kv, or K, V with `rope` (rotating the keys at `todo`, see _rotate_rest);
    with `latent` also its Latents."""
    if rope is None:
        if latent is not None:
            raise ValueError("a latent read returns K, V and Z for attention: pass the tokens' RoPE")
        return kv
    k, v = _rotate_rest(kv, rope, todo)
    return (k, v) if latent is None else (k, v, latent)


def _selected_latents(B: int, S: int, code_at: torch.Tensor, z: torch.Tensor) -> Latents:
    """Latents of a selection [B, S] whose codes sit at the flat positions code_at [N] (row-major), with
    their latents z [N, d_c]."""
    rows, cols = code_at // S, code_at % S
    if B == 1:  # one row: no padding to lay out (and nothing for the host to wait for)
        return Latents(cols[None], z[None])
    counts = torch.bincount(rows, minlength=B)
    C = int(counts.max())
    rank = torch.arange(code_at.numel(), device=code_at.device) - (torch.cumsum(counts, 0) - counts)[rows]
    out = Latents(cols.new_zeros(B, C), z.new_zeros(B, C, z.shape[-1]))
    out.cols[rows, rank], out.z[rows, rank] = cols, z
    return out


def _row_rope(rope: Rope | None, i: int) -> Rope | None:
    return None if rope is None else (rope[0][i : i + 1], rope[1][i : i + 1], rope[2])


def _stack(parts: list):
    """Per-row reads (flat tensors, or (K, V[, Latents]) tuples) -> one batch."""
    if isinstance(parts[0], tuple):
        return tuple(Latents.place([(i, t, 0) for i, t in enumerate(p)], len(p)) if isinstance(p[0], Latents)
                     else torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def nbytes_of(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ResidualStore:
    """References + packed latent residual codes for one layer and one row group, in ordinal order."""

    # grown in place along the token axis (residualkv.growing): a step appends, it does not copy
    refs = grown("_refs")  # [B, R, d] uint8 (fp8 bytes) or fp16
    codes = grown("_codes")  # Packed, fields [B, C, ...]
    # [B, C, ceil(k·idx_bits/8)] uint8: each code's k reference indices, idx_bits each (quant.PackedIndices)
    ref_idx = grown("_ref_idx")
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
        # as wide as the references held need (8 bits up to 255 of them): widened, and every code's indices
        # repacked, when the count passes a power of two (a few times over a sequence); narrowed by evict
        self.idx_bits = 0
        self.evicted_refs = 0
        self.evicted_codes = 0
        self.hidden_refs = 0  # references kept after an eviction only because codes need them
        # instrumentation (what reads really reconstructed): latent codes decoded, references read. The
        # kernel path counts its references on the device (the count would be a host sync per layer and
        # step on a GPU): refs_count is then a 0-d tensor, read as a number by `refs_decoded`
        self.codes_decoded = 0
        self.refs_count: int | torch.Tensor = 0
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

    def _held(self) -> torch.Tensor | None:
        """A tensor the store holds, for its batch size, feature width and device (None while empty): the
        references, or before the first one is coded the recent window."""
        return self.win if self.refs is None else self.refs

    @property
    def indices(self) -> PackedIndices | None:
        return None if self.ref_idx is None else PackedIndices(self.ref_idx, self.idx_bits, self.cfg.k)

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
        s0 = self.n_coded
        if self.refs is not None and not self.schedule.count_in(s0, s0 + T):
            # all codes (most decode steps): no reference bookkeeping, no masked copies; the same bytes
            out = self._code_tokens(kv, torch.full((T,), self.n_refs, device=kv.device), kv.new_empty(B, 0, d))
            if self.ref_ord is not None:  # evicted layout: list the new tokens' ordinals
                self._code_ord.append(torch.arange(s0, s0 + T, dtype=self.code_ord.dtype, device=self.code_ord.device))
        else:
            # the chunk's references and codes by position (the schedule is known on the host: no masks)
            ref_at, code_at = self.schedule.split(s0, s0 + T, kv.device)
            out = kv.new_empty(B, T, d)
            new_refs = kv.index_select(1, ref_at)
            stored = encode_ref(new_refs.detach(), cfg.ref_format)
            refs_hat = new_refs + (decode_ref(stored, cfg.ref_format) - new_refs).detach()
            out.index_copy_(1, ref_at, refs_hat)
            r_old = self.n_refs
            self._refs.append(stored)
            if code_at.numel():
                # references strictly before each token: the old ones plus those earlier in this chunk
                n_avail = r_old + torch.searchsorted(ref_at, code_at)
                out.index_copy_(1, code_at, self._code_tokens(kv.index_select(1, code_at), n_avail, refs_hat))
            if self.ref_ord is not None:  # evicted layout: list the new tokens' ordinals
                self._ref_ord.append((s0 + ref_at).to(self.ref_ord.dtype))
                self._ref_visible.append(torch.ones(ref_at.numel(), dtype=torch.bool, device=ref_at.device))
                self._code_ord.append((s0 + code_at).to(self.code_ord.dtype))
        if self.keep_grad:
            self.grad_history = _cat(self.grad_history, out)
        self.n_coded += T
        return out

    def _code_tokens(self, x: torch.Tensor, n_avail: torch.Tensor, refs_hat: torch.Tensor) -> torch.Tensor:
        """Store the codes of tokens x [B, T, d] that see the first n_avail [T] references (the last
        refs_hat.shape[1] of them this write's, refs_hat carrying their gradient); their reconstruction."""
        cfg = self.cfg
        # the search reads the stored bytes (the kernel decodes them in registers): a decode step
        # must not decode, copy or convert the whole reference history
        idx = topk_l2(x.detach(), self.refs, n_avail, cfg.k, ref_format=cfg.ref_format, impl=cfg.kernel_impl)
        mean = self._mean_of_chosen(idx, refs_hat)
        z = self.codec.encode(x, mean).float()
        packed = quantize_pack(z.detach(), cfg.bits, cfg.group_size, impl=cfg.kernel_impl)
        z_hat = z + (dequantize(packed, cfg.bits, cfg.group_size) - z).detach()
        self._codes.append(packed)
        bits = index_bits(self.n_refs)
        if bits > self.idx_bits:
            if self.ref_idx is not None:
                self.ref_idx = pack_indices(self.indices.unpack(), bits, check=False).data  # stored: in range
            self.idx_bits = bits
        self._ref_idx.append(pack_indices(idx, bits, check=False).data)  # topk named one of the n_refs
        return self.codec.decode(z_hat).float() + mean

    def _ref_table(self, b: torch.Tensor, r: torch.Tensor,
                   fresh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode each reference named by the pairs (b, r) once: (table [M, d] float32 in (row, reference)
        order, the table row of each pair). The last R_new stored references are this write's, taken from
        `fresh` [B, R_new, d], which carries the straight-through gradient; the rest come from their bytes."""
        named, key, R = self._mark(b, r)
        rows, slot = named.nonzero().squeeze(1), (torch.cumsum(named, 0) - 1)[key]
        ub, ur = rows // R, rows % R
        if fresh is None:  # a read: every named reference is stored
            return decode_ref(take_rows(self.refs, ub, ur), self.cfg.ref_format), slot
        r_old = self.n_refs - fresh.shape[1]
        old = ur < r_old
        table = torch.empty(rows.numel(), self.refs.shape[-1], device=self.refs.device)
        table[old] = decode_ref(take_rows(self.refs, ub[old], ur[old]), self.cfg.ref_format)
        table[~old] = fresh[ub[~old], ur[~old] - r_old]
        return table, slot

    def _mark(self, b: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(a mark per stored reference [B·R] set where the pairs (b, r) name one, each pair's key into it, R).
        A mark instead of torch.unique: the same ascending rows and inverse, without its sort (4x faster on
        CPU for the ~11K pairs a sparse read at 8K names)."""
        R = max(self.n_refs, 1)
        key = b * R + r
        named = torch.zeros(self.refs.shape[0] * R, dtype=torch.bool, device=key.device)
        named[key] = True
        return named, key, R

    def _count_refs(self, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """How many distinct references the pairs (b, r) name (what `_ref_table` would decode), 0-d on the device."""
        return self._mark(b, r)[0].sum()

    @property
    def refs_decoded(self) -> int:
        """References reads have decoded so far (a host sync on a GPU where the kernel path counted them)."""
        return int(self.refs_count)

    def _mean_of_chosen(self, idx: torch.Tensor, refs_hat: torch.Tensor) -> torch.Tensor:
        """Mean of the references `idx` [B, T, k] (-1 = unused) picked for new tokens, decoding only those
        (each once); the store's last refs_hat.shape[1] references, this write's, are read from `refs_hat`.
        Same rows in the same order as `mean_of_refs` over every reference, so the same bits."""
        B, T, k = idx.shape
        valid = idx >= 0
        rows = torch.arange(B, device=idx.device)[:, None, None].expand_as(idx)
        if not self.n_refs:  # none stored (a SnapKV eviction kept none): nothing to average
            return torch.zeros(B, T, self.refs.shape[-1], device=idx.device)
        if not refs_hat.shape[1]:  # a decode step: decode its B·T·k rows directly
            # (-1 entries, before k references exist, read reference 0 and are left out of the mean)
            table = decode_ref(take_rows(self.refs, rows.reshape(-1), idx.clamp(min=0).reshape(-1)), self.cfg.ref_format)
            slots = torch.arange(B * T * k, device=idx.device).view(1, B * T, k)
            return mean_of_refs(table[None], torch.where(valid.view(1, B * T, k), slots, -1))[0].view(B, T, -1)
        table, slot = self._ref_table(rows[valid], idx[valid], refs_hat)
        local = torch.full_like(idx, -1)
        local[valid] = slot
        return mean_of_refs(table[None], local.reshape(1, B * T, k))[0].reshape(B, T, -1)

    def read(self, rope: Rope | None = None, latent: bool = False):
        """Reconstruct every stored token (after an eviction: every visible one): [B, n, 2·d_k] float32
        pre-RoPE keys ‖ values; with `rope` = (cos, sin [B, n, D] of the tokens' positions, H heads), the
        K, V [B, H, n, D] attention reads, keys rotated (on the kernel, inside the fused reconstruction).

        `latent` (with `rope`): the codes' values come back without the decoder's term, V = the mean of
        their references, and a third item (`Latents`) holds their columns and dequantised latents Z; the
        true values are V + Z W_v^T, which the attention applies after the softmax
        (residualkv.attention.LatentValues). Where the fused kernel decodes the codes, it decodes their
        values too and the Latents are empty: still V + Z W_v^T, without the saving."""
        cfg = self.cfg
        if self.ref_ord is not None:
            return self.read_selected(self.visible_ordinals(), rope, latent)
        if self.grad_history is not None:  # training: nothing decoded, the kept reconstruction is read
            return self.grad_history if rope is None else _rotate_rest(self.grad_history, rope, None)
        if self.n == 0:
            return torch.empty(0)
        like = self._held()
        B, d, dev = like.shape[0], like.shape[-1], like.device
        out = torch.empty(B, self.n, d, device=dev)
        lat = Latents.empty(B, self.codec.dims.d_c, dev) if latent else None
        # tokens go to their columns by index (the schedule's ordinals, kept on the device), not by mask
        _, ref_ord, code_ord = self.schedule.layout(self.n_coded, dev)
        if self.win is not None:
            out[:, self.n_coded :] = self.win.float()
        todo = None  # keys to rotate after the read (None: all of them)
        if self.refs is not None:
            refs = self.decoded_refs()
            self.refs_count = self.refs_count + refs.shape[0] * refs.shape[1]
            out.index_copy_(1, ref_ord, refs)
        if self.codes is not None:
            self.codes_decoded += self.codes.codes.shape[0] * self.codes.codes.shape[1]
            if self._use_kernel():
                C = self.codes.codes.shape[1]
                sel = torch.arange(C, device=dev)[None].expand(B, C)
                code_rope = None if rope is None else (rope[0].index_select(1, code_ord),
                                                       rope[1].index_select(1, code_ord), rope[2])
                kv, fused = self._reconstruct_kernel(sel, code_rope)
                out.index_copy_(1, code_ord, kv)
                if fused:  # the keys left to rotate: references and window, in every row
                    rest = torch.cat([ref_ord, torch.arange(self.n_coded, self.n, device=dev)])
                    todo = (torch.arange(B, device=dev)[:, None] * self.n + rest).reshape(-1)
            else:
                mean = mean_of_refs(refs, self.indices.unpack())
                z = dequantize(self.codes, cfg.bits, cfg.group_size)
                out.index_copy_(1, code_ord, self._decode(z, mean, latent))
                if latent:
                    lat = Latents(code_ord.expand(B, -1), z)
        return _with_latent(out, rope, todo, lat)

    def _decode(self, z: torch.Tensor, mean: torch.Tensor, latent: bool) -> torch.Tensor:
        """Codes' reconstruction from their latents and reference means (torch path); `latent`: the
        values stay the means (the attention adds W_v z, see `read`)."""
        if not latent:
            return self.codec.decode(z).float() + mean
        dk = mean.shape[-1] // 2
        mean[..., :dk] += self.codec.decode(z, keys_only=True).float()
        return mean

    def _use_kernel(self) -> bool:
        return kernel_reads(self.cfg, self.refs)

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
        k, v = reconstruct_selected(self.codes, self.indices, self.refs, self.codec, sel, cos, sin,
                                    bits=cfg.bits, group=cfg.group_size, num_kv_heads=heads, ref_format=cfg.ref_format,
                                    impl=cfg.kernel_impl)
        return torch.cat([flat_heads(k), flat_heads(v)], dim=-1), fused

    # ---- selective reads (OmniKV) and eviction (SnapKV), seed §2.7 ----

    def _schedule_layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_ref [n] bool, reference ordinals [R] long) of the schedule over this store's coded ordinals."""
        return self.schedule.layout(self.n_coded, device)[:2]

    def _locate(self, ordinals: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Coded ordinals [B, S] -> (is_ref [B, S], index into refs where is_ref else into codes).
        `check=False` skips the range and eviction checks (host-device syncs on a GPU) where the ordinals
        are valid by construction (a selection the cache made)."""
        is_ref_of, sched_refs = self._schedule_layout(ordinals.device)
        if check and bool(((ordinals < 0) | (ordinals >= self.n_coded)).any()):
            raise IndexError(f"coded ordinals must lie in [0, {self.n_coded})")
        is_ref = is_ref_of[ordinals]
        if self.ref_ord is None:
            ridx = torch.searchsorted(sched_refs, ordinals)
            cidx = ordinals - ridx  # a code's index = its ordinal minus the references before it
        else:
            ref_ord, code_ord = self.ref_ord.long(), self.code_ord.long()
            ridx = torch.searchsorted(ref_ord, ordinals).clamp(max=max(len(ref_ord) - 1, 0))
            cidx = torch.searchsorted(code_ord, ordinals).clamp(max=max(len(code_ord) - 1, 0))
            if check:
                found = torch.where(is_ref, ref_ord[ridx] if len(ref_ord) else ordinals + 1,
                                    code_ord[cidx] if len(code_ord) else ordinals + 1) == ordinals
                if not bool(found.all()):
                    raise IndexError("asked for a token that SnapKV evicted: eviction is irreversible")
        return is_ref, torch.where(is_ref, ridx, cidx)

    def read_selected(self, ordinals: torch.Tensor, rope: Rope | None = None, latent: bool = False,
                      check: bool = True):
        """Reconstruct only the tokens at `ordinals` [B, S] (each row its own ordinals): selected
        references are read as references; selected codes are dequantised and decoded, and only the
        references their means need are read (each needed reference once). Returns [B, S, 2·d_k]
        float32, equal to the same columns of `read()`; with `rope` (cos, sin [B, S, D], H), K, V
        [B, H, S, D] with the keys rotated, as `read` does (and Z with `latent`, as `read` does).
        `check=False`: the ordinals are valid by construction (the cache's own selections), so the range
        and eviction checks, each a host-device sync on a GPU, are skipped."""
        cfg = self.cfg
        B, S = ordinals.shape
        like = self._held()
        dev = ordinals.device if like is None else like.device
        lat = Latents.empty(B, self.codec.dims.d_c, dev) if latent else None
        if like is None or S == 0:
            out = torch.zeros(B, S, self.codec.dims.d_kv, device=dev)
            return _with_latent(out, rope, None, lat)
        ordinals = ordinals.to(device=dev, dtype=torch.long)
        if check and bool((ordinals >= self.n).any()):
            raise IndexError(f"ordinals must lie in [0, {self.n})")
        is_ref, pos, is_code, order, n_ref, n_code = self._plan(ordinals, check)
        ref_at, win_at, code_at = order[:n_ref], order[n_ref : B * S - n_code], order[B * S - n_code :]
        flat_pos = pos.reshape(-1)
        out = torch.empty(B, S, like.shape[-1], device=dev)
        flat_out = out.view(B * S, -1)
        if win_at.numel():
            w_ord = ordinals.reshape(-1).index_select(0, win_at) - self.n_coded
            flat_out.index_copy_(0, win_at, take_rows(self.win, win_at // S, w_ord).float())
        rb, rp = ref_at // S, flat_pos.index_select(0, ref_at)
        cb, cp = code_at // S, flat_pos.index_select(0, code_at)
        todo = None
        kernel = bool(cb.numel()) and self._use_kernel()
        if rb.numel() or cb.numel():
            # which references are read: the selected ones and those the selected codes average, each
            # once. A code with fewer than k references before it (-1 entries; only where n_sink < k) names
            # reference 0 there, which its mean then leaves out (no mask, so no sync, to list the pairs);
            # where no reference is stored at all (a SnapKV eviction kept none) codes name none
            idx = self.indices.rows(cb, cp) if cb.numel() else cb.new_empty(0, cfg.k)  # [N, k], -1 = unused
            named = idx if self.n_refs else idx[:0]
            pairs = (torch.cat([rb, cb[: named.shape[0], None].expand_as(named).reshape(-1)]),
                     torch.cat([rp, named.clamp(min=0).reshape(-1)]))
            if kernel:  # the kernel decodes the references its codes average: decode the selected ones only
                self.refs_count = self.refs_count + self._count_refs(*pairs)  # on the device: no sync
                flat_out.index_copy_(0, ref_at, decode_ref(take_rows(self.refs, rb, rp), cfg.ref_format))
            else:
                table, slot = self._ref_table(*pairs)
                self.refs_count = self.refs_count + int(table.shape[0])
                flat_out.index_copy_(0, ref_at, table.index_select(0, slot[: rb.numel()]))
        if kernel:
            # per row, its selected codes in order, padded with -1
            rank = (torch.cumsum(is_code, dim=1) - 1).reshape(-1)[code_at]
            # wide enough for the row with the most codes, without asking the device which row that is
            width = min(S, n_code)
            sel = torch.full((B, width), -1, dtype=torch.long, device=dev)
            sel[cb, rank] = cp
            code_rope = None
            if rope is not None:  # cos/sin in the same ragged layout as sel (padding rows: zeros)
                cos = rope[0].new_zeros(B, width, rope[0].shape[-1])
                sin = torch.zeros_like(cos)
                cos[cb, rank] = rope[0].reshape(B * S, -1).index_select(0, code_at)
                sin[cb, rank] = rope[1].reshape(B * S, -1).index_select(0, code_at)
                code_rope = (cos, sin, rope[2])
            kv, fused = self._reconstruct_kernel(sel, code_rope)
            flat_out.index_copy_(0, code_at, kv[cb, rank])
            if fused:  # the keys left to rotate: the selected references and window tokens
                todo = order[: B * S - n_code]
            self.codes_decoded += int(cb.numel())
        elif cb.numel():
            if self.n_refs:
                mean = mean_of_refs(table[None], torch.where(idx >= 0, slot[rb.numel():].view_as(idx), -1)[None])[0]
            else:
                mean = torch.zeros(cb.numel(), like.shape[-1], device=dev)
            z = dequantize(Packed(*(take_rows(t, cb, cp) for t in self.codes)), cfg.bits, cfg.group_size)
            flat_out.index_copy_(0, code_at, self._decode(z, mean, latent))
            if latent:
                lat = _selected_latents(B, S, code_at, z)
            self.codes_decoded += int(cb.numel())
        return _with_latent(out, rope, todo, lat)

    def _plan(self, ordinals: torch.Tensor, check: bool) -> tuple:
        """Where the selected tokens live: (is_ref, index into refs or codes, is_code [B, S]; their flat
        positions sorted references first, window tokens next, codes last; how many references, codes).
        Without an eviction this depends only on the schedule and the token count, which every compressed
        layer shares: a selection the cache made (`check` False) is planned once for the run of sparse
        layers that read it (kept on the schedule until the step ends), so its count, a host-device sync on
        a GPU, is taken once per selection instead of once per layer."""
        shared = not check and self.ref_ord is None
        # an in-place change to the selection bumps its version (inference tensors keep none; the cache never
        # changes a selection it made)
        key = (None if ordinals.is_inference() else ordinals._version, self.n_coded, self.n, ordinals.device)
        kept = self.schedule.selection_plan
        if shared and kept is not None and kept[0] is ordinals and kept[1] == key:
            return kept[2]
        if not self.n_win:  # the usual case (no recent window): every selected token is coded
            is_ref, pos = self._locate(ordinals, check)
            is_code = ~is_ref
        else:
            in_win = ordinals >= self.n_coded
            if self.n_coded:
                is_ref, pos = self._locate(ordinals.clamp(max=self.n_coded - 1), check=False)
                if check and not bool(in_win.all()):
                    self._locate(ordinals[~in_win][None])  # the checks, on the coded ordinals only
                is_ref = is_ref & ~in_win
            else:
                is_ref, pos = torch.zeros_like(in_win), torch.zeros_like(ordinals)
            is_code = ~is_ref & ~in_win
        # flat indices into the B·S selected tokens, for index_select/index_copy_ (each boolean-mask index or
        # assignment would be a host-device sync of its own): one count for the host, then a stable sort
        n_codes = 0 if self.codes is None else self.codes.codes.shape[1]
        visible_refs = self.n_refs - self.hidden_refs
        if self.ref_ord is not None and not check and ordinals.shape == (1, visible_refs + n_codes + self.n_win):
            # SnapKV reading every token it kept (the cache's own distinct ordinals, as many as are visible):
            # the counts are the store's, known on the host
            n_ref, n_code = visible_refs, n_codes
        else:
            n_ref, n_code = torch.stack([is_ref.sum(), is_code.sum()]).tolist()
        order = torch.argsort(is_code.reshape(-1).to(torch.int8) - is_ref.reshape(-1).to(torch.int8), stable=True)
        plan = (is_ref, pos, is_code, order, n_ref, n_code)
        if shared:
            self.schedule.selection_plan = (ordinals, key, plan)  # holds `ordinals`: its identity stays its own
        return plan

    def visible_ordinals(self) -> torch.Tensor:
        """[B, S] ordinals that take part in attention: all of them, or a SnapKV row's survivors."""
        like = self._held()
        if self.ref_ord is None:
            B = like.shape[0] if like is not None else 1
            return torch.arange(self.n, device=like.device if like is not None else None).expand(B, self.n)
        window = torch.arange(self.n_coded, self.n, device=self.ref_ord.device)
        # hidden references sort first as -1 and are sliced off by their count, known on the host (a
        # boolean mask would be a host-device sync at every step)
        vis = torch.cat([torch.where(self.ref_visible, self.ref_ord, -1), self.code_ord]).long().sort().values
        return torch.cat([vis[self.hidden_refs :], window])[None]

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
                s.ref_idx, s.idx_bits = self.ref_idx[b : b + 1].clone(), self.idx_bits
            for name in ("ref_ord", "code_ord", "ref_visible"):
                setattr(s, name, getattr(self, name))
            s.hidden_refs = self.hidden_refs
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
            idx = self.indices.rows(torch.zeros_like(code_pos), code_pos)
            kept_refs[idx[idx >= 0]] = True
            remap = torch.where(kept_refs, torch.cumsum(kept_refs.long(), 0) - 1, -1)
            new_idx = torch.where(idx >= 0, remap[idx.clamp(min=0)], -1)
            if bool((new_idx[idx >= 0] < 0).any()):  # cannot happen: every needed reference is kept
                raise RuntimeError("eviction would leave a code pointing at an evicted reference")
            self.codes = Packed(*(t[:, code_pos] for t in self.codes))
            # fewer references: the indices may need fewer bits
            self.idx_bits = index_bits(int(kept_refs.sum()))
            self.ref_idx = pack_indices(new_idx[None], self.idx_bits).data
        self.refs = self.refs[:, kept_refs]
        self.ref_ord = sched_refs[kept_refs].to(torch.int32)
        self.ref_visible = visible[kept_refs]
        self.code_ord = keep[~is_ref].to(torch.int32)
        self.evicted_refs = R - int(kept_refs.sum())
        self.evicted_codes = C - int(code_pos.numel())
        self.hidden_refs = int(kept_refs.sum() - visible.sum())
        return {"evicted_refs": self.evicted_refs, "evicted_codes": self.evicted_codes, "hidden_refs": self.hidden_refs}

    def nbytes(self) -> dict[str, int]:
        c = self.codes
        out = {
            "references": nbytes_of(self.refs),
            "latent_codes": nbytes_of(c.codes) if c else 0,
            "latent_mins_scales": nbytes_of(c.mins, c.scales) if c else 0,
            "reference_indices": nbytes_of(self.ref_idx),
            "recent_window_fp16": nbytes_of(self.win),
        }
        if self.ref_ord is not None:
            out["eviction_ordinals"] = nbytes_of(self.ref_ord, self.code_ord, self.ref_visible)
        return out

    def spare_bytes(self) -> int:
        return sum(g.spare_bytes() for g in (self._refs, self._codes, self._ref_idx, self._ref_ord, self._code_ord,
                                             self._ref_visible))


class RowStores:
    """One ResidualStore per row of a group, after SnapKV kept different tokens in each row. Every row
    keeps the same number of visible tokens, so their reads stack into one batch."""

    def __init__(self, stores: list[ResidualStore]):
        self.stores = stores

    n = property(lambda self: self.stores[0].n)
    codes_decoded = property(lambda self: sum(s.codes_decoded for s in self.stores))
    refs_count = property(lambda self: sum(s.refs_count for s in self.stores))
    refs_decoded = property(lambda self: int(self.refs_count))
    evicted_refs = property(lambda self: sum(s.evicted_refs for s in self.stores))
    evicted_codes = property(lambda self: sum(s.evicted_codes for s in self.stores))

    def write(self, kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.write(kv[i : i + 1]) for i, s in enumerate(self.stores)])

    def read(self, rope: Rope | None = None, latent: bool = False):
        return _stack([s.read(_row_rope(rope, i), latent) for i, s in enumerate(self.stores)])

    def read_selected(self, ordinals: torch.Tensor, rope: Rope | None = None, latent: bool = False,
                      check: bool = True):
        return _stack([s.read_selected(ordinals[i : i + 1], _row_rope(rope, i), latent, check)
                       for i, s in enumerate(self.stores)])

    def visible_ordinals(self) -> torch.Tensor:
        return torch.cat([s.visible_ordinals() for s in self.stores])

    def nbytes(self) -> dict[str, int]:
        return sum_bytes(s.nbytes() for s in self.stores)

    def spare_bytes(self) -> int:
        return sum(s.spare_bytes() for s in self.stores)


def kivi_value_group(full_group_size: int, head_dim: int) -> int:
    """KIVI values are grouped along head_dim: full_group_size coordinates, or the largest power of two
    below it that divides the head (16 for head_dim 80 or 48: the groups must tile it); a head smaller
    than a group is one group. The accounting reports the extra scales as a gap."""
    if head_dim <= full_group_size:
        return head_dim
    g = full_group_size
    while head_dim % g:
        g //= 2
    return g


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
        return kivi_value_group(self.cfg.full_group_size, head_dim)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # decoded straight into one buffer per half (keys through a transposed view): every step
        # re-decodes the whole history, and on CPU each extra copy of it costs about as much as decoding
        cfg, (B, H, w, D) = self.cfg, self.win_k.shape
        k = self.win_k.new_empty((B, H, self.n, D), dtype=torch.float32)
        v = self.win_v.new_empty((B, H, self.n, self.win_v.shape[-1]), dtype=torch.float32)
        m = self.n - w
        if m:
            g = cfg.full_group_size
            dequantize(self.kq, cfg.full_bits, g, out=k[:, :, :m].unflatten(2, (m // g, g)).transpose(-1, -2))
            dequantize(self.vq, cfg.full_bits, self.value_group(D), out=v[:, :, :m])
        k[:, :, m:] = self.win_k
        v[:, :, m:] = self.win_v
        return k.to(dtype), v.to(dtype)

    def nbytes(self) -> dict[str, int]:
        return {
            "full_layer_codes": nbytes_of(self.kq.codes, self.vq.codes) if self.kq else 0,
            "full_layer_mins_scales": nbytes_of(self.kq.mins, self.kq.scales, self.vq.mins, self.vq.scales) if self.kq else 0,
            "full_layer_window_fp16": nbytes_of(self.win_k, self.win_v),
        }

    def spare_bytes(self) -> int:
        return self._kq.spare_bytes() + self._vq.spare_bytes()


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


def flat_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H·D]"""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def unflat_heads(kv: torch.Tensor, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, _ = kv.shape
    k, v = kv.split(H * D, dim=-1)
    return k.reshape(B, T, H, D).transpose(1, 2), v.reshape(B, T, H, D).transpose(1, 2)


def sum_bytes(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
