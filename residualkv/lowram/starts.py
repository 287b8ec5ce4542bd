"""Saved starts for LowRAM's value predictors, learnt once per backbone (seed 003, step four and the
meta-init); `meta.py` learns them, the cache reads them.

A folder holds `starts.safetensors` (per kind and layer: W1, b1, W2, b2, W_lin stacked over the KV heads,
float32) and `starts.json` (backbone, fingerprint, how they were learnt and what they did on held-out
contexts). It is written atomically. The predictors map one model's keys to its values through its K/V
projections, so a start is tied to those weights by a digest and refused on any other model, even one
of the same shape (a fine-tune).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backbones import kv_digest
from ..config import ConfigError
from ..paths import data_dir
from ..saved import read_folder, save_folder
from .values import Predictor

WEIGHTS, META = "starts.safetensors", "starts.json"
FORMAT_VERSION = 1
_LOADED: dict[tuple, "PredictorStarts"] = {}  # (folder, its files' mtimes and sizes) -> starts, the last 8 read


def starts_root() -> Path:
    return data_dir() / "lowram"


LAYOUT_FIELDS = ("ratio", "layer_group", "key_bits")  # what shapes the keys a predictor is learnt on


def _layout(meta_file: Path) -> dict[str, Any]:
    try:
        saved = json.loads(meta_file.read_text()).get("lowram_config") or {}
    except (OSError, json.JSONDecodeError):  # being replaced by a save this moment: matches nothing
        saved = {}
    return {k: saved.get(k) for k in LAYOUT_FIELDS}


@dataclass
class PredictorStarts:
    layers: dict[str, list[Predictor]]  # kind -> one Predictor [H, ...] per layer
    meta: dict[str, Any] = field(default_factory=dict)

    def start(self, kind: str, layer: int) -> Predictor:
        if kind not in self.layers:
            raise ConfigError(f"invalid start={kind!r}: {self.meta.get('path', 'these starts')} holds "
                              f"{sorted(self.layers)}")
        return self.layers[kind][layer]

    def save(self, directory: str | Path) -> Path:
        tensors = {f"{kind}.{i}.{name}": t.float() for kind, preds in self.layers.items() for i, p in enumerate(preds)
                   for name, t in zip(Predictor._fields, p)}
        meta = {k: v for k, v in self.meta.items() if k != "path"}
        meta |= {"format_version": FORMAT_VERSION, "kinds": sorted(self.layers), "n_layers": len(next(iter(self.layers.values())))}
        return save_folder(directory, tensors, meta, weights=WEIGHTS, meta_name=META, tag="residualkv-lowram-starts")

    @classmethod
    def load(cls, directory: str | Path, model=None) -> "PredictorStarts":
        """The folder's starts, read (and their sha256 checked) once while its files stay as they are:
        every cache that starts from them shares the tensors (callers must not write into them)."""
        folder = Path(directory)
        try:
            key = (str(folder.resolve()),) + tuple((f.stat().st_mtime_ns, f.stat().st_size)
                                                   for f in (folder / WEIGHTS, folder / META))
        except OSError:
            key = None  # read_folder says what is missing
        starts = _LOADED.get(key) if key else None
        if starts is None:
            meta, flat = read_folder(directory, weights=WEIGHTS, meta_name=META, format_version=FORMAT_VERSION,
                                     what="LowRAM starts folder", fix="rerun `rkv lowram-init`", error=ConfigError)
            layers = {kind: [Predictor(*(flat[f"{kind}.{i}.{name}"] for name in Predictor._fields))
                             for i in range(meta["n_layers"])] for kind in meta["kinds"]}
            starts = cls(layers, meta | {"path": str(directory)})
            if key:
                while len(_LOADED) >= 8:
                    _LOADED.pop(next(iter(_LOADED)))
                _LOADED[key] = starts
        if model is not None and starts.meta.get("kv_digest") != kv_digest(model):
            raise ConfigError(f"invalid starts_path={str(directory)!r}: its predictors were learnt on "
                              f"{starts.meta.get('backbone') or 'another model'}'s K/V projections, not this model's; "
                              "run `rkv lowram-init --backbone ...` for this model")
        return starts

    @classmethod
    def resolve(cls, path: str | None, model, config=None) -> "PredictorStarts":
        """`path`, else the newest starts saved under the data directory for this model's K/V weights,
        preferring those learnt for `config`'s key layout (ratio, layer group, key bits: the predictors map
        the keys as stored to values). Where none was learnt for it, the newest is used and a warning says so."""
        if path is not None:
            return cls.load(path, model)
        digest, root = kv_digest(model), starts_root()
        found = []
        for meta_file in root.glob(f"**/{META}") if root.is_dir() else []:
            parts = meta_file.parent.relative_to(root).parts
            if any(p.startswith(".") or p.endswith(".old") for p in parts):
                continue  # a save in progress or the folder it is replacing
            try:
                if json.loads(meta_file.read_text()).get("kv_digest") == digest:
                    found.append(meta_file)
            except (OSError, json.JSONDecodeError):
                continue  # not a complete starts folder: never read
        if not found:
            raise ConfigError("start='warm' or 'meta' needs predictor starts learnt on this model: run "
                              "`rkv lowram-init --backbone NAME` once (minutes on CPU), or pass starts_path=FOLDER")
        if config is not None:
            want = {k: getattr(config, k) for k in LAYOUT_FIELDS}
            same = [m for m in found if _layout(m) == want]
            if same:
                found = same
            else:
                newest = max(found, key=lambda p: p.stat().st_mtime)
                warnings.warn(f"no LowRAM starts learnt for {want} on this model; using {newest.parent} (learnt for "
                              f"{_layout(newest)}). Run `rkv lowram-init` with these settings for starts that match",
                              stacklevel=2)
        # its digest was just matched against this model's: no second pass over the weights
        return cls.load(max(found, key=lambda p: p.stat().st_mtime).parent)
