"""Measured bytes, KR and CR, with the seed's formula beside them (seed §3.3).

KR = bytes of everything the cache holds / bytes of the FP16 full cache for the same real tokens.
Formula: KR = β q_full + (1-β)(ρ_ref·r_ref + q_b d_c / (2 d_k)), q_b = b/16 + 2/g, r_ref = 1/2 for FP8
references (1 for FP16). The formula leaves out reference indices, sink tokens, the FP16 window of
full layers and the per-row positions; `gap` attributes the difference to each of them, and
`unexplained` is what is left (zero when every byte is accounted for).
Stores grow in place into spare capacity (residualkv.growing): `spare_bytes` is that capacity, memory
that holds no data yet, and `kr_allocated` counts it too; KR does not. `working_vs_fp16` is memory
kept between decode steps that can be rebuilt from the stored bytes (the reuse buffers of LowRAM-SR and
of ResidualKV + OmniKV with select_reuse, residualkv/reuse.py), / FP16 cache bytes; KR does not count
it either. `bookkeeping_bytes` is what the cache holds that its config and batch layout determine (each row
group's row indices, the reference schedule's ordinals): not in KR. `held_bytes` is every byte of tensor
memory the cache holds: stored (in the dtype kept, where dense tokens of a float32 model are charged as
FP16) + spare + working + bookkeeping; tests/test_memory.py checks it against the allocator.
CR = history tokens that took part in attention / history tokens, averaged over layers, measured over
decode steps (one new token per row; prefill attends densely in every mode) from what the attention
path really read. With filter (full-attention) layers a fraction β of the layers, CR = β + (1-β)·r,
r = the sparse layers' measured fraction (seed §3.3); `cr_formula` puts the selection's nominal r there.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache

from .cache import KiviLayer, OmniKVCache, ResidualKVCache, ResidualLayer
from .stores import kivi_value_group, nbytes_of


def q_bits(bits: int, group: int) -> float:
    """Bytes per coordinate, relative to FP16, of b-bit codes with an FP16 min and scale per group."""
    return bits / 16 + 2 / group


def kr_formula(beta: float, rho_ref: float, bits: int, d_c: int, d_kv: int, *, full_bits: int = 4,
               group: int = 32, full_group: int = 32, ref_format: str = "fp8") -> float:
    ref_ratio = 0.5 if ref_format == "fp8" else 1.0
    return beta * q_bits(full_bits, full_group) + (1 - beta) * (rho_ref * ref_ratio + q_bits(bits, group) * d_c / d_kv)


def report(cache) -> dict[str, Any]:
    """JSON-ready accounting of a filled cache."""
    from .lowram import LowRAMCache
    from .snapkv import SnapKVCache, snapkv_report

    if isinstance(cache, SnapKVCache):
        return snapkv_report(cache)
    if isinstance(cache, DynamicCache):
        return _report_dynamic(cache)
    if isinstance(cache, OmniKVCache):
        return _report_omnikv(cache)
    if isinstance(cache, LowRAMCache):
        return _report_lowram(cache)
    if not isinstance(cache, ResidualKVCache):
        raise TypeError(f"no accounting for {type(cache).__name__}")
    return _report_residual(cache)


def _nominal_read(cfg, n: int) -> int:
    """History tokens the selection is meant to read for a row with n history tokens."""
    if cfg.mode != "omnikv":
        return n
    from .attention import token_budget

    forced = min(n, cfg.n_sink + max(cfg.n_recent, cfg.recent_window))  # the FP16 window is always read
    return min(n, forced + token_budget(cfg, n))


def _cr_per_layer(layers) -> list[float]:
    """History tokens each layer's attention read / history tokens, over the decode steps."""
    return [layer.tokens_read / layer.tokens_available if layer.tokens_available else 1.0 for layer in layers]


def _per_step(layers, steps: int, *fields: int) -> list[int]:
    """Sum over layers of the given decode_log fields, one entry per decode step."""
    return [sum(layer.decode_log[t][f] for layer in layers for f in fields) for t in range(steps)]


def _sparse_report(cache) -> dict[str, Any]:
    """CR and what the attention path read, per layer and per decode step (see module docstring)."""
    cfg, layers = cache.config, cache.layers
    n_layers = len(layers)
    filters = set(cfg.full_attention_layers)
    per_layer = _cr_per_layer(layers)
    sparse_ids = [i for i in range(n_layers) if i not in filters]
    beta = len(filters) / n_layers
    r = sum(per_layer[i] for i in sparse_ids) / len(sparse_ids) if sparse_ids else 1.0
    steps = min((len(layer.decode_log) for layer in layers), default=0)
    # nominal r: what the selection should read given each step's history. Layers before the first
    # choosing filter layer read everything (nothing has been chosen yet in that step).
    first_chooser = min((i for i in filters if i + 1 < n_layers and i + 1 not in filters), default=n_layers)
    rows = cache.rows
    hist = nominal = 0
    for t in range(steps):
        for g in rows.groups:
            h_row = max(rows.n_slots - (steps - t) - g.start, 0)
            hist += int(g.rows.numel()) * h_row
            nominal += int(g.rows.numel()) * _nominal_read(cfg, h_row)
    r_sel = nominal / hist if hist else 1.0
    r_nominal = (sum(r_sel if i > first_chooser else 1.0 for i in sparse_ids) / len(sparse_ids)) if sparse_ids else 1.0
    if cfg.mode == "snapkv":  # survivors are chosen once, from the prompt: no per-step nominal
        r_nominal = r
    rec_layer = {str(i): {"history": sum(e[0] for e in layer.decode_log[:steps]) / steps,
                          "attended": sum(e[1] for e in layer.decode_log[:steps]) / steps,
                          "codes_decoded": sum(e[2] for e in layer.decode_log[:steps]) / steps,
                          "refs_read": sum(e[3] for e in layer.decode_log[:steps]) / steps}
                 for i, layer in enumerate(layers)} if steps else {}
    evicted = getattr(cache.sparse, "evicted", {}) if getattr(cache, "sparse", None) is not None else {}
    return {
        "mode": cfg.mode,
        "cr": sum(per_layer) / n_layers,
        "cr_per_layer": per_layer,
        "cr_formula": beta + (1 - beta) * r_nominal,
        "cr_scope": "decode steps (one new token per row); prefill attends densely",
        "cr_inputs": {"beta": beta, "r_measured": r, "r_nominal": r_nominal, "filter_layers": sorted(filters),
                      "select_budget": cfg.select_budget, "select_ratio": cfg.select_ratio,
                      "n_sink": cfg.n_sink, "n_recent": cfg.n_recent},
        "decode_steps": steps,
        "history_tokens_per_step": _per_step(layers, steps, 0),
        "tokens_attended_per_step": _per_step(layers, steps, 1),
        "tokens_reconstructed_per_step": _per_step(layers, steps, 2, 3),
        "reconstruction_per_layer_per_step": rec_layer,
        "evicted_tokens": sum(c["evicted_refs"] + c["evicted_codes"] for c in evicted.values()),
        "eviction": {"irreversible": bool(evicted), "per_layer": {str(k): v for k, v in sorted(evicted.items())},
                     "note": "SnapKV eviction: evicted tokens are gone for good; kept references that only serve "
                             "the surviving codes are 'hidden_refs' (stored, not attended)"} if cfg.mode == "snapkv" else None,
    }


def _report_omnikv(cache: OmniKVCache) -> dict[str, Any]:
    comp = cache.nbytes()
    fp16 = cache.fp16_bytes()
    kv = comp.get("kv_fp16", 0)
    total = sum(comp.values())
    as_held = total - kv + sum(nbytes_of(s.k, s.v) for layer in cache.layers for s in layer.stores)  # the model's dtype
    # every stored byte counts, positions too, as in the ResidualKV report: the formula's 1.0 plus that gap
    kr = total / fp16 if fp16 else 1.0
    gap = {"positions": comp.get("positions", 0) / fp16} if fp16 else {}
    return {"kr_measured": kr, "kr_formula": 1.0, "bytes": comp, "total_bytes": total,
            **_beside(cache, total, fp16, stored_as_held=as_held), "fp16_bytes": fp16, "gap": gap,
            "unexplained": kr - 1.0 - sum(gap.values()), **_sparse_report(cache)}


def _report_lowram(cache) -> dict[str, Any]:
    """LowRAM's target is its ratio: keys and values each get 1/ratio of their FP16 bytes (of the prompt tokens
    LowRAM-E's eviction kept: kept fraction / ratio of the whole prompt's). The gap is the eviction mask, the
    exact tail (tokens after the prompt, FP16 by design), the positions, and what the per-context solve
    could not meet: rank and residual counts rounded down, or predictors alone over budget (short prompts)."""
    comp = cache.nbytes()
    total, fp16 = sum(comp.values()), cache.fp16_bytes()
    kr = total / fp16 if fp16 else 0.0
    stores = [s for layer in cache.layers for s in layer.stores if s.mask is not None]
    # LowRAM-E: the ratio applies to the prompt tokens eviction kept
    seen = sum(s.shape[0] * (s.kept.n_seen if s.kept is not None else s.n_prompt) for s in stores)
    kept = sum(s.shape[0] * s.n_prompt for s in stores) / seen if seen else 1.0
    target = kept / cache.config.ratio
    gap = {k: comp[k] / fp16 for k in ("exact_tail_fp16", "positions", "evict_kept_mask", "prompt_pending_fp16")
           if k in comp} if fp16 else {}
    gap["rank_and_residual_rounding"] = kr - target - sum(gap.values()) if fp16 else 0.0
    buffer = sum(layer.buffer_bytes() for layer in cache.layers)  # LowRAM-SR's reuse buffers, not in KR
    per_layer = _cr_per_layer(cache.layers)
    cfg, steps = cache.config, min((len(layer.decode_log) for layer in cache.layers), default=0)
    return {"kr_measured": kr, "kr_formula": target, "cr": sum(per_layer) / len(per_layer), "cr_per_layer": per_layer,
            "cr_scope": ("decode steps; the selected prompt chunks, the exact chunks and window, and the tail are "
                         "attended (prompts too short to select from are read whole)") if cfg.selective else
                        "decode steps; every stored token is rebuilt and attended" + (
                            " (the prompt's: those eviction kept)" if cfg.evict_keep is not None else ""),
            "decode_steps": steps,
            "history_tokens_per_step": _per_step(cache.layers, steps, 0),
            "tokens_attended_per_step": _per_step(cache.layers, steps, 1),
            "selective": _selective_report(cache, stores, buffer) if cfg.selective else None,
            "bytes": comp, "total_bytes": total, **_beside(cache, total, fp16, buffer), "fp16_bytes": fp16, "gap": gap,
            "unexplained": 0.0, "working_vs_fp16": buffer / fp16 if fp16 else 0.0,
            "inputs": {"ratio": cache.config.ratio, "layer_group": cache.config.layer_group, "key_ranks": cache.key_ranks,
                       "residual_fraction": sum(s.n_keep / s.n_prompt for s in stores) / len(stores) if stores else 0.0,
                       "key_bits": cache.config.key_bits, "residual_bits": cache.config.residual_bits,
                       "fit_steps": cache.config.fit_steps, "tokens": cache.rows.valid_tokens(),
                       "evict_keep": cache.config.evict_keep, "prompt_kept": kept,
                       "layers": len(cache.layers)}}


def _selective_report(cache, stores, buffer: int) -> dict[str, Any]:
    """LowRAM-SR: where it engaged, its settings, the prompt tokens each decode step rebuilt (summed over
    layers and rows, each token with every KV head; fewer than the budget where the reuse buffer held
    chunks from the step before), and the buffer's bytes, which are not in KR (rebuilt from stored ones;
    / FP16 bytes they are the report's `working_vs_fp16`)."""
    cfg = cache.config
    steps = min((len(layer.rebuilt_log) for layer in cache.layers), default=0)
    return {"engaged_stores": sum(s.selective is not None for s in stores), "stores": len(stores),
            "chunk": cfg.sr_chunk, "budget": cfg.sr_budget, "outlier_chunks": cfg.sr_outliers,
            "window": cfg.sr_window, "reuse": cfg.sr_reuse,
            "tokens_rebuilt_per_step": [sum(layer.rebuilt_log[t] for layer in cache.layers) for t in range(steps)],
            "reuse_buffer_bytes": buffer}


def _beside(cache, total: int, fp16: int, buffer: int = 0, stored_as_held: int | None = None) -> dict[str, Any]:
    """Memory beside KR's bytes: spare capacity, bookkeeping, and all of it held (`stored_as_held`: the
    stored bytes as allocated, where the FP16 charge differs from the dtype they are kept in)."""
    spare, book = cache.spare_bytes(), cache.rows.bookkeeping_bytes()
    held = (total if stored_as_held is None else stored_as_held) + spare + buffer + book
    return {"spare_bytes": spare, "kr_allocated": (total + spare) / fp16 if fp16 else 0.0,
            "bookkeeping_bytes": book, "held_bytes": held}


def _report_dynamic(cache: DynamicCache) -> dict[str, Any]:
    # The baseline is defined as the FP16 full cache, whatever dtype this run computes in.
    numel = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized)
    fp16 = numel * 2
    held = sum(nbytes_of(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized)
    return {"kr_measured": 1.0, "kr_formula": 1.0, "cr": 1.0, "cr_per_layer": [1.0] * len(cache.layers),
            "bytes": {"kv_fp16": fp16}, "total_bytes": fp16, "held_bytes": held, "fp16_bytes": fp16, "gap": {},
            "unexplained": 0.0}


def _report_residual(cache: ResidualKVCache) -> dict[str, Any]:
    cfg = cache.config
    comp = cache.nbytes()
    total = sum(comp.values())
    fp16 = cache.fp16_bytes()
    n_layers = len(cache.layers)
    n_full = sum(isinstance(layer, KiviLayer) for layer in cache.layers)
    beta = n_full / n_layers
    d_kv = 2 * cache.num_kv_heads * cache.head_dim
    d_c = cache.codec.mean_d_c if cache.codec is not None else d_kv
    sched = cache.rows.schedule
    n_ord = max((cache.rows.n_slots - g.start for g in cache.rows.groups), default=0)
    rho_nominal = (1 / cfg.stride) if cfg.stride_alpha == 0 else (sched.formula_count(n_ord) - min(n_ord, cfg.n_sink)) / max(n_ord, 1)
    formula = kr_formula(beta, rho_nominal, cfg.bits, d_c, d_kv, full_bits=cfg.full_bits, group=cfg.group_size,
                         full_group=cfg.full_group_size, ref_format=cfg.ref_format)
    kr = total / fp16 if fp16 else 0.0
    buffer = sum(layer.buffer_bytes() for layer in cache.layers)  # select_reuse's buffers, not in KR

    gap: dict[str, float] = {}
    if fp16:
        gap["reference_indices"] = comp.get("reference_indices", 0) / fp16
        gap["positions"] = comp.get("positions", 0) / fp16
        # FP16 window tokens cost 1.0 instead of q_full
        win = comp.get("full_layer_window_fp16", 0)
        gap["full_layer_window_fp16"] = win * (1 - q_bits(cfg.full_bits, cfg.full_group_size)) / fp16
        # a KIVI value group never spans two heads: heads narrower than full_group_size, or not a multiple
        # of it, take smaller groups
        vg = kivi_value_group(cfg.full_group_size, cache.head_dim)
        if vg != cfg.full_group_size:
            value_coords = comp.get("full_layer_codes", 0) * 8 // cfg.full_bits // 2  # half the codes are values
            gap["full_layer_value_groups"] = value_coords * 2 * (2 / vg - 2 / cfg.full_group_size) / fp16
        # sinks and the integer schedule make the real reference count differ from ρ·n
        n_res = n_layers - n_full
        if n_res:
            ref_ratio = 0.5 if cfg.ref_format == "fp8" else 1.0
            kept_refs = comp.get("references", 0) / (d_kv * (1 if cfg.ref_format == "fp8" else 2))
            stores = [s for layer in cache.layers if isinstance(layer, ResidualLayer) for s in layer.stores]
            ev_refs = sum(s.evicted_refs for s in stores)
            ev_codes = sum(s.evicted_codes for s in stores)
            actual_refs = kept_refs + ev_refs  # what the schedule made, before any SnapKV eviction
            valid = cache.rows.valid_tokens() * n_res
            q_code = q_bits(cfg.bits, cfg.group_size) * d_c / d_kv
            gap["sinks_and_schedule_rounding"] = (actual_refs - rho_nominal * valid) / valid * ref_ratio * (1 - beta) if valid else 0.0
            # reference tokens carry no latent code, the formula charges one to every token
            gap["refs_have_no_code"] = -(actual_refs / valid) * q_code * (1 - beta) if valid else 0.0
            # the recent window's tokens are FP16 (cost 1.0), not yet references or codes
            win_tokens = comp.get("recent_window_fp16", 0) / (2 * d_kv)
            if win_tokens:
                gap["recent_window_fp16"] = (win_tokens / valid) * (1 - q_code) * (1 - beta)
            if ev_refs or ev_codes or "eviction_ordinals" in comp:  # SnapKV: freed tokens, and the kept ordinals
                gap["snapkv_evicted_references"] = -(ev_refs / valid) * ref_ratio * (1 - beta) if valid else 0.0
                gap["snapkv_evicted_codes"] = -(ev_codes / valid) * q_code * (1 - beta) if valid else 0.0
                gap["snapkv_kept_ordinals"] = comp.get("eviction_ordinals", 0) / fp16
    unexplained = kr - formula - sum(gap.values())
    return {
        "kr_measured": kr,
        "kr_formula": formula,
        **_sparse_report(cache),
        "bytes": comp,
        "total_bytes": total,
        **_beside(cache, total, fp16, buffer),
        "fp16_bytes": fp16,
        "reuse_buffer_bytes": buffer,
        "working_vs_fp16": buffer / fp16 if fp16 else 0.0,
        "gap": gap,
        "unexplained": unexplained,
        "inputs": {"beta": beta, "rho_ref": rho_nominal, "bits": cfg.bits, "d_c": d_c, "d_kv": d_kv,
                   "full_bits": cfg.full_bits, "ref_format": cfg.ref_format, "recent_window": cfg.recent_window, "tokens": cache.rows.valid_tokens(),
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
    if rep.get("inputs", {}).get("evict_keep") is not None:
        lines.append(f"  prompt tokens kept by eviction (LowRAM-E; the ratio applies to them): {rep['inputs']['prompt_kept']:.1%}")
    if rep.get("working_vs_fp16"):
        lines.append(f"  plus working memory (reuse buffers, not in KR): {rep['working_vs_fp16']:.2%} of the FP16 cache")
    if rep.get("held_bytes") and rep.get("fp16_bytes"):
        lines.append(f"  held in memory: {rep['held_bytes'] / 2**20:.2f} MiB, {rep['held_bytes'] / rep['fp16_bytes']:.2%} of "
                     "the FP16 cache (stored, spare capacity, working memory, bookkeeping)")
    return "\n".join(lines)
