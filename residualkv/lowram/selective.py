"""LowRAM's selective reconstruction (seed 003, "LowRAM-SR", after ShadowKV's landmark retrieval).

A decode step of plain LowRAM rebuilds every prompt key (A B, rotated) and value (f(k) + residuals).
With selective reconstruction the prompt is cut into `sr_chunk`-token chunks; per (row, KV head):

* each chunk's landmark is the mean of its exact post-RoPE keys, so q . landmark is the chunk's mean
  logit for any query;
* the `sr_outliers` chunks whose keys their landmark represents worst (lowest cosine similarity of a
  key to its chunk's mean, ShadowKV's criterion) and the prompt's last `sr_window` tokens (plus the
  tokens that do not fill a chunk) are stored exact in FP16 and always attended;
* at each step the query heads of the KV head score the other chunks by softmax(q . landmark),
  max-pooled over those heads, and only the best ceil(`sr_budget` / `sr_chunk`) chunks are rebuilt
  from A B and f; attention runs over those, the exact chunks, the window and every token written
  after the prompt.

The landmarks and exact tokens are stored bytes, paid inside the ratio: the landmarks and exact keys
from the keys' share (the key rank shrinks; the seed deducts them from the rank, its appendix F), the
exact values from the values' share (fewer residuals; none is spent on a token stored exact). The
landmarks alone are an eighth of the FP16 keys, half the keys' share at 4x (`sr_landmark_bits`, not in
the seed, packs them: in 4 bits they take 16% of the share); the exact chunks weigh less the longer
the prompt. Selection engages only where it would skip something (more chunks than
the exact ones plus the budget) and where both shares can pay for it (cache.selective_bytes); other
prompts are read whole, as plain LowRAM, and the accounting report counts the stores that engaged.
With `sr_reuse` (the seed's persistent buffer) the rebuilt chunks are kept in FP16 between steps and a
step rebuilds only the chunks its selection adds (for every KV head the largest count of any head, so
the rebuild stays one batched call); consecutive steps of SmolLM2 at 8K share ~84% of their chunks.
The buffer is working memory (it can be rebuilt from the stored bytes), reported beside KR, not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import LowRAMConfig
from ..reuse import assign, put
from ..stores import nbytes_of
from .quantised import Quantised, bytes_per_coord, head_group


def window_len(T: int, cfg: LowRAMConfig) -> int:
    """Exact tail of a T-token prompt: `sr_window` tokens plus those that do not fill a chunk."""
    w = min(cfg.sr_window, T)
    return w + (T - w) % cfg.sr_chunk


def engages(T: int, cfg: LowRAMConfig) -> bool:
    """Whether selection over a T-token prompt would skip something: its chunks outnumber the exact ones
    plus the budget (whether the bytes can pay for it is cache.selective_bytes)."""
    if not cfg.selective:
        return False
    n_chunks = (T - window_len(T, cfg)) // cfg.sr_chunk
    return n_chunks > cfg.sr_outliers + chunks_selected(cfg)


def chunks_selected(cfg: LowRAMConfig) -> int:
    return -(-cfg.sr_budget // cfg.sr_chunk)


def tokens_chosen(cfg: LowRAMConfig) -> int:
    """Prompt tokens a selective step chooses and attends per (row, KV head): the chosen chunks, whole
    (without the reuse buffer it rebuilds all of them)."""
    return chunks_selected(cfg) * cfg.sr_chunk


def extra_bytes(T: int, H: int, D: int, cfg: LowRAMConfig) -> tuple[int, int]:
    """Bytes one row of one layer holds for selective reconstruction of a T-token prompt, (keys' side:
    the landmarks, the exact chunks' ids, the exact keys; values' side: the exact values); (0, 0)
    where selection would skip nothing."""
    if not engages(T, cfg):
        return 0, 0
    w = window_len(T, cfg)
    n_chunks = (T - w) // cfg.sr_chunk
    exact = (cfg.sr_outliers * cfg.sr_chunk + w) * H * D * 2
    marks = round(n_chunks * H * D * bytes_per_coord(cfg.sr_landmark_bits, head_group(cfg, D)))
    return marks + cfg.sr_outliers * H * 4 + exact, exact


@dataclass
class Selective:
    """One layer's selective-reconstruction state for one row group [R rows, H KV heads]."""

    chunk: int
    landmarks: Quantised  # [R, H, C, D]: mean post-RoPE key of each chunk, FP16 or sr_landmark_bits
    outliers: torch.Tensor  # [R, H, n_out] int32: chunk ids stored exact, ascending
    out_k: torch.Tensor  # [R, H, n_out · chunk, D] FP16, post-RoPE, token order within each chunk
    out_v: torch.Tensor
    win_k: torch.Tensor  # [R, H, w, D] FP16: the prompt's last w tokens, post-RoPE
    win_v: torch.Tensor
    # sr_reuse: the chunk id each slot holds [R, H, n] and its rebuilt keys, values [R, H, n · chunk, D] FP16
    buffer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    rebuilt: int = 0  # tokens the last step rebuilt per row (every KV head rebuilds as many)

    @classmethod
    def build(cls, k_post: torch.Tensor, v: torch.Tensor, cfg: LowRAMConfig) -> "Selective":
        """From the prompt's exact keys (post-RoPE) and values [R, H, T, D]."""
        R, H, T, D = k_post.shape
        w, c = window_len(T, cfg), cfg.sr_chunk
        chunks = k_post[:, :, : T - w].float().unflatten(2, (-1, c))  # [R, H, C, c, D]
        marks = chunks.mean(dim=3)
        fit = F.cosine_similarity(chunks, marks[:, :, :, None], dim=-1).amin(dim=-1)  # [R, H, C]
        outliers = fit.topk(cfg.sr_outliers, dim=-1, largest=False).indices.sort(dim=-1).values
        tok = chunk_tokens(outliers, c)
        take = lambda x: x.gather(2, tok[..., None].expand(-1, -1, -1, D)).to(torch.float16)  # noqa: E731
        return cls(c, Quantised(marks, cfg.sr_landmark_bits, head_group(cfg, D)), outliers.to(torch.int32),
                   take(k_post), take(v), k_post[:, :, T - w :].to(torch.float16), v[:, :, T - w :].to(torch.float16))

    def exact_tokens(self) -> torch.Tensor:
        """Prompt token ids stored exact [R, H, n_out · chunk + w], in the order of out_k then win_k."""
        R, H, C, _ = self.landmarks.shape
        w = self.win_k.shape[2]
        win = torch.arange(C * self.chunk, C * self.chunk + w, device=self.outliers.device).expand(R, H, w)
        return torch.cat([chunk_tokens(self.outliers.long(), self.chunk), win], dim=2)

    def overwrite(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put the exact tokens into a whole-prompt read k (rotated), v [R, H, T, D] float32, in place."""
        idx = self.exact_tokens()[..., None].expand(-1, -1, -1, k.shape[-1])
        k.scatter_(2, idx, torch.cat([self.out_k, self.win_k], dim=2).float())
        v.scatter_(2, idx, torch.cat([self.out_v, self.win_v], dim=2).float())

    def choose_chunks(self, query: torch.Tensor, n_select: int, scaling: float) -> torch.Tensor:
        """Chunk ids [R, H, n_select] the step's queries [R, Hq, 1, D] want most (softmax over chunks per
        query head, max over the query heads of each KV head), outliers excluded."""
        R, H, C, D = self.landmarks.shape
        q = query.float().reshape(R, H, -1, D) * scaling  # query head j reads KV head j // (Hq / H)
        p = torch.softmax(q @ self.landmarks.read().mT, dim=-1).amax(dim=2)  # [R, H, C]
        p.scatter_(-1, self.outliers.long(), -1.0)
        return p.topk(n_select, dim=-1).indices

    def gather(self, chunks: torch.Tensor, rebuild, reuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, H, n · chunk, D] float32 of the chosen chunks [R, H, n]; `rebuild(token ids)`
        decodes tokens from the stored bytes. With `reuse` they come from the buffer, whose slots keep
        their chunk while it stays chosen: a new chunk is rebuilt into a slot the step freed (as many per
        KV head as the head with most new ones; the others rebuild one of their own in place), so the
        order is the buffer's, not the selection's (attention does not depend on it)."""
        c = self.chunk
        if not reuse or self.buffer is None or self.buffer[0].shape != chunks.shape:
            k, v = rebuild(chunk_tokens(chunks, c))
            self.rebuilt = chunks.shape[-1] * c
            if not reuse:
                return k, v
            self.buffer = (chunks.clone(), k.to(torch.float16).contiguous(), v.to(torch.float16).contiguous())
            return self.buffer[1].float(), self.buffer[2].float()  # every step reads the buffer's FP16
        ids, bk, bv = self.buffer
        new, slots, _ = assign(ids, chunks, self.landmarks.shape[2])
        m = new.shape[-1]
        if m:
            kr, vr = rebuild(chunk_tokens(new, c))
            at = chunk_tokens(slots, c)
            put(bk, at, kr)
            put(bv, at, vr)
        self.rebuilt = m * c
        return bk.float(), bv.float()

    def buffer_bytes(self) -> int:
        return 0 if self.buffer is None else nbytes_of(*self.buffer)

    def nbytes(self) -> dict[str, int]:
        return {"sr_landmarks": self.landmarks.nbytes(),
                "sr_exact_chunks": nbytes_of(self.outliers, self.out_k, self.out_v),
                "sr_exact_window": nbytes_of(self.win_k, self.win_v)}


def chunk_tokens(chunks: torch.Tensor, size: int) -> torch.Tensor:
    """Chunk ids [..., n] -> their token ids [..., n · size], chunk by chunk."""
    return (chunks[..., None] * size + torch.arange(size, device=chunks.device)).flatten(-2)


__all__ = ["Selective", "chunk_tokens", "chunks_selected", "engages", "extra_bytes", "tokens_chosen", "window_len"]
