"""Measured bytes, KR and CR, with the seed's formula beside them (seed §3.3).

KR = bytes of everything the cache holds / bytes of the FP16 full cache for the same real tokens.
Formula: KR = β q_full + (1-β)(ρ_ref·r_ref + q_b d_c / (2 d_k)), q_b = b/16 + 2/g, r_ref = 1/2 for FP8
references (1 for FP16). The formula leaves out reference indices, sink tokens, the FP16 window of
full layers and the per-row positions; `gap` attributes the difference to each of them, and
`unexplained` is what is left (zero when every byte is accounted for).
CR = history tokens that took part in attention / history tokens, averaged over layers.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache

from .cache import KiviLayer, ResidualKVCache, ResidualLayer


def q_bits(bits: int, group: int) -> float:
    """Bytes per coordinate, relative to FP16, of b-bit codes with an FP16 min and scale per group."""
    return bits / 16 + 2 / group


def kr_formula(beta: float, rho_ref: float, bits: int, d_c: int, d_kv: int, *, full_bits: int = 4,
               group: int = 32, full_group: int = 32, ref_format: str = "fp8") -> float:
    ref_ratio = 0.5 if ref_format == "fp8" else 1.0
    return beta * q_bits(full_bits, full_group) + (1 - beta) * (rho_ref * ref_ratio + q_bits(bits, group) * d_c / d_kv)


def report(cache) -> dict[str, Any]:
    """JSON-ready accounting of a filled cache."""
    if isinstance(cache, DynamicCache):
        return _report_dynamic(cache)
    if not isinstance(cache, ResidualKVCache):
        raise TypeError(f"no accounting for {type(cache).__name__}")
    return _report_residual(cache)


def _report_dynamic(cache: DynamicCache) -> dict[str, Any]:
    # The baseline is defined as the FP16 full cache, whatever dtype this run computes in.
    numel = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized)
    fp16 = numel * 2
    return {"kr_measured": 1.0, "kr_formula": 1.0, "cr": 1.0, "cr_per_layer": [1.0] * len(cache.layers),
            "bytes": {"kv_fp16": fp16}, "total_bytes": fp16, "fp16_bytes": fp16, "gap": {}, "unexplained": 0.0}


def _report_residual(cache: ResidualKVCache) -> dict[str, Any]:
    cfg = cache.config
    comp = cache.nbytes()
    total = sum(comp.values())
    fp16 = cache.fp16_bytes()
    n_layers = len(cache.layers)
    n_full = sum(isinstance(layer, KiviLayer) for layer in cache.layers)
    beta = n_full / n_layers
    d_kv = 2 * cache.num_kv_heads * cache.head_dim
    d_c = cache.codec.dims.d_c if cache.codec is not None else d_kv
    sched = cache.rows.schedule
    n_ord = max((cache.rows.n_slots - g.start for g in cache.rows.groups), default=0)
    rho_nominal = (1 / cfg.stride) if cfg.stride_alpha == 0 else (sched.formula_count(n_ord) - min(n_ord, cfg.n_sink)) / max(n_ord, 1)
    formula = kr_formula(beta, rho_nominal, cfg.bits, d_c, d_kv, full_bits=cfg.full_bits, group=cfg.group_size,
                         full_group=cfg.full_group_size, ref_format=cfg.ref_format)
    kr = total / fp16 if fp16 else 0.0

    gap: dict[str, float] = {}
    if fp16:
        gap["reference_indices"] = comp.get("reference_indices", 0) / fp16
        gap["positions"] = comp.get("positions", 0) / fp16
        # FP16 window tokens cost 1.0 instead of q_full
        win = comp.get("full_layer_window_fp16", 0)
        gap["full_layer_window_fp16"] = win * (1 - q_bits(cfg.full_bits, cfg.full_group_size)) / fp16
        # sinks and the integer schedule make the real reference count differ from ρ·n
        n_res = n_layers - n_full
        if n_res:
            ref_ratio = 0.5 if cfg.ref_format == "fp8" else 1.0
            actual_refs = comp.get("references", 0) / (d_kv * (1 if cfg.ref_format == "fp8" else 2))
            valid = cache.rows.valid_tokens() * n_res
            gap["sinks_and_schedule_rounding"] = (actual_refs - rho_nominal * valid) / valid * ref_ratio * (1 - beta) if valid else 0.0
            # reference tokens carry no latent code, the formula charges one to every token
            gap["refs_have_no_code"] = -(actual_refs / valid) * q_bits(cfg.bits, cfg.group_size) * d_c / d_kv * (1 - beta) if valid else 0.0
    unexplained = kr - formula - sum(gap.values())
    per_layer = [layer.tokens_read / layer.tokens_available if layer.tokens_available else 1.0 for layer in cache.layers]
    return {
        "kr_measured": kr,
        "kr_formula": formula,
        "cr": sum(per_layer) / len(per_layer),
        "cr_per_layer": per_layer,
        "bytes": comp,
        "total_bytes": total,
        "fp16_bytes": fp16,
        "gap": gap,
        "unexplained": unexplained,
        "inputs": {"beta": beta, "rho_ref": rho_nominal, "bits": cfg.bits, "d_c": d_c, "d_kv": d_kv,
                   "full_bits": cfg.full_bits, "ref_format": cfg.ref_format, "tokens": cache.rows.valid_tokens(),
                   "layers": n_layers, "full_layers": list(cfg.full_attention_layers)},
    }


def explain(rep: dict[str, Any]) -> str:
    """One paragraph a person can read next to the numbers."""
    lines = [f"measured KR {rep['kr_measured']:.2%} vs formula {rep['kr_formula']:.2%} "
             f"(gap {rep['kr_measured'] - rep['kr_formula']:+.2%}), CR {rep['cr']:.1%}"]
    for k, v in sorted(rep.get("gap", {}).items(), key=lambda kv: -abs(kv[1])):
        lines.append(f"  {k:32s} {v:+.3%}")
    if rep.get("gap"):
        lines.append(f"  {'unexplained':32s} {rep['unexplained']:+.3%}")
    return "\n".join(lines)
