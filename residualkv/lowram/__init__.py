"""LowRAM (seed 003): low-rank keys and amortised values, fitted to each context at prefill.

keys.py (xKV cross-layer low rank), values.py (the test-time value predictor and its residuals),
cache.py (the transformers Cache that stores and reads them). Configuration: residualkv.config.LowRAMConfig.
"""

from ..config import LowRAMConfig
from .cache import LowRAMCache

__all__ = ["LowRAMCache", "LowRAMConfig"]
