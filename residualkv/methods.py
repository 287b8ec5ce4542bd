"""One registry of KV-cache methods, each a small recipe that builds a fresh cache for a model.

Every method is compared against the FP16 full cache on the same model and inputs. Methods that
need a trained codec say so; ResidualKV† needs none (quantised raw residuals, seed Table III).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from transformers import DynamicCache

from .cache import OmniKVCache, ResidualKVCache
from .codec import ResidualCodec, model_shape
from .config import InputError, LowRAMConfig, ResidualKVConfig
from .lowram import LowRAMCache
from .snapkv import SnapKVCache


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    needs_codec: bool
    build: Callable[..., Any]  # (model, codec, base_config[, changes]) -> Cache
    learnt_starts: bool = False  # reads `rkv lowram-init`'s saved starts: run only when named
    evicts: bool = False  # a LowRAM method that evicts part of the prompt (LowRAM-E): its keep fraction can vary
    in_default: bool = True  # False: a bare `rkv eval` leaves it out (run only when named)
    # where build_cache's field changes go: "base" (the backbone's ResidualKVConfig, passed as base),
    # "codec" (also handed to build, which applies them over the codec's own config), "lowram" (LowRAMConfig)
    changes: str = "base"


def _full(model, codec, base):
    return DynamicCache(config=model.config)


def _kivi(bits: int):
    def build(model, codec, base):
        n_layers = model_shape(model.config)[0]
        # as KIVI runs: the prompt attends over its exact keys and values, the cache stores them quantised
        cfg = ResidualKVConfig(full_attention_layers=tuple(range(n_layers)), full_bits=bits, new_kv="exact")
        return ResidualKVCache.from_model(model, None, cfg)
    return build


def _residual(name: str, description: str, *, in_default: bool = True, **overrides) -> Method:
    """A trained-codec method: the caller's changes apply over the codec's own config."""
    def build(model, codec, base, changes=None):
        # the codec's own config (it was trained with that schedule), the caller's changes, the method's mode
        return ResidualKVCache.from_model(model, codec, codec.config.replace(**{**(changes or {}), **overrides}))
    return Method(name, description, True, build, in_default=in_default, changes="codec")


def _omnikv(model, codec, base):
    # OmniKV selection on an uncompressed cache: filter layers = the backbone's full-attention layers
    return OmniKVCache.from_model(model, base.replace(mode="omnikv"))


def _dagger(bits: int):
    def build(model, codec, base):
        cfg = base.replace(bits=bits, new_kv="exact")  # untrained: run as a serving engine would
        ident = ResidualCodec.for_model(model.config, cfg, d_c=0, d_ff=1, kind="identity")
        return ResidualKVCache.from_model(model, ident, cfg)
    return build


def _snapkv(ratio: float):
    def build(model, codec, base):
        return SnapKVCache.from_model(model, ratio=ratio, window=32)
    return build


def _lowram(name: str, description: str, *, learnt_starts: bool = False, in_default: bool = True, **fields) -> Method:
    """A LowRAM method (no codec): the caller's changes are LowRAMConfig fields (e.g. fit_steps)."""
    def build(model, codec, base, changes=None):
        return LowRAMCache.from_model(model, LowRAMConfig(**fields).replace(**(changes or {})))
    return Method(name, description, False, build, learnt_starts=learnt_starts, in_default=in_default,
                  evicts=fields.get("evict_keep") is not None, changes="lowram")


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("full", "FP16 full cache (transformers DynamicCache)", False, _full),
    Method("kivi4", "KIVI-style 4-bit keys per channel / values per token on every layer (prefill over exact KV)",
           False, _kivi(4)),
    Method("kivi2", "KIVI-style 2-bit keys per channel / values per token on every layer (prefill over exact KV)",
           False, _kivi(2)),
    Method("residualkv-dagger", "ResidualKV†: FP8 references + 2-bit raw residuals, no neural codec", False, _dagger(2)),
    Method("snapkv", "SnapKV: keep the 20% most-attended prompt tokens (32-token window included) per layer "
           "and KV head, FP16", False, _snapkv(0.2)),
    Method("snapkv-10", "SnapKV keeping 10% of the prompt", False, _snapkv(0.1)),
    Method("omnikv", "OmniKV dynamic selection on the FP16 full cache (no compression, KR = 100%)", False, _omnikv),
    _residual("residualkv", "ResidualKV + OmniKV (default deployment): trained codec, INT4 latents, sparse layers "
              "reconstruct only the tokens the filter layers select", bits=4, mode="omnikv"),
    # reads what residualkv reads (up to FP16 rounding under a float32 model): a decode-speed variant, run when named
    _residual("residualkv-reuse", "ResidualKV + OmniKV as residualkv, the sparse layers keeping their reconstructed "
              "tokens between steps (working memory beside the stored bytes, reported) and decoding only those a "
              "step's selection adds", in_default=False, bits=4, mode="omnikv", select_reuse=True),
    _residual("residualkv-standalone", "ResidualKV standalone: trained codec, INT4 latents, every token reconstructed "
              "(CR = 100%)", bits=4, mode="standalone"),
    _residual("residualkv-snapkv", "ResidualKV + SnapKV: trained codec, INT4 latents, compressed layers keep only "
              "SnapKV's survivors after the prompt plus the references they need (irreversible)",
              bits=4, mode="snapkv"),
    _residual("residualkv-int2", "ResidualKV standalone, trained codec, INT2 latents (a codec trained at "
              "INT4 is then quantised below the grid it learnt: train one with --bits 2 for the seed's INT2 setting)", bits=2, mode="standalone"),
    _lowram("lowram", "LowRAM (seed 003) at 4x: xKV low-rank keys (groups of 4 layers), values from a predictor fitted "
            "to the prompt (150 Adam steps) + FP16 residuals of the worst-predicted tokens; no training"),
    _lowram("lowram-q", "LowRAM-Q at 5x: as lowram, the key basis in 4 bits and the value residuals in 2 bits",
            ratio=5.0, key_bits=4, residual_bits=2),
    _lowram("lowram-sr", "LowRAM-SR at 4x: as lowram, but each decode step rebuilds only the 2048 prompt tokens "
            "(8-token chunks) its query selects by mean-key landmarks; 48 outlier chunks and the last 32 prompt tokens "
            "kept exact, paid from the keys' share of the bytes", selective=True),
    # reads what lowram-sr reads (up to FP16 rounding): a decode-speed variant, run only when named
    _lowram("lowram-sr-reuse", "LowRAM-SR as lowram-sr with the seed's persistent buffer: the rebuilt chunks are kept "
            "(FP16 working memory beside the stored bytes, reported) and a step rebuilds only those its selection adds",
            in_default=False, selective=True, sr_reuse=True),
    _lowram("lowram-sr-l4", "LowRAM-SR as lowram-sr with its landmarks in 4 bits (not in the seed): they take 16% of "
            "the keys' share instead of half, and the rest goes to the key rank", selective=True, sr_landmark_bits=4),
    _lowram("lowram-sr16", "LowRAM-SR at 4x with 16-token chunks and 12 exact chunks: landmarks and exact keys take "
            "about half the keys' share at 4K tokens instead of nine tenths (the seed's settings are for 16K+ prompts)",
            selective=True, sr_chunk=16, sr_outliers=12),
    _lowram("lowram-q-sr16", "LowRAM-Q at 5x with selective reconstruction as lowram-sr16 (with the seed's 8-token "
            "chunks and 48 exact ones, a 4-bit basis at 5x cannot pay for them below ~8K tokens and reads whole)",
            ratio=5.0, key_bits=4, residual_bits=2, selective=True, sr_chunk=16, sr_outliers=12),
    _lowram("lowram-q-sr16-l4", "LowRAM-Q at 5x with selective reconstruction as lowram-sr16 and its landmarks in 4 "
            "bits (not in the seed): the key basis keeps rank 192 of 288 at 4K tokens instead of 96",
            ratio=5.0, key_bits=4, residual_bits=2, selective=True, sr_chunk=16, sr_outliers=12, sr_landmark_bits=4),
    _lowram("lowram-e", "LowRAM-E at 5x: SnapKV keeps half the prompt (one token set per xKV group, by its layers' "
            "and heads' votes), then LowRAM at 2.5x on the kept tokens", evict_keep=0.5, ratio=2.5),
    _lowram("lowram-eq", "LowRAM-EQ at 10x: SnapKV keeps half the prompt as lowram-e, then LowRAM-Q at 5x on the kept "
            "tokens (4-bit basis, 2-bit residuals)", evict_keep=0.5, ratio=5.0, key_bits=4, residual_bits=2),
    _lowram("lowram-warm", "LowRAM at 4x fitted in 150 Adam steps from the warm start of `rkv lowram-init` "
            "(the seed's pipeline: pooled pre-training, then the per-context fit)", learnt_starts=True, start="warm"),
    _lowram("lowram-meta", "LowRAM at 4x fitted in 2 Adam steps from the meta-learned start of `rkv lowram-init` "
            "(the seed's fast prefill)", learnt_starts=True, start="meta", fit_steps=2),
    _lowram("lowram-meta-sr", "LowRAM at 4x fitted in 2 steps from the meta-learned start, with selective "
            "reconstruction: the seed's fast prefill and fast decode together", learnt_starts=True,
            start="meta", fit_steps=2, selective=True),
    _lowram("lowram-q-meta", "LowRAM-Q at 5x fitted in 2 Adam steps from the meta-learned start", learnt_starts=True,
            ratio=5.0, key_bits=4, residual_bits=2, start="meta", fit_steps=2),
]}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def build_cache(name: str, model, codec: ResidualCodec | None = None, base: ResidualKVConfig | None = None,
                **changes: Any):
    """A fresh cache for one run of `model` with method `name`.

    `base` is the backbone's default cache config (full layers, schedule) used by codec-free methods.
    `changes` override single config fields of the built cache (e.g. select_budget=1024, select_ratio=0.2).
    Sparse methods (residualkv, residualkv-snapkv, omnikv) route the model's attention through
    `residualkv.attention` ("residualkv_sparse", which equals SDPA for every other cache).
    """
    method = get_method(name)
    if method.needs_codec and codec is None:
        raise InputError(f"method {name!r} needs a trained codec: train one with `rkv train --backbone ...` "
                         "or pass --codec PATH_OR_URI")
    if base is None:
        base = codec.config if codec is not None else ResidualKVConfig()
    if not changes:
        return method.build(model, codec, base)
    if method.changes == "lowram":
        return method.build(model, codec, base, changes)
    if "mode" in changes:
        raise ValueError("the deployment mode comes with the method name (residualkv = + OmniKV, residualkv-standalone, "
                         "residualkv-snapkv, omnikv); do not pass mode=")
    base = base.replace(**changes)
    if method.changes == "codec":  # codec methods read their config from the codec
        return method.build(model, codec, base, changes)
    return method.build(model, codec, base)
