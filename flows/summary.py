"""Terminal tables for the end of a pipeline run and for bench-regress."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from registry import env


def _fmt(value: Any, kind: str = "num") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "int":
        return f"{int(value)}"
    if kind == "signed":
        return f"{value:+.3f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(map(str, r)) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def backbone_table(bench_rows: Sequence[Mapping[str, Any]], speed_rows: Sequence[Mapping[str, Any]]) -> str:
    speed = {(r["method"], r["context_len"]): r for r in speed_rows}
    best_speed = {}
    for r in speed_rows:
        best_speed.setdefault(r["method"], r)
    rows = []
    for r in bench_rows:
        s = speed.get((r["method"], r.get("context_len"))) or best_speed.get(r["method"])
        rows.append([r["method"], _fmt(r.get("context_len"), "int"), _fmt(r.get("kr_measured"), "pct"),
                     _fmt(r.get("kr_formula"), "pct"), _fmt(r.get("cr"), "pct"), _fmt(r.get("score"), "pct"),
                     _fmt(r.get("rel_score")), _fmt(r.get("answer_nll_delta"), "signed"), _fmt(r.get("ppl_rel")),
                     f"{s['decode_tok_s']:.1f} @{s['context_len']}" if s else "-",
                     f"{s['cache_held_mib']:.1f}" if s and s.get("cache_held_mib") is not None else "-"])
    return table(["method", "ctx", "KR meas.", "KR formula", "CR", "score", "rel. score", "ans. NLL-full",
                  "ppl/full", "decode tok/s (CPU)", "cache MiB"], rows)


def pipeline_summary(result: Mapping[str, Any]) -> str:
    lines = [f"== ResidualKV pipeline, profile {result['profile']} ({result.get('status', '?')}) =="]
    for b in result["backbones"]:
        lines.append("")
        lines.append(f"-- {b['backbone']}: {b['status']}")
        if b.get("train"):
            t = b["train"]
            how = "reused (cached)" if t.get("cached") else (f"resumed from step {t['resumed_from']}" if t.get("resumed_from") else "trained")
            lines.append(f"   training: {t.get('steps')}/{t.get('total_steps')} steps, {how}; codec {t.get('codec_dir')}")
        if b.get("bench_rows"):
            lines.append("   " + backbone_table(b["bench_rows"], b.get("speed_rows", [])).replace("\n", "\n   "))
        if b.get("registered"):
            r = b["registered"]
            lines.append(f"   registered {r['uri']} (alias candidate)")
        if b.get("promotion"):
            p = b["promotion"]
            lines.append(f"   promotion: {'PROMOTED to champion' if p['promoted'] else 'not promoted'} - {p['reason']}")
        if b.get("error"):
            lines.append("   " + str(b["error"]).replace("\n", "\n   "))
        if b.get("report_dir"):
            lines.append(f"   tables + plots: {b['report_dir']}")
    lines.append("")
    lines.append(f"MLflow UI:  {env.ui_command()}   (then open http://127.0.0.1:5000)")
    lines.append(f"MLflow store: {env.tracking_uri()}")
    if result.get("reports_root"):
        lines.append(f"plots and tables: {result['reports_root']}")
    return "\n".join(lines)
