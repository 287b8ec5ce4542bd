import os

# Triton reads TRITON_INTERPRET when it is first imported, and transformers imports it: set it before
# anything else so the kernel tests run on the CPU (the GPU benchmark sets RKV_KERNEL_TEST_DEVICE=cuda).
if os.environ.get("RKV_KERNEL_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides) -> LlamaConfig:
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, restored after (`pytestmark = usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
