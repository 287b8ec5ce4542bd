"""LowRAM (seed 003): low-rank keys and amortised values, fitted to each context at prefill.

keys.py (xKV cross-layer low rank), values.py (the test-time value predictor and its residuals),
cache.py (the transformers Cache that stores and reads them), selective.py (LowRAM-SR), evict.py
(LowRAM-E: SnapKV eviction before the fit), starts.py (saved predictor starts learnt
once per backbone) and meta.py (learning them: the warm start and the FOMAML meta-init, `rkv lowram-init`).
Configuration: residualkv.config.LowRAMConfig.
"""

from ..config import LowRAMConfig
from .cache import LowRAMCache

__all__ = ["LowRAMCache", "LowRAMConfig"]
