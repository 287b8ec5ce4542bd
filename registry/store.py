"""MLflow clients for the configured store, with the retries a shared SQLite file needs.

An embedded SQLite store is one file that several processes write (parallel flow runs, the CLI, a
test starting 8 registrations at once). SQLite serialises writers; a writer that waits longer than
the driver's timeout gets `database is locked`, and two writers racing for the same new model
version number get an IntegrityError that MLflow retries only three times. Both are transient:
`retrying` repeats the call with jittered backoff. Creating the schema (MLflow's alembic
migrations) is not safe to run twice at once, so the first client in a fresh store takes a file lock.
Moving an alias (read the current target, decide, write) takes `store_lock` for the same reason.
"""

from __future__ import annotations

import fcntl
import logging
import random
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from . import env

env.configure()

from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT = ("database is locked", "database table is locked", "model version creation error",
              "busy", "connection reset",
              # upserts (alias, tag) that lost a race to a concurrent insert of the same key
              "unique constraint failed: registered_model_aliases", "unique constraint failed: model_version_tags",
              "unique constraint failed: tags", "unique constraint failed: latest_metrics", "connection refused",
              "max retries exceeded", "temporarily unavailable", "deadlock")


def is_transient(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return any(marker in text for marker in _TRANSIENT)


def retrying(fn: Callable[..., T], *args, attempts: int = 12, base_delay: float = 0.2, **kwargs) -> T:
    """Call fn, repeating it on transient store errors (jittered exponential backoff, ~1 min total)."""
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - filtered by is_transient
            if attempt == attempts - 1 or not is_transient(error):
                raise
            delay = min(8.0, base_delay * 2 ** attempt) * (0.5 + random.random())
            log.info("MLflow store busy (%s); retry %d/%d in %.1fs", str(error).splitlines()[0][:120],
                     attempt + 1, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def store_lock(purpose: str, uri: str | None = None) -> Iterator[None]:
    """Serialise a read-decide-write sequence among the processes that share an embedded SQLite store.

    MLflow has no compare-and-set on aliases, so without this two flows promoting at once both compare
    against the same champion and the last alias write wins. With a tracking server, or a database
    server other machines write too, there is no shared file to lock; callers re-read what they decided
    on just before writing (see promote_if_not_worse), which narrows the race but cannot close it.
    """
    uri = uri or env.tracking_uri()
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    with _file_lock(db.with_name(f"{db.name}.{purpose}.lock")):
        yield


@lru_cache(maxsize=8)
def _client_for(tracking_uri: str, registry_uri: str) -> MlflowClient:
    if tracking_uri.startswith("sqlite:///"):
        with store_lock("init", tracking_uri):
            # Building the store runs the schema migrations on a fresh file; one process at a time.
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
            retrying(client.search_experiments, max_results=1)
            retrying(client.search_registered_models, max_results=1)
        return client
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)


def client() -> MlflowClient:
    """A client for the configured tracking and registry URIs (read at call time)."""
    return _client_for(env.tracking_uri(), env.registry_uri())


def experiment_id(name: str = env.EXPERIMENT) -> str:
    """The experiment's id, created on first use with its artifacts beside an embedded store."""
    c = client()
    found = retrying(c.get_experiment_by_name, name)
    if found is not None:
        return found.experiment_id
    root = env.artifact_root_for()
    try:
        return retrying(c.create_experiment, name, artifact_location=f"{root}/{name}" if root else None)
    except MlflowException as error:
        if "already exists" not in str(error).lower() and "unique" not in str(error).lower():
            raise
        return retrying(c.get_experiment_by_name, name).experiment_id
