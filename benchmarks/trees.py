"""Importing the library from another checkout, for benchmarks that compare two trees (before/after).

A script calls `use_tree(path)` before its first `residualkv` import and `check_tree(path)` after it.
Both trees read this checkout's data directory (backbones, codecs) unless RKV_DATA_DIR says otherwise:
a fresh `git worktree` has none, and two runs must load the same files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def use_tree(tree: str | Path) -> Path:
    root = Path(tree).resolve()
    if not (root / "residualkv").is_dir():
        raise SystemExit(f"--tree {root}: no residualkv/ package there; pass the root of a checkout")
    sys.path.insert(0, str(root))
    os.environ.setdefault("RKV_DATA_DIR", str(HERE / "data"))
    return root


def check_tree(root: Path) -> None:
    """An installed (editable) copy must not stand in for the tree asked for."""
    import kernels
    import residualkv

    for pkg in (residualkv, kernels):
        if not Path(pkg.__file__).resolve().is_relative_to(root):
            raise SystemExit(f"imported {pkg.__name__} from {pkg.__file__}, not from --tree {root}")


def describe(root: Path) -> str:
    """The tree's commit (short hash), with "+changes" when its work tree differs from it."""
    git = ["git", "-C", str(root)]
    try:
        def out(*a: str) -> str:
            return subprocess.run(git + list(a), check=True, capture_output=True, text=True).stdout.strip()

        head, dirty = out("rev-parse", "--short", "HEAD"), out("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head + ("+changes" if dirty else "")
