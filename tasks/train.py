"""Train a codec for one backbone (residualkv.training, accelerate), resumable and cached by input hash.

The run folder is `<data>/codecs/<backbone>/pipeline-<key>/` (beside `rkv train`'s runs, so `rkv eval`
and `rkv generate` find the newest codec), key = hash(backbone fingerprint, packed-data
fingerprint, training settings, codec sizes, cache config, source of the training code). So:
  - a finished run is returned at once by a re-run (result.json is written last);
  - a run killed mid-way (or failed and retried by Prefect) finds its folder again and the trainer
    resumes from its newest checkpoint (`checkpoints/step-N`), without redoing finished steps.
Metrics go to `metrics.jsonl` in the folder and, live, to the MLflow run when one is given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from residualkv.backbones import fingerprint, fingerprint_hash, kv_digest, load_backbone
from residualkv.cli import base_config, codecs_dir, resolve_codec
from residualkv.codec import CodecError, ResidualCodec, parse_layer_d_c
from residualkv.config import ResidualKVConfig
from residualkv.training import TrainConfig
from residualkv.training import train_codec as run_training

from .cache import code_hash, read_result, step_key, step_lock, write_result
from .common import say, set_threads
from .data import packed_data

log = logging.getLogger(__name__)

# pipeline-only keys of a profile's `train:` section (not TrainConfig fields)
PIPELINE_KEYS = ("bits", "d_c", "d_ff", "layer_d_c", "retries", "torch_threads", "launch")
# TrainConfig fields that do not change what is learned (kept out of the cache key)
NOT_IN_KEY = ("log_every", "minutes", "ckpt_every", "keep_checkpoints")


def train_payload(model, spec, packed: dict[str, Any], config: dict[str, Any],
                  start: ResidualCodec | None = None) -> dict[str, Any]:
    cache_config = start.config if start is not None else base_config(spec)
    bits = config.get("bits") or cache_config.bits
    codec_defaults = {"d_c": start.dims.d_c, "d_ff": start.dims.d_ff} if start is not None else spec.codec if spec else {}
    d_c, d_ff = config.get("d_c") or codec_defaults.get("d_c"), config.get("d_ff") or codec_defaults.get("d_ff")
    if not d_c or not d_ff:
        raise ValueError(f"{spec.name if spec else 'this backbone'}: set train.d_c and train.d_ff in the profile")
    train = {k: v for k, v in config.items() if k not in PIPELINE_KEYS and k not in NOT_IN_KEY}
    # train.layer_d_c: ["3-11=224", ...] as `rkv train --layer-d-c`; a bad one fails here, before any run folder exists
    coded = cache_config.coded_layers(model.config.num_hidden_layers)
    layer_d_c = parse_layer_d_c(config.get("layer_d_c") or [], coded, "train.layer_d_c")
    return {
        "backbone": spec.name if spec else "", "fingerprint": fingerprint_hash(fingerprint(model)),
        "weights": kv_digest(model)[:16],  # a local backbone folder whose weights changed is another run
        "data": packed["fingerprint"], "seq_len": packed["seq_len"], "train": train,
        "budget_minutes": config.get("minutes"), "d_c": int(d_c), "d_ff": int(d_ff),
        "launch": config.get("launch"),  # another process layout is another run (the trainer resumes only its own)
        "cache_config": cache_config.replace(bits=bits).to_dict(),
        # the forward pass runs through the cache, stores, quantiser and kernels as well as the trainer:
        # a codec the old code trained is not reused (tasks.cache.LIBRARY)
        "code": code_hash("tasks.train", "tasks.data", "tasks.common"),
        # init: codec: the weights it starts from (a registry alias moves; its weights say what was used)
        "start": start.weights_digest() if start is not None else None,
    } | ({"layer_d_c": {str(i): d for i, d in sorted(layer_d_c.items())}} if layer_d_c else {})


def _finished(folder: Path) -> dict[str, Any] | None:
    done = read_result(folder)
    if done is None:
        return None
    try:
        ResidualCodec.load(done["codec_dir"])
    except (CodecError, OSError, KeyError):
        return None
    return done


def _metrics_sink(folder: Path, run_id: str | None):
    path = folder / "metrics.jsonl"
    client = None
    if run_id:
        from registry.store import client as mlflow_client

        client = mlflow_client()

    def on_metrics(step: int, metrics: dict[str, Any]) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **numeric}) + "\n")
        if client is not None:
            try:  # never let a tracking hiccup stop training; log_results backfills from metrics.jsonl
                import time

                from mlflow.entities import Metric

                now = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric(f"train/{k}".replace("train/eval/", "train_eval/"), v, now, step)
                                                  for k, v in numeric.items()])
            except Exception as error:  # noqa: BLE001
                log.warning("could not log training metrics to MLflow: %s", error)

    return on_metrics


def run_train(backbone_ref: str, packed: dict[str, Any], config: dict[str, Any], *, run_id: str | None = None,
              use_cache: bool = True, progress: bool = True, _rank_of: str | None = None) -> dict[str, Any]:
    """The train task's body: reuse a finished run, else train (resuming from the run folder's checkpoints)."""
    if config.get("seq_len") not in (None, packed["seq_len"]):
        raise ValueError(f"train seq_len={config['seq_len']} but the data was packed into {packed['seq_len']}-token blocks")
    config = dict(config) | {"seq_len": packed["seq_len"]}
    set_threads(config.get("torch_threads"))
    model, tokenizer, spec = load_backbone(backbone_ref)  # a private copy: training freezes/wraps it
    train_cfg = TrainConfig(**{k: v for k, v in config.items() if k not in PIPELINE_KEYS})  # bad settings fail here
    config["bf16"] = train_cfg.bf16  # `auto` resolved: the run's key records the precision it trains in
    start = None
    if train_cfg.init == "codec":  # go on from a saved codec (a folder or models:/NAME@ALIAS)
        start = resolve_codec(config.get("init_from"), model, spec)
        start.check_shape(config["init_from"], lambda field: f"train.{field}", layer_d_c=config.get("layer_d_c"),
                          **{field: config.get(field) for field in ("d_c", "d_ff", "bits")})
    payload = train_payload(model, spec, packed, config, start)
    folder = Path(_rank_of) if _rank_of else codecs_dir(payload["backbone"] or "unnamed") / f"pipeline-{step_key(payload)}"
    if use_cache and (done := _finished(folder)) is not None:
        say(f"training: reusing the finished run in {folder} ({done['steps']} steps)")
        return done | {"cached": True}

    def train() -> dict[str, Any]:
        folder.mkdir(parents=True, exist_ok=True)
        if not _rank_of:
            (folder / "inputs.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
        if config.get("launch") and not _rank_of:  # scale-out: the same training under `accelerate launch` (DDP over processes/machines)
            return _launched(backbone_ref, packed, config, folder, run_id)
        cache_config = ResidualKVConfig.from_dict(payload["cache_config"])
        codec = start or ResidualCodec.for_model(model.config, cache_config, d_c=payload["d_c"], d_ff=payload["d_ff"],
                                                 layer_d_c={int(i): d for i, d in payload.get("layer_d_c", {}).items()},
                                                 backbone=payload["backbone"], seed=int(config.get("seed", 0)))
        data = packed_data(backbone_ref, {"source": packed["source"], "seq_len": packed["seq_len"]})
        if data.meta["fingerprint"] != packed["fingerprint"]:
            raise ValueError(f"the packed data changed under this run ({data.meta['fingerprint']} != {packed['fingerprint']})")
        data_info = {"source": packed["source"], "fingerprint": packed["fingerprint"], "seq_len": packed["seq_len"],
                     "train_blocks": packed["train_blocks"], "heldout_blocks": packed["heldout_blocks"]}
        result = run_training(model, codec, data.train, folder, train_cfg, heldout_data=data.heldout, data_info=data_info,
                              on_metrics=_metrics_sink(folder, run_id), progress=progress)
        out = {"codec_dir": str(result.codec_path), "run_dir": str(folder), "steps": result.steps,
               "total_steps": result.total_steps, "tokens": result.tokens, "train_seconds": result.seconds,
               "resumed_from": result.resumed_from, "stopped_early": result.stopped_early, "metrics": result.metrics,
               "metrics_file": str(folder / "metrics.jsonl"), "backbone": payload["backbone"],
               "fingerprint": payload["fingerprint"], "data_fingerprint": packed["fingerprint"], "key": folder.name}
        if _is_main_process():
            write_result(folder, out)  # last: marks the run finished for the next caller
        if result.resumed_from is not None:
            say(f"training resumed from step {result.resumed_from}")
        return out | {"cached": False}

    if _rank_of:  # a rank of `accelerate launch`: its parent holds the folder
        return train()
    with step_lock(folder, "training"):
        if use_cache and (done := _finished(folder)) is not None:  # another run finished it while this one waited
            say(f"training: reusing the run another process finished in {folder} ({done['steps']} steps)")
            return done | {"cached": True}
        return train()


@task(name="train-codec", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10)
def train_codec(backbone_ref: str, packed: dict[str, Any], config: dict[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """Train (or resume, or reuse) the codec for one backbone; a Prefect retry resumes from the last checkpoint."""
    return run_train(backbone_ref, packed, config, run_id=run_id)


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def _launched(backbone_ref: str, packed: dict[str, Any], config: dict[str, Any], folder: Path,
              run_id: str | None) -> dict[str, Any]:
    """Run this task's training under `accelerate launch <config['launch']...>` and read its result.

    config['launch'] holds accelerate's own arguments, e.g. ["--multi_gpu", "--num_processes", "8"] or,
    per machine of a multi-node job, ["--num_machines", "2", "--machine_rank", "0", "--main_process_ip",
    "10.0.0.1", "--main_process_port", "29500", "--num_processes", "16"]; ["--cpu", "--num_processes", "2"]
    runs two CPU processes (what the test does).
    """
    import subprocess
    import sys

    args = config["launch"] if isinstance(config["launch"], list) else str(config["launch"]).split()
    job = folder / "launch.json"
    job.write_text(json.dumps({"backbone_ref": backbone_ref, "packed": packed, "config": config, "run_id": run_id,
                               "folder": str(folder)}))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *map(str, args), "-m", "tasks.train", str(job)]
    say(f"training under accelerate: {' '.join(cmd)}")
    subprocess.run(cmd, check=True)
    done = _finished(folder)
    if done is None:
        raise RuntimeError(f"`accelerate launch` finished but {folder} holds no finished codec")
    return done | {"cached": False, "launched": args}


if __name__ == "__main__":  # one rank of an `accelerate launch` started by _launched
    import sys

    job = json.loads(Path(sys.argv[1]).read_text())
    run_train(job["backbone_ref"], job["packed"], job["config"], run_id=job["run_id"], progress=_is_main_process(),
              _rank_of=job["folder"])
