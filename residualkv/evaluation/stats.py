"""How far a relative score can be trusted: a paired bootstrap over samples, stratified by task.

    rel_score = sum_t mean_t(method) / sum_t mean_t(full)     over the tasks where the full cache scores > 0

With 2-4 samples per task one answer moves a rel_score by about 0.1, so two codecs 0.1 apart may rank either
way on another draw of samples. Each resample draws, for every task, as many of its samples as it has, with
replacement, and scores the method and the full cache on the same draw (paired: what both answer right or
wrong together does not widen the band), the rel_score recomputed on each draw as defined above (a task
counts on a draw only where the full cache scores > 0 there; before 2026-12-06 the observed set of such
tasks was kept, which shifted intervals upward by up to ~0.1). The percentile interval of the resampled ratios is reported, and
for two methods the interval of their difference and the share of resamples in which the first is ahead.
It describes sampling noise of the prompts only; a retrained codec's own run-to-run spread comes on top.
A task with one sample cannot vary under resampling, so no interval is given unless every task that
counts has at least two.

The same resampling serves a per-sample number that needs no reference to be read, such as the answer's
teacher-forced NLL (`mean_difference`): the mean over tasks of the paired per-task mean differences.

Two training recipes are compared through several training runs of each (`compare_recipes`): a recipe's figure
is the mean of its runs', and each resample draws the samples as above and, independently, each recipe's runs
with replacement, so the interval holds the run-to-run spread as well as the prompts'. Drawing k runs from k
understates their spread by a factor (k - 1) / k in variance (half with two runs): read an interval from two
runs a side as a lower bound on the uncertainty, and the per-run figures beside it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


def _paired_scores(records: Sequence[dict[str, Any]], methods: Sequence[str], key: Callable[[dict], tuple],
                   field: str = "score") -> dict[str, np.ndarray]:
    """{task: [n_t, len(methods)] values of `field`} over the samples every one of `methods` has it for."""
    by_sample: dict[tuple, dict[str, float]] = defaultdict(dict)
    task_of: dict[tuple, str] = {}
    for r in records:
        if r["method"] in methods and r.get(field) is not None:
            k = key(r)
            by_sample[k][r["method"]] = float(r[field])
            task_of[k] = r["task"]
    table: dict[str, list[list[float]]] = defaultdict(list)
    for k, scores in by_sample.items():
        if len(scores) == len(methods):
            table[task_of[k]].append([scores[m] for m in methods])
    return {t: np.asarray(v) for t, v in table.items()}


def _resampled_task_means(table: dict[str, np.ndarray], n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """{task: [n_boot, n_methods]} means of each resample (plus the observed means as row 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in sorted(table):  # a fixed task order keeps the draws reproducible
        x = table[t]
        idx = rng.integers(0, len(x), size=(n_boot, len(x)))
        out[t] = np.concatenate([x.mean(0, keepdims=True), x[idx].mean(1)])
    return out


def _counted_tasks(table: dict[str, np.ndarray], ref_col: int) -> list[str] | None:
    """The tasks where the reference scores > 0; None when there are none or one has a single sample."""
    signal = [t for t, x in table.items() if x[:, ref_col].mean() > 0]
    return signal if signal and min(len(table[t]) for t in signal) >= 2 else None


def _ratios(means: dict[str, np.ndarray], signal: list[str], col: int, ref_col: int) -> np.ndarray:
    # rel_score recomputed on each resample as it is defined: a task counts only where the reference scores
    # > 0 on that draw (a resample in which the full cache misses a task gives the method no credit there)
    num = sum(np.where(means[t][:, ref_col] > 0, means[t][:, col], 0.0) for t in signal)
    den = sum(means[t][:, ref_col] for t in signal)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _interval(x: np.ndarray, level: float) -> list[float]:
    x = x[~np.isnan(x)]
    a = (1 - level) / 2
    return [float(np.quantile(x, a)), float(np.quantile(x, 1 - a))]


def rel_score_interval(records: Sequence[dict[str, Any]], method: str, reference: str, key: Callable[[dict], tuple],
                       level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0) -> list[float] | None:
    """[lo, hi] of `method`'s rel_score on the samples it and `reference` both ran; None without signal."""
    table = _paired_scores(records, [method, reference], key)
    signal = _counted_tasks(table, 1)
    if signal is None:
        return None
    means = _resampled_task_means(table, n_boot, seed)
    return _interval(_ratios(means, signal, 0, 1)[1:], level)


def compare(records: Sequence[dict[str, Any]], a: str, b: str, reference: str, key: Callable[[dict], tuple],
            level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Any]:
    """rel_score(a) - rel_score(b) on the samples a, b and the reference all ran, with its interval and
    the share of resamples where a is ahead (ties count half)."""
    table = _paired_scores(records, [a, b, reference], key)
    n = sum(len(x) for x in table.values())
    signal = _counted_tasks(table, 2)
    if signal is None:
        return {"a": a, "b": b, "n_samples": n, "difference": None, "ci": None, "p_a_ahead": None}
    means = _resampled_task_means(table, n_boot, seed)
    diff = _ratios(means, signal, 0, 2) - _ratios(means, signal, 1, 2)
    boot = diff[1:][~np.isnan(diff[1:])]
    return {"a": a, "b": b, "n_samples": n, "rel_a": float(_ratios(means, signal, 0, 2)[0]),
            "rel_b": float(_ratios(means, signal, 1, 2)[0]), "difference": float(diff[0]),
            "ci": _interval(diff[1:], level), "level": level,
            "p_a_ahead": float((boot > 0).mean() + 0.5 * (boot == 0).mean())}


def mean_difference(records: Sequence[dict[str, Any]], a: str, b: str, key: Callable[[dict], tuple],
                    field: str = "answer_nll", level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0
                    ) -> dict[str, Any]:
    """Mean over tasks of mean_t(a) - mean_t(b) of a per-sample `field`, on the samples both have it for, with
    its interval (None unless every task has two samples) and the share of resamples where a's is lower."""
    table = _paired_scores(records, [a, b], key, field)
    n = sum(len(x) for x in table.values())
    if not table:
        return {"a": a, "b": b, "field": field, "n_samples": 0, "difference": None, "ci": None, "p_a_lower": None}
    means = _resampled_task_means(table, n_boot, seed)
    diff = sum(m[:, 0] - m[:, 1] for m in means.values()) / len(means)
    boot = diff[1:]
    ok = min(len(x) for x in table.values()) >= 2
    return {"a": a, "b": b, "field": field, "n_samples": n, "difference": float(diff[0]),
            "ci": _interval(boot, level) if ok else None, "level": level,
            "p_a_lower": float((boot < 0).mean() + 0.5 * (boot == 0).mean()) if ok else None}


def _per_method_draws(table: dict[str, np.ndarray], n_methods: int, n_boot: int, seed: int,
                      rel_ref_col: int | None) -> np.ndarray | None:
    """[n_boot + 1, n_methods]: each method's rel_score (against column rel_ref_col) or, with None, its mean over
    tasks of the per-task means, observed (row 0) and on each resample of the samples."""
    if rel_ref_col is None:
        if not table:
            return None
        means = _resampled_task_means(table, n_boot, seed)
        return sum(m[:, :n_methods] for m in means.values()) / len(means)
    signal = _counted_tasks(table, rel_ref_col)
    if signal is None:
        return None
    means = _resampled_task_means(table, n_boot, seed)
    return np.stack([_ratios(means, signal, c, rel_ref_col) for c in range(n_methods)], axis=1)


def compare_recipes(records: Sequence[dict[str, Any]], runs_a: Sequence[str], runs_b: Sequence[str], reference: str,
                    key: Callable[[dict], tuple], field: str = "answer_nll", level: float = LEVEL,
                    n_boot: int = N_BOOT, seed: int = 0, nll_key: Callable[[dict], tuple] | None = None
                    ) -> dict[str, Any]:
    """Recipe A (the mean of its runs `runs_a`, each a method name) minus recipe B, in rel_score and in the mean
    of a per-sample `field`, on the samples every run and the reference ran; intervals from drawing the samples
    (per task) and each recipe's runs (with replacement) on every resample (see the module's note). `nll_key`
    pairs the `field` values (default: `key`)."""
    runs = [*runs_a, *runs_b]
    if len(set(runs)) != len(runs):
        raise ValueError(f"a run may belong to one recipe once: {list(runs_a)} and {list(runs_b)}")
    ka = len(runs_a)
    rng = np.random.default_rng(seed + 1)  # the run draws, apart from the sample draws
    pick_a = rng.integers(0, ka, size=(n_boot, ka))
    pick_b = ka + rng.integers(0, len(runs_b), size=(n_boot, len(runs_b)))

    def recipe_diff(draws: np.ndarray) -> tuple[float, np.ndarray]:
        boot = draws[1:]
        a = np.take_along_axis(boot, pick_a, axis=1).mean(1)
        b = np.take_along_axis(boot, pick_b, axis=1).mean(1)
        return float(draws[0, :ka].mean() - draws[0, ka:].mean()), a - b

    out: dict[str, Any] = {"a": list(runs_a), "b": list(runs_b), "level": level}
    table = _paired_scores(records, [*runs, reference], key)
    out["n_samples"] = sum(len(x) for x in table.values())
    rel = _per_method_draws(table, len(runs), n_boot, seed, rel_ref_col=len(runs))
    if rel is None:
        out.update({"rel_runs": None, "difference": None, "ci": None, "p_a_ahead": None})
    else:
        diff, boot = recipe_diff(rel)
        boot = boot[~np.isnan(boot)]
        out.update({"rel_runs": {m: float(v) for m, v in zip(runs, rel[0])},
                    "rel_a": float(rel[0, :ka].mean()), "rel_b": float(rel[0, ka:].mean()), "difference": diff,
                    "ci": _interval(boot, level), "p_a_ahead": float((boot > 0).mean() + 0.5 * (boot == 0).mean())})
    nll_table = _paired_scores(records, runs, nll_key or key, field)
    out[f"{field}_samples"] = sum(len(x) for x in nll_table.values())
    nll = _per_method_draws(nll_table, len(runs), n_boot, seed, rel_ref_col=None)
    ok = nll is not None and min(len(x) for x in nll_table.values()) >= 2
    if nll is None:
        out.update({f"{field}_runs": None, f"{field}_difference": None, f"{field}_ci": None, f"{field}_p_a_lower": None})
    else:
        diff, boot = recipe_diff(nll)
        out.update({f"{field}_runs": {m: float(v) for m, v in zip(runs, nll[0])}, f"{field}_difference": diff,
                    f"{field}_ci": _interval(boot, level) if ok else None,
                    f"{field}_p_a_lower": float((boot < 0).mean() + 0.5 * (boot == 0).mean()) if ok else None})
    return out
