"""Result files of one evaluation: JSON rows (the CLI contract), CSV, a markdown table, a plot, predictions."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

CONTRACT = ("method", "kr_measured", "cr", "score", "rel_score")
REFERENCE = "full"  # the method every score is relative to


def scalar_columns(row: dict[str, Any]) -> dict[str, Any]:
    """A row's plain fields, rel_score_ci as rel_score_ci_lo / rel_score_ci_hi (nested fields left out)."""
    out = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
    if row.get("rel_score_ci"):
        out["rel_score_ci_lo"], out["rel_score_ci_hi"] = row["rel_score_ci"]
    if row.get("answer_nll_delta_ci"):
        out["answer_nll_delta_ci_lo"], out["answer_nll_delta_ci_hi"] = row["answer_nll_delta_ci"]
    return out


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """One CSV line: nested per-task dicts become score_<task> / rel_<task> columns."""
    out = scalar_columns(row)
    for t, v in (row.get("tasks") or {}).items():
        out[f"score_{t}"] = v
    for t, v in (row.get("rel_tasks") or {}).items():
        out[f"rel_{t}"] = v
    if row.get("tasks_without_signal"):
        out["tasks_without_signal"] = ";".join(row["tasks_without_signal"])
    return out


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    flat = [flat_row(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(flat)
    return path


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _nll_delta(r: dict[str, Any]) -> str:
    d, ci = r.get("answer_nll_delta"), r.get("answer_nll_delta_ci")
    if d is None:
        return "–"
    return f"{d:+.3f}" + (" ({:+.2f} .. {:+.2f})".format(*ci) if ci else "")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    tasks = list(dict.fromkeys(t for r in rows for t in (r.get("tasks") or {})))
    head = ["method", "context", "KR (measured)", "KR (formula)", "CR", "score", "rel. score", "95% CI", *tasks,
            "answer NLL", "− full (95% CI)", "ppl", "ppl / full", "s / sample", "decode tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r.get("context_len") or "–"), _pct(r.get("kr_measured")), _pct(r.get("kr_formula")),
                 _pct(r.get("cr"), 0), _pct(r.get("score")), _num(r.get("rel_score"), "{:.3f}"),
                 "–" if not r.get("rel_score_ci") else "{:.2f}–{:.2f}".format(*r["rel_score_ci"]),
                 *[_pct((r.get("tasks") or {}).get(t), 0) for t in tasks],
                 _num(r.get("answer_nll"), "{:.3f}"), _nll_delta(r),
                 _num(r.get("ppl"), "{:.3f}"), _num(r.get("ppl_rel"), "{:.4f}"), _num(r.get("s_per_sample"), "{:.1f}"),
                 _num(r.get("decode_tok_s"), "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "KR: bytes held / bytes of the FP16 full cache, mean over samples after prefill + generation. "
             "Scores: string match (fraction of answers present), mean over tasks. rel. score: relative to the "
             "full cache over the tasks where it scores > 0; 95% CI: paired bootstrap over the samples, by task. "
             "answer NLL: nats per token of a correct answer teacher-forced through the cache, mean over tasks; "
             "− full: paired difference to the full cache (> 0: the right answer became less likely)."]
    silent = sorted({t for r in rows for t in r.get("tasks_without_signal") or []})
    if silent:
        notes.append(f"Tasks where the full cache scores 0 (left out of rel. score): {', '.join(silent)}.")
    return "\n".join(lines + notes) + "\n"


def _panel_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    """(value key, y label, interval key) of each row of panels the rows have figures for."""
    if any(r.get("rel_score") is not None for r in rows):
        out = [("rel_score", "rel. score (x full cache; 95% CI)", "rel_score_ci")]
    elif any(r.get("score") is not None for r in rows):
        out = [("score", "score (string match)", None)]
    else:
        out = [("ppl", "perplexity", None)]
    if any(r.get("answer_nll_delta") is not None for r in rows):
        out.append(("answer_nll_delta", "answer NLL - full cache\n(nats/token; 95% CI; lower is better)",
                    "answer_nll_delta_ci"))
    return out


def kr_axis(rows: Sequence[dict[str, Any]]) -> tuple[float, float, bool]:
    """The plot's KR axis: (lower and upper limit in %, whether the full cache is left off it). When every
    other method holds under 60% of the bytes, the axis spans just them (from a multiple of 5 below), so
    methods a point of KR apart do not share one column of pixels; the full cache's values are then
    dashed lines across it."""
    others = [100 * r["kr_measured"] for r in rows if r["method"] != REFERENCE and r.get("kr_measured") is not None]
    if others and max(others) < 60:
        return 5.0 * math.floor(0.9 * min(others) / 5), 1.06 * max(others) + 0.5, True
    return 0.0, 108.0, False


def plot_score_vs_kr(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Quality against measured KR: a column of panels per context length; the top row is the rel. score
    (the score, or perplexity, where there is none), the bottom one, when the rows carry it, the answer NLL
    minus the full cache's. Paired 95% intervals as error bars; one colour per method, named in the legend
    (labels beside the points overlap where methods sit at the same bytes). The KR axis is `kr_axis`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panel_rows(rows)
    x_lo, x_hi, full_off_axis = kr_axis(rows)
    lengths = list(dict.fromkeys(r.get("context_len") for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colour = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    marker = {m: "osD^v<>ph*"[(i // 10) % 10] for i, m in enumerate(methods)}
    fig, axes = plt.subplots(len(panels), len(lengths), figsize=(5.2 * len(lengths) + 1.7, 3.8 * len(panels)),
                             squeeze=False, sharex=True)
    for col, L in enumerate(lengths):
        for row, (key, label, ci_key) in enumerate(panels):
            ax = axes[row][col]
            for r in rows:
                if r.get("context_len") != L or r.get(key) is None or r.get("kr_measured") is None:
                    continue
                x, y = 100 * r["kr_measured"], float(r[key])
                if full_off_axis and r["method"] == REFERENCE:  # its value as a line across the zoomed axis
                    ax.axhline(y, color="0.5", lw=0.8, ls="--", zorder=1, label="full cache (KR 100%)")
                    continue
                ci = r.get(ci_key) if ci_key else None
                yerr = [[max(0.0, y - ci[0])], [max(0.0, ci[1] - y)]] if ci else None
                ax.errorbar([x], [y], yerr=yerr, fmt=marker[r["method"]], ms=7, capsize=3, zorder=3,
                            color=colour[r["method"]], label=r["method"])
            if key in ("rel_score", "answer_nll_delta"):
                ax.axhline(1.0 if key == "rel_score" else 0.0, color="0.5", lw=0.8, ls="--", zorder=1)
            if row == 0:
                ax.set_title(f"{L} tokens" if L else "prompts as given", fontsize=10)
            if row == len(panels) - 1:
                ax.set_xlabel("measured KR (% of FP16 full-cache bytes)")
            if col == 0:
                ax.set_ylabel(label)
            ax.set_xlim(x_lo, x_hi)
            ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=8, frameon=False)
    fig.suptitle("quality vs measured KV-cache bytes", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(rows: Sequence[dict[str, Any]], *, out_dir: str | Path | None = None, stem: str = "eval",
                  json_path: str | Path | None = None, records: Sequence[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write the JSON rows (at json_path, else out_dir/<stem>.json) and CSV/markdown/plot/predictions in out_dir."""
    if json_path is not None:
        json_path = Path(json_path)
        out_dir = Path(out_dir) if out_dir is not None else json_path.parent
    else:
        if out_dir is None:
            raise ValueError("give out_dir or json_path")
        out_dir = Path(out_dir)
        json_path = out_dir / f"{stem}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        missing = [k for k in CONTRACT if k not in r]
        if missing:
            raise ValueError(f"row for {r.get('method')} lacks contract field(s) {missing}")
    json_path.write_text(json.dumps(list(rows), indent=2) + "\n", encoding="utf-8")
    paths = {"json": json_path,
             "csv": write_csv(rows, out_dir / f"{stem}.csv"),
             "md": out_dir / f"{stem}.md",
             "plot": plot_score_vs_kr(rows, out_dir / f"{stem}_score_vs_kr.png")}
    paths["md"].write_text(markdown_table(rows), encoding="utf-8")
    p = out_dir / f"{stem}_predictions.jsonl"
    if records:
        with open(p, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        paths["predictions"] = p
    elif records is not None and p.exists():
        p.unlink()  # a perplexity-only run has no predictions: never leave an earlier run's beside its rows
    return paths


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The per-sample records `write_outputs` wrote to <stem>_predictions.jsonl (json.JSONDecodeError if not)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
