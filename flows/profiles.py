"""Pipeline profiles: `configs/pipelines/<name>.yaml`, read into one typed object and checked up front.

A profile names the backbones to train codecs for and the settings of every step of the retraining
flow (data, training, accounting, evaluation, throughput, registry, schedule). Unknown keys fail
loudly, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from residualkv.config import InputError
from residualkv.paths import configs_dir
from residualkv.training.trainer import TrainConfig

SECTIONS = {
    "name": None, "description": None, "backbones": None, "data": None, "train": None, "accounting": None,
    "evaluate": None, "throughput": None, "registry": None, "schedule": None,
}
DEFAULTS: dict[str, Any] = {
    "data": {"source": "offline", "seq_len": 512, "text_field": "text"},
    # every TrainConfig field (its own default; seq_len comes from `data`), plus the pipeline's keys
    "train": {**{f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "seq_len"},
              "bits": None, "d_c": None, "d_ff": None, "retries": 1, "torch_threads": None,
              "launch": None},  # e.g. ["--multi_gpu", "--num_processes", "8"]: train under `accelerate launch`
    "accounting": {"methods": ["full", "kivi4", "kivi2", "residualkv-dagger", "residualkv", "residualkv-int2"],
                   "context_lens": [2048], "kr_tol": 0.03},
    "evaluate": {"methods": ["full", "kivi4", "kivi2", "residualkv-dagger", "residualkv", "residualkv-int2"],
                 "options": {}},
    "throughput": {"methods": ["full", "residualkv"], "context_lens": [1024, 2048], "new_tokens": 16, "repeats": 1,
                   "gpu_script": "benchmarks/gpu_bench.py"},
    "registry": {"model_name": "rkv-{backbone}", "method": "residualkv", "register": True, "promote": True,
                 "tracking_uri": None,  # None: $MLFLOW_TRACKING_URI, else the embedded SQLite store
                 "promotion": {"score_metric": "rel_score", "score_tol": 0.01, "kr_metric": "kr_measured",
                               "kr_tol": 0.005, "higher_is_better": True, "ppl_metric": "ppl_rel", "ppl_tol": 0.05,
                               "paired": True, "answer_nll_tol": 0.05}},
    "schedule": {"cron": "0 3 * * 1", "timezone": "UTC", "deployment": None},
}


class ProfileError(InputError):
    """A pipeline profile is malformed; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    backbones: list[Any]  # registered names, YAML paths, or {name, tiny_random: {...}} entries
    data: dict[str, Any]
    train: dict[str, Any]
    accounting: dict[str, Any]
    evaluate: dict[str, Any]
    throughput: dict[str, Any]
    registry: dict[str, Any]
    schedule: dict[str, Any]
    path: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


def profile_path(name_or_path: str | Path) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.is_file():
            raise ProfileError(f"no pipeline profile at {candidate}")
        return candidate.resolve()
    folder = configs_dir() / "pipelines"
    path = folder / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ProfileError(f"unknown pipeline profile {str(name_or_path)!r}; known: {', '.join(list_profiles())} "
                           f"(in {folder}), or pass a path to a profile YAML")
    return path


def _merge(section: str, given: Any, where: Path) -> dict[str, Any]:
    default = DEFAULTS[section]
    if given is None:
        return copy.deepcopy(default)
    if not isinstance(given, dict):
        raise ProfileError(f"{where}: `{section}` must be a mapping")
    open_keys = {"options"} if section == "evaluate" else set()
    unknown = sorted(set(given) - set(default) - open_keys)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown} in `{section}`; known: {sorted(default)}")
    out = copy.deepcopy(default)
    for key, value in given.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict) and key != "options":
            bad = sorted(set(value) - set(out[key]))
            if bad:
                raise ProfileError(f"{where}: unknown key(s) {bad} in `{section}.{key}`; known: {sorted(out[key])}")
            out[key].update(value)
        else:
            out[key] = value
    return out


def load_profile(name_or_path: str | Path) -> Profile:
    path = profile_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ProfileError(f"{path}: not valid YAML{where} ({getattr(error, 'problem', None) or error}); "
                           "fix the syntax there") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: expected a mapping with keys {sorted(SECTIONS)}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ProfileError(f"{path}: unknown top-level key(s) {unknown}; known: {sorted(SECTIONS)}")
    backbones = raw.get("backbones")
    if not backbones or not isinstance(backbones, list):
        raise ProfileError(f"{path}: `backbones` must be a non-empty list (registered names, YAML paths, or "
                           "{name, tiny_random} entries)")
    for entry in backbones:
        if isinstance(entry, dict) and not ({"name", "tiny_random"} <= set(entry)):
            raise ProfileError(f"{path}: backbone entry {entry} needs `name` and `tiny_random`")
        if not isinstance(entry, (str, dict)):
            raise ProfileError(f"{path}: backbone entry {entry!r} must be a name, a path or a mapping")
    sections = {s: _merge(s, raw.get(s), path) for s in DEFAULTS}
    train = sections["train"]
    if train["steps"] is None and train["minutes"] is None:
        raise ProfileError(f"{path}: set train.steps (schedule length) or train.minutes (time budget)")
    try:  # the training settings fail here, not in the training task after the data is packed
        TrainConfig(seq_len=sections["data"]["seq_len"],
                    **{f.name: train[f.name] for f in dataclasses.fields(TrainConfig) if f.name != "seq_len"})
    except InputError as error:
        raise ProfileError(f"{path}: train: {error}") from None
    for key, value in sections["registry"]["promotion"].items():  # read only when a codec is promoted
        want = type(DEFAULTS["registry"]["promotion"][key])
        if value is None and key in ("ppl_metric", "answer_nll_tol"):
            continue  # None switches that guard off
        if not (isinstance(value, bool) if want is bool else
                isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else isinstance(value, want)):
            kind = {bool: "true or false", float: "a number", str: "a metric name"}[want]
            raise ProfileError(f"{path}: registry.promotion.{key} is {value!r}; it must be {kind}")
    _check_registry_and_schedule(path, sections)
    for section in ("accounting", "throughput"):
        lens = sections[section]["context_lens"]
        if not isinstance(lens, list) or not lens or not all(_positive_int(n) for n in lens):
            raise ProfileError(f"{path}: {section}.context_lens is {lens!r}; it must be a list of positive token "
                               "counts, e.g. [2048, 4096]")
    for key in ("new_tokens", "repeats"):
        if not _positive_int(sections["throughput"][key]):
            raise ProfileError(f"{path}: throughput.{key} is {sections['throughput'][key]!r}; it must be a positive integer")
    if sections["registry"]["method"] not in sections["evaluate"]["methods"]:
        raise ProfileError(f"{path}: registry.method {sections['registry']['method']!r} must be one of "
                           f"evaluate.methods {sections['evaluate']['methods']}")
    if "full" not in sections["evaluate"]["methods"]:
        raise ProfileError(f"{path}: evaluate.methods must include 'full' (scores are relative to the full cache)")
    from residualkv.evaluation.harness import VARIANTS_HELP, evaluate, known_method

    options = sections["evaluate"]["options"]
    if not isinstance(options, dict):
        raise ProfileError(f"{path}: `evaluate.options` must be a mapping of residualkv.evaluation.evaluate keywords")
    # the pipeline passes these itself; any other keyword must be one evaluate() takes, or it fails after training
    settable = sorted(set(inspect.signature(evaluate).parameters) - {
        "model", "tokenizer", "methods", "codec", "base_config", "out_dir", "stem", "json_path", "progress"})
    bad = sorted(set(options) - set(settable))
    if bad:
        raise ProfileError(f"{path}: unknown key(s) {bad} in `evaluate.options`; known: {settable}")

    for section in ("accounting", "evaluate", "throughput"):
        unknown_methods = [m for m in sections[section]["methods"] if not known_method(m)]
        if unknown_methods:
            from residualkv.methods import METHODS

            raise ProfileError(f"{path}: unknown method(s) {unknown_methods} in `{section}.methods`; known: "
                               f"{', '.join(METHODS)}; and variants: {VARIANTS_HELP}")
    return Profile(name=str(raw.get("name") or path.stem), description=str(raw.get("description") or ""),
                   backbones=list(backbones), path=path, raw=raw, **sections)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_registry_and_schedule(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    """What the flow reads only after training (the model name, the promotion metrics) or the deployment
    only once its server runs (the cron), checked at load: a typo fails in a second, not after an hour,
    and a misspelt metric does not leave a scheduled job that never promotes."""
    from tasks.tracking import known_metric

    name = sections["registry"]["model_name"]
    try:
        formatted = name.format(backbone="b") if isinstance(name, str) else None
    except (KeyError, IndexError, ValueError, AttributeError) as error:
        raise ProfileError(f"{path}: registry.model_name {name!r} cannot be formatted ({type(error).__name__}: "
                           f"{error}); the only placeholder is {{backbone}}, e.g. 'rkv-{{backbone}}'") from None
    if not formatted:
        raise ProfileError(f"{path}: registry.model_name is {name!r}; give a name such as 'rkv-{{backbone}}'")
    for key in ("score_metric", "kr_metric", "ppl_metric"):
        metric = sections["registry"]["promotion"][key]
        if metric is not None and not known_metric(metric):
            raise ProfileError(f"{path}: registry.promotion.{key} {metric!r} is not a metric a version stores; use "
                               "one of rel_score, score, kr_measured, kr_formula, cr, ppl, ppl_rel, answer_nll, "
                               "answer_nll_delta, NAME_ctxL (one context length), task.TASK or decode_tok_s_ctxL")
    cron, tz = sections["schedule"]["cron"], sections["schedule"]["timezone"] or "UTC"
    if cron is not None:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        from prefect.schedules import Cron

        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise ProfileError(f"{path}: schedule.timezone {tz!r} is not an IANA time zone; e.g. UTC or "
                               "Europe/Berlin") from None
        try:
            Cron(str(cron), timezone=tz)
        except ValueError as error:
            raise ProfileError(f"{path}: schedule.cron {cron!r}: {error}; write five fields, minute hour day "
                               "month weekday, e.g. '0 3 * * 1' (Mondays 03:00), or null for no schedule") from None


def list_profiles() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "pipelines").glob("*.yaml"))
