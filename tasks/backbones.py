"""Backbone entries of a pipeline profile -> something `residualkv.backbones.load_backbone` loads.

A profile lists registered names ("smollm2-135m"), backbone YAML paths, or a tiny random model:

    - name: tiny-llama
      tiny_random: {hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2,
                    head_dim: 16, intermediate_size: 128, seed: 0, initializer_range: 0.02}
      tokenizer: smollm2-135m            # a registered backbone whose tokenizer it borrows
      full_attention_layers: [0]
      codec: {d_c: 32, d_ff: 64}

The tiny model (the `smoke` profile and the tests) is written once, deterministically from its seed,
to `<data_dir>/backbones/<name>/` with a backbone YAML beside it, so every step loads it by that YAML
exactly like a registered backbone (same fingerprint each time).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from residualkv.paths import data_dir
from residualkv.saved import write_dir_atomically, write_file_atomically

TINY_DEFAULTS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192, "seed": 0,
                 "initializer_range": 0.02, "rope_theta": 10000.0}


def backbone_name(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry["name"])
    text = str(entry)
    return Path(text).stem if text.endswith((".yaml", ".yml")) else text


def resolve_backbone(entry: Any) -> str:
    """A reference load_backbone accepts: the registered name / YAML path as given, or the tiny model's YAML."""
    if isinstance(entry, dict):
        return str(ensure_tiny_backbone(entry))
    return str(entry)


def ensure_tiny_backbone(entry: dict[str, Any]) -> Path:
    name = str(entry["name"])
    params = dict(TINY_DEFAULTS) | dict(entry.get("tiny_random") or {})
    tokenizer_from = str(entry.get("tokenizer", "smollm2-135m"))
    full_layers = [int(i) for i in entry.get("full_attention_layers", [0])]
    codec = {"d_c": 32, "d_ff": 64, "k": 4, "stride": 10, "stride_alpha": 0.0, "n_sink": 8, "bits": 4,
             "group_size": 32, "ref_format": "fp8"} | dict(entry.get("codec") or {})
    digest = hashlib.sha256(json.dumps([params, tokenizer_from], sort_keys=True).encode()).hexdigest()[:10]
    root = data_dir() / "backbones"
    folder = root / f"{name}-{digest}"
    yaml_path = root / f"{name}-{digest}.yaml"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        _write_tiny(folder, params, tokenizer_from)
    arch = {"num_layers": params["num_hidden_layers"], "num_kv_heads": params["num_key_value_heads"],
            "head_dim": params["head_dim"]}
    spec = {"name": name, "hf_id": str(folder), "source": {"kind": "hub"}, "config_only": False,
            "architecture": arch, "full_attention_layers": full_layers, "codec": codec,
            "notes": f"tiny random Llama (seed {params['seed']}) with the {tokenizer_from} tokenizer, for smoke runs"}
    text = yaml.safe_dump(spec, sort_keys=False)
    if not yaml_path.is_file() or yaml_path.read_text() != text:
        write_file_atomically(yaml_path, text)
    return yaml_path


def _write_tiny(folder: Path, params: dict[str, Any], tokenizer_from: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from residualkv.backbones import load_backbone  # noqa: F401  (fetches the tokenizer's backbone if needed)
    from residualkv.backbones import _resolve

    _, location = _resolve(tokenizer_from)
    tokenizer = AutoTokenizer.from_pretrained(location)
    kw = {k: v for k, v in params.items() if k not in ("seed", "rope_theta")}
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": float(params["rope_theta"])}, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(int(params["seed"]))
        model = LlamaForCausalLM(config).eval()
    write_dir_atomically(folder, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
