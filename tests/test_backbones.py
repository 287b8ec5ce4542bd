import json

import pytest
import torch
from transformers import LlamaConfig

from residualkv.backbones import (
    BackboneError,
    BackboneSpec,
    cache_dir,
    check_architecture,
    fingerprint,
    fingerprint_hash,
    get_backbone,
    list_backbones,
    load_backbone,
)
from residualkv.config import InputError

# ResidualKV Table I (PDF p. 8): 2d_k, d_c, d_ff, full-attention layer ids. Written out here, apart
# from the YAMLs, so a typo in either shows up.
TABLE_I = {
    "llava-onevision-qwen2-7b-ov": (1024, 384, 3072, [0, 1, 4, 7, 14]),
    "qwen3-vl-8b-instruct": (2048, 384, 3072, [0, 1, 2, 3, 10, 21, 29]),
    "llama-3.1-8b-instruct": (2048, 512, 3072, [0, 1, 2, 8, 18]),
    "qwen2.5-7b-instruct-1m": (1024, 384, 3072, [0, 1, 2, 4, 7, 14]),
    "qwen2.5-32b-instruct": (2048, 512, 4096, [0, 1, 2, 3, 4, 5, 17, 29, 40]),
    "qwen3-4b-instruct-2507": (2048, 512, 3072, [0, 3, 9, 13, 16, 21, 28]),
    "qwen3-4b-thinking-2507": (2048, 512, 3072, [0, 3, 9, 13, 16, 21, 28]),
    # not in Table I: Llama-3.1's choices for Mistral; SmolLM2's own (see its YAML notes)
    "mistral-7b-instruct-v0.3": (2048, 512, 3072, [0, 1, 2, 8, 18]),
    "smollm2-135m": (384, 160, 1152, [0, 1, 2, 8, 17]),
}


def tiny_llama(**overrides) -> LlamaConfig:
    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=100)
    return LlamaConfig(**{**kwargs, **overrides})


def test_every_table_row_has_a_yaml():
    assert sorted(TABLE_I) == list_backbones()


@pytest.mark.parametrize("name", sorted(TABLE_I))
def test_yaml_matches_table_and_is_consistent(name):
    spec = get_backbone(name)
    two_dk, d_c, d_ff, layers = TABLE_I[name]
    assert spec.name == name
    assert (2 * spec.d_k, spec.codec["d_c"], spec.codec["d_ff"], list(spec.full_attention_layers)) == (
        two_dk, d_c, d_ff, layers)

    arch = spec.architecture
    assert 2 * arch["num_kv_heads"] * arch["head_dim"] == two_dk
    assert layers == sorted(set(layers)) and max(layers) < arch["num_layers"]
    codec = spec.codec
    assert codec["group_size"] == 32 and codec["d_c"] % codec["group_size"] == 0 and codec["d_c"] % 2 == 0
    assert codec["d_c"] < two_dk
    assert codec["bits"] in (2, 4) and codec["ref_format"] == "fp8"
    assert spec.config_only == (name in ("llava-onevision-qwen2-7b-ov", "qwen3-vl-8b-instruct"))


def test_smollm2_choices():
    spec = get_backbone("smollm2-135m")
    assert spec.d_k == 192
    assert spec.codec["d_c"] == 5 * 32  # the YAML notes why 5/12 of 2·d_k and not Table I's 1/4
    assert spec.codec["stride"] == 11  # what pays for it inside the 20% KR budget
    assert spec.codec["d_ff"] == 3 * 2 * spec.d_k
    assert spec.source["kind"] == "pypi-gguf"


def test_get_backbone_accepts_a_yaml_path():
    spec = get_backbone("llama-3.1-8b-instruct")
    assert get_backbone(spec.path) == spec


def test_unknown_backbone_names_the_known_ones():
    with pytest.raises(KeyError) as info:
        get_backbone("llama-9000")
    message = info.value.args[0]
    assert "llama-9000" in message and "smollm2-135m" in message


def test_yaml_with_a_missing_key_names_it(tmp_path):
    text = get_backbone("smollm2-135m").path.read_text().replace("config_only: false\n", "")
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="config_only"):
        BackboneSpec.from_yaml(path)


def test_architecture_mismatch_names_the_field():
    spec = get_backbone("smollm2-135m")
    config = tiny_llama(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_architecture(spec, config)


def test_fingerprint_is_stable_and_sees_rope():
    fp = fingerprint(tiny_llama())
    assert json.loads(json.dumps(fp)) == fp
    assert fingerprint_hash(fp) == fingerprint_hash(fingerprint(tiny_llama()))
    assert len(fingerprint_hash(fp)) == 16
    assert (fp["num_layers"], fp["num_kv_heads"], fp["head_dim"]) == (2, 2, 16)
    other = fingerprint(tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert fingerprint_hash(other) != fingerprint_hash(fp)
    same = fingerprint(tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 10000}))
    assert fingerprint_hash(same) == fingerprint_hash(fp)


def test_smollm2_loads_and_answers():
    """The real offline backbone (fetched once into the data dir, ~1 min; then a few seconds)."""
    model, tokenizer, spec = load_backbone("smollm2-135m")
    assert spec.name == "smollm2-135m"
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (30, 3, 64)
    assert config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    provenance = json.loads((cache_dir(spec) / "rkv_source.json").read_text())
    assert fingerprint_hash(provenance["fingerprint"]) == fingerprint_hash(fingerprint(model))

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert "Paris" in text


def test_an_unreachable_hub_fails_at_once_and_says_so(monkeypatch):
    """A host name that does not resolve ends the load before the hub client's ~25 s of retries."""
    import socket

    from residualkv.evaluation.hub import load_benchmark
    from residualkv.training.packing import DataError, HubSource

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(BackboneError, match="hub is unreachable .huggingface.co does not resolve"):
        load_backbone("no-such-org/no-such-model")
    with pytest.raises(DataError, match="--data no-such-org/corpus: the Hugging Face hub is unreachable"):
        HubSource("no-such-org/corpus").load()
    with pytest.raises(InputError, match="the hub is unreachable .* HF_HUB_OFFLINE=1"):
        load_benchmark("longbench", "hotpotqa")

    # rkv eval fetches a hub suite before the model: an unknown backbone name is never reached
    from residualkv.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the hub suite")

    monkeypatch.setattr("residualkv.backbones.load_backbone", no_model)
    assert main(["eval", "--backbone", "no-such-org/no-such-model", "--methods", "full",
                 "--suite", "longbench:hotpotqa", "--json", "/nonexistent/out.json"]) == 2
