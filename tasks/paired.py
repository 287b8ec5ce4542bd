"""Scores of two codec versions judged on the samples both answered (bench-regress and promotion).

A rel. score over a few samples per task moves by ~0.1 between two equally good codecs (two training
runs of one recipe differ by 0.08-0.18 here), so a fixed tolerance on point scores fails good codecs and
passes bad ones by chance. Both gates instead take, per context length, rel_score of one version minus
the other's on the same samples with a paired bootstrap interval (`residualkv.evaluation.stats`): worse
only when the interval lies wholly below -tolerance. Beside it, where both runs scored the gold answers,
the answer NLL (nats per token of the right answer teacher-forced through the cache) of one minus the
other's: continuous, so it sees a codec that makes right answers less likely before enough of them flip
to move a string-match score; worse only when its interval lies wholly above +nll_tolerance. The registry
judges those intervals without importing the evaluation code; this module computes them.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import registry
from registry.store import client, retrying
from residualkv.evaluation.report import read_predictions

from .tracking import headline_metrics
from .validation import validate_benchmark

PREDICTIONS_ARTIFACT = "tables/benchmark_predictions.jsonl"  # where log_results puts the harness's predictions


ANSWER_NLL_TOLERANCE = registry.PromotionRule.answer_nll_tol  # nats per token; one number for both gates


@dataclass
class PairedCheck:
    """The measured version minus the baseline on the samples both answered: rel_score (higher is better; a
    regression is an interval wholly below -tolerance) or answer_nll (lower is better; wholly above
    +tolerance). `p_ahead`: the share of resamples where the measured version is the better one."""
    context_len: int
    n_samples: int
    difference: float
    ci: list[float]
    p_ahead: float
    tolerance: float
    quantity: str = "rel_score"

    @property
    def metric(self) -> str:
        return f"{self.quantity}_ctx{self.context_len} paired ({self.n_samples} samples)"

    @property
    def lower_is_better(self) -> bool:
        return self.quantity == "answer_nll"

    @property
    def regressed(self) -> bool:
        return self.ci[0] > self.tolerance if self.lower_is_better else self.ci[1] < -self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "quantity": self.quantity, "context_len": self.context_len,
                "n_samples": self.n_samples, "difference": self.difference, "ci": self.ci, "p_ahead": self.p_ahead,
                "tolerance": self.tolerance, "regressed": self.regressed}


def paired_checks(measured: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]], method: str,
                  tolerance: float, nll_tolerance: float | None = ANSWER_NLL_TOLERANCE) -> list[PairedCheck]:
    """Per context length: a rel_score check where both runs have samples and the full cache scores (the
    measured run's full-cache rows are the reference for both: same backbone, same samples), and an answer_nll
    check where both scored the gold answers on at least two samples of every task (None: no answer_nll checks)."""
    from residualkv.evaluation.harness import REFERENCE, compare_by_length

    records = [dict(r, method="measured") if r["method"] == method else r
               for r in measured if r["method"] in (method, REFERENCE)]
    records += [dict(r, method="baseline") for r in baseline if r["method"] == method]
    out = []
    for c in compare_by_length(records, "measured", "baseline"):
        if c["difference"] is not None:
            out.append(PairedCheck(c["context_len"], c["n_samples"], c["difference"], c["ci"], c["p_a_ahead"],
                                   tolerance))
        if nll_tolerance is not None and c["answer_nll_ci"] is not None:
            out.append(PairedCheck(c["context_len"], c["answer_nll_samples"], c["answer_nll_difference"],
                                   c["answer_nll_ci"], c["answer_nll_p_a_lower"], nll_tolerance, "answer_nll"))
    return out


ANSWER_FLIPS = 1.0  # answers a re-run may lose, net, against its own stored run (bench-regress --flips)


@dataclass
class FlipCheck:
    """A version re-run against its own stored predictions at one context length: the score lost and gained
    on the same samples, in answers (a sample scored 0.5 counts half). On one machine a re-run is
    deterministic, so any change is the code's; but on another CPU float rounding can flip a greedy answer
    either way, and one answer of a few samples per task moves a score by more than a useful tolerance. Up
    to `allowed` answers lost net of those gained are forgiven; more is a regression."""
    context_len: int
    n_samples: int
    lost: float
    gained: float
    allowed: float

    @property
    def metric(self) -> str:
        return f"answers_ctx{self.context_len} vs the stored run ({self.n_samples} samples)"

    @property
    def regressed(self) -> bool:
        return self.lost - self.gained > self.allowed + 1e-9

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "context_len": self.context_len, "n_samples": self.n_samples, "lost": self.lost,
                "gained": self.gained, "allowed": self.allowed, "regressed": self.regressed}


def flip_checks(measured: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]], method: str,
                allowed: float = ANSWER_FLIPS) -> list[FlipCheck]:
    """Per context length, the answers of `method` that the re-run `measured` lost and gained against the
    `stored` run on the samples both answered (none shared: no checks)."""
    from residualkv.evaluation.harness import sample_key

    before = {sample_key(r): float(r["score"]) for r in stored if r["method"] == method}
    tally: dict[Any, list[float]] = {}
    for r in measured:
        key = sample_key(r) if r["method"] == method else None
        if key in before:
            t = tally.setdefault(r.get("context_len"), [0, 0.0, 0.0])
            change = float(r["score"]) - before[key]
            t[0] += 1
            t[1] += max(-change, 0.0)
            t[2] += max(change, 0.0)
    return [FlipCheck(L, int(n), lost, gained, allowed) for L, (n, lost, gained) in tally.items()]


def judges_scores(checks: Sequence[PairedCheck]) -> bool:
    """Whether the checks include rel_score ones, which then stand in for the point scores' fixed tolerance."""
    return any(c.quantity == "rel_score" for c in checks)


def result_predictions(result: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The per-sample predictions of a `run_evaluation` result (None when its files hold none)."""
    found = [Path(f) for f in result.get("files", []) if str(f).endswith("_predictions.jsonl") and Path(f).is_file()]
    return read_predictions(found[0]) if found else None


def stored_predictions(mv) -> list[dict[str, Any]] | None:
    """The per-sample predictions the pipeline logged beside a version's benchmark (None for versions without)."""
    if not getattr(mv, "run_id", None):
        return None
    folder = PREDICTIONS_ARTIFACT.rpartition("/")[0]
    try:
        listed = retrying(client().list_artifacts, mv.run_id, folder)
        if not any(f.path == PREDICTIONS_ARTIFACT for f in listed):
            return None  # a version registered without them: the caller falls back to the fixed tolerance
        with tempfile.TemporaryDirectory() as tmp:
            return read_predictions(retrying(client().download_artifacts, mv.run_id, PREDICTIONS_ARTIFACT, tmp))
    except Exception as error:  # noqa: BLE001 - an outage is not "no predictions": the caller stops (exit 2)
        raise registry.RegistryError(f"could not read the per-sample predictions of {mv.name} v{mv.version} "
                                     f"(run {mv.run_id}) from the artifact store: {type(error).__name__}: {error}; "
                                     "check the store and try again") from error


def baseline_of(mv, suite: Mapping[str, Any], remeasure: Callable[[str], Mapping[str, Any]],
                method: str) -> dict[str, Any]:
    """Another version as the baseline of a candidate benchmarked on `suite`: its stored metrics and predictions
    when it was benchmarked on the same suite, else both from `remeasure(codec_dir)` (a `run_evaluation` result)."""
    if registry.version_suite(mv) == suite:
        return {"version": str(mv.version), "metrics": registry.version_metrics(mv),
                "predictions": stored_predictions(mv), "remeasured": False}
    result = remeasure(str(registry.fetch_codec_dir(f"models:/{mv.name}/{mv.version}")))
    # judged against only if it is a valid table (the candidate's own table passed before it was registered)
    validate_benchmark(result["rows"], methods=suite["methods"], table=f"v{mv.version}'s re-measured benchmark",
                       consequence=f"nothing can be judged against v{mv.version} (a candidate registered before "
                                   "this check stays registered, not promoted)")
    return {"version": str(mv.version), "metrics": headline_metrics(result["rows"], method),
            "predictions": result_predictions(result), "remeasured": True}


def judge_paired(mine: Sequence[Mapping[str, Any]] | None, theirs: Sequence[Mapping[str, Any]] | None,
                 method: str, tolerance: float, *, side: str = "baseline",
                 nll_tolerance: float | None = ANSWER_NLL_TOLERANCE) -> tuple[list[PairedCheck], str]:
    """(checks, why): `why` says why there are no rel_score checks, so a caller that falls back to the point
    scores can say so (answer_nll checks may still be there)."""
    if mine is None or theirs is None:
        missing = side if mine is not None else "measured run"
        return [], f"no per-sample predictions stored for the {missing}"
    checks = paired_checks(mine, theirs, method, tolerance, nll_tolerance)
    if not judges_scores(checks):
        return checks, ("no paired comparison of scores (no shared samples, or the full cache scores 0 on them, "
                        "or a task has a single sample)")
    return checks, ""
