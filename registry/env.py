"""The one place the pipeline's services are configured: MLflow and Prefect, embedded by default.

Call `configure()` before `mlflow` or `prefect` is imported (the `registry`, `tasks` and `flows`
packages do it in their `__init__`). Every value is a *default*: a variable the user already set
(`MLFLOW_TRACKING_URI`, `PREFECT_API_URL`, `PREFECT_HOME`, ...) wins, which is how the configured
scale-out (a tracking server, a Prefect server with workers) is selected.

Embedded defaults (SPEC §4), all under the project's data directory (`residualkv.paths.data_dir()`):

    MLflow   tracking + registry  sqlite:///<data>/mlflow/mlflow.db
             artifacts            <data>/mlflow/artifacts
    Prefect  home                 <data>/prefect   (ephemeral API, SQLite <data>/prefect/prefect.db,
                                                    served by Prefect itself on 127.0.0.1 only)

Telemetry is off for both: MLFLOW_DISABLE_TELEMETRY / DO_NOT_TRACK (read by mlflow 3.17's
`mlflow.telemetry.utils.is_telemetry_disabled`), PREFECT_SERVER_ANALYTICS_ENABLED=false.
"""

from __future__ import annotations

import os
from pathlib import Path

from residualkv.paths import data_dir

EXPERIMENT = "residualkv-codecs"


def mlflow_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / "mlflow"


def default_tracking_uri(root: Path | None = None) -> str:
    return f"sqlite:///{mlflow_dir(root) / 'mlflow.db'}"


def prefect_home(root: Path | None = None) -> Path:
    return (root or data_dir()) / "prefect"


def service_defaults(root: Path | None = None) -> dict[str, str]:
    """The environment the embedded pipeline runs with (before any user override)."""
    home = prefect_home(root)
    return {
        # --- MLflow
        "MLFLOW_TRACKING_URI": default_tracking_uri(root),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        # --- Prefect (ephemeral API; it binds 127.0.0.1 itself)
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
        "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # 2 shared CPU cores start slowly
        "PREFECT_LOGGING_LOG_PRINTS": "false",  # see tasks.common.say
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def configure(root: Path | None = None, *, override: bool = False) -> dict[str, str]:
    """Apply `service_defaults` to os.environ (without replacing what the user set unless `override`).

    Returns the effective values of those keys. Safe to call more than once.
    """
    for key, value in service_defaults(root).items():
        if override or key not in os.environ:
            os.environ[key] = value
    # (no folders are created here: Prefect makes its home, MLflow the SQLite file's parent, on first use)
    return {k: os.environ[k] for k in service_defaults(root)}


def use_tracking_uri(uri: str) -> None:
    """Point this process (and the processes it starts) at another tracking store or server, e.g. from a
    pipeline profile's `registry.tracking_uri`."""
    os.environ["MLFLOW_TRACKING_URI"] = uri


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def registry_uri() -> str:
    return os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri()


def is_embedded_store(uri: str | None = None) -> bool:
    """True when MLflow talks straight to a database (no tracking server in between)."""
    uri = uri or tracking_uri()
    return not uri.startswith(("http://", "https://", "databricks"))


def artifact_root_for(uri: str | None = None) -> str | None:
    """Where new experiments keep artifacts: a local folder beside an embedded SQLite store.

    With a tracking server the server decides (`--artifacts-destination` / `--default-artifact-root`).
    """
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent.joinpath("artifacts").as_uri()
    return None


def ui_command(uri: str | None = None) -> str:
    uri = uri or tracking_uri()
    if not is_embedded_store(uri):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
