"""The serving loader: a registered codec version -> a verified `ResidualCodec` ready to attach.

    from registry.serving import load_codec
    codec = load_codec("models:/rkv-smollm2-135m@champion", model_config=model.config)
    cache = residualkv.methods.build_cache("residualkv", model, codec)

Refuses, with a `RegistryError` (a `residualkv.codec.CodecError`) that says what to do:
  - a version without `rkv.complete=true` (registration did not finish: never served);
  - artifacts whose weights do not hash to the version's `sha256` tag, or whose codec.json was
    changed after registration (`codec_json_sha256`) - a corrupted or tampered artifact;
  - a codec whose backbone fingerprint does not match `model_config` (`ResidualCodec.load` checks it).

Downloads are cached under `<data_dir>/registry_cache/<name>/v<version>-<sha12>/` (moved into place
only after verification); a cached copy is re-hashed on every load and replaced if it does not verify.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from residualkv.codec import META, WEIGHTS, CodecError, ResidualCodec
from residualkv.saved import exchange_paths, sha256_file
from residualkv.paths import data_dir

from . import env
from .codecs import COMPLETE_TAG, RegistryError, _download, get_version, is_complete
from .store import client, retrying


def cache_root() -> Path:
    return data_dir() / "registry_cache"


def _verify(path: Path, mv, uri: str, model_config) -> ResidualCodec:
    tags = mv.tags or {}
    want = tags.get("sha256", "")
    if not want:
        raise RegistryError(f"{uri} (v{mv.version}) carries no sha256 tag; it was not registered by registry.register_codec")
    if not (path / WEIGHTS).is_file() or not (path / META).is_file():
        raise RegistryError(f"{uri} (v{mv.version}): the stored artifacts lack {WEIGHTS} or {META}; the version is "
                            "broken - register the codec again")
    got = sha256_file(path / WEIGHTS)
    if got != want:
        raise RegistryError(f"{uri} (v{mv.version}) is corrupted: {WEIGHTS} has sha256 {got[:12]}… but the version "
                            f"was registered with {want[:12]}…; refusing to serve it. Re-register the codec or roll "
                            f"the alias back to a good version (`rkv registry alias {mv.name} ALIAS VERSION`)")
    meta_want = tags.get("codec_json_sha256")
    if meta_want and sha256_file(path / META) != meta_want:
        raise RegistryError(f"{uri} (v{mv.version}) is corrupted: {META} was changed after registration; refusing to serve it")
    try:
        return ResidualCodec.load(path, model_config=model_config)
    except CodecError as error:
        raise RegistryError(f"{uri} (v{mv.version}, backbone {tags.get('backbone', '?')}): {error}") from error


def load_codec(uri: str, model_config=None, *, use_cache: bool = True) -> ResidualCodec:
    """Download, verify and load the codec version `uri` (models:/NAME@ALIAS or models:/NAME/VERSION)."""
    return _fetch(uri, model_config, use_cache)[1]


def fetch_codec_dir(uri: str, model_config=None) -> Path:
    """The verified local copy of a version's codec directory (for tools that take a path)."""
    return _fetch(uri, model_config, True)[0]


def servable_version(uri: str):
    """The registry version `uri` names, refused unless its registration finished (cheap: no download;
    the CLIs call it before loading a model)."""
    mv = get_version(uri)
    if not is_complete(mv):
        raise RegistryError(f"{uri} points at version {mv.version}, which is not complete ({COMPLETE_TAG} is not "
                            "'true'): its registration did not finish, so it is never served. Register the codec "
                            "again, or load a complete version")
    return mv


def _fetch(uri: str, model_config, use_cache: bool) -> tuple[Path, ResidualCodec]:
    mv = servable_version(uri)
    sha12 = (mv.tags or {}).get("sha256", "")[:12] or "nosha"
    dest = cache_root() / mv.name / f"v{mv.version}-{sha12}"
    if use_cache and dest.is_dir():
        try:
            return dest, _verify(dest, mv, uri, model_config)
        except RegistryError as error:
            if "does not fit" in str(error) or "trained for backbone" in str(error):
                raise  # wrong model, not a bad cache
            # a bad copy (or one another loader was swapping): download again; _place swaps it out
    source = retrying(client().get_model_version_download_uri, mv.name, str(mv.version))
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_downloads(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{mv.version}-", dir=dest.parent))
    try:
        try:
            path = _download(source, tmp)
        except Exception as error:  # noqa: BLE001
            raise RegistryError(f"{uri} (v{mv.version}): cannot download its artifacts from {source} "
                                f"(tracking URI {env.tracking_uri()}): {error}") from error
        codec = _verify(path, mv, uri, model_config)
        if not use_cache:
            return path, codec  # (the caller must use the codec, the folder is removed)
        return _place(path, dest, tmp, mv, uri, model_config), codec
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _place(path: Path, dest: Path, tmp: Path, mv, uri: str, model_config) -> Path:
    """Move a verified download to `dest`. Another loader may have placed its copy there meanwhile and
    handed it to a caller that reads it later (fetch_codec_dir): a copy that verifies is kept and ours
    dropped. One that does not is swapped for ours in one step (renameat2), never deleted in place, so
    `dest` always holds a whole folder; every verified copy has the same bytes, so a reader holding the
    path reads the same codec whichever copy is there. Where no swap is possible, ours is kept beside."""
    for _ in range(3):  # another loader may be swapping at the same moment: look again
        try:
            path.rename(dest)
            return dest
        except OSError:
            pass  # dest exists (a whole folder, or one being swapped)
        try:
            _verify(dest, mv, uri, model_config)
            return dest  # a concurrent loader's identical, verified copy
        except RegistryError:
            pass
        try:
            if exchange_paths(path, dest):  # ours in, the bad one out (removed with tmp)
                return dest
        except FileNotFoundError:
            continue  # dest vanished mid-swap: try the plain rename again
        break
    private = dest.parent / f"{dest.name}.copy-{os.getpid()}-{tmp.name[-8:]}"
    path.rename(private)  # a verified copy of our own that no other loader touches
    return private


def _sweep_stale_downloads(folder: Path, older_than_s: float = 3600.0) -> None:
    """Temporary folders of loaders that were killed mid-download (a live one is younger than this)."""
    import time

    for stale in folder.glob(".v*-*"):
        try:
            if time.time() - stale.stat().st_mtime > older_than_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def describe(uri: str) -> dict:
    """Name, version, run, tags of a registry URI (for CLIs and reports)."""
    mv = get_version(uri)
    return {"name": mv.name, "version": str(mv.version), "run_id": mv.run_id, "source": mv.source,
            "aliases": list(getattr(mv, "aliases", []) or []), "tags": dict(mv.tags or {}),
            "complete": is_complete(mv)}
