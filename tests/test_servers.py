"""The configured scale-out, for real, on 127.0.0.1: an `mlflow server` (SQLite backend + proxied local
artifact root) used through its URI by the registry and the serving loader, and a `prefect server`
against which the scheduled-retraining deployment is created and run once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from registry import env as rkv_env
from tests.conftest import tiny_llama_config
from tests.test_pipeline import REPO, SMOL, isolated_env, write_profile
from tests.test_registry import make_codec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1.0)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


@contextmanager
def server(cmd: list[str], health: str, log: Path, env: dict[str, str]):
    from flows.deploy import stop_server

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_http(health, proc)
            yield proc
        finally:
            stop_server(proc)


def _listening_on_loopback_only(port: int) -> bool:
    """The server accepts on 127.0.0.1; /proc/net/tcp shows no 0.0.0.0 listener on that port."""
    hexport = f"{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if p == hexport and state == "0A" and addr not in ("0100007F", "00000000000000000000000001000000"):
                return False
    return True


def test_mlflow_server_register_and_serve(tmp_path, monkeypatch):
    port = free_port()
    db = tmp_path / "server" / "mlflow.db"
    db.parent.mkdir()
    artifacts = tmp_path / "server" / "artifacts"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(artifacts), "--serve-artifacts"]
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    uri = f"http://127.0.0.1:{port}"
    with server(cmd, f"{uri}/health", tmp_path / "mlflow-server.log", env):
        assert _listening_on_loopback_only(port)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
        monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path / "client-data"))
        import registry
        from registry import env as rkv_env

        assert not rkv_env.is_embedded_store()
        reg = registry.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 0.97, "kr_measured": 0.2},
                                      suite={"suite": "server"})
        assert reg.source.startswith("mlflow-artifacts:")  # proxied through the server, stored in its artifact root
        mv = registry.get_version(f"models:/{reg.name}@candidate")
        assert mv.tags["rkv.complete"] == "true"
        codec = registry.load_codec(f"models:/{reg.name}@candidate", model_config=tiny_llama_config())
        assert codec.backbone == "tiny-llama"
        assert registry.promote_if_not_worse(reg.name, reg.version).promoted
        assert registry.load_codec(f"models:/{reg.name}@champion").layer_ids == [1, 2, 3]

        # concurrent registrations through the server: distinct versions
        dirs = [make_codec(tmp_path / f"c{i}", seed=i) for i in range(8)]
        results, errors = [], []

        def work(d):
            try:
                results.append(registry.register_codec(d, name="rkv-server-concurrent", metrics={"rel_score": 1.0}).version)
            except Exception as error:  # noqa: BLE001
                errors.append(repr(error))

        threads = [threading.Thread(target=work, args=(d,)) for d in dirs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert sorted(int(v) for v in results) == list(range(1, 9))

        # an artifact corrupted in the server's store is refused by the loader
        (stored,) = [p for p in artifacts.rglob("codec.safetensors") if reg.run_id in str(p)]
        stored.write_bytes(stored.read_bytes()[:-16] + b"\0" * 16)
        shutil.rmtree(Path(tmp_path / "client-data" / "registry_cache"), ignore_errors=True)
        from residualkv.codec import CodecError

        with pytest.raises(CodecError, match="corrupted"):
            registry.load_codec(f"models:/{reg.name}/{reg.version}")


@pytest.mark.skipif(not (SMOL / "tokenizer.json").is_file(), reason="SmolLM2 not fetched: run `make setup`")
def test_scheduled_retraining_deployment_runs_once_on_a_prefect_server(tmp_path, monkeypatch):
    port = free_port()
    home = tmp_path / "prefect-server"
    home.mkdir()
    data = tmp_path / "data"
    server_env = isolated_env(data)
    server_env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
                       "PREFECT_UI_ENABLED": "false"})
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    api = f"http://127.0.0.1:{port}/api"
    # a micro profile: every step, the smallest settings
    profile = write_profile(tmp_path, name="micro", train={"steps": 2, "ckpt_every": 1},
                            accounting={"methods": ["full", "residualkv"], "context_lens": [256]},
                            evaluate={"methods": ["full", "residualkv"],
                                      "options": {"suite": "ppl", "context_len": 128, "ppl_tokens": 4}},
                            throughput={"context_lens": [128], "new_tokens": 2},
                            schedule={"cron": "17 4 * * 2", "timezone": "UTC"})
    with server(cmd, f"{api}/health", tmp_path / "prefect-server.log", server_env):
        assert _listening_on_loopback_only(port)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--profile", str(profile), "--run-now",
                               "--run-once", "--timeout", "900"], cwd=REPO, env=isolated_env(data, PREFECT_API_URL=api),
                              capture_output=True, text=True, timeout=1200)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert "deployment rkv-retrain/retrain-micro" in out and ": COMPLETED" in out
        print(f"\n[deploy] deployment + one scheduled-flow run took {time.monotonic() - t0:.0f}s")
        # --run-once alone executes the runs that are due and exits with their status: none is due here
        idle = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--profile", str(profile), "--run-once",
                               "--timeout", "120"], cwd=REPO, env=isolated_env(data, PREFECT_API_URL=api),
                              capture_output=True, text=True, timeout=300)
        assert idle.returncode == 0 and "no scheduled run was due" in idle.stdout, idle.stdout[-3000:] + idle.stderr[-3000:]

        # the server holds the deployment with the repo's cron schedule, and the completed run
        facts = asyncio.run(_deployment_facts(api))
        assert facts["crons"] == ["17 4 * * 2"] and facts["parameters"] == {"profile": str(profile)}
        assert "COMPLETED" in facts["states"]

        # scale-out: the same deployment on a work pool, executed by a `prefect worker`
        env = isolated_env(data, PREFECT_API_URL=api)
        deploy = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--profile", str(profile),
                                 "--work-pool", "rkv-test"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        assert "registered on work pool 'rkv-test'" in deploy.stdout
        run_id = asyncio.run(_trigger(api))
        worker = subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", "rkv-test", "--run-once"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
        assert asyncio.run(_state(api, run_id)) == "COMPLETED"
    monkeypatch.setenv("RKV_DATA_DIR", str(data))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", rkv_env.default_tracking_uri(data))
    import registry

    champion = registry.get_version("models:/rkv-tiny-llama@champion")
    assert champion.tags["rkv.complete"] == "true" and champion.tags["profile"] == "micro"


async def _deployment_facts(api: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        async with get_client() as c:
            d = await c.read_deployment_by_name("rkv-retrain/retrain-micro")
            runs = await c.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [d.id]}))
            return {"crons": [s.schedule.cron for s in d.schedules], "parameters": d.parameters,
                    "states": [r.state.type.value for r in runs]}


async def _trigger(api: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        async with get_client() as c:
            d = await c.read_deployment_by_name("rkv-retrain/retrain-micro")
            assert d.work_pool_name == "rkv-test"
            run = await c.create_flow_run_from_deployment(d.id)
            return str(run.id)


async def _state(api: str, run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        async with get_client() as c:
            return (await c.read_flow_run(run_id)).state.type.value
