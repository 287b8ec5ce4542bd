"""The pipeline end to end on the `smoke` settings (tiny random Llama + SmolLM2's tokenizer), for real:
Prefect's ephemeral API, an embedded MLflow store, pandera, the registry, in a temporary data directory.

  - `rkv run` (flows.cli run) registers a champion with tables, plots and metrics as artifacts, and the
    serving loader loads it; a second run reuses every finished step and registers the next version;
  - a pandera failure stops the flow with a readable report and registers nothing;
  - the training task killed with SIGKILL resumes on re-run without losing finished steps;
  - bench-regress passes against itself and fails (exit 1, a table) for a degraded candidate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from registry import env as rkv_env
from residualkv.backbones import cache_dir, get_backbone

REPO = Path(__file__).resolve().parents[1]
SMOL = cache_dir(get_backbone("smollm2-135m"))  # the tokenizer the tiny model borrows (fetched by `make setup`)
RUN_TIMEOUT = 900

pytestmark = pytest.mark.skipif(not (SMOL / "tokenizer.json").is_file(),
                                reason=f"SmolLM2 not fetched to {SMOL}: run `make setup`")


def isolated_env(data: Path, **extra: str) -> dict[str, str]:
    """The environment of a fresh user whose data directory is `data` (nothing inherited from this process)."""
    env = {k: v for k, v in os.environ.items() if k not in rkv_env.service_defaults() and not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"RKV_DATA_DIR": str(data), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, **extra)
    return env


def write_profile(folder: Path, name: str = "smoke-test", **changes) -> Path:
    """configs/pipelines/smoke.yaml with the tokenizer taken from the local SmolLM2 folder, plus changes."""
    raw = yaml.safe_load((REPO / "configs" / "pipelines" / "smoke.yaml").read_text())
    raw["name"] = name
    raw["backbones"][0]["tokenizer"] = str(SMOL)
    raw["train"].update({"steps": 6, "log_every": 1, "ckpt_every": 3, "torch_threads": 1})
    raw["evaluate"]["options"].update({"ppl_tokens": 8})
    raw["throughput"].update({"new_tokens": 3})
    for section, values in changes.items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def rkv(args: list[str], data: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=isolated_env(data),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `rkv run --profile <smoke-test>` in a fresh data directory; shared by the tests below."""
    root = tmp_path_factory.mktemp("pipeline")
    data = root / "data"
    profile = write_profile(root)
    t0 = time.monotonic()
    proc = rkv(["run", "--profile", str(profile), "--json", str(root / "summary.json")], data)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return {"root": root, "data": data, "profile": profile, "proc": proc, "seconds": seconds,
            "summary": json.loads((root / "summary.json").read_text())}


@pytest.fixture()
def store(smoke, monkeypatch):
    """This process pointed at the smoke run's data directory and MLflow store."""
    monkeypatch.setenv("RKV_DATA_DIR", str(smoke["data"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", rkv_env.default_tracking_uri(smoke["data"]))
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    import registry

    return registry


def test_run_registers_a_champion_with_artifacts(smoke, store):
    out = smoke["proc"].stdout + smoke["proc"].stderr
    summary = smoke["summary"]
    assert summary["status"] == "ok"
    (b,) = summary["backbones"]
    assert b["status"] == "registered" and b["promotion"]["promoted"], b
    # the summary table and where to look
    assert "== ResidualKV pipeline, profile smoke-test (ok) ==" in out
    assert "KR meas." in out and "residualkv-dagger" in out
    assert "mlflow ui --backend-store-uri sqlite:///" in out and str(smoke["data"]) in out
    # the champion: complete, with metrics, tags and the run's artifacts
    mv = store.get_version("models:/rkv-tiny-llama@champion")
    assert mv.tags["rkv.complete"] == "true" and mv.tags["backbone"] == "tiny-llama"
    metrics = store.version_metrics(mv)
    assert {"kr_measured", "cr", "ppl_rel", "score", "task.niah_single"} <= set(metrics)
    assert 0 < metrics["kr_measured"] < 1
    # the decode speed-up over the full cache per length, and the throughput profile bench-regress re-times
    timed = store.version_speed_suite(mv)
    assert timed["methods"] == ["full", "residualkv"] and timed["new_tokens"] == 3, timed
    assert {f"decode_speedup_ctx{n}" for n in timed["context_lens"]} <= set(metrics)
    assert all(metrics[f"decode_speedup_ctx{n}"] > 0 for n in timed["context_lens"])
    # the KR/CR table's CR is measured over decode steps: OmniKV selecting 10% reads a fraction of the
    # history, standalone all of it (as does `residualkv`, whose 2048-token budget covers a 512-token prompt)
    cr = {r["method"]: r["cr"] for r in b["kr_cr_rows"]}
    assert cr["residualkv-standalone"] == 1.0 == cr["residualkv"] and 0.25 <= cr["residualkv-r10"] < 0.6, cr
    from registry.store import client

    c = client()
    artifacts = {f.path for f in c.list_artifacts(mv.run_id)}
    assert {"codec", "tables", "plots"} <= artifacts
    tables = {f.path for f in c.list_artifacts(mv.run_id, "tables")}
    assert {"tables/kr_cr.csv", "tables/benchmark.csv", "tables/throughput.csv"} <= tables
    plots = {f.path for f in c.list_artifacts(mv.run_id, "plots")}
    assert {"plots/training_loss.png", "plots/quality_vs_kr.png", "plots/throughput.png", "plots/memory.png"} <= plots
    run = c.get_run(mv.run_id)
    assert run.info.status == "FINISHED"
    # the cache's memory beside its speed, compressed below the full cache's
    held = {k.split("/")[1]: v for k, v in run.data.metrics.items() if k.startswith("memory/") and "cache_held" in k}
    assert {"full", "residualkv"} <= set(held) and 0 < held["residualkv"] < held["full"]
    assert any(k.startswith("train/loss") for k in run.data.metrics)
    assert "train.steps" in run.data.params
    assert Path(b["report_dir"], "plots", "quality_vs_kr.png").is_file()
    # the serving loader attaches it to the model it was trained for
    from residualkv.backbones import load_backbone
    from residualkv.methods import build_cache

    yaml_path = Path(b["train"]["codec_dir"]).parents[3] / "backbones"
    model, tok, spec = load_backbone(next(yaml_path.glob("tiny-llama-*.yaml")))
    codec = store.load_codec("models:/rkv-tiny-llama@champion", model_config=model.config)
    cache = build_cache("residualkv", model, codec)
    ids = tok("def f(x): return x", return_tensors="pt").input_ids
    model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    print(f"\n[smoke] rkv run --profile smoke-test took {smoke['seconds']:.0f}s")


def test_second_run_reuses_finished_steps_and_registers_the_next_version(smoke, store):
    t0 = time.monotonic()
    proc = rkv(["run", "--profile", str(smoke["profile"]), "--json", str(smoke["root"] / "summary2.json")], smoke["data"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (b,) = json.loads((smoke["root"] / "summary2.json").read_text())["backbones"]
    assert b["train"]["cached"] is True  # nothing retrained
    assert b["registered"]["version"] == "2"
    # same codec, same suite, same numbers: no worse than the champion -> promoted, and the rule is logged
    assert b["promotion"]["promoted"], b["promotion"]
    mv = store.get_version("models:/rkv-tiny-llama/2")
    assert "promote iff" in mv.tags["rkv.promotion_rule"]
    print(f"\n[smoke] cached re-run took {time.monotonic() - t0:.0f}s")


def test_pandera_failure_stops_the_flow_and_registers_nothing(smoke, store):
    from registry.store import client

    before = len(store.list_versions("rkv-tiny-llama"))
    strict = write_profile(smoke["root"], name="smoke-strict", accounting={"kr_tol": 1e-6})
    proc = rkv(["run", "--profile", str(strict)], smoke["data"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "KR/CR table failed validation - nothing was registered." in out
    assert "|kr_measured - kr_window - kr_formula| <= 1e-06 (ResidualKV methods)" in out and "residualkv-dagger" in out
    assert len(store.list_versions("rkv-tiny-llama")) == before  # nothing registered
    runs = client().search_runs([rkv_env_experiment()], "tags.profile = 'smoke-strict'")
    assert runs and runs[0].info.status == "FAILED"
    arts = {f.path for f in client().list_artifacts(runs[0].info.run_id, "validation")}
    assert "validation/KR_CR_FAILED.txt" in arts


def test_a_failed_registration_fails_the_run(smoke, store):
    """A step after validation that fails (here the registry upload) fails the backbone and the run: exit 1,
    never "ok" with nothing registered."""
    before = len(store.list_versions("rkv-tiny-llama"))
    inject = textwrap.dedent(f"""
        import flows.retrain as retrain
        def upload_fails(*args, **kwargs):
            raise OSError("injected: the artifact store refused the upload")
        retrain.register_codec_version = upload_fails
        from flows.cli import main
        raise SystemExit(main(["run", "--profile", {str(smoke["profile"])!r}, "--json", {str(smoke["root"] / "failed.json")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", inject], cwd=REPO, env=isolated_env(smoke["data"]),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "injected: the artifact store refused the upload" in out
    summary = json.loads((smoke["root"] / "failed.json").read_text())
    assert summary["status"] == "failed" and summary["backbones"][0]["status"] == "failed"
    assert "OSError: injected" in summary["backbones"][0]["error"]
    assert len(store.list_versions("rkv-tiny-llama")) == before


def rkv_env_experiment() -> str:
    from registry.store import experiment_id

    return experiment_id()


def test_training_task_resumes_after_sigkill(smoke, tmp_path, monkeypatch):
    """Through the task: kill it after a checkpoint, re-run it, and it continues from that step."""
    data = smoke["data"]  # the packed data and the tiny backbone are already there
    prof = yaml.safe_load(smoke["profile"].read_text())
    config = prof["train"] | {"steps": 24, "ckpt_every": 4, "log_every": 1, "eval_blocks": 0, "seed": 7}
    script = textwrap.dedent(f"""
        import json, sys
        from tasks.backbones import resolve_backbone
        from tasks.data import pack_data
        from tasks.train import run_train
        entry = {prof['backbones'][0]!r}
        ref = resolve_backbone(entry)
        packed = pack_data.fn(ref, {prof['data']!r})
        out = run_train(ref, packed, {config!r}, progress=False)
        print("RESULT " + json.dumps(out), flush=True)
    """)
    env = isolated_env(data)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    train_root = data / "codecs" / "tiny-llama"
    deadline = time.monotonic() + 600
    ckpts: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        ckpts = sorted(int(p.name.split("-")[1]) for p in train_root.glob("*/checkpoints/step-*")
                       if (p / "trainer_state.json").is_file() and _seed_of(p) == 7)
        if ckpts and ckpts[-1] >= 8:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "training finished before it could be killed: " + (proc.stdout.read() or "")[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (run_dir,) = {p.parents[1] for p in train_root.glob("*/checkpoints/step-*") if _seed_of(p) == 7}
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                   if (p / "trainer_state.json").is_file())
    assert not (run_dir / "result.json").exists()
    lines_before = (run_dir / "metrics.jsonl").read_text().splitlines()
    logged_before = {json.loads(l)["step"] for l in lines_before}

    # the re-run: the same task call, here in-process
    monkeypatch.setenv("RKV_DATA_DIR", str(data))
    from tasks.backbones import resolve_backbone
    from tasks.data import pack_data
    from tasks.train import run_train

    ref = resolve_backbone(prof["backbones"][0])
    packed = pack_data.fn(ref, prof["data"])
    result = run_train(ref, packed, config, progress=False)
    assert result["resumed_from"] == saved[-1] >= 8  # no finished (checkpointed) step is redone
    assert result["steps"] == 24 and result["run_dir"] == str(run_dir) and not result["cached"]
    history = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {s for s in logged_before if s <= saved[-1]} <= set(history)
    assert min(s for s in history[len(lines_before):]) == saved[-1] + 1  # picked up right after the checkpoint
    assert run_train(ref, packed, config, progress=False)["cached"] is True  # and a third call reuses it


def test_training_task_goes_on_from_a_saved_codec(smoke, monkeypatch):
    """init: codec + init_from: a run keyed by the starting weights, starting from them."""
    from residualkv.codec import ResidualCodec
    from residualkv.training import TrainError
    from tasks.backbones import resolve_backbone
    from tasks.data import pack_data
    from tasks.train import run_train

    monkeypatch.setenv("RKV_DATA_DIR", str(smoke["data"]))
    prof = yaml.safe_load(smoke["profile"].read_text())
    ref = resolve_backbone(prof["backbones"][0])
    packed = pack_data.fn(ref, prof["data"])
    config = prof["train"] | {"steps": 2, "log_every": 1, "eval_blocks": 0, "seed": 11}
    first = run_train(ref, packed, config, progress=False)
    # bf16: auto where the CPU has no bf16 units is this fp32 run: the key holds the precision, not the word
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert run_train(ref, packed, config | {"bf16": "auto"}, progress=False)["cached"] is True
    start = ResidualCodec.load(first["codec_dir"])
    # a vanishing LR: the continued codec is the one it started from
    more = run_train(ref, packed, config | {"init": "codec", "init_from": first["codec_dir"], "lr": 1e-12},
                     progress=False)
    assert more["run_dir"] != first["run_dir"] and not more["cached"]
    assert json.loads((Path(more["run_dir"]) / "inputs.json").read_text())["start"] == start.weights_digest()
    cont = ResidualCodec.load(more["codec_dir"])
    assert cont.extra["training"]["init_from"] == first["codec_dir"] and cont.dims == start.dims
    for (name, a), b in zip(start.state_dict().items(), cont.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    with pytest.raises(TrainError, match="init_from"):
        run_train(ref, packed, config | {"init": "codec"}, progress=False)
    # a profile asking the start codec for another shape is refused, naming the profile key
    with pytest.raises(ValueError, match=f"train.d_c {start.dims.d_c + 8} but the codec in .* has d_c {start.dims.d_c}"):
        run_train(ref, packed, config | {"init": "codec", "init_from": first["codec_dir"], "d_c": start.dims.d_c + 8},
                  progress=False)
    with pytest.raises(ValueError, match="train.layer_d_c: the codec in .* keeps its latent sizes"):
        run_train(ref, packed, config | {"init": "codec", "init_from": first["codec_dir"], "layer_d_c": ["1=64"]},
                  progress=False)
    # another latent size in one layer: another run (its own key), and the codec it saves has that shape
    sized = run_train(ref, packed, config | {"steps": 1, "layer_d_c": ["2-3=64"]}, progress=False)
    assert sized["run_dir"] != first["run_dir"]
    assert ResidualCodec.load(sized["codec_dir"]).layer_d_c == {2: 64, 3: 64}
    with pytest.raises(ValueError, match="train.layer_d_c .*layer 0 has no codec"):
        run_train(ref, packed, config | {"steps": 1, "layer_d_c": ["0=64"]}, progress=False)


def _seed_of(ckpt: Path) -> int | None:
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())["config"]["seed"]
    except (OSError, ValueError, KeyError):
        return None


def test_bench_regress_passes_against_itself_and_fails_for_a_degraded_candidate(smoke, store, tmp_path, capsys):
    from flows.cli import main as cli

    champion = store.get_version("models:/rkv-tiny-llama@champion")
    # speed: a tiny model's few-ms decode steps are too noisy for the gate (the next test times it)
    assert cli(["bench-regress", "--codec", "models:/rkv-tiny-llama@champion", "--tolerance", "0.02", "--no-speed"]) == 0
    out = capsys.readouterr().out
    assert "PASS - 0 regression(s)" in out and "kr_measured" in out

    # A deliberately degraded candidate: twice the latent size (more bytes) and scrambled weights,
    # registered with the champion's claims and suite, as a broken training run would be.
    import torch

    from residualkv.codec import ResidualCodec

    good = store.load_codec("models:/rkv-tiny-llama@champion")
    dims = good.dims
    from residualkv.config import CodecDims

    bad = ResidualCodec(CodecDims(d_kv=dims.d_kv, d_c=2 * dims.d_c, d_ff=dims.d_ff), good.layer_ids, good.config,
                        backbone=good.backbone, fingerprint=good.fingerprint)
    with torch.no_grad():
        for p in bad.parameters():
            p.normal_(0, 3.0)
    bad_dir = bad.save(tmp_path / "degraded")
    reg = store.register_codec(bad_dir, name="rkv-tiny-llama", metrics=store.version_metrics(champion),
                               suite=store.version_suite(champion), tags={"note": "deliberately degraded"})
    assert str(store.get_version("models:/rkv-tiny-llama@candidate").version) == reg.version
    code = cli(["bench-regress", "--codec", "models:/rkv-tiny-llama@candidate", "--tolerance", "0.02",
                "--json", str(tmp_path / "regress.json")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"vs the champion's stored metrics (v{champion.version}): FAIL" in out
    assert "REGRESSION" in out and "kr_measured" in out
    result = json.loads((tmp_path / "regress.json").read_text())
    assert not result["passed"] and any(c["regressed"] and c["metric"] == "kr_measured" for c in result["comparisons"])
    # the champion's stored predictions were found; a random tiny model gives the paired check no signal
    assert result["paired"] == [] and "no paired comparison" in result["paired_note"], result["paired_note"]
    # the outcome is recorded on the version
    assert store.get_version(f"models:/rkv-tiny-llama/{reg.version}").tags["rkv.bench_regress"].startswith("fail")


def test_bench_regress_re_times_the_decode_and_fails_a_slower_decode_path(smoke, store, tmp_path, monkeypatch):
    """The champion's throughput profile is re-timed, full cache and ResidualKV side by side; a decode path
    made slower for real (the codec's encoder and decoder each sleep 5 ms a call) drops the speed-up below the
    stored one and fails, while every quality figure still passes. The plumbing check allows 0.9 of the
    speed-up to go, not the gate's 0.4: a tiny model's steps take a few ms, where the scheduler's noise is
    large (a re-timing read 0.34x against a stored 0.58x)."""
    import time as clock

    from flows.cli import main as cli
    from residualkv.codec import LayerCodec

    uri = "models:/rkv-tiny-llama@champion"
    assert cli(["bench-regress", "--codec", uri, "--speed-tolerance", "0.9", "--json", str(tmp_path / "same.json")]) == 0
    same = json.loads((tmp_path / "same.json").read_text())
    speed = [c for c in same["comparisons"] if c["metric"].startswith("decode_speedup_ctx")]
    assert speed and all(c["gated"] and c["measured"] > 0 for c in speed), same["comparisons"]
    assert same["speed_note"] == ""
    assert {r["method"] for r in same["speed_rows"]} == {"full", "residualkv"}
    assert all(r["decode_steps_timed"] >= 3 * 2 for r in same["speed_rows"])  # 3 rounds, 3 new tokens (2 timed)

    for name in ("encode", "decode"):
        real = getattr(LayerCodec, name)

        def slower(self, *args, _real=real, **kwargs):
            clock.sleep(0.005)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(LayerCodec, name, slower)
    assert cli(["bench-regress", "--codec", uri, "--json", str(tmp_path / "slow.json")]) == 1
    slow = json.loads((tmp_path / "slow.json").read_text())
    regressed = {c["metric"] for c in slow["comparisons"] if c["regressed"]}
    assert regressed and all(m.startswith("decode_speedup_ctx") for m in regressed), slow["comparisons"]
    assert not slow["flips"] or not any(f["regressed"] for f in slow["flips"])

    # --no-speed: shown, not gated, and said why
    assert cli(["bench-regress", "--codec", uri, "--no-speed", "--json", str(tmp_path / "off.json")]) == 0
    off = json.loads((tmp_path / "off.json").read_text())
    assert "not re-timed" in off["speed_note"] and off["speed_rows"] == []
    assert all(not c["gated"] for c in off["comparisons"] if c["metric"].startswith("decode_speedup_ctx"))


def test_bench_regress_reads_the_store_its_profile_names(smoke, store, tmp_path, capsys):
    """`--profile P` whose registry.tracking_uri names another store: the gate reads that store (where the
    champion of this process's store does not exist), not $MLFLOW_TRACKING_URI."""
    from flows.cli import main as cli

    other = write_profile(tmp_path, name="elsewhere", registry={"tracking_uri": f"sqlite:///{tmp_path / 'other.db'}"})
    assert store.get_version("models:/rkv-tiny-llama@champion") is not None  # there in the default store
    assert cli(["bench-regress", "--profile", str(other), "--codec", "models:/rkv-tiny-llama@champion"]) == 2
    assert "cannot check models:/rkv-tiny-llama@champion" in capsys.readouterr().err


def test_step_keys_hash_every_library_source_file(tmp_path, monkeypatch):
    """A step's key covers every .py file of the library, subpackages included, by its path in the
    package: a changed store layout (residualkv/stores.py was outside the measurement keys) re-runs the
    measurements and the training instead of reusing what the old code produced."""
    from tasks import cache as step_cache

    pkg = tmp_path / "libx"
    (pkg / "sub").mkdir(parents=True)
    for rel in ("__init__.py", "sub/__init__.py", "sub/stores.py", "stores.py"):
        (pkg / rel).write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = step_cache.source_hash("libx")
    (pkg / "sub" / "stores.py").write_text("X = 2\n")
    after = step_cache.source_hash("libx")
    assert after != before
    (pkg / "sub" / "stores.py").write_text("X = 1\n")
    (pkg / "stores.py").write_text("X = 2\n")  # the same change in a same-named file elsewhere: another key
    assert step_cache.source_hash("libx") not in (before, after)
    assert step_cache.LIBRARY == ("residualkv", "kernels")
    monkeypatch.setattr(step_cache, "LIBRARY", ("libx",))
    assert step_cache.code_hash("tasks.measure") != step_cache.source_hash("libx")  # the task module counts too
    # every step's key goes through code_hash (a hand-picked list of modules is what missed stores.py)
    import ast

    for module in ("measure", "train"):
        calls = {node.func.id for node in ast.walk(ast.parse((REPO / "tasks" / f"{module}.py").read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "code_hash" in calls and "source_hash" not in calls, module


def test_a_second_run_of_a_step_waits_for_the_first_and_reuses_its_result(tmp_path, monkeypatch):
    """Two runs of one step at once (a scheduled run beside a manual one): the second waits on the step
    folder's lock and returns what the first computed, instead of computing into the same folder."""
    from tasks.cache import cached_step

    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path / "data"))
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from tasks.cache import cached_step
        def slow(folder):
            (folder / "started").write_text("")
            time.sleep(3)
            return {"by": "first"}
        print(cached_step("probe", {"k": 1}, slow)["by"])
    """)], cwd=REPO, env=isolated_env(tmp_path / "data"), stdout=subprocess.PIPE, text=True)
    started = next((tmp_path / "data" / "pipeline" / "probe").glob("*/started"), None)
    deadline = time.monotonic() + 60
    while started is None:
        assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
        time.sleep(0.05)
        started = next((tmp_path / "data" / "pipeline" / "probe").glob("*/started"), None)
    second = cached_step("probe", {"k": 1}, lambda folder: {"by": "second"})
    assert second["by"] == "first" and second["cached"] is True
    assert first.wait(60) == 0 and first.stdout.read().strip() == "first"


def test_regression_table_logic():
    from flows.bench_regress import RegressReport, compare

    base = {"rel_score": 0.98, "score": 0.6, "task.vt": 0.8, "kr_measured": 0.18, "ppl": 10.0, "decode_tok_s_ctx512": 30.0}
    same = compare(base, dict(base), 0.02)
    assert all(not c.regressed for c in same) and {c.metric for c in same} == set(base) - {"decode_tok_s_ctx512"}
    worse = compare(base, base | {"rel_score": 0.95, "ppl": 10.3, "kr_measured": 0.19, "task.vt": 0.79}, 0.02)
    assert {c.metric for c in worse if c.regressed} == {"rel_score", "ppl"}  # 0.03 > 0.02; 3% > 2%; the rest within
    missing = compare(base, {k: v for k, v in base.items() if k != "task.vt"}, 0.02)
    assert [c.metric for c in missing if c.regressed] == ["task.vt"]
    text = RegressReport("models:/x@candidate", "3", "the champion", worse).text()
    assert "FAIL - 2 regression(s)" in text and "REGRESSION" in text


def test_bench_regress_judges_scores_on_the_same_samples_against_another_version():
    from flows.bench_regress import RegressReport, compare
    from tasks.paired import paired_checks

    def records(method, answers_right):
        out = []
        for task, right in answers_right.items():
            for i, ok in enumerate(right):
                out.append({"method": method, "context_len": 2048, "id": f"{task}-{i}", "task": task, "seed": 0,
                            "answers": [f"{task}{i}"], "prediction": "x", "score": float(ok)})
        return out

    full = records("full", {"a": [1, 1, 1, 1], "b": [1, 1, 1, 1]})
    champion = records("residualkv", {"a": [1, 1, 1, 1], "b": [1, 1, 1, 0]})
    one_flip = full + records("residualkv", {"a": [1, 1, 1, 0], "b": [1, 1, 1, 0]})  # 7/8 -> 6/8: one answer
    broken = full + records("residualkv", {"a": [0, 0, 0, 0], "b": [0, 0, 1, 0]})

    [noise] = paired_checks(one_flip, champion, "residualkv", 0.02)
    assert noise.n_samples == 8 and abs(noise.difference + 0.125) < 1e-9 and noise.ci[0] < -0.02 < noise.ci[1]
    assert not noise.regressed  # one answer among 8 is inside the sampling noise, a fixed 0.02 would fail it
    [real] = paired_checks(broken, champion, "residualkv", 0.02)
    assert real.regressed and real.ci[1] < -0.02 and real.p_ahead == 0.0
    # the champion's own full-cache rows are not needed: the measured run's are the reference
    assert paired_checks(broken, champion + full, "residualkv", 0.02)[0].difference == real.difference

    base = {"rel_score": 0.875, "task.a": 1.0, "kr_measured": 0.18, "cr": 0.28}
    point = {"rel_score": 0.75, "task.a": 0.75, "kr_measured": 0.18, "cr": 0.29}
    assert {c.metric for c in compare(base, point, 0.02) if c.regressed} == {"rel_score", "task.a"}
    # the sparse path reading the whole history: answers may hold, the bytes attended do not
    assert [c.metric for c in compare(base, point | {"cr": 1.0}, 0.02, paired=["rel_score"]) if c.regressed] == ["cr"]
    shown = compare(base, point, 0.02, paired=["rel_score"])
    assert not any(c.regressed for c in shown) and [c.metric for c in shown if c.gated] == ["cr", "kr_measured"]
    text = RegressReport("models:/x@candidate", "4", "the champion", shown, paired=[noise]).text()
    assert "PASS - 0 regression(s) in 3 metrics" in text and "shown (judged on the samples below)" in text
    assert "rel_score_ctx2048 paired (8 samples)" in text
    assert "FAIL - 1 regression(s)" in RegressReport("models:/x@candidate", "4", "the champion", shown,
                                                     paired=[real]).text()


def stored_version(monkeypatch, br, metrics, *, predictions, bench_rows, speed_suite) -> None:
    """bench_regress's registry and harness replaced by one champion's records (v3 of rkv-x): its stored
    metrics, predictions and throughput profile, and the rows its re-run benchmark gives."""
    class Version:
        name, version, run_id = "rkv-x", "3", "r"

    monkeypatch.setattr(br.registry, "get_version", lambda uri: Version())
    monkeypatch.setattr(br.registry, "version_suite", lambda v: {"backbone_ref": "b", "methods": ["full", "residualkv"],
                                                                 "options": {}, "method": "residualkv"})
    monkeypatch.setattr(br.registry, "fetch_codec_dir", lambda uri: "/nowhere")
    monkeypatch.setattr(br.registry, "version_metrics", lambda v: metrics)
    monkeypatch.setattr(br.registry, "version_speed_suite", lambda v: speed_suite)
    monkeypatch.setattr(br, "stored_predictions", lambda v: predictions)
    monkeypatch.setattr(br, "validate_benchmark", lambda *a, **k: None)
    monkeypatch.setattr(br, "run_evaluation", lambda *a, **k: {"rows": bench_rows, "files": []})


def test_bench_regress_against_itself_forgives_one_flipped_answer_and_keeps_the_answer_nll_fixed(monkeypatch):
    """A self-check (the champion re-run): one answer flipped by another CPU's rounding passes, two answers lost
    by a code change fail (a paired bootstrap would let 2-3 of 16 through: the interval's top stays at 0),
    flips both ways cancel, and the answer NLL (teacher-forced: nothing flips) keeps the fixed tolerance.
    bench_regress runs with the registry and the harness replaced by their records: what is under test is
    which baseline judges what."""
    import flows.bench_regress as br
    from tasks.paired import FlipCheck

    def records(method, right, nll=0.5):
        return [{"method": method, "context_len": 2048, "id": f"{t}-{i}", "task": t, "seed": 0, "answers": [f"{t}{i}"],
                 "prediction": "x", "score": float(ok), "answer_nll": nll}
                for t, col in right.items() for i, ok in enumerate(col)]

    full = records("full", {"a": [1] * 8, "b": [1] * 8})
    stored_right = {"a": [1, 1, 1, 1, 1, 1, 1, 1], "b": [1, 1, 1, 1, 1, 1, 0, 0]}
    stored = full + records("residualkv", stored_right)
    stored_metrics = {"rel_score": 0.875, "score": 0.875, "task.a": 1.0, "answer_nll": 0.5, "kr_measured": 0.18}

    # no timing: not what is under test
    stored_version(monkeypatch, br, stored_metrics, predictions=stored, bench_rows=[], speed_suite=None)

    def rerun(a, b, nll=0.5, **kw):
        preds = full + records("residualkv", {"a": a, "b": b}, nll)
        monkeypatch.setattr(br, "result_predictions", lambda result: preds)
        right = (sum(a) + sum(b)) / 16
        monkeypatch.setattr(br, "headline_metrics", lambda rows, method, speed_rows=(): stored_metrics | {
            "rel_score": right, "score": right, "task.a": sum(a) / 8, "answer_nll": nll})
        return br.bench_regress("models:/rkv-x@champion", 0.02, log_to_mlflow=False, progress=False, **kw)

    one = rerun([1, 1, 1, 1, 1, 1, 1, 0], stored_right["b"])  # 14/16 -> 13/16: one answer
    assert one.passed and one.paired == [] and one.baseline_source.startswith("its stored"), one.text()
    assert [(f.lost, f.gained, f.n_samples) for f in one.flips] == [(1.0, 0.0, 16)]
    assert "answers_ctx2048 vs the stored run (16 samples)" in one.text()
    two = rerun([1, 1, 1, 1, 1, 1, 0, 0], stored_right["b"])
    assert not two.passed and [type(r) for r in two.regressions] == [FlipCheck], two.text()
    assert rerun([1, 1, 1, 1, 1, 1, 0, 0], stored_right["b"], allowed=2).passed  # --flips 2
    both_ways = rerun([1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1])  # 3 lost, 2 gained: net 1
    assert both_ways.passed, both_ways.text()
    nll = rerun([1] * 8, stored_right["b"], nll=0.53)  # same answers, right ones 0.03 nats less likely
    assert [c.metric for c in nll.regressions] == ["answer_nll"]


def test_bench_regress_gates_the_decode_speedup_relative_to_the_baselines(monkeypatch):
    """Which throughput profile is re-timed and how the speed-up is judged: relative to the baseline's stored
    ratio, with its own tolerance, only where the baseline was timed the same way (registry and timings
    replaced by their records)."""
    import flows.bench_regress as br

    timed = {"methods": ["full", "residualkv"], "context_lens": [512, 1024], "new_tokens": 6, "repeats": 1}
    stored = {"rel_score": 1.0, "score": 1.0, "kr_measured": 0.18, "decode_speedup_ctx512": 0.5,
              "decode_speedup_ctx1024": 0.4, "decode_tok_s_ctx512": 20.0}
    bench = [{"method": "residualkv", "context_len": 512, "rel_score": 1.0, "score": 1.0, "kr_measured": 0.18}]
    asked = []

    def timing(ratios):
        def measure(ref, codec_dir, config, **kw):
            asked.append(config | kw)
            return {"rows": [{"method": m, "context_len": n, "decode_tok_s": 10.0 * (ratios[n] if m != "full" else 1),
                              "decode_speedup_vs_full": ratios[n] if m != "full" else 1.0}
                             for n in config["context_lens"] for m in config["methods"]]}
        monkeypatch.setattr(br, "measure_throughput", measure)

    stored_version(monkeypatch, br, stored, predictions=None, bench_rows=bench, speed_suite=timed)

    def run(**kw):
        return br.bench_regress("models:/rkv-x@champion", 0.02, log_to_mlflow=False, progress=False, **kw)

    timing({512: 0.35, 1024: 0.25})  # 0.7x and 0.625x of the stored ratios: inside the 0.4 allowed
    ok = run()
    assert ok.passed, ok.text()
    assert asked[-1]["methods"] == ["full", "residualkv"] and asked[-1]["repeats"] == 3 and not asked[-1]["gpu_bench"]
    assert {c.metric: round(c.allowed, 12) for c in ok.comparisons if c.gated and c.metric.startswith("decode")} == {
        "decode_speedup_ctx512": 0.2, "decode_speedup_ctx1024": 0.16}
    assert "decode_tok_s_ctx512" not in {c.metric for c in ok.comparisons}  # tok/s belongs to the machine
    timing({512: 0.5, 1024: 0.23})  # the longer context lost more than 40% of its speed-up
    slow = run()
    assert [c.metric for c in slow.regressions] == ["decode_speedup_ctx1024"], slow.text()
    assert run(speed_tolerance=0.45).passed
    calls = len(asked)
    assert run(speed=False).passed and len(asked) == calls  # nothing timed
    monkeypatch.setattr(br.registry, "version_speed_suite", lambda v: None)  # registered before the tag
    old = run()
    assert old.passed and "stored no throughput profile" in old.speed_note and len(asked) == calls
    assert "not gated: see below" in old.text()


def test_bench_regress_judges_answer_nll_on_the_same_samples():
    """Two codecs can give the same string-match answers while one makes the right answer less likely:
    the paired answer-NLL check sees it, and judges it against the sampling noise, not a fixed step."""
    from flows.bench_regress import RegressReport, compare
    from tasks.paired import judge_paired, paired_checks

    def records(method, nll):
        return [{"method": method, "context_len": 2048, "id": f"{t}-{i}", "task": t, "seed": 0, "answers": [f"{t}{i}"],
                 "prediction": f"{t}{i}", "score": 1.0, "answer_nll": x}
                for t in ("a", "b") for i, x in enumerate(nll)]

    full = records("full", [0.5, 0.6, 0.7, 0.8])
    champion = records("residualkv", [0.6, 0.7, 0.8, 0.9])
    noisy = full + records("residualkv", [0.62, 0.66, 0.85, 0.87])
    worse = full + records("residualkv", [0.9, 1.0, 1.1, 1.3])
    checks = paired_checks(noisy, champion, "residualkv", 0.02)
    assert [c.quantity for c in checks] == ["rel_score", "answer_nll"]
    nll = checks[1]
    assert nll.n_samples == 8 and abs(nll.difference) < 0.02 and not nll.regressed
    [_, bad] = paired_checks(worse, champion, "residualkv", 0.02)
    assert abs(bad.difference - 0.325) < 1e-9 and bad.ci[0] > 0.05 and bad.regressed and bad.p_ahead == 0.0
    assert bad.as_dict()["quantity"] == "answer_nll" and "answer_nll_ctx2048 paired (8 samples)" == bad.metric
    assert not paired_checks(worse, champion, "residualkv", 0.02, nll_tolerance=0.5)[1].regressed
    assert len(paired_checks(worse, champion, "residualkv", 0.02, nll_tolerance=None)) == 1
    # a champion scored before answer NLL existed: the rel_score check only
    old = [{k: v for k, v in r.items() if k != "answer_nll"} for r in champion]
    assert [c.quantity for c in paired_checks(worse, old, "residualkv", 0.02)] == ["rel_score"]
    # the full cache scoring 0 everywhere leaves no rel_score check; the NLL one stands, the note says so
    zero = [dict(r, score=0.0) for r in worse]
    checks, note = judge_paired(zero, champion, "residualkv", 0.02)
    assert [c.quantity for c in checks] == ["answer_nll"] and "no paired comparison of scores" in note

    base = {"rel_score": 0.9, "answer_nll": 0.75, "answer_nll_delta": 0.1, "kr_measured": 0.18}
    point = {"rel_score": 0.9, "answer_nll": 1.08, "answer_nll_delta": 0.43, "kr_measured": 0.18}
    assert {c.metric for c in compare(base, point, 0.02) if c.regressed} == {"answer_nll", "answer_nll_delta"}
    shown = compare(base, point, 0.02, paired=["answer_nll"])
    assert [c.metric for c in shown if c.gated] == ["kr_measured", "rel_score"]
    text = RegressReport("models:/x@candidate", "3", "the champion", shown, paired=[bad]).text()
    assert "FAIL - 1 regression(s) in 3 metrics" in text and "above +0.0500" in text


def test_benchmark_schema_checks_the_interval_and_kr_cr_schema_ignores_it():
    from tasks.validation import TableValidationError, validate_benchmark, validate_kr_cr

    row = {"method": "residualkv", "context_len": 2048, "score": 0.5, "rel_score": 0.5, "kr_measured": 0.2,
           "kr_formula": 0.2, "cr": 1.0, "tasks": {"niah_single": 0.5}}
    full = dict(row, method="full", score=1.0, rel_score=1.0, kr_measured=1.0, kr_formula=1.0,
                tasks={"niah_single": 1.0}, rel_score_ci=None)
    ok = dict(row, rel_score_ci=[0.3, 0.7])
    df = validate_benchmark([full, ok], methods=["full", "residualkv"])
    assert df.loc[df["method"] == "residualkv", "rel_score_ci_lo"].item() == 0.3
    with pytest.raises(TableValidationError, match="rel_score_ci_lo <= rel_score_ci_hi"):
        validate_benchmark([full, dict(row, rel_score_ci=[0.7, 0.3])], methods=["full", "residualkv"])
    kr = validate_kr_cr([dict(ok, rel_score_ci_lo=0.3, rel_score_ci_hi=0.7)], methods=["residualkv"],
                        beta=0.0, kr_tol=1e-3)
    assert len(kr) == 1
    # an FP16 recent window's bytes are explained by kr_window, not charged against the formula
    windowed = dict(row, method="residualkv-standalone-w48", kr_measured=0.25)
    with pytest.raises(TableValidationError, match="kr_window"):
        validate_kr_cr([windowed], methods=[windowed["method"]], beta=0.0, kr_tol=1e-3)
    assert len(validate_kr_cr([dict(windowed, kr_window=0.05)], methods=[windowed["method"]], beta=0.0, kr_tol=1e-3)) == 1
    # KR is the bytes: a row whose KR does not follow from its byte counts, or with unexplained bytes, fails
    counted = dict(row, total_bytes=20.0, fp16_bytes=100.0, kr_gap_unexplained=0.0)
    assert len(validate_kr_cr([counted], methods=["residualkv"], beta=0.0, kr_tol=1e-3)) == 1
    with pytest.raises(TableValidationError, match=r"kr_measured == total_bytes / fp16_bytes"):
        validate_kr_cr([dict(counted, total_bytes=95.0)], methods=["residualkv"], beta=0.0, kr_tol=1e-3)
    with pytest.raises(TableValidationError, match="every byte accounted for"):
        validate_kr_cr([dict(counted, kr_gap_unexplained=0.5)], methods=["residualkv"], beta=0.0, kr_tol=1e-3)
    # the promotion guards and the answer NLL: positive, finite; a scored row has a score
    for bad, check in [({"ppl_rel": -3.0}, "greater_than"), ({"ppl_rel": 0.0}, "greater_than"),
                       ({"answer_nll": float("nan")}, "NaN where a number was measured"), ({"answer_nll_delta": float("inf")}, "finite"),
                       ({"score": None}, "score present where tasks were scored")]:
        with pytest.raises(TableValidationError, match=check):
            validate_benchmark([full, dict(ok, **bad)], methods=["full", "residualkv"])
    assert len(validate_benchmark([full, dict(ok, ppl_rel=0.9, answer_nll=1.2, answer_nll_delta=-0.1)],
                                  methods=["full", "residualkv"])) == 2
    # a table other than the candidate's says what its failure means (the candidate may already be registered)
    with pytest.raises(TableValidationError, match="v3's re-measured benchmark table failed validation - nothing can be"):
        validate_benchmark([full, dict(ok, ppl_rel=-1.0)], methods=["full", "residualkv"],
                           table="v3's re-measured benchmark", consequence="nothing can be judged against v3")


def test_a_paired_promotion_rule_reads_both_sides_predictions_in_the_flow(smoke, store):
    """The retrain flow with a rel_score rule (`paired: true`, the default profiles' rule): the champion's stored
    predictions and the candidate's reach the paired check. A random tiny model scores 0 on every task, so the
    check finds no signal, and the decision says so. (Last in this file: it registers another version.)"""
    profile = write_profile(smoke["root"], name="smoke-paired",
                            registry={"promotion": {"score_metric": "rel_score", "higher_is_better": True,
                                                    "score_tol": 0.02, "kr_metric": "kr_measured", "kr_tol": 0.005,
                                                    "paired": True}})
    proc = rkv(["run", "--profile", str(profile), "--json", str(smoke["root"] / "summary3.json")], smoke["data"])
    (b,) = json.loads((smoke["root"] / "summary3.json").read_text())["backbones"]
    assert b["train"]["cached"] is True, proc.stdout[-4000:] + proc.stderr[-4000:]
    p = b["promotion"]
    assert p["paired"] == [] and p["paired_note"].startswith("rel_score judged by the point clause: no paired comparison"), p
    mv = store.get_version(f"models:/rkv-tiny-llama/{b['registered']['version']}")
    assert "no 95% interval" in mv.tags["rkv.promotion_rule"]
    assert json.loads(mv.tags["rkv.promotion"])["paired_note"] == p["paired_note"]
