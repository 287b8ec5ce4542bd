"""The CI benchmark-regression gate: re-evaluate a registered codec version and compare.

    rkv bench-regress                                    # models:/rkv-<backbone>@champion (profile quick)
    rkv bench-regress --codec models:/rkv-smollm2-135m@candidate --tolerance 0.02

The version's benchmark is re-run from scratch (no cache) with the suite stored on the version
(`rkv.suite`: backbone, methods, harness options). The measured figures of the registered method
are compared with a baseline:
  - the version's own stored metrics, when it is the champion (or there is none): did the code change
    what this codec delivers?
  - the champion's stored metrics, when the version is not the champion (a fresh @candidate): is the
    candidate worse than what is served? (The champion is re-measured on the candidate's suite when the
    two were benchmarked on different suites.)
Gated metrics and directions: score, rel_score, task.* (higher is better, absolute tolerance);
kr_measured (lower is better, absolute tolerance); ppl, ppl_rel (lower is better, relative tolerance).
Exit 0: no regression; 1: regressions (a table says which); 2: the version cannot be checked.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import registry
from registry.store import client, experiment_id, retrying
from tasks.backbones import resolve_backbone
from tasks.measure import run_evaluation
from tasks.tracking import headline_metrics, metric_direction

from .summary import table


@dataclass
class Comparison:
    metric: str
    baseline: float
    measured: float | None
    direction: str
    kind: str
    tolerance: float

    @property
    def delta(self) -> float | None:
        return None if self.measured is None else self.measured - self.baseline

    @property
    def allowed(self) -> float:
        return self.tolerance * abs(self.baseline) if self.kind == "rel" else self.tolerance

    @property
    def regressed(self) -> bool:
        if self.measured is None or not math.isfinite(self.measured):
            return True
        worse = (self.baseline - self.measured) if self.direction == "max" else (self.measured - self.baseline)
        return worse > self.allowed + 1e-12


@dataclass
class RegressReport:
    uri: str
    version: str
    baseline_source: str
    comparisons: list[Comparison] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.regressed]

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and not self.regressions

    def text(self) -> str:
        rows = []
        for c in self.comparisons:
            sign = ">=" if c.direction == "max" else "<="
            bound = c.baseline - c.allowed if c.direction == "max" else c.baseline + c.allowed
            rows.append([c.metric, f"{c.baseline:.4f}", "-" if c.measured is None else f"{c.measured:.4f}",
                         "-" if c.delta is None else f"{c.delta:+.4f}", f"{sign} {bound:.4f}",
                         "REGRESSION" if c.regressed else "ok"])
        head = (f"bench-regress {self.uri} (v{self.version}) vs {self.baseline_source}: "
                f"{'PASS' if self.passed else 'FAIL'} - {len(self.regressions)} regression(s) in {len(self.comparisons)} metrics")
        return head + "\n" + table(["metric", "baseline", "measured", "delta", "allowed", "status"], rows)


def compare(baseline: Mapping[str, float], measured: Mapping[str, float], tolerance: float) -> list[Comparison]:
    out = []
    for metric in sorted(baseline):
        how = metric_direction(metric)
        if how is None:
            continue
        out.append(Comparison(metric, float(baseline[metric]), measured.get(metric), how[0], how[1], tolerance))
    return out


def _baseline(mv, against: str) -> tuple[str, Any]:
    """(description, version whose metrics are the baseline)."""
    try:
        champ = registry.get_version(f"models:/{mv.name}@champion")
    except registry.RegistryError:
        champ = None
    if against == "self" or champ is None or str(champ.version) == str(mv.version):
        return f"its stored metrics (v{mv.version})", mv
    if against in ("champion", "auto"):
        return f"the champion's stored metrics (v{champ.version})", champ
    raise ValueError(f"against={against!r}: use auto, self or champion")


def bench_regress(uri: str, tolerance: float = 0.02, against: str = "auto", progress: bool = True,
                  log_to_mlflow: bool = True) -> RegressReport:
    mv = registry.get_version(uri)
    suite = registry.version_suite(mv)
    if not suite:
        raise registry.RegistryError(f"{uri} (v{mv.version}) carries no benchmark suite ({registry.codecs.SUITE_TAG}); "
                                     "only versions registered by the pipeline can be re-checked")
    ref = resolve_backbone(suite["backbone_entry"]) if isinstance(suite.get("backbone_entry"), dict) else suite["backbone_ref"]
    codec_dir = str(registry.fetch_codec_dir(f"models:/{mv.name}/{mv.version}"))  # verified: complete, sha256
    config = {"methods": suite["methods"], "options": suite["options"]}
    result = run_evaluation(ref, codec_dir, config, use_cache=False, progress=progress)  # from scratch
    measured = headline_metrics(result["rows"], suite["method"])

    source, base_mv = _baseline(mv, against)
    baseline = registry.version_metrics(base_mv)
    if base_mv is not mv and registry.version_suite(base_mv) != suite:
        base_dir = str(registry.fetch_codec_dir(f"models:/{base_mv.name}/{base_mv.version}"))
        rows = run_evaluation(ref, base_dir, config, progress=progress)["rows"]
        baseline = headline_metrics(rows, suite["method"])
        source = f"the champion (v{base_mv.version}) re-measured on this suite"
    report = RegressReport(uri=uri, version=str(mv.version), baseline_source=source,
                           comparisons=compare(baseline, measured, tolerance), measured=measured, rows=result["rows"])
    if log_to_mlflow:
        _log(report, mv, tolerance)
    return report


def _log(report: RegressReport, mv, tolerance: float) -> None:
    """A `bench-regress` run in MLflow (metrics + the table) and a tag on the version with the outcome."""
    from mlflow.entities import Metric

    c = client()
    run = retrying(c.create_run, experiment_id(), run_name=f"bench-regress-{mv.name}-v{mv.version}",
                   tags={"rkv.kind": "bench-regress", "model": mv.name, "version": str(mv.version),
                         "rkv.tolerance": str(tolerance), "rkv.passed": str(report.passed).lower()})
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in report.measured.items() if math.isfinite(v)]
    if metrics:
        retrying(c.log_batch, run.info.run_id, metrics=metrics)
    retrying(c.log_text, run.info.run_id, report.text() + "\n", "bench_regress.txt")
    retrying(c.log_text, run.info.run_id, json.dumps(report.rows, indent=2, default=str), "benchmark.json")
    retrying(c.set_terminated, run.info.run_id, "FINISHED" if report.passed else "FAILED")
    retrying(c.set_model_version_tag, mv.name, str(mv.version), "rkv.bench_regress",
             f"{'pass' if report.passed else 'fail'} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
             f"run {run.info.run_id}")
