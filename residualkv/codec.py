"""The ResidualKV codec (seed §2.3, §2.5): a SwiGLU encoder that runs once per token at write time,
and a bias-free linear decoder that runs on every read.

    f_c(x) = (swish(x W_c1) ⊙ x W_c2) W_c3          z_i = f_c(kv_i) - f_c(mean_ref_i)
    kv_hat_i = z~_i W_d + mean_ref_i

Note the order: each side is encoded, then subtracted; f_c is non-linear, so this is not f_c(kv - mean_ref).
The "identity" kind is ResidualKV† (quantised raw residuals, no network).

A saved codec is a directory with `codec.safetensors` (weights only) and `codec.json` (dims, cache
config, the backbone's fingerprint, a digest of the K/V weights it was trained on, the weights' sha256),
so it is never attached to the wrong model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import CodecDims, InputError, ResidualKVConfig
from .saved import read_folder, save_folder

FORMAT_VERSION = 1
WEIGHTS = "codec.safetensors"
META = "codec.json"


class CodecError(InputError):
    """A codec cannot be loaded or does not fit the model it is attached to."""


class LayerCodec(nn.Module):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.dims = dims
        if dims.kind == "swiglu":
            self.w_c1 = nn.Linear(dims.d_kv, dims.d_ff, bias=False)
            self.w_c2 = nn.Linear(dims.d_kv, dims.d_ff, bias=False)
            self.w_c3 = nn.Linear(dims.d_ff, dims.d_c, bias=False)
            self.w_d = nn.Linear(dims.d_c, dims.d_kv, bias=False)

    def f_c(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_c3(F.silu(self.w_c1(x)) * self.w_c2(x))

    def encode(self, kv: torch.Tensor, mean_ref: torch.Tensor) -> torch.Tensor:
        if self.dims.kind == "identity":
            return kv - mean_ref
        dtype = self.w_c1.weight.dtype
        return self.f_c(kv.to(dtype)) - self.f_c(mean_ref.to(dtype))

    def decode(self, z: torch.Tensor, keys_only: bool = False) -> torch.Tensor:
        """z [..., d_c] -> residual [..., d_kv] (keys ‖ values), or [..., d_kv/2] keys only."""
        if self.dims.kind == "identity":
            return z[..., : self.dims.d_kv // 2] if keys_only else z
        w = self.w_d.weight[: self.dims.d_kv // 2] if keys_only else self.w_d.weight
        return F.linear(z.to(w.dtype), w)

    @property
    def absorbable(self) -> bool:
        """Whether attention can apply the values' decoder after the softmax (residualkv.attention): the
        decoder is linear, so sum_i p_i (W_v z_i + m_i) = W_v (sum_i p_i z_i) + sum_i p_i m_i, and the
        per-token W_v GEMM becomes one per query head. Not for the identity codec: nothing to save."""
        return self.dims.kind == "swiglu"

    def value_decoder(self) -> torch.Tensor:
        """W_v [d_kv/2, d_c]: the rows of W_d that decode the values (all KV heads, head-major)."""
        return self.w_d.weight[self.dims.d_kv // 2 :]


class ResidualCodec(nn.Module):
    """One LayerCodec per compressed (non full-attention) layer of a backbone.

    Every layer has latent size `dims.d_c` unless `layer_d_c` {layer: d_c} gives it another: the bytes a
    layer's error costs are not the same everywhere, so a budget can be spent unevenly (KR follows the
    mean latent size)."""

    def __init__(self, dims: CodecDims, layer_ids: list[int], config: ResidualKVConfig,
                 backbone: str = "", fingerprint: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 layer_d_c: dict[int, int] | None = None, kv_digest: str = ""):
        super().__init__()
        self.dims = dims
        self.config = config
        self.layer_ids = [int(i) for i in layer_ids]
        self.backbone = backbone
        self.fingerprint = dict(fingerprint or {})
        self.kv_digest = kv_digest  # backbones.kv_digest of the model it was trained on ("" = untrained)
        self.extra = dict(extra or {})
        self.layer_d_c = {int(i): int(d) for i, d in (layer_d_c or {}).items() if int(d) != dims.d_c}
        unknown = sorted(set(self.layer_d_c) - set(self.layer_ids))
        if unknown:
            raise CodecError(f"layer_d_c names layers {unknown} that have no codec (the coded layers are "
                             f"{self.layer_ids}); give latent sizes to coded layers only")
        if self.layer_d_c and dims.kind == "identity":
            raise CodecError("layer_d_c: the identity codec (ResidualKV†) keeps d_c == 2*d_k in every layer")
        self.layers = nn.ModuleDict({str(i): LayerCodec(dataclasses.replace(dims, d_c=self.layer_d_c.get(i, dims.d_c)))
                                     for i in self.layer_ids})

    @property
    def mean_d_c(self) -> float:
        """Latent size averaged over the coded layers: what the bytes follow."""
        return sum(self.layer(i).dims.d_c for i in self.layer_ids) / max(len(self.layer_ids), 1)

    @classmethod
    def for_model(cls, model_config, config: ResidualKVConfig, d_c: int, d_ff: int, kind: str = "swiglu",
                  backbone: str = "", seed: int = 0, layer_d_c: dict[int, int] | None = None) -> "ResidualCodec":
        from .backbones import fingerprint

        n_layers, n_kv, head_dim = model_shape(model_config)
        config.check_model(n_layers)
        d_kv = 2 * n_kv * head_dim
        dims = CodecDims(d_kv=d_kv, d_c=d_kv if kind == "identity" else d_c, d_ff=d_ff, kind=kind)
        layer_ids = config.coded_layers(n_layers)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return cls(dims, layer_ids, config, backbone=backbone, fingerprint=fingerprint(model_config),
                       layer_d_c=layer_d_c)

    def layer(self, layer_idx: int) -> LayerCodec:
        return self.layers[str(layer_idx)]

    def meta(self) -> dict[str, Any]:
        from .backbones import fingerprint_hash

        return {
            "format_version": FORMAT_VERSION,
            "backbone": self.backbone,
            "fingerprint": self.fingerprint,
            "fingerprint_hash": fingerprint_hash(self.fingerprint) if self.fingerprint else "",
            "kv_digest": self.kv_digest,
            "dims": {"d_kv": self.dims.d_kv, "d_c": self.dims.d_c, "d_ff": self.dims.d_ff, "kind": self.dims.kind},
            "layer_ids": self.layer_ids,
            "layer_d_c": {str(i): d for i, d in sorted(self.layer_d_c.items())},
            "cache_config": self.config.to_dict(),
            "extra": self.extra,
        }

    def save(self, directory: str | Path) -> Path:
        """Write weights and metadata atomically: a reader sees the old codec or the new one, never half."""
        return save_folder(directory, self.state_dict(), self.meta(), weights=WEIGHTS, meta_name=META,
                           tag="residualkv-codec")

    @classmethod
    def load(cls, directory: str | Path, model_config=None) -> "ResidualCodec":
        meta, state = read_folder(directory, weights=WEIGHTS, meta_name=META, format_version=FORMAT_VERSION,
                                  what="codec", fix="re-download or re-train it", error=CodecError)
        dims = CodecDims(**meta["dims"])
        codec = cls(dims, meta["layer_ids"], ResidualKVConfig.from_dict(meta["cache_config"]),
                    backbone=meta.get("backbone", ""), fingerprint=meta.get("fingerprint"), extra=meta.get("extra"),
                    layer_d_c={int(i): d for i, d in meta.get("layer_d_c", {}).items()},
                    kv_digest=meta.get("kv_digest", ""))
        codec.load_state_dict(state)
        if model_config is not None:
            codec.check_compatible(model_config)
        return codec

    def weights_digest(self) -> str:
        """sha256 over the weights (names, dtypes, shapes, bytes): the same digest wherever they came from."""
        h = hashlib.sha256()
        for name, t in self.state_dict().items():
            t = t.detach().contiguous().cpu()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def check_shape(self, source: str, spell=lambda field: field, layer_d_c=None, **asked) -> None:
        """Refuse settings that ask this (starting) codec for another shape: training goes on from its
        weights, so a d_c, d_ff, stride or bits it does not have would be recorded but never trained, and
        per-layer sizes (`layer_d_c`, specs as `rkv train --layer-d-c`) are never asked of it at all.
        `spell` names a field the way the caller's user wrote it (a CLI flag, a profile key)."""
        if layer_d_c:
            sizes = self.layer_d_c or f"d_c {self.dims.d_c} everywhere"
            raise CodecError(f"{spell('layer_d_c')}: the codec in {source} keeps its latent sizes ({sizes}); "
                             f"drop {spell('layer_d_c')} or train a fresh codec")
        have = {"d_c": self.dims.d_c, "d_ff": self.dims.d_ff, "stride": self.config.stride, "bits": self.config.bits}
        for field, value in asked.items():
            if value is not None and int(value) != have[field]:
                raise CodecError(f"{spell(field)} {value} but the codec in {source} has {field} {have[field]}; "
                                 f"drop {spell(field)} (a codec keeps its shape) or train a fresh codec")

    def check_weights(self, model) -> None:
        """Refuse a model of the right shape but other weights than the codec was trained on (the base
        model for an instruct codec, a fine-tune): its keys and values are not the ones it learnt to code."""
        from .backbones import kv_digest

        if not self.kv_digest and "training" in self.extra:  # trained before codecs recorded the digest
            warnings.warn(f"this codec ({self.backbone or 'unnamed'}) records no digest of the K/V weights it was "
                          "trained on, so it cannot be checked against this model's weights; retrain it (or "
                          "`rkv train --init-from` it) to record one", stacklevel=3)
        if self.kv_digest and self.kv_digest != kv_digest(model):
            raise CodecError(f"this codec was trained on {self.backbone or 'another model'}'s weights, and this model's "
                             "K/V projections differ (same shape, other weights: a base model, a fine-tune); load the "
                             "model it was trained on, or train a codec for this one (`rkv train --init-from` "
                             "starts from this codec)")

    def check_compatible(self, model_config) -> None:
        from .backbones import fingerprint

        if not self.fingerprint:
            return
        theirs = fingerprint(model_config)
        diff = {k: (self.fingerprint.get(k), theirs.get(k)) for k in set(self.fingerprint) | set(theirs)
                if self.fingerprint.get(k) != theirs.get(k)}
        if diff:
            details = ", ".join(f"{k}: codec {a!r} vs model {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CodecError(f"this codec was trained for backbone {self.backbone or '?'} and does not fit this model "
                             f"({details}); load the model it was trained for or train a codec for this one")


def parse_layers(text: str, layer_ids: list[int] | None = None, where: str = "layers") -> list[int]:
    """"3-7,9" -> [3, 4, 5, 6, 7, 9]. With `layer_ids` (the coded layers), a range keeps the coded layers
    inside it (full-attention layers have no codec and are skipped) and a single layer must be a coded one."""
    coded, out = (None if layer_ids is None else set(layer_ids)), []
    for part in filter(None, text.split(",")):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise CodecError(f"{where}: {part!r} is not a layer or a range such as 3-11")
        ids = list(range(int(lo), int(hi if dash else lo) + 1))
        if coded is not None:
            if not dash and ids[0] not in coded:
                raise CodecError(f"{where}: layer {lo} has no codec (the coded layers are {sorted(coded)})")
            ids = [i for i in ids if i in coded]
        out += ids
    return out


def parse_layer_d_c(specs: list[str], layer_ids: list[int], flag: str = "--layer-d-c") -> dict[int, int]:
    """["3-7,9=224", "21-29=128"] -> {layer: d_c} over the coded layers `layer_ids` (see parse_layers)."""
    out = {}
    for spec in specs:
        layers, sep, size = spec.partition("=")
        if not sep or not size.strip().isdigit() or int(size) <= 0:
            raise CodecError(f"{flag} {spec!r}: write LAYERS=D_C, e.g. {flag} 3-11=224 (layer ranges, comma-separated)")
        out.update(dict.fromkeys(parse_layers(layers, layer_ids, f"{flag} {spec!r}"), int(size)))
    return out


def model_shape(model_config) -> tuple[int, int, int]:
    n_layers = model_config.num_hidden_layers
    n_heads = model_config.num_attention_heads
    n_kv = getattr(model_config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // n_heads
    return n_layers, n_kv, head_dim
