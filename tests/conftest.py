import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides) -> LlamaConfig:
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded backbone (fetched once into the data dir by `make setup`)."""
    from residualkv.backbones import load_backbone

    model, tok, spec = load_backbone("smollm2-135m")
    return model, tok, spec
