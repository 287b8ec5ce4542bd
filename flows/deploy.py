"""Scheduled retraining: a Prefect deployment of `retrain_flow`, its cron schedule read from the profile.

    rkv deploy --profile quick                 # one command: server (if none is configured) + deployment + runner
    rkv deploy --profile quick --run-now       # ... and start one run immediately
    rkv deploy --profile smoke --run-now --run-once --timeout 900   # run once and exit (what the test does)
    rkv deploy --profile quick --work-pool rkv # scale-out: register on a work pool, run with
                                               #   `prefect worker start --pool rkv` on any number of machines

The schedule (`schedule: {cron, timezone}`) lives in configs/pipelines/<profile>.yaml, in the repo.
Without PREFECT_API_URL, `rkv deploy` starts `prefect server start --host 127.0.0.1` with its database
under the data directory (schedules need a server: the ephemeral API of `rkv run` lives only as long as
its process) and stops it on exit. With PREFECT_API_URL set it uses that server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from registry import env as _env

_env.configure()

from residualkv.paths import data_dir, repo_root  # noqa: E402

from .profiles import load_profile  # noqa: E402

DEPLOYMENT_PREFIX = "retrain-"


def deployment_name(profile: str) -> str:
    prof = load_profile(profile)
    return prof.schedule.get("deployment") or f"{DEPLOYMENT_PREFIX}{prof.name}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(api_url: str, timeout: float = 180.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as error:  # noqa: BLE001
            last = error
        time.sleep(1.0)
    raise TimeoutError(f"Prefect server at {api_url} not healthy after {timeout:.0f}s ({last})")


@contextmanager
def local_prefect_server(port: int | None = None, home: Path | None = None, log_path: Path | None = None) -> Iterator[str]:
    """`prefect server start --host 127.0.0.1` in a child process; yields its API URL; stops it on exit."""
    port = port or free_port()
    home = home or Path(os.environ.get("PREFECT_HOME") or data_dir() / "prefect")
    home.mkdir(parents=True, exist_ok=True)
    server_env = dict(os.environ)
    server_env.update({"PREFECT_HOME": str(home),
                       "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'server.db'}",
                       "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"})
    server_env.pop("PREFECT_API_URL", None)
    log = open(log_path or home / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--no-ui"], env=server_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(api_url, process=proc)
        yield api_url
    finally:
        stop_server(proc)
        log.close()


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Ask a server started in its own session to stop; after `grace` seconds kill its whole process group
    (a server's workers must not outlive it)."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def build_deployment(profile: str):
    """The RunnerDeployment of the retraining flow for `profile`, with the profile's cron schedule."""
    from prefect.schedules import Cron

    from .retrain import retrain_flow

    prof = load_profile(profile)
    cron = prof.schedule.get("cron")
    schedules = [Cron(cron, timezone=prof.schedule.get("timezone") or "UTC")] if cron else None
    return retrain_flow.to_deployment(
        name=deployment_name(profile), schedules=schedules, parameters={"profile": profile},
        tags=["residualkv", "retrain", prof.name],
        description=f"Retrain, validate, benchmark and register ResidualKV codecs ({prof.name}: {prof.description})")


def serve(profile: str, *, run_now: bool = False, run_once: bool = False, timeout: float = 3600.0) -> int:
    """Create/update the deployment on the configured API and run its flow runs in this process's runner.

    run_once: poll once, execute what is due (with run_now: the run just triggered), wait for it, exit
    with 0 when every run it started completed. `timeout` bounds the polling until a run starts, not the
    run: Prefect's runner waits for the runs a poll started (a 30-second smoke run under --timeout 5
    completes and exits 0).
    """
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.runner import Runner

    deployment = build_deployment(profile)
    runner = Runner(name=f"rkv-{deployment.name}", query_seconds=2, prefetch_seconds=10, pause_on_shutdown=False)
    deployment_id = runner.add_deployment(deployment)
    full_name = f"{deployment.flow_name}/{deployment.name}"
    print(f"[rkv deploy] deployment {full_name} ({deployment_id}) on {_api_url()} "
          f"schedule {load_profile(profile).schedule}", flush=True)
    flow_run = None
    if run_now:
        flow_run = run_deployment(full_name, timeout=0)
        print(f"[rkv deploy] triggered flow run {flow_run.name} ({flow_run.id})", flush=True)
    if not run_once:
        asyncio.run(runner.start())
        return 0
    deadline = time.monotonic() + timeout
    started_after = datetime.now(timezone.utc)

    async def due_runs():
        """The runs of this deployment the runner started (scheduled ones that were due)."""
        from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                    FlowRunFilterStartTime)

        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=started_after)))

    async def once():
        async with get_client() as client:
            while time.monotonic() < deadline:
                await runner.start(run_once=True)
                if flow_run is None:
                    return None
                state = (await client.read_flow_run(flow_run.id)).state
                if state is not None and state.is_final():
                    return state
                await asyncio.sleep(2)
        return None

    state = asyncio.run(once())
    if flow_run is None:  # no run of its own: the exit status is that of the due runs it executed
        ran = asyncio.run(due_runs())
        for run in ran:
            print(f"[rkv deploy] flow run {run.name}: {run.state.type.value if run.state else '?'}", flush=True)
        if not ran:
            print("[rkv deploy] no scheduled run was due", flush=True)
        return 0 if all(run.state is not None and run.state.is_completed() for run in ran) else 1
    print(f"[rkv deploy] flow run {flow_run.name}: {state.type.value if state else 'not finished before the timeout'}",
          flush=True)
    return 0 if state is not None and state.is_completed() else 1


def deploy_to_work_pool(profile: str, work_pool: str) -> str:
    """Scale-out: register the deployment on a work pool (created as a `process` pool if missing);
    workers started with `prefect worker start --pool <work_pool>` run it from this checkout."""
    from prefect.schedules import Cron

    from .retrain import retrain_flow

    prof = load_profile(profile)
    _ensure_work_pool(work_pool)
    root = repo_root() or Path.cwd()
    flow = retrain_flow.from_source(source=str(root), entrypoint="flows/retrain.py:retrain_flow")
    cron = prof.schedule.get("cron")
    deployment_id = flow.deploy(name=deployment_name(profile), work_pool_name=work_pool, parameters={"profile": profile},
                                schedules=[Cron(cron, timezone=prof.schedule.get("timezone") or "UTC")] if cron else None,
                                tags=["residualkv", "retrain", prof.name], print_next_steps=False)
    print(f"[rkv deploy] {deployment_name(profile)} registered on work pool {work_pool!r} ({deployment_id}); "
          f"start workers with: prefect worker start --pool {work_pool}")
    return str(deployment_id)


def _ensure_work_pool(name: str) -> None:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    async def go():
        async with get_client() as client:
            try:
                await client.read_work_pool(name)
            except ObjectNotFound:
                try:
                    await client.create_work_pool(WorkPoolCreate(name=name, type="process"))
                except ObjectAlreadyExists:
                    pass

    asyncio.run(go())


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "(ephemeral)"


def deploy_command(profile: str, *, run_now: bool, run_once: bool, timeout: float, work_pool: str | None,
                   port: int | None = None) -> int:
    """`rkv deploy`: use PREFECT_API_URL when set, else start a local server for the lifetime of the command."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        if work_pool:
            deploy_to_work_pool(profile, work_pool)
            return 0
        return serve(profile, run_now=run_now, run_once=run_once, timeout=timeout)
    if work_pool:
        print("[rkv deploy] --work-pool needs a long-lived server: set PREFECT_API_URL (e.g. start "
              "`prefect server start --host 127.0.0.1` and export PREFECT_API_URL=http://127.0.0.1:4200/api)",
              file=sys.stderr)
        return 2
    print("[rkv deploy] PREFECT_API_URL is not set: starting a local Prefect server on 127.0.0.1", flush=True)
    with local_prefect_server(port=port) as api_url:
        print(f"[rkv deploy] Prefect server ready at {api_url}", flush=True)
        with temporary_settings({PREFECT_API_URL: api_url}):
            os.environ["PREFECT_API_URL"] = api_url  # for the flow-run subprocesses the runner starts
            try:
                return serve(profile, run_now=run_now, run_once=run_once, timeout=timeout)
            finally:
                os.environ.pop("PREFECT_API_URL", None)
