"""Triton kernels for ResidualKV's hot paths, each next to the torch reference it must match.

Every entry point takes `impl="auto" | "triton" | "torch"`: "auto" runs the Triton kernel on CUDA
tensors and the torch reference (the library's own CPU code) elsewhere. Importing this package never
needs a GPU, nor triton itself.

    quantize_pack         residualkv.quant.quantize            latents -> packed b-bit codes + FP16 min/scale
    topk_l2               residualkv.retrieval.topk_refs       causal L2 top-k references of new tokens
    reconstruct_selected  reconstruct_selected_reference       selected codes -> K (RoPE'd), V for attention
    kivi_decode_attention KiviStore.read + SDPA                one decode step over a KIVI-4 full layer
"""

from .kivi_attention import kivi_decode_attention, kivi_decode_attention_reference
from .quant_pack import quantize_pack
from .reconstruct import reconstruct_selected, reconstruct_selected_reference, rope_from_positions, rope_params
from .topk_l2 import topk_l2

__all__ = ["kivi_decode_attention", "kivi_decode_attention_reference", "quantize_pack", "reconstruct_selected",
           "reconstruct_selected_reference", "rope_from_positions", "rope_params", "topk_l2"]
