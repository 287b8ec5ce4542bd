"""ResidualKV: compresses the KV cache of Hugging Face causal LMs with learned codecs."""
