"""A saved folder: tensors in safetensors and metadata in JSON, written atomically, checked when read.

Codecs (`codec.py`) and LowRAM's learnt starts (`lowram/starts.py`) are saved this way: a reader sees the
old folder or the new one, never half of either, and a folder whose weights changed after saving (a
partial copy, a tampered file) is refused by the sha256 its metadata records.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_dir_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Build `directory` by `write(tmp)` in a hidden sibling, then swap it in (a crash leaves only the
    hidden sibling behind)."""
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


def save_folder(directory: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, weights: str,
                meta_name: str, tag: str) -> Path:
    """`tensors` to `weights` and `meta` (plus their sha256) to `meta_name`, as one folder."""
    def write(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / weights),
                  metadata={"format": tag})
        full = meta | {"weights_sha256": sha256_file(tmp / weights)}
        (tmp / meta_name).write_text(json.dumps(full, indent=2, sort_keys=True))

    return write_dir_atomically(directory, write)


def read_folder(directory: str | Path, *, weights: str, meta_name: str, format_version: int, what: str, fix: str,
                error: type[Exception]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a folder `save_folder` wrote, or `error` saying what is wrong and `fix`."""
    directory = Path(directory)
    if not (directory / meta_name).is_file() or not (directory / weights).is_file():
        raise error(f"{directory} is not a saved {what}: expected {meta_name} and {weights} inside it")
    meta = json.loads((directory / meta_name).read_text())
    if meta.get("format_version") != format_version:
        raise error(f"{directory}: {what} format_version {meta.get('format_version')} is not {format_version}; {fix}")
    digest = sha256_file(directory / weights)
    if meta.get("weights_sha256") and digest != meta["weights_sha256"]:
        raise error(f"{directory}/{weights} is corrupted: sha256 {digest[:12]}… does not match "
                    f"{meta['weights_sha256'][:12]}… recorded at save time; {fix}")
    return meta, load_file(str(directory / weights))
