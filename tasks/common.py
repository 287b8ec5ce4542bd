"""What several tasks share: loading a backbone once per process, and its fingerprint."""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from residualkv.backbones import fingerprint, fingerprint_hash, kv_digest, load_backbone
from residualkv.cli import base_config

_LOCK = threading.Lock()


@lru_cache(maxsize=2)
def _load(ref: str):
    return load_backbone(ref)


def shared_backbone(ref: str):
    """(model, tokenizer, spec), loaded once per process for the read-only steps (not for training)."""
    with _LOCK:
        return _load(ref)


def backbone_identity(model, spec) -> dict[str, Any]:
    fp = fingerprint(model)
    return {"name": spec.name if spec else "", "fingerprint_hash": fingerprint_hash(fp), "weights": kv_digest(model)[:16]}


def cache_defaults(spec):
    return base_config(spec)


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(int(n))


def say(message: str, *, error: bool = False) -> None:
    """Log to the Prefect run (UI + terminal) when inside one, else print.

    The flows do not use Prefect's `log_prints`: it replaces `print`, which breaks libraries that capture
    stdout to parse it (dill's global detection, used by `datasets` fingerprinting, then logs bytecode).
    """
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        logger = get_run_logger()
    except (ImportError, MissingContextError, RuntimeError):
        print(message, flush=True)
        return
    (logger.error if error else logger.info)(message)
