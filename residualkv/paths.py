"""Where ResidualKV keeps what it downloads and produces (backbones, data, codecs, runs)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_PACKAGE_DIR = Path(__file__).resolve().parent


def repo_root() -> Path | None:
    """The source checkout holding this package, or None when it is installed as a plain package."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def data_dir() -> Path:
    """`$RKV_DATA_DIR`, else `<checkout>/data`, else `~/.local/share/residualkv`; created on demand.

    A checkout keeps its data beside the code, so deleting the clone removes everything it fetched.
    """
    env = os.environ.get("RKV_DATA_DIR")
    if env:
        path = Path(env).expanduser()
    elif (root := repo_root()) is not None:
        path = root / "data"
    else:
        path = Path.home() / ".local" / "share" / "residualkv"
    path.mkdir(parents=True, exist_ok=True)
    return path


def configs_dir() -> Path:
    """The repository's `configs/` folder (backbone and pipeline YAMLs)."""
    root = repo_root()
    if root is None or not (root / "configs").is_dir():
        raise FileNotFoundError(
            f"no configs/ folder next to {_PACKAGE_DIR}: ResidualKV's YAML configs live in its source "
            "checkout. Install it from a clone (`pip install -e .`) or pass the path of a YAML file."
        )
    return root / "configs"


def hub_unreachable(name: str | os.PathLike) -> str | None:
    """Why `name`, a hub id, cannot be fetched from this machine (the hub's host name does not resolve),
    or None when it may be, or when `name` is a local path. Checked before a hub load because the hub
    client retries a failed lookup for ~25 s before it gives up or falls back to its cache."""
    from huggingface_hub import constants

    if Path(name).exists() or constants.HF_HUB_OFFLINE:
        return None  # a local path; or offline mode, where the libraries go straight to their caches
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"{host} does not resolve: {error.strerror or error}"
    return None
