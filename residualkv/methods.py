"""One registry of KV-cache methods, each a small recipe that builds a fresh cache for a model.

Every method is compared against the FP16 full cache on the same model and inputs. Methods that
need a trained codec say so; ResidualKV† needs none (quantised raw residuals, seed Table III).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from transformers import DynamicCache

from .cache import ResidualKVCache
from .codec import ResidualCodec, model_shape
from .config import ResidualKVConfig


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    needs_codec: bool
    build: Callable[..., Any]  # (model, codec, base_config) -> Cache
    overrides: dict[str, Any] = field(default_factory=dict)


def _full(model, codec, base):
    return DynamicCache(config=model.config)


def _kivi(bits: int):
    def build(model, codec, base):
        n_layers = model_shape(model.config)[0]
        cfg = ResidualKVConfig(full_attention_layers=tuple(range(n_layers)), full_bits=bits)
        return ResidualKVCache.from_model(model, None, cfg)
    return build


def _residual(**overrides):
    def build(model, codec, base):
        return ResidualKVCache.from_model(model, codec, codec.config.replace(**overrides) if overrides else codec.config)
    return build


def _dagger(bits: int):
    def build(model, codec, base):
        cfg = base.replace(bits=bits)
        ident = ResidualCodec.for_model(model.config, cfg, d_c=0, d_ff=1, kind="identity")
        return ResidualKVCache.from_model(model, ident, cfg)
    return build


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("full", "FP16 full cache (transformers DynamicCache)", False, _full),
    Method("kivi4", "KIVI-style 4-bit keys per channel / values per token on every layer", False, _kivi(4)),
    Method("kivi2", "KIVI-style 2-bit keys per channel / values per token on every layer", False, _kivi(2)),
    Method("residualkv-dagger", "ResidualKV†: FP8 references + 2-bit raw residuals, no neural codec", False, _dagger(2)),
    Method("residualkv", "ResidualKV standalone, trained codec, INT4 latents", True, _residual(bits=4)),
    Method("residualkv-int2", "ResidualKV standalone, trained codec, INT2 latents", True, _residual(bits=2)),
]}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def build_cache(name: str, model, codec: ResidualCodec | None = None, base: ResidualKVConfig | None = None):
    """A fresh cache for one run of `model` with method `name`.

    `base` is the backbone's default cache config (full layers, schedule) used by codec-free methods.
    """
    method = get_method(name)
    if method.needs_codec and codec is None:
        raise ValueError(f"method {name!r} needs a trained codec: train one with `rkv train --backbone ...` "
                         "or pass --codec PATH_OR_URI")
    if base is None:
        base = codec.config if codec is not None else ResidualKVConfig()
    return method.build(model, codec, base)
