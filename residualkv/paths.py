"""Where ResidualKV keeps what it downloads and produces (backbones, data, codecs, runs)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

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


def write_dir_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Build `directory` by `write(tmp)` in a hidden sibling, then swap it in: a reader sees the old
    folder or the new one, never half of either (a crash leaves only the hidden sibling behind)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; what is saved here is meant to be shared
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    return directory
