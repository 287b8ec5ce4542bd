"""Registering codec versions, the `candidate`/`champion` aliases, and the promotion rule.

A registered version carries everything serving and auditing need:

  artifacts (of the run that produced it)   codec/codec.safetensors, codec/codec.json (dims, cache
                                            config, backbone fingerprint, weights sha256), plus any
                                            tables and plots the pipeline adds (kr_cr.csv, benchmark.json, ...)
  version tags                              backbone, fingerprint_hash, kv_digest, sha256, codec_json_sha256,
                                            metric.<name> for every metric (kr_measured, cr, rel_score, ...),
                                            rkv.suite (the benchmark suite that produced the metrics)
  run metrics                               the same metrics, on the version's run
  rkv.complete = "true"                     written last, after the artifacts were uploaded, read back
                                            and verified; the serving loader refuses any version without it

Every new complete version gets the `candidate` alias. `promote_if_not_worse` moves `champion` only
when the candidate passes an explicit `PromotionRule` against the current champion; the rule, the
numbers and the decision are written to the candidate's run (tag + text artifact) and version tags.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from residualkv.codec import META, CodecError, ResidualCodec
from residualkv.saved import sha256_file

from . import env
from .store import client, experiment_id, retrying, store_lock

from mlflow.entities import Metric, RunTag  # noqa: E402  (after env.configure via .store)
from mlflow.exceptions import MlflowException  # noqa: E402

CANDIDATE = "candidate"
CHAMPION = "champion"
COMPLETE_TAG = "rkv.complete"
SUITE_TAG = "rkv.suite"
# the throughput profile the version's decode speed-up comes from; its own tag, so that versions profiled
# differently still share an evaluation suite (and its stored figures) for promotion
SPEED_SUITE_TAG = "rkv.speed_suite"
METRIC_PREFIX = "metric."
CODEC_ARTIFACT_DIR = "codec"


class RegistryError(CodecError):
    """A registry operation failed or a registered version must not be used; the message says why."""


@dataclass(frozen=True)
class RegisteredCodec:
    name: str
    version: str
    run_id: str
    source: str

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def default_model_name(backbone: str) -> str:
    return f"rkv-{backbone}".replace("/", "-").replace(" ", "-") if backbone else "rkv-codec"


def _clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError) as error:
            raise RegistryError(f"metric {key!r} = {value!r} is not a number") from error
        if not math.isfinite(number):
            raise RegistryError(f"metric {key!r} = {value!r} is not finite; refusing to register it")
        out[str(key)] = number
    return out


def _sha_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _download(artifact_uri: str, dst: Path) -> Path:
    import mlflow.artifacts

    path = retrying(mlflow.artifacts.download_artifacts, artifact_uri=artifact_uri, dst_path=str(dst),
                    tracking_uri=env.tracking_uri())
    return Path(path)


def register_codec(codec_dir: str | Path, *, name: str | None = None, metrics: Mapping[str, Any] | None = None,
                   tags: Mapping[str, Any] | None = None, run_id: str | None = None,
                   artifacts: Mapping[str, str | Path] | None = None, suite: Mapping[str, Any] | None = None,
                   description: str | None = None, speed_suite: Mapping[str, Any] | None = None) -> RegisteredCodec:
    """Log a saved codec directory as a run's artifacts and register it as a new, complete version.

    codec_dir   a directory written by `ResidualCodec.save` (verified before anything is logged)
    name        registered model name (default `rkv-<backbone>`)
    metrics     flat {name: number}: logged on the run and stored as `metric.<name>` version tags
    tags        extra version tags (strings)
    run_id      the MLflow run that produced the codec; a new run is made when None
    artifacts   {artifact_path: local file or folder} logged beside the codec (tables, plots, suite)
    suite       the benchmark suite the metrics come from (stored as the `rkv.suite` tag)
    speed_suite the throughput profile its decode speed-up metrics come from (`rkv.speed_suite`)
    """
    codec_dir = Path(codec_dir)
    ResidualCodec.load(codec_dir)  # raises CodecError on a missing, malformed or corrupted codec
    meta = json.loads((codec_dir / META).read_text())
    backbone = meta.get("backbone", "")
    name = name or default_model_name(backbone)
    metrics = _clean_metrics(metrics)
    local_shas = _sha_tree(codec_dir)
    c = client()

    own_run = run_id is None
    if own_run:
        run = retrying(c.create_run, experiment_id(), run_name=f"register-{backbone or 'codec'}",
                       tags={"rkv.kind": "registration", "backbone": backbone})
        run_id = run.info.run_id
    try:
        retrying(c.log_artifacts, run_id, str(codec_dir), CODEC_ARTIFACT_DIR)
        for artifact_path, local in (artifacts or {}).items():
            local = Path(local)
            if local.is_dir():
                retrying(c.log_artifacts, run_id, str(local), artifact_path)
            else:
                retrying(c.log_artifact, run_id, str(local), artifact_path or None)
        if metrics:
            now = _now_ms()
            retrying(c.log_batch, run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                     tags=[RunTag("rkv.codec_sha256", meta.get("weights_sha256", ""))])
        artifact_uri = retrying(c.get_run, run_id).info.artifact_uri
        source = f"{artifact_uri.rstrip('/')}/{CODEC_ARTIFACT_DIR}"
        # Read the upload back before any version points at it.
        with tempfile.TemporaryDirectory(prefix="rkv-verify-") as tmp:
            remote = _sha_tree(_download(source, Path(tmp)))
        if remote != local_shas:
            raise RegistryError(f"uploaded codec differs from {codec_dir}: local {local_shas}, store {remote}")

        _ensure_registered_model(name, backbone)
        version_tags = {
            "backbone": backbone,
            "fingerprint_hash": meta.get("fingerprint_hash", ""),
            # the K/V weights it was trained on (backbones.kv_digest; "" for an untrained codec)
            "kv_digest": meta.get("kv_digest", ""),
            "sha256": meta.get("weights_sha256", ""),
            "codec_json_sha256": local_shas[META],
            "codec_kind": meta.get("dims", {}).get("kind", ""),
            "d_c": str(meta.get("dims", {}).get("d_c", "")),
            # a codec with other latent sizes in some layers ({layer: d_c}; d_c above is the rest's)
            **({"layer_d_c": json.dumps(meta["layer_d_c"], sort_keys=True)} if meta.get("layer_d_c") else {}),
            **{f"{METRIC_PREFIX}{k}": repr(v) for k, v in metrics.items()},
            **{str(k): str(v) for k, v in (tags or {}).items()},
        }
        if suite is not None:
            version_tags[SUITE_TAG] = json.dumps(dict(suite), sort_keys=True)
        if speed_suite is not None:
            version_tags[SPEED_SUITE_TAG] = json.dumps(dict(speed_suite), sort_keys=True)
        mv = retrying(c.create_model_version, name, source, run_id=run_id, tags=version_tags,
                      description=description or f"ResidualKV codec for {backbone}")
        version = str(mv.version)

        # Verify the version as the serving loader will see it, then mark it complete: last write.
        uri = retrying(c.get_model_version_download_uri, name, version)
        with tempfile.TemporaryDirectory(prefix="rkv-verify-") as tmp:
            path = _download(uri, Path(tmp))
            got = _sha_tree(path)
            if got != local_shas:
                raise RegistryError(f"{name} v{version}: registered artifacts differ from the codec that was logged")
            ResidualCodec.load(path)
        retrying(c.set_model_version_tag, name, version, COMPLETE_TAG, "true")
        # The alias only ever points at complete versions, and at the newest one: parallel
        # registrations complete in any order.
        with store_lock("aliases"):
            current = _version(_alias(c, name, CANDIDATE))
            if current is None or int(current) < int(version):
                retrying(c.set_registered_model_alias, name, CANDIDATE, version)
        if own_run:
            retrying(c.set_terminated, run_id, "FINISHED")
        return RegisteredCodec(name=name, version=version, run_id=run_id, source=source)
    except BaseException:
        if own_run:
            try:
                c.set_terminated(run_id, "FAILED")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        raise


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def _ensure_registered_model(name: str, backbone: str) -> None:
    c = client()
    try:
        retrying(c.get_registered_model, name)
        return
    except MlflowException as error:
        if "RESOURCE_DOES_NOT_EXIST" not in str(error.error_code) and "not found" not in str(error).lower():
            raise
    try:
        retrying(c.create_registered_model, name, tags={"backbone": backbone},
                 description=f"ResidualKV KV-cache codecs for {backbone}. Aliases: candidate (newest complete "
                             "version), champion (served; moved only by the promotion rule).")
    except MlflowException as error:  # another process created it first
        if "already exists" not in str(error).lower() and "RESOURCE_ALREADY_EXISTS" not in str(error.error_code):
            raise


# ----------------------------------------------------------------------------------------------
# Reading versions back


def parse_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`models:/NAME@ALIAS` -> (NAME, None, ALIAS); `models:/NAME/VERSION` -> (NAME, VERSION, None)."""
    if not uri.startswith("models:/"):
        raise RegistryError(f"{uri!r} is not a registry URI; use models:/<name>@<alias> or models:/<name>/<version>")
    rest = uri[len("models:/"):].strip("/")
    if "@" in rest:
        name, alias = rest.rsplit("@", 1)
        if name and alias and "/" not in alias:
            return name, None, alias
    else:
        parts = rest.split("/")
        if len(parts) == 2 and parts[0] and parts[1].isdigit():
            return parts[0], parts[1], None
    raise RegistryError(f"cannot read {uri!r}: use models:/<name>@<alias> (e.g. @champion) or models:/<name>/<version>")


def get_version(uri: str):
    """The MLflow ModelVersion a registry URI points at, with a clear error when there is none."""
    name, version, alias = parse_uri(uri)
    c = client()
    try:
        if alias is not None:
            return retrying(c.get_model_version_by_alias, name, alias)
        return retrying(c.get_model_version, name, version)
    except MlflowException as error:
        known = _describe_model(name)
        raise RegistryError(f"{uri}: no such codec version in the registry at {env.tracking_uri()} ({known})") from error


def _describe_model(name: str) -> str:
    c = client()
    try:
        model = retrying(c.get_registered_model, name)
    except MlflowException:
        names = [m.name for m in retrying(c.search_registered_models, max_results=50)]
        return f"no registered model {name!r}; registered: {', '.join(names) or 'none'}"
    aliases = ", ".join(f"@{a}=v{v}" for a, v in sorted(model.aliases.items())) or "no aliases"
    return f"model {name!r} has {aliases}"


def version_metrics(mv) -> dict[str, float]:
    return {k[len(METRIC_PREFIX):]: float(v) for k, v in (mv.tags or {}).items() if k.startswith(METRIC_PREFIX)}


def _json_tag(mv, tag: str) -> dict[str, Any] | None:
    raw = (mv.tags or {}).get(tag)
    return json.loads(raw) if raw else None


def version_suite(mv) -> dict[str, Any] | None:
    return _json_tag(mv, SUITE_TAG)


def version_speed_suite(mv) -> dict[str, Any] | None:
    return _json_tag(mv, SPEED_SUITE_TAG)


def is_complete(mv) -> bool:
    return (mv.tags or {}).get(COMPLETE_TAG) == "true"


def list_versions(name: str) -> list:
    c = client()
    return sorted(retrying(c.search_model_versions, f"name = '{name}'"), key=lambda v: int(v.version))


# ----------------------------------------------------------------------------------------------
# Promotion


@dataclass(frozen=True)
class PromotionRule:
    """The candidate becomes champion iff, on the same benchmark suite,

        candidate[score_metric] >= champion[score_metric] - score_tol      (quality no worse), and
        candidate[kr_metric]    <= champion[kr_metric]    + kr_tol         (no more bytes kept)

        candidate[ppl_metric]   <= champion[ppl_metric] * (1 + ppl_tol)   (perplexity through the cache
                                                                           no worse; when both have it)

    (for a lower-is-better quality metric such as ppl_rel, set higher_is_better=False: then
    candidate <= champion + score_tol). The perplexity guard matters when the task scores carry no
    signal (both 0): quality is then only visible in perplexity. With no champion yet, a complete
    candidate is promoted. A candidate for another backbone (fingerprint) than the champion is never
    promoted under the same name.

    With `paired` (the default) and a rel_score rule, when the caller passes paired differences (the
    candidate's rel_score minus the champion's on the samples both answered, per context length, with a
    95% interval), the quality clause becomes: no interval lies wholly below -score_tol. Two training
    runs of one recipe differ by ~0.1 in point rel_score over a few samples per task, so the point
    clause alone promotes or rejects equally good codecs by chance.
    """

    score_metric: str = "rel_score"
    score_tol: float = 0.01
    kr_metric: str = "kr_measured"
    kr_tol: float = 0.005
    higher_is_better: bool = True
    ppl_metric: str | None = "ppl_rel"
    ppl_tol: float = 0.05
    paired: bool = True
    answer_nll_tol: float | None = 0.05

    def uses_paired(self) -> bool:
        return self.paired and self.higher_is_better and self.score_metric == "rel_score"

    def metrics(self) -> tuple[str, ...]:
        return tuple(m for m in (self.score_metric, self.kr_metric, self.ppl_metric) if m)

    def text(self) -> str:
        quality = (f"candidate.{self.score_metric} >= champion.{self.score_metric} - {self.score_tol}"
                   if self.higher_is_better else
                   f"candidate.{self.score_metric} <= champion.{self.score_metric} + {self.score_tol}")
        ppl = (f" and candidate.{self.ppl_metric} <= champion.{self.ppl_metric} * (1 + {self.ppl_tol})"
               if self.ppl_metric else "")
        paired = (f"; with paired differences on the same samples, the {self.score_metric} clause is instead: "
                  f"no 95% interval of (candidate - champion) lies wholly below -{self.score_tol}"
                  if self.uses_paired() else "")
        if self.uses_paired() and self.answer_nll_tol is not None:
            paired += (f"; and, where both scored the gold answers, no 95% interval of answer_nll (candidate - "
                       f"champion) lies wholly above +{self.answer_nll_tol}")
        return (f"promote iff {quality} and candidate.{self.kr_metric} <= champion.{self.kr_metric} + {self.kr_tol}"
                f"{ppl} (same suite, same backbone fingerprint; no champion -> promote){paired}")


@dataclass
class PromotionDecision:
    name: str
    candidate: str
    champion_before: str | None
    promoted: bool
    reason: str
    rule: dict[str, Any] = field(default_factory=dict)
    candidate_metrics: dict[str, float] = field(default_factory=dict)
    champion_metrics: dict[str, float] = field(default_factory=dict)
    paired: list[dict[str, Any]] = field(default_factory=list)  # the differences the quality clause judged
    paired_note: str = ""  # why the point clause was used, when the rule asks for paired ones

    @property
    def champion_after(self) -> str | None:
        return self.candidate if self.promoted else self.champion_before

    def text(self) -> str:
        lines = [f"model {self.name}: candidate v{self.candidate} vs champion "
                 f"{'v' + self.champion_before if self.champion_before else '(none)'}",
                 f"rule: {PromotionRule(**self.rule).text()}",
                 f"decision: {'PROMOTED' if self.promoted else 'NOT promoted'} - {self.reason}"]
        keys = sorted(set(self.candidate_metrics) | set(self.champion_metrics))
        if keys:
            lines.append(f"{'metric':28s} {'candidate':>12s} {'champion':>12s}")
            for k in keys:
                a, b = self.candidate_metrics.get(k), self.champion_metrics.get(k)
                lines.append(f"{k:28s} {_fmt(a):>12s} {_fmt(b):>12s}")
        for p in self.paired:
            lines.append(f"paired {_quantity(p)} ctx{p['context_len']} ({p['n_samples']} samples): candidate - "
                         f"champion {p['difference']:+.4f} (95% CI {p['ci'][0]:+.4f} .. {p['ci'][1]:+.4f})")
        if self.paired_note:
            lines.append(self.paired_note)
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _quantity(p: Mapping[str, Any]) -> str:
    return p.get("quantity", "rel_score")  # evidence recorded before answer NLL existed is rel_score


def promote_if_not_worse(name: str, version: str | int, rule: PromotionRule | None = None, *,
                         champion_metrics: Mapping[str, float] | None = None,
                         paired: Sequence[Mapping[str, Any]] | None = None, paired_note: str = "",
                         paired_champion: str | None = None) -> PromotionDecision:
    """Move `champion` to `version` when it passes `rule` against the current champion; log the decision.

    `champion_metrics` overrides the champion's stored metrics, for a champion re-evaluated on the
    candidate's suite (the flow does that when the stored suites differ). `paired` are the candidate's
    rel_score differences from champion `paired_champion` on shared samples, each {context_len,
    n_samples, difference, ci: [lo, hi]} (tasks.paired computes them); `paired_note` says why there are
    none. They only count against the champion they were measured against.
    """
    rule = rule or PromotionRule()
    c = client()
    version = str(version)
    cand = retrying(c.get_model_version, name, version)
    cand_m = version_metrics(cand)
    with store_lock("aliases"):
        for _ in range(_PROMOTE_ATTEMPTS):
            champ = _alias(c, name, CHAMPION)
            champ_m = dict(champion_metrics) if champion_metrics is not None else (version_metrics(champ) if champ else {})
            evidence = list(paired or ()) if paired_champion is not None and paired_champion == _version(champ) else []
            promoted, reason = _decide(rule, cand, cand_m, champ, champ_m, champion_metrics is not None, evidence)
            if not promoted:
                break
            # Only an unlocked store (a server, see store_lock) lets another flow move the champion after our read.
            now = _alias(c, name, CHAMPION)
            if _version(now) == _version(champ):
                retrying(c.set_registered_model_alias, name, CHAMPION, version)
                break
            if champion_metrics is not None:
                promoted, reason = False, (f"the champion moved from v{_version(champ)} to v{_version(now)} while this "
                                           "decision was made; champion_metrics describe the old one: re-evaluate the "
                                           "new champion on the candidate's suite and promote again")
                break
        else:
            promoted, reason = False, (f"the champion moved {_PROMOTE_ATTEMPTS} times while this decision was made "
                                       "(other flows promoting at once); promote again")
    decision = PromotionDecision(name=name, candidate=version, champion_before=_version(champ),
                                 promoted=promoted, reason=reason, rule=asdict(rule),
                                 candidate_metrics={k: cand_m[k] for k in rule.metrics() if k in cand_m},
                                 champion_metrics={k: champ_m[k] for k in rule.metrics() if k in champ_m},
                                 paired=evidence if rule.uses_paired() else [],
                                 paired_note=_paired_note(rule, evidence, paired, paired_champion, champ, paired_note))
    _log_decision(decision, cand)
    return decision


_PROMOTE_ATTEMPTS = 5


def _alias(c, name: str, alias: str):
    try:
        return retrying(c.get_model_version_by_alias, name, alias)
    except MlflowException:
        return None


def _version(mv) -> str | None:
    return str(mv.version) if mv is not None else None


def _paired_note(rule: PromotionRule, evidence, paired, paired_champion, champ, note: str) -> str:
    if not rule.uses_paired() or any(_quantity(p) == "rel_score" for p in evidence) or champ is None:
        return ""
    if paired and paired_champion is None:
        return (f"{rule.score_metric} judged by the point clause: paired differences were passed without "
                "paired_champion, the version they were measured against")
    if paired and paired_champion != _version(champ):
        return (f"{rule.score_metric} judged by the point clause: the paired differences were measured against "
                f"v{paired_champion}, the champion is v{_version(champ)}")
    return f"{rule.score_metric} judged by the point clause: {note or 'no paired differences were passed'}"


def _decide(rule: PromotionRule, cand, cand_m, champ, champ_m, fresh_champion: bool,
            paired: Sequence[Mapping[str, Any]] = ()) -> tuple[bool, str]:
    if not is_complete(cand):
        return False, f"candidate v{cand.version} is not complete ({COMPLETE_TAG} missing): it is never served"
    missing = [k for k in (rule.score_metric, rule.kr_metric) if k not in cand_m]
    if missing:
        return False, f"candidate has no stored metric(s) {missing}"
    if champ is None:
        return True, "no champion yet"
    if str(champ.version) == str(cand.version):
        return True, "candidate already is the champion"
    if (champ.tags or {}).get("fingerprint_hash") != (cand.tags or {}).get("fingerprint_hash"):
        return False, ("candidate was trained for another backbone fingerprint than the champion; register it "
                       "under its own model name")
    theirs, ours = (champ.tags or {}).get("kv_digest"), (cand.tags or {}).get("kv_digest")
    if theirs and ours and theirs != ours:
        return False, ("candidate was trained on other weights of the same shape than the champion (another "
                       "checkpoint of the backbone); register it under its own model name")
    if not fresh_champion and version_suite(champ) != version_suite(cand):
        return False, ("champion and candidate were benchmarked on different suites; re-evaluate the champion "
                       "on the candidate's suite and pass champion_metrics")
    missing = [k for k in (rule.score_metric, rule.kr_metric) if k not in champ_m]
    if missing:
        return True, f"champion has no stored metric(s) {missing}; the candidate is the first measured version"
    s_c, s_ch = cand_m[rule.score_metric], champ_m[rule.score_metric]
    k_c, k_ch = cand_m[rule.kr_metric], champ_m[rule.kr_metric]
    problems = []
    scores = [p for p in paired if _quantity(p) == "rel_score"] if rule.uses_paired() else []
    nlls = ([p for p in paired if _quantity(p) == "answer_nll"]
            if rule.uses_paired() and rule.answer_nll_tol is not None else [])
    by_samples = bool(scores)
    for p in scores:
        if p["ci"][1] < -rule.score_tol:
            problems.append(f"{rule.score_metric} at {p['context_len']} tokens {p['difference']:+.4f} below the champion on "
                            f"the same {p['n_samples']} samples (95% CI {p['ci'][0]:+.4f} .. {p['ci'][1]:+.4f}, "
                            f"wholly below -{rule.score_tol})")
    for p in nlls:
        if p["ci"][0] > rule.answer_nll_tol:
            problems.append(f"answer_nll at {p['context_len']} tokens {p['difference']:+.4f} nats/token above the champion "
                            f"on the same {p['n_samples']} samples (95% CI {p['ci'][0]:+.4f} .. {p['ci'][1]:+.4f}, "
                            f"wholly above +{rule.answer_nll_tol})")
    if not by_samples and rule.higher_is_better and s_c < s_ch - rule.score_tol:
        problems.append(f"{rule.score_metric} {s_c:.4f} < champion {s_ch:.4f} - {rule.score_tol}")
    if not rule.higher_is_better and s_c > s_ch + rule.score_tol:
        problems.append(f"{rule.score_metric} {s_c:.4f} > champion {s_ch:.4f} + {rule.score_tol}")
    if k_c > k_ch + rule.kr_tol:
        problems.append(f"{rule.kr_metric} {k_c:.4f} > champion {k_ch:.4f} + {rule.kr_tol}")
    p_c, p_ch = cand_m.get(rule.ppl_metric or ""), champ_m.get(rule.ppl_metric or "")
    if p_c is not None and p_ch is not None and p_c > p_ch * (1 + rule.ppl_tol):
        problems.append(f"{rule.ppl_metric} {p_c:.4f} > champion {p_ch:.4f} * (1 + {rule.ppl_tol})")
    if problems:
        return False, "worse than the champion: " + "; ".join(problems)
    cmp = (f">= {s_ch:.4f} - {rule.score_tol}" if rule.higher_is_better else f"<= {s_ch:.4f} + {rule.score_tol}")
    if by_samples:
        cmp = (f"(champion {s_ch:.4f}) not worse on the same samples: paired 95% CI upper bound(s) "
               + ", ".join(f"{p['ci'][1]:+.4f} at {p['context_len']}" for p in scores) + f" >= -{rule.score_tol}")
    if nlls:
        cmp += (", answer_nll paired 95% CI lower bound(s) "
                + ", ".join(f"{p['ci'][0]:+.4f} at {p['context_len']}" for p in nlls) + f" <= +{rule.answer_nll_tol}")
    ppl = (f" and {rule.ppl_metric} {p_c:.4f} <= {p_ch:.4f} * (1 + {rule.ppl_tol})"
           if p_c is not None and p_ch is not None else "")
    return True, f"{rule.score_metric} {s_c:.4f} {cmp} and {rule.kr_metric} {k_c:.4f} <= {k_ch:.4f} + {rule.kr_tol}{ppl}"


def _log_decision(decision: PromotionDecision, cand) -> None:
    c = client()
    payload = json.dumps(asdict(decision) | {"champion_after": decision.champion_after}, sort_keys=True)
    retrying(c.set_model_version_tag, decision.name, decision.candidate, "rkv.promotion", payload[:4900])
    retrying(c.set_model_version_tag, decision.name, decision.candidate, "rkv.promotion_rule",
             PromotionRule(**decision.rule).text())
    if cand.run_id:
        retrying(c.set_tag, cand.run_id, f"rkv.promotion.v{decision.candidate}",
                 f"{'promoted' if decision.promoted else 'not promoted'}: {decision.reason}"[:4900])
        retrying(c.log_text, cand.run_id, decision.text() + "\n", f"promotion/decision_v{decision.candidate}.txt")
