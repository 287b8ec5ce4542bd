"""Rotary position embedding: undo it on keys as they arrive, redo it on reconstructed keys.

ResidualKV compares and compresses *pre-RoPE* keys (seed §2.1). transformers hands the cache keys
that are already rotated, so the cache rebuilds the model's own cos/sin (same rotary module, same
positions, rope scaling included) in float32 and applies the inverse. Under a float32 model that is the
model's own rotation exactly; a bf16 model rotates with bf16 tables, so the recovered pre-RoPE key
carries bf16's rounding (~0.3% relative, about what the model's own tables would give). A
reconstructed key is rotated with the position of the token it belongs to, never a reference's.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] (the layout transformers' rotary modules return)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    # x·cos + rotate_half(x)·sin, written half by half so that no rotated copy of x is built: the same
    # products and sums, so the same bits (2x faster on the thousands of keys a sparse read rotates)
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `apply_rope`, including a rope attention scaling a: R(-θ)/a = R(θ)^T / a²."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    xf = x.float()
    out = (xf * cos - rotate_half(xf) * sin) / (cos * cos + sin * sin)
    return out.to(x.dtype)


def _same_key(a: tuple | None, b: tuple) -> bool:
    return a is not None and len(a) == len(b) and all(
        x is y or (type(x) in (int, str) and type(y) is type(x) and x == y) for x, y in zip(a, b))


class RopeTable:
    """The model's rotary embedding as a function of integer positions."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        # every compressed layer of a decode step asks for the same positions (the whole history, or one
        # selection shared by a run of sparse layers): the last answer is kept and handed out again when
        # the positions are the same, instead of rebuilding cos/sin over the history in every layer
        self._last: tuple[tuple | None, torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> "RopeTable":
        base = getattr(model, "model", model)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None:
            raise ValueError(
                f"{type(model).__name__} has no `rotary_emb` module; ResidualKV needs a RoPE model "
                "(Llama, Mistral, Qwen2/3 families). Pass `rope=RopeTable(rotary_module)` explicitly."
            )
        return cls(rotary)

    @classmethod
    def from_config(cls, config) -> "RopeTable":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return cls(LlamaRotaryEmbedding(config))

    @torch.no_grad()
    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] integer -> cos, sin [B, T, D] in `dtype`. Callers must not write into them.
        `key`: a tuple naming these positions by objects that determine them (ints and strings compare
        by value, anything else by identity: a row layout, a selection tensor; kept with the answer, so
        no other object takes their identity meanwhile). The cache's layers name the slots they read,
        and the kept answer is recognised by its key, without comparing positions (a host-device sync on
        a GPU). Without a key, positions are compared."""
        positions = positions.long()
        last = self._last
        if (last is not None and last[2] == dtype and last[1].shape == positions.shape
                and last[1].device == positions.device
                and (_same_key(last[0], key) if key is not None else torch.equal(last[1], positions))):
            return last[3]
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        self.rotary.to(positions.device)
        out = self.rotary(probe, positions)
        self._last = (key, positions.clone(), dtype, out)  # a copy: the caller's tensor may change later
        return out

    def forget(self) -> None:
        """Drop the kept answer. Caches call this once a step's last layer is done: the next step asks
        for other positions, so kept between steps it would only hold cos/sin over the history."""
        self._last = None
