"""The retraining flow: one codec per backbone of a pipeline profile, validated, benchmarked, registered.

    profile -> prepare backbones -> start MLflow runs -> pack data -> train codecs      (mapped over backbones)
            -> per backbone: KR/CR table -> validate (pandera) -> benchmark -> validate (pandera)
                             -> throughput -> log tables/plots/metrics -> register -> promote

A failed validation stops that backbone with a readable report in the log and on its MLflow run, and
nothing is registered for it. Re-running the flow resumes: finished steps are reused (tasks.cache),
an interrupted training run continues from its last checkpoint.
"""

from __future__ import annotations

import re
import time
import traceback
from typing import Any

from registry import env as _env

_env.configure()

from prefect import flow, unmapped  # noqa: E402
from prefect.context import get_run_context  # noqa: E402

import registry  # noqa: E402
from residualkv.paths import data_dir  # noqa: E402
from tasks.backbones import backbone_name, resolve_backbone  # noqa: E402
from tasks.common import say, set_threads  # noqa: E402
from tasks.data import pack_data  # noqa: E402
from tasks.measure import evaluate_codec, kr_cr_table, profile_throughput  # noqa: E402
from tasks.paired import baseline_of, judge_paired, result_predictions  # noqa: E402
from tasks.tracking import (  # noqa: E402
    end_run, headline_metrics, log_failure, log_results, promote_version, register_codec_version, start_run,
    suite_spec,
)
from tasks.train import train_codec  # noqa: E402
from tasks.validation import TableValidationError, validate_benchmark_table, validate_kr_cr_table  # noqa: E402

from .profiles import Profile, load_profile  # noqa: E402
from .summary import pipeline_summary  # noqa: E402


def _flow_run_name() -> str:
    try:
        return str(get_run_context().flow_run.name)
    except Exception:  # noqa: BLE001
        return time.strftime("%Y%m%d-%H%M%S")


@flow(name="rkv-retrain", log_prints=False)
def retrain_flow(profile: str = "quick") -> dict[str, Any]:
    """Retrain, validate, benchmark and register a codec for every backbone of `profile`."""
    prof = load_profile(profile)
    if prof.registry.get("tracking_uri"):
        _env.use_tracking_uri(prof.registry["tracking_uri"])
    set_threads(prof.train.get("torch_threads"))
    run_name = _flow_run_name()
    reports_root = data_dir() / "pipeline" / "reports" / prof.name / run_name
    names = [backbone_name(b) for b in prof.backbones]
    say(f"profile {prof.name}: backbones {names}; MLflow store {_env.tracking_uri()}")

    # mapped over the backbones: each training run is independent (scale out with workers / accelerate)
    refs = [resolve_backbone(b) for b in prof.backbones]
    runs = start_run.map(names, profile=unmapped(prof.name), params=unmapped(_params(prof)), flow_run=unmapped(run_name))
    packed = pack_data.map(refs, data=unmapped(prof.data))
    trained = train_codec.with_options(retries=int(prof.train.get("retries", 1))).map(
        refs, packed, config=unmapped(_train_config(prof)), run_id=runs)

    results = []
    for entry, name, ref, run, train in zip(prof.backbones, names, refs, runs, trained):
        results.append(benchmark_and_register(prof, entry, name, ref, run, train, str(reports_root / name)))

    status = "ok" if all(r["status"] == "registered" or r["status"] == "validated" for r in results) else "failed"
    summary = {"profile": prof.name, "status": status, "backbones": results, "reports_root": str(reports_root),
               "tracking_uri": _env.tracking_uri(), "flow_run": run_name}
    print(pipeline_summary(summary), flush=True)
    if status != "ok":
        failed = [r["backbone"] for r in results if r["status"] not in ("registered", "validated")]
        raise PipelineFailed(f"backbone(s) {failed} failed; see the report above", summary)
    return summary


class PipelineFailed(RuntimeError):
    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


def benchmark_and_register(prof: Profile, entry: Any, name: str, ref: str, run_future, train_future,
                           report_dir: str) -> dict[str, Any]:
    """The per-backbone tail of the DAG; returns a summary row instead of raising, so one backbone's
    failure does not hide the others' results (the flow fails at the end). A step that fails after
    validation (registration, the champion's re-measurement, promotion) fails the backbone too: the
    row keeps what was done, and its status is "failed"."""
    out: dict[str, Any] = {"backbone": name, "status": "failed", "run_id": None, "report_dir": report_dir}
    run_id = None
    try:
        run_id = out["run_id"] = run_future.result()
        train = train_future.result()
        out["train"] = {k: train.get(k) for k in ("codec_dir", "steps", "total_steps", "resumed_from", "cached",
                                                   "train_seconds", "run_dir")}
        codec_dir = train["codec_dir"]

        kr = kr_cr_table(ref, codec_dir, prof.accounting)
        validate_kr_cr_table(kr, prof.accounting["methods"], float(prof.accounting["kr_tol"]))
        out["kr_cr_rows"] = kr["rows"]

        bench = evaluate_codec(ref, codec_dir, prof.evaluate)
        validate_benchmark_table(bench, prof.evaluate["methods"])
        out["bench_rows"] = bench["rows"]

        speed = profile_throughput(ref, codec_dir, prof.throughput)
        out["speed_rows"] = speed["rows"]

        logged = log_results(run_id, report_dir, train, kr, bench, speed, f"{name} ({prof.name})")
        out["plots"] = logged["plots"]
        out["status"] = "validated"

        reg_cfg = prof.registry
        if reg_cfg["register"]:
            method = reg_cfg["method"]
            metrics = headline_metrics(bench["rows"], method, speed["rows"])
            suite = suite_spec(entry, ref, prof.evaluate, method)
            model_name = reg_cfg["model_name"].format(backbone=name)
            tags = {"profile": prof.name, "method": method, "train_steps": train.get("steps"),
                    "data_fingerprint": train.get("data_fingerprint", ""), "train_key": train.get("key", ""),
                    "train_dir": train.get("run_dir", "")}
            reg = register_codec_version(run_id, codec_dir, model_name, metrics, suite, tags, report_dir,
                                         speed_suite=prof.throughput)
            out["registered"] = reg
            out["status"] = "registered"
            if reg_cfg["promote"]:
                champ = champion_on_this_suite(model_name, reg["version"], ref, prof, suite)
                rule = registry.PromotionRule(**reg_cfg["promotion"])
                paired, note = judge_paired(result_predictions(bench), champ["predictions"], method, rule.score_tol,
                                            side="champion", nll_tolerance=rule.answer_nll_tol
                                            ) if rule.uses_paired() else ([], "")
                out["promotion"] = promote_version(model_name, reg["version"], reg_cfg["promotion"], champ["metrics"],
                                                   [p.as_dict() for p in paired], note, champ["version"])
        end_run(run_id, "FINISHED")
    except TableValidationError as error:
        say(str(error), error=True)
        out["status"], out["error"] = "failed", str(error)
        _safe(log_failure, run_id, re.sub(r"[^A-Za-z0-9_.-]+", "_", error.table), str(error))  # a file name
        _safe(end_run.fn, run_id, "FAILED", str(error))
    except Exception as error:  # noqa: BLE001 - reported per backbone, the flow fails at the end
        out["status"], out["error"] = "failed", f"{type(error).__name__}: {error}"
        say(traceback.format_exc(), error=True)
        if run_id is not None:
            _safe(end_run.fn, run_id, "FAILED", traceback.format_exc())
    return out


def champion_on_this_suite(model_name: str, candidate: str, ref: str, prof: Profile,
                           suite: dict[str, Any]) -> dict[str, Any]:
    """The champion to judge the candidate against: its version, its metrics on the candidate's suite (None:
    the stored ones are comparable) and its per-sample predictions there (stored, or from the re-measurement)."""
    try:
        champ = registry.get_version(f"models:/{model_name}@champion")
    except registry.RegistryError:
        champ = None
    if champ is None or str(champ.version) == str(candidate):
        return {"version": champ and str(champ.version), "metrics": None, "predictions": None}
    if registry.version_suite(champ) != suite:
        say(f"champion v{champ.version} was benchmarked on another suite: re-evaluating it on this one")
    base = baseline_of(champ, suite, lambda d: evaluate_codec(ref, d, prof.evaluate), suite["method"])
    return base | {"metrics": base["metrics"] if base["remeasured"] else None}


def _safe(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001
        say(f"(could not record the failure in MLflow: {error})")


def _params(prof: Profile) -> dict[str, Any]:
    return {"profile": prof.name, "profile_digest": prof.digest(), "data": prof.data, "train": prof.train,
            "accounting": prof.accounting, "evaluate": prof.evaluate, "throughput": prof.throughput,
            "registry": prof.registry}


def _train_config(prof: Profile) -> dict[str, Any]:
    cfg = dict(prof.train)
    cfg["seq_len"] = int(prof.data["seq_len"])
    return cfg


def run_profile(profile: str) -> tuple[int, dict[str, Any] | None]:
    """Run the flow in this process (Prefect's ephemeral API); (exit code, summary)."""
    try:
        summary = retrain_flow(profile)
        return 0, summary
    except PipelineFailed as error:
        return 1, error.summary


if __name__ == "__main__":
    import sys

    code, _ = run_profile(sys.argv[1] if len(sys.argv) > 1 else "quick")
    sys.exit(code)
