"""Typed configuration of the compressed cache: one table of names and defaults, validated up front.

Defaults follow the ResidualKV paper and the authors' public code (SPEC §2): stride 10 (reference
density ~10%), k = 4 references averaged, 4-bit latents in groups of 32 with FP16 min/scale, FP8
references, KIVI 4-bit full-attention layers with a 32-token FP16 residual window, 8 sink tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_BITS = (2, 4, 8)
REF_FORMATS = ("fp8", "fp16")
MODES = ("standalone", "omnikv", "snapkv")
NEW_KV = ("exact", "reconstructed")
KERNEL_IMPLS = ("auto", "torch", "triton")


class InputError(ValueError):
    """Bad input from whoever called: a setting, a file, a name. The message names it and the fix, so the
    command line prints the message alone (`rkv` exits 2), without a traceback. Each area raises its own
    subclass (ConfigError, CodecError, TrainError, DataError, ...)."""


class ConfigError(InputError):
    """A configuration value is invalid; the message names the field and how to fix it."""


@dataclass(frozen=True)
class ResidualKVConfig:
    """Everything that decides how a ResidualKV cache stores and reconstructs tokens."""

    full_attention_layers: tuple[int, ...] = ()
    # reference schedule
    n_sink: int = 8
    stride: int = 10
    stride_alpha: float = 0.0
    ref_format: str = "fp8"
    # retrieval
    k: int = 4
    # latent quantisation
    bits: int = 4
    group_size: int = 32
    # full-attention layers (KIVI-style)
    full_bits: int = 4
    full_group_size: int = 32
    full_window: int = 32
    # compressed layers: the newest recent_window tokens are held exact in FP16 and coded as they leave
    # the window (as KIVI holds its newest tokens). 0 = code every token on write, as the paper does.
    # A serving setting: codecs train with 0. The newest tokens carry much of retrieval (BENCHMARKS.md)
    recent_window: int = 0
    # how sparse layers read history (seed §2.7): "standalone" reconstructs every token (CR = 100%);
    # "omnikv" lets the full-attention (filter) layers pick the tokens the following layers reconstruct
    # at each decode step; "snapkv" evicts compressed layers' tokens once, after the prompt (irreversible)
    mode: str = "standalone"
    # token selection, shared by "omnikv" (per decode step) and "snapkv" (survivors at eviction): the
    # `select_budget` best-scored tokens (or ceil(select_ratio x the row's history) when select_ratio is
    # set), always plus the n_sink first tokens and the newest n_recent ("omnikv") or snapkv_window
    # ("snapkv") tokens. Authors' defaults: 2048 tokens, 8 sinks, 128 recent, raw q.k scores. For
    # "snapkv", select_ratio is the fraction of the prompt kept in all (as the SnapKV baseline's ratio)
    select_budget: int = 2048
    select_ratio: float | None = None
    n_recent: int = 128
    select_pool: int = 1  # max-pool width over token scores (authors' pool_kernel_size, 1 = none)
    # "omnikv": keep the sparse layers' reconstructed tokens between decode steps and reconstruct only the
    # ones a step's I_t adds (residualkv/reuse.py); the same attention, fewer decodes, more working memory
    # (reported as working_vs_fp16, outside KR). Not in the seed.
    select_reuse: bool = False
    snapkv_window: int = 32  # SnapKV observation window: the last prompt tokens whose queries vote
    snapkv_pool: int = 5  # SnapKV average-pool width over the votes (as residualkv.snapkv / kvpress)
    # what attention reads for the tokens a forward call writes (a prompt in prefill, the new token in
    # decode): "reconstructed", what the cache stores for them, as the codec is trained (L_ntp reads
    # reconstructions everywhere), or "exact", their own keys and values, as a serving engine's prefill
    # attends over the fresh chunk and only stores it (how KIVI and ResidualKV† run in the harness).
    # A codec is served the way it was trained: under "exact" the trained SmolLM2 codec kept 0.16 of
    # the full cache's synthetic score at 4K where it keeps 0.66-0.75 read as trained (BENCHMARKS.md)
    new_kv: str = "reconstructed"
    # which implementation runs the hot paths (top-k retrieval, quantise-and-pack, code reconstruction):
    # "auto" = the Triton kernels of `kernels/` on CUDA tensors, the torch code elsewhere; "torch" always
    # the torch code; "triton" always the kernels (on CPU only under TRITON_INTERPRET=1, for tests)
    kernel_impl: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_attention_layers", tuple(int(i) for i in self.full_attention_layers))
        _check(self.n_sink >= 0, "n_sink", self.n_sink, "use 0 or more sink tokens (paper default 8)")
        _check(self.stride >= 1, "stride", self.stride, "use a stride of at least 1 (paper default 10)")
        _check(self.stride_alpha >= 0, "stride_alpha", self.stride_alpha, "use 0 for a fixed stride or a small positive growth such as 0.001")
        _check(self.ref_format in REF_FORMATS, "ref_format", self.ref_format, f"choose one of {REF_FORMATS}")
        _check(self.k >= 1, "k", self.k, "average at least one reference (paper default 4)")
        _check(self.bits in SUPPORTED_BITS, "bits", self.bits, f"choose one of {SUPPORTED_BITS}")
        _check(self.full_bits in SUPPORTED_BITS, "full_bits", self.full_bits, f"choose one of {SUPPORTED_BITS}")
        for name in ("group_size", "full_group_size"):
            g = getattr(self, name)
            _check(g >= 8 and g % 8 == 0, name, g, "use a positive multiple of 8 (paper default 32) so groups pack into whole bytes")
        _check(self.full_window >= self.full_group_size, "full_window", self.full_window,
               f"hold at least one quantisation group (full_group_size={self.full_group_size}) of FP16 recent tokens")
        _check(self.recent_window >= 0, "recent_window", self.recent_window,
               "use 0 (code every token, the paper) or a positive number of FP16 recent tokens such as 64")
        _check(self.kernel_impl in KERNEL_IMPLS, "kernel_impl", self.kernel_impl, f"choose one of {KERNEL_IMPLS}")
        _check(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}")
        _check(self.new_kv in NEW_KV, "new_kv", self.new_kv, f"choose one of {NEW_KV}")
        _check(self.select_budget >= 0, "select_budget", self.select_budget, "use 0 or more tokens (authors' default 2048)")
        _check(self.select_ratio is None or 0.0 <= self.select_ratio <= 1.0, "select_ratio", self.select_ratio,
               "use None (token budget) or a fraction of the history in [0, 1]")
        _check(self.n_recent >= 0, "n_recent", self.n_recent, "use 0 or more recent tokens (authors' default 128)")
        for name in ("select_pool", "snapkv_pool"):
            w = getattr(self, name)
            _check(w >= 1 and w % 2 == 1, name, w, "use an odd pooling width of at least 1")
        _check(isinstance(self.select_reuse, bool), "select_reuse", self.select_reuse, "use True or False")
        _check(self.snapkv_window >= 1, "snapkv_window", self.snapkv_window, "use at least one observation query (SnapKV default 32)")
        _check(len(set(self.full_attention_layers)) == len(self.full_attention_layers), "full_attention_layers",
               self.full_attention_layers, "list each layer id once")

    def replace(self, **changes: Any) -> "ResidualKVConfig":
        return _replace(self, changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ResidualKVConfig":
        unknown = set(data) - set(cls.field_names())
        if unknown:
            raise ConfigError(f"unknown ResidualKVConfig field(s) {sorted(unknown)}; known: {cls.field_names()}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        return d

    def check_model(self, num_layers: int) -> None:
        bad = [i for i in self.full_attention_layers if not 0 <= i < num_layers]
        _check(not bad, "full_attention_layers", bad, f"layer ids must lie in [0, {num_layers})")

    def coded_layers(self, num_layers: int) -> list[int]:
        """The layers a codec compresses: all but the full-attention (KIVI) ones."""
        return [i for i in range(num_layers) if i not in self.full_attention_layers]


PREDICTOR_STARTS = ("slim", "warm", "meta")


@dataclass(frozen=True)
class LowRAMConfig:
    """LowRAM, the second method (seed 003): keys in a cross-layer low-rank basis (xKV), values amortised by
    a predictor fitted to the context at prefill, plus residuals for the worst-predicted tokens. No training
    run: everything is fitted per context. Tokens written after the prompt are kept exact in FP16 (the seed)."""

    # target compression over the FP16 cache: the keys' factors and the values' predictor + residuals each
    # get 1/ratio of their FP16 bytes; the key rank and the residual count are solved from it per context
    ratio: float = 4.0
    layer_group: int = 4  # G adjacent layers share one key basis (xKV)
    fit_steps: int = 150  # Adam steps per layer (seed: 150-300; 2 from the meta-learned start)
    lr: float = 1e-3
    # where each context's fit starts: "slim" (W_K^+ W_V, nothing learnt offline), or a start learnt once
    # per backbone by `rkv lowram-init`: "warm" (pre-trained on pooled contexts) or "meta" (FOMAML, for
    # 2-step fits); starts_path is its folder, None = the newest saved for the model under the data dir
    start: str = "slim"
    starts_path: str | None = None
    hidden_factor: float = 1.0  # predictor hidden width / head_dim (seed: gamma = 1)
    # LowRAM-Q: the key basis A in key_bits and the value residuals in residual_bits (None = FP16), groups
    # of group_size coordinates with an FP16 minimum and scale (residualkv.quant)
    key_bits: int | None = None
    residual_bits: int | None = None
    group_size: int = 32
    oversample: int = 8  # randomised range finder: extra columns and power iterations
    power_iters: int = 1
    # LowRAM-SR, selective reconstruction (seed: 8-token chunks with mean-key landmarks, 48 outlier chunks and
    # the last 32 tokens exact, the best chunks up to 2048 tokens rebuilt per decode step; lowram/selective.py)
    selective: bool = False
    sr_chunk: int = 8
    sr_budget: int = 2048
    sr_outliers: int = 48
    sr_window: int = 32
    # landmarks in sr_landmark_bits (groups as the residuals'), None = FP16 as the seed: a landmark only ranks
    # chunks, and in FP16 the landmarks alone take half the keys' share at 4x
    sr_landmark_bits: int | None = None
    # the seed's persistent buffer: keep the rebuilt chunks (FP16) and rebuild only those the next step's
    # selection adds. Working memory beside the stored bytes (sr_budget tokens per layer, row and KV head),
    # reported by the accounting, not in KR; decode reads the same values either way (up to FP16 rounding)
    sr_reuse: bool = False
    # LowRAM-E: before the prompt is factorised, keep only evict_keep of its tokens (None = keep all), chosen
    # by SnapKV's votes (the last evict_window queries' attention, average-pooled over evict_pool tokens); an
    # xKV group shares its key basis A row by row, so its layers and heads keep one token set: the best by the
    # max over them. The ratio then applies to the kept tokens (overall about ratio / evict_keep)
    evict_keep: float | None = None
    evict_window: int = 32
    evict_pool: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.ratio > 1.0, "ratio", self.ratio, "use a compression ratio above 1 (seed: 3-4, LowRAM-Q 4.8-6.4)")
        _check(self.layer_group >= 1, "layer_group", self.layer_group, "group at least one layer (xKV: 2-4)")
        _check(self.fit_steps >= 0, "fit_steps", self.fit_steps, "use 0 or more Adam steps (seed: 150-300)")
        _check(self.lr > 0, "lr", self.lr, "use a positive learning rate (seed: 1e-3)")
        _check(self.start in PREDICTOR_STARTS, "start", self.start, f"choose one of {PREDICTOR_STARTS}")
        _check(self.starts_path is None or self.start != "slim", "starts_path", self.starts_path,
               "saved starts are read only with start='warm' or 'meta'; drop starts_path or set start")
        _check(self.hidden_factor > 0, "hidden_factor", self.hidden_factor, "use a positive width factor (seed: 1)")
        for name in ("key_bits", "residual_bits", "sr_landmark_bits"):
            b = getattr(self, name)
            _check(b is None or b in SUPPORTED_BITS, name, b, f"use None (FP16) or one of {SUPPORTED_BITS}")
        _check(self.group_size >= 8 and self.group_size % 8 == 0, "group_size", self.group_size,
               "use a positive multiple of 8 (default 32) so groups pack into whole bytes")
        _check(self.oversample >= 0, "oversample", self.oversample, "use 0 or more extra columns (default 8)")
        _check(self.power_iters >= 0, "power_iters", self.power_iters, "use 0 or more power iterations (default 1)")
        _check(self.sr_chunk >= 1, "sr_chunk", self.sr_chunk, "use chunks of 1 or more tokens (seed: 8)")
        _check(self.sr_budget >= 1, "sr_budget", self.sr_budget, "rebuild 1 or more tokens per step (seed: 2048)")
        _check(self.sr_outliers >= 0, "sr_outliers", self.sr_outliers, "keep 0 or more exact chunks (seed: 48)")
        _check(self.sr_window >= 0, "sr_window", self.sr_window, "keep 0 or more recent prompt tokens exact (seed: 32)")
        _check(isinstance(self.sr_reuse, bool), "sr_reuse", self.sr_reuse, "use True or False")
        _check(not self.sr_reuse or self.selective, "sr_reuse", self.sr_reuse,
               "the reuse buffer belongs to selective reconstruction: set selective=True too, or drop sr_reuse")
        _check(self.evict_keep is None or 0 < self.evict_keep <= 1, "evict_keep", self.evict_keep,
               "keep a fraction of the prompt in (0, 1] (e.g. 0.5), or None for no eviction")
        _check(self.evict_window >= 1, "evict_window", self.evict_window, "observe with 1 or more queries (SnapKV: 32)")
        _check(self.evict_pool >= 1 and self.evict_pool % 2 == 1, "evict_pool", self.evict_pool,
               "use an odd pooling width of 1 or more (SnapKV: 5)")

    def replace(self, **changes: Any) -> "LowRAMConfig":
        return _replace(self, changes)


@dataclass(frozen=True)
class CodecDims:
    """Shapes of a per-layer codec: input 2·d_k (all KV heads' key and value), latent d_c, SwiGLU width d_ff."""

    d_kv: int  # 2 * d_k
    d_c: int
    d_ff: int
    kind: str = "swiglu"  # "swiglu" (the paper's codec) or "identity" (ResidualKV†: raw residuals, no network)

    def __post_init__(self) -> None:
        _check(self.kind in ("swiglu", "identity"), "kind", self.kind, "choose 'swiglu' or 'identity'")
        if self.kind == "identity":
            _check(self.d_c == self.d_kv, "d_c", self.d_c, f"the identity codec keeps d_c == 2*d_k == {self.d_kv}")
        for name in ("d_kv", "d_c", "d_ff"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "use a positive size")


def check_group_size(group_size: int, latent_sizes, label: str = "group_size=") -> None:
    """Latents are quantised in whole groups: refuse a group size that does not divide every latent size
    (`label` names the setting as the caller's user wrote it, e.g. "--group-size ")."""
    bad = sorted({int(d) for d in latent_sizes if d % group_size})
    if bad:
        options = " or ".join(map(str, sorted({math.gcd(bad[0], 32), bad[0]})))
        raise ConfigError(f"{label}{group_size} does not divide the latent size d_c {bad}: choose a group size "
                          f"that divides d_c (for d_c {bad[0]}: {options})")


def _replace(cfg, changes: dict[str, Any]):
    """A copy of the frozen config `cfg` with `changes`; unknown field names are refused by name."""
    known = [f.name for f in dataclasses.fields(cfg)]
    unknown = set(changes) - set(known)
    if unknown:
        raise ConfigError(f"unknown {type(cfg).__name__} field(s) {sorted(unknown)}; known: {known}")
    return dataclasses.replace(cfg, **changes)


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {name}={value!r}: {fix}")


def load_codec_defaults(spec_codec: dict[str, Any], full_attention_layers: list[int]) -> ResidualKVConfig:
    """Build a cache config from a backbone YAML's `codec:` block (unknown keys are codec sizes, not cache fields)."""
    cache_keys = set(ResidualKVConfig.field_names())
    kw = {k: v for k, v in spec_codec.items() if k in cache_keys}
    return ResidualKVConfig(full_attention_layers=tuple(full_attention_layers), **kw)


__all__ = ["InputError", "ConfigError", "ResidualKVConfig", "LowRAMConfig", "CodecDims", "check_group_size",
           "load_codec_defaults"]
