"""A saved folder: tensors in safetensors and metadata in JSON, written atomically, checked when read.

Codecs (`codec.py`) and LowRAM's learnt starts (`lowram/starts.py`) are saved this way: a reader sees the
old folder or the new one, never half of either, and a folder whose weights changed after saving (a
partial copy, a tampered file) is refused by the sha256 its metadata records.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
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
    """Build `directory` by `write(tmp)` in a hidden sibling, flush it to disk, then swap it in: a reader
    sees the old folder or the new one, and a crash at any point leaves the old folder in place (or, where
    the file system cannot exchange two names at once, in a hidden `.NAME.old-*` sibling)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; what is saved here is meant to be shared
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp)
        if not directory.exists():
            os.replace(tmp, directory)
        elif exchange_paths(tmp, directory):  # tmp now holds the old folder
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old)  # an empty directory is replaced; a unique name never collides
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(directory.parent)
    return directory


def write_file_atomically(path: str | Path, text: str) -> Path:
    """Write `text` to a hidden sibling, flush it, and rename it over `path`: readers see the old file or
    the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are shared like the rest of the data dir
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    libc = _libc()
    if libc is None:
        return False
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # a file system (or kernel) without the exchange
    raise OSError(err, os.strerror(err), str(b))


@lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return libc
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None


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
