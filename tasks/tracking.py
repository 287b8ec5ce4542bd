"""MLflow logging, registration and promotion tasks (over `registry`).

One MLflow run per backbone per flow run ("retrain-<backbone>") holds the params, the training curve,
the KR/CR, benchmark and throughput tables (CSV/JSON/markdown), the plots, and the codec that the
registered version points at.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

import registry
from registry.store import client, experiment_id, retrying

from .common import say

HIGHER_IS_BETTER = ("score", "rel_score")
# Metrics stored on a version and re-checked by bench-regress: name -> (direction, tolerance kind)
#   direction "max": higher is better, "min": lower is better; kind "abs": |delta| in the metric's units,
#   "rel": delta relative to the stored value (perplexities).


def metric_direction(name: str) -> tuple[str, str] | None:
    base = name.split("_ctx", 1)[0]
    if base in ("score", "rel_score") or base.startswith("task."):
        return "max", "abs"
    # cr: the share of the history the attention path read; a sparse path that reads more is a regression
    # even where the answers hold (the issue #4 bound), and it moves by far less than 0.02 between codecs
    if base in ("kr_measured", "cr", "answer_nll", "answer_nll_delta"):  # answer NLL: nats per token
        return "min", "abs"
    if base in ("ppl", "ppl_rel"):
        return "min", "rel"
    # decode tok/s over the full cache's, timed side by side in one process: a ratio that carries from one
    # machine to another where tok/s does not (bench-regress gates it with its own relative --speed-tolerance)
    if base == SPEEDUP:
        return "max", "rel"
    return None  # timing and descriptive figures are recorded, not gated


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean(xs: Sequence[Any]) -> float | None:
    xs = [float(x) for x in xs if _finite(x)]
    return sum(xs) / len(xs) if xs else None


SPEEDUP = "decode_speedup"
HEADLINE_KEYS = ("kr_measured", "kr_formula", "cr", "score", "rel_score", "ppl", "ppl_rel", "answer_nll",
                 "answer_nll_delta")


def known_metric(name: str) -> bool:
    """Whether `name` is one headline_metrics can store: a headline key, KEY_ctxL, task.TASK, decode_tok_s_ctxL,
    decode_speedup_ctxL."""
    keys = "|".join(HEADLINE_KEYS + ("decode_tok_s", SPEEDUP))
    return bool(re.fullmatch(rf"(?:{'|'.join(HEADLINE_KEYS)})|(?:{keys})_ctx\d+|task\.[\w.-]+", name))


def headline_metrics(bench_rows: Sequence[Mapping[str, Any]], method: str,
                     speed_rows: Sequence[Mapping[str, Any]] = ()) -> dict[str, float]:
    """The registered method's figures: means over context lengths, per-length values (`name_ctxL`), per task,
    and from `speed_rows` its decode tok/s and decode speed-up over the full cache per length."""
    mine = [r for r in bench_rows if r["method"] == method]
    if not mine:
        raise ValueError(f"the benchmark has no rows for {method!r}")
    out: dict[str, float] = {}
    for key in HEADLINE_KEYS:
        value = _mean([r.get(key) for r in mine])
        if value is not None:
            out[key] = value
        if len(mine) > 1:
            for r in mine:
                if _finite(r.get(key)):
                    out[f"{key}_ctx{r.get('context_len')}"] = float(r[key])
    tasks = sorted({t for r in mine for t in (r.get("tasks") or {})})
    for t in tasks:
        value = _mean([(r.get("tasks") or {}).get(t) for r in mine])
        if value is not None:
            out[f"task.{t}"] = value
    for r in speed_rows:
        if r["method"] != method:
            continue
        for key, name in (("decode_tok_s", "decode_tok_s"), ("decode_speedup_vs_full", SPEEDUP)):
            if _finite(r.get(key)):
                out[f"{name}_ctx{r['context_len']}"] = float(r[key])
    return out


def suite_spec(backbone_entry: Any, backbone_ref: str, evaluate: Mapping[str, Any], method: str) -> dict[str, Any]:
    """What bench-regress needs to re-run exactly this benchmark."""
    return {"backbone_entry": backbone_entry, "backbone_ref": backbone_ref, "methods": list(evaluate["methods"]),
            "options": dict(evaluate.get("options") or {}), "method": method}


# ---------------------------------------------------------------------------------------------- runs


@task(name="start-mlflow-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def start_run(backbone: str, profile: str, params: Mapping[str, Any], flow_run: str | None = None) -> str:
    c = client()
    tags = {"rkv.kind": "retrain", "backbone": backbone, "profile": profile, "mlflow.runName": f"retrain-{backbone}"}
    if flow_run:
        tags["prefect.flow_run"] = flow_run
    run = retrying(c.create_run, experiment_id(), run_name=f"retrain-{backbone}", tags=tags)
    from mlflow.entities import Param

    flat = _flatten(params)
    batch = [Param(k[:250], str(v)[:6000]) for k, v in flat.items()]
    for i in range(0, len(batch), 90):
        retrying(c.log_batch, run.info.run_id, params=batch[i : i + 90])
    return run.info.run_id


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


@task(name="end-mlflow-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def end_run(run_id: str, status: str = "FINISHED", error: str | None = None) -> None:
    c = client()
    if error:
        retrying(c.log_text, run_id, error, "errors/failure.txt")
        retrying(c.set_tag, run_id, "rkv.error", error.splitlines()[0][:4000] if error else "")
    retrying(c.set_terminated, run_id, status)


def log_failure(run_id: str, name: str, report: str) -> None:
    """A failed validation's report goes to the run (text artifact + tag), so the UI shows why."""
    c = client()
    retrying(c.log_text, run_id, report, f"validation/{name}_FAILED.txt")
    retrying(c.set_tag, run_id, "rkv.validation", f"{name} failed")


# ---------------------------------------------------------------------------------------------- results


def _write_tables(folder: Path, name: str, rows: Sequence[Mapping[str, Any]]) -> list[Path]:
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    flat = []
    for r in rows:
        out = {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        for t, v in (r.get("tasks") or {}).items():
            out[f"task_{t}"] = v
        flat.append(out)
    df = pd.DataFrame(flat)
    paths = [folder / f"{name}.csv", folder / f"{name}.json", folder / f"{name}.md"]
    df.to_csv(paths[0], index=False)
    paths[1].write_text(json.dumps(list(rows), indent=2, default=str))
    paths[2].write_text(df.to_markdown(index=False, floatfmt=".4g") if _has_tabulate() else df.to_string(index=False))
    return paths


def _has_tabulate() -> bool:
    import importlib.util

    return importlib.util.find_spec("tabulate") is not None


def _training_history(metrics_file: str | None) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: metrics}; a resumed run re-logs steps after its checkpoint: the last wins."""
    history: dict[int, dict[str, float]] = {}
    if metrics_file and Path(metrics_file).is_file():
        for line in Path(metrics_file).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                history.setdefault(int(row.pop("step")), {}).update(row)
    return history


def make_plots(folder: Path, history: Mapping[int, Mapping[str, float]], bench_rows: Sequence[Mapping[str, Any]],
               speed_rows: Sequence[Mapping[str, Any]], title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    steps = sorted(s for s, m in history.items() if "loss" in m)
    def line_plot(name: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, what: str,
                  log_y: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"{what} - {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)
        out.append(folder / name)

    if steps:
        losses = {k: (steps, [history[s].get(k) for s in steps]) for k in ("loss", "rec", "ntp")}
        line_plot("training_loss.png", {k: v for k, v in losses.items() if any(y is not None for y in v[1])},
                  "optimizer step", "loss", "codec training", log_y=True)
    if bench_rows:
        from residualkv.evaluation.report import plot_score_vs_kr

        out.append(plot_score_vs_kr([dict(r) for r in bench_rows], folder / "quality_vs_kr.png"))
    if speed_rows:
        def by_method(key: str) -> dict:
            series = {}
            for m in dict.fromkeys(r["method"] for r in speed_rows):
                pts = sorted((r["context_len"], r[key]) for r in speed_rows if r["method"] == m and _finite(r.get(key)))
                series[m] = ([p[0] for p in pts], [p[1] for p in pts])
            return series
        line_plot("throughput.png", by_method("decode_tok_s"), "context tokens", "decode tokens/s (CPU)", "decode throughput")
        line_plot("memory.png", by_method("cache_held_mib"), "context tokens", "MiB held by the cache (allocator)",
                  "cache memory")
    return out


@task(name="log-results", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def log_results(run_id: str, report_dir: str, train: Mapping[str, Any], kr: Mapping[str, Any],
                bench: Mapping[str, Any], speed: Mapping[str, Any], title: str) -> dict[str, Any]:
    """Tables, plots and metrics of one backbone's run -> files under report_dir and the MLflow run."""
    from mlflow.entities import Metric

    folder = Path(report_dir)
    tables = folder / "tables"
    plots = folder / "plots"
    files = []
    files += _write_tables(tables, "kr_cr", kr["rows"])
    files += _write_tables(tables, "benchmark", bench["rows"])
    files += _write_tables(tables, "throughput", speed["rows"])
    history = _training_history(train.get("metrics_file"))
    files += make_plots(plots, history, bench["rows"], speed["rows"], title)
    for extra in bench.get("files", []):  # the harness's own markdown/plot/predictions
        p = Path(extra)
        if p.is_file() and p.suffix in (".png", ".md", ".jsonl"):
            files.append(p)
    c = client()
    now = int(time.time() * 1000)
    metrics: list[Metric] = []
    logged = _logged_steps(run_id, "train/loss")
    for step, row in sorted(history.items()):  # backfill what live logging missed (cached or resumed runs)
        if step in logged:
            continue
        metrics += [Metric(f"train/{k}".replace("train/eval/", "train_eval/"), float(v), now, step)
                    for k, v in row.items() if _finite(v)]
    for r in bench["rows"]:
        for key in ("kr_measured", "kr_formula", "cr", "score", "rel_score", "ppl", "ppl_rel", "decode_tok_s"):
            if _finite(r.get(key)):
                metrics.append(Metric(f"bench/{r['method']}/{key}_ctx{r.get('context_len')}", float(r[key]), now, 0))
        for bound, value in zip(("lo", "hi"), r.get("rel_score_ci") or ()):  # recorded beside rel_score, not gated
            metrics.append(Metric(f"bench/{r['method']}/rel_score_ci_{bound}_ctx{r.get('context_len')}", float(value), now, 0))
    for r in kr["rows"]:
        metrics.append(Metric(f"kr_cr/{r['method']}/kr_measured_ctx{r['context_len']}", float(r["kr_measured"]), now, 0))
        metrics.append(Metric(f"kr_cr/{r['method']}/kr_formula_ctx{r['context_len']}", float(r["kr_formula"]), now, 0))
        metrics.append(Metric(f"kr_cr/{r['method']}/cr_ctx{r['context_len']}", float(r["cr"]), now, 0))
    for r in speed["rows"]:
        metrics.append(Metric(f"speed/{r['method']}/decode_tok_s_ctx{r['context_len']}", float(r["decode_tok_s"]), now, 0))
        metrics.append(Metric(f"speed/{r['method']}/prefill_tok_s_ctx{r['context_len']}", float(r["prefill_tok_s"]), now, 0))
        for key in ("prefill_peak_mib", "cache_held_mib"):
            if _finite(r.get(key)):
                metrics.append(Metric(f"memory/{r['method']}/{key}_ctx{r['context_len']}", float(r[key]), now, 0))
    for k in ("steps", "tokens", "train_seconds"):
        if _finite(train.get(k)):
            metrics.append(Metric(f"train_{k}", float(train[k]), now, 0))
    for i in range(0, len(metrics), 500):
        retrying(c.log_batch, run_id, metrics=metrics[i : i + 500])
    for p in files:
        sub = "plots" if p.suffix == ".png" else "tables"
        retrying(c.log_artifact, run_id, str(p), sub)
    if speed.get("gpu"):
        retrying(c.log_text, run_id, json.dumps(speed["gpu"], indent=2, default=str), "tables/gpu_bench.json")
    retrying(c.set_tag, run_id, "rkv.train_dir", str(train.get("run_dir", "")))
    return {"report_dir": str(folder), "plots": [str(p) for p in files if p.suffix == ".png"],
            "tables": [str(p) for p in files if p.suffix != ".png"]}


def _logged_steps(run_id: str, key: str) -> set[int]:
    try:
        return {m.step for m in retrying(client().get_metric_history, run_id, key)}
    except Exception:  # noqa: BLE001
        return set()


# ---------------------------------------------------------------------------------------------- registry


@task(name="register-codec", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def register_codec_version(run_id: str, codec_dir: str, name: str, metrics: Mapping[str, float],
                           suite: Mapping[str, Any], tags: Mapping[str, Any], report_dir: str,
                           speed_suite: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A new complete version (alias `candidate`); a retry after a crash registers a fresh version, never
    completes a half-written one (the loader refuses those)."""
    reg = registry.register_codec(codec_dir, name=name, metrics=metrics, tags=tags, run_id=run_id, suite=suite,
                                  speed_suite=speed_suite)
    return {"name": reg.name, "version": reg.version, "run_id": reg.run_id, "uri": reg.uri, "source": reg.source}


@task(name="promote-codec", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def promote_version(name: str, version: str, rule: Mapping[str, Any],
                    champion_metrics: Mapping[str, float] | None = None,
                    paired: Sequence[Mapping[str, Any]] | None = None, paired_note: str = "",
                    paired_champion: str | None = None) -> dict[str, Any]:
    decision = registry.promote_if_not_worse(name, version, registry.PromotionRule(**rule),
                                             champion_metrics=champion_metrics, paired=paired,
                                             paired_note=paired_note, paired_champion=paired_champion)
    say(decision.text())
    return {"promoted": decision.promoted, "reason": decision.reason, "champion_before": decision.champion_before,
            "champion_after": decision.champion_after, "paired": decision.paired, "paired_note": decision.paired_note,
            "text": decision.text()}
