"""Content-addressed step folders: a re-run finds what a previous run finished, and resumes the rest.

Every expensive step (training, accounting, evaluation, throughput) works in

    <data_dir>/pipeline/<step>/<key>/          key = sha256(step inputs + source of the code it runs)

and writes `result.json` there as its last act (atomically). A re-run with the same inputs and the
same code returns that result without recomputing; an interrupted step finds its folder again, which
is how training resumes from its last checkpoint. Changing an input or the code it depends on changes
the key, so a stale result is never reused. This plays the part of Prefect's INPUTS + TASK_SOURCE
cache policy, but the cache lives beside the outputs it describes: delete the outputs and the cache
entry goes with them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from residualkv.paths import data_dir
from residualkv.saved import write_file_atomically

RESULT = "result.json"


def _canonical(payload: Any) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)


# Every step runs through nearly all of the library (a static import closure of tasks.train or
# tasks.measure reaches all but a few of its modules), so each key hashes all of it: an edit anywhere in
# residualkv/ or kernels/ re-runs training and measurements rather than reuse a result the old code made.
LIBRARY = ("residualkv", "kernels")


def source_hash(*modules: str) -> str:
    """sha256 of the source files of the named modules (a package means all its .py files, recursively)."""
    h = hashlib.sha256()
    for name in sorted(modules):
        mod = importlib.import_module(name)
        path = Path(mod.__file__)
        root = path.parents[name.count(".") + (1 if path.name == "__init__.py" else 0)]
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
        for file in files:
            h.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:16]


def code_hash(*task_modules: str) -> str:
    """What a step's result depends on in code: the whole library and the task modules that run it."""
    return source_hash(*LIBRARY, *task_modules)


def step_key(payload: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()[:16]


def step_dir(step: str, payload: dict[str, Any], root: Path | None = None) -> Path:
    return (root or data_dir() / "pipeline") / step / step_key(payload)


def read_result(folder: Path) -> dict[str, Any] | None:
    path = folder / RESULT
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn file cannot happen with write_result, but never trust it


def write_result(folder: Path, result: dict[str, Any]) -> None:
    write_file_atomically(folder / RESULT, json.dumps(result, indent=2, sort_keys=True, default=str))


@contextlib.contextmanager
def step_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold `folder` for one run: two runs of the same step (a scheduled run and a manual one) would
    otherwise resume each other's checkpoints and write each other's results. The second waits, then
    finds the first's result. flock: released when the holder exits, however it exits."""
    from .common import say

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"{what}: another run is working in {folder}; waiting for it to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def cached_step(step: str, payload: dict[str, Any], compute: Callable[[Path], dict[str, Any]], *,
                use_cache: bool = True, validate: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Run compute(folder) once per (step, payload); later calls return the stored result (with cached=True)."""
    folder = step_dir(step, payload)

    def finished() -> dict[str, Any] | None:
        found = read_result(folder) if use_cache else None
        if found is not None and (validate is None or validate(found)):
            return found | {"cached": True, "step_dir": str(folder)}
        return None

    if (done := finished()) is not None:
        return done
    with step_lock(folder, step):
        if (done := finished()) is not None:  # another run finished it while this one waited
            return done
        (folder / "inputs.json").write_text(_canonical(payload))
        result = compute(folder)
        write_result(folder, result)
    return result | {"cached": False, "step_dir": str(folder)}
