"""Every Triton kernel against the torch reference the library uses on CPU.

On a machine without a GPU the kernels run in Triton's CPU interpreter. TRITON_INTERPRET=1 has to be
set before triton.language is first imported, and tests/conftest.py imports transformers, which
imports triton: `make test` exports the variable, and this module sets it too (enough when nothing
imported triton before it); where it came too late the CPU kernel tests skip with that reason.

On a CUDA machine `RKV_KERNEL_TEST_DEVICE=cuda pytest tests/test_kernels.py` runs the same tests
compiled, on the GPU (benchmarks/gpu_bench.py does that). Shapes stay tiny: the interpreter runs
every program of the grid in Python.
"""

import os
import subprocess
import sys
from pathlib import Path

DEVICE = os.environ.get("RKV_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # must precede the first import of triton.language (see above)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import _common  # noqa: E402
from kernels.kivi_attention import kivi_decode_attention, kivi_decode_attention_reference  # noqa: E402
from kernels.quant_pack import quantize_pack  # noqa: E402
from kernels.reconstruct import (reconstruct_selected, reconstruct_selected_reference, rope_from_positions,  # noqa: E402
                                 rope_params)
from kernels.topk_l2 import topk_l2  # noqa: E402
from residualkv import quant  # noqa: E402
from residualkv.stores import KiviStore, ResidualStore  # noqa: E402
from residualkv.codec import LayerCodec  # noqa: E402
from residualkv.config import CodecDims, ResidualKVConfig  # noqa: E402
from residualkv.quant import decode_ref, encode_ref  # noqa: E402
from residualkv.retrieval import topk_refs  # noqa: E402
from residualkv.rope import RopeTable, apply_rope  # noqa: E402
from residualkv.schedule import ReferenceSchedule  # noqa: E402

from .conftest import tiny_llama_config  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("RKV_KERNEL_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)
if DEVICE == "cpu" and not _common.interpreter_usable():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by transformers, via conftest): "
                "run `make test` or `TRITON_INTERPRET=1 pytest tests/test_kernels.py`", allow_module_level=True)
DEV = torch.device(DEVICE)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEV)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (FP16 compared as raw bits, so -0.0 differs from +0.0)."""
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


# ---------------------------------------------------------------------------------------------
# quantise-and-pack


def test_library_rounds_fp16_min_down_and_scale_up():
    # -6.3457 lies between the FP16 values -6.3438 and -6.3477: a rounded-down minimum is the latter
    probe = torch.full((1, 32), 2.0)
    probe[0, 0] = -6.3457
    assert quant.quantize(probe, 4, 32).mins.float().item() <= -6.3457


def _latents(shape, seed, dtype=torch.float32):
    z = _randn(*shape, seed=seed, scale=3.0)
    flat = z.reshape(-1, shape[-1])
    if shape[-1] >= 64 and flat.shape[0] >= 2:
        flat[0, :32] = 1.5  # a constant group: scale 0, decodes to its min
        flat[1, 32:64] = torch.tensor([0.0, -0.0] * 16)  # zeros of both signs
    if flat.shape[0] >= 3 and shape[-1] >= 64:
        flat[2, :32] = torch.linspace(-1e5, 1e5, 32)  # beyond the ±FP16_MAX/4 clamp
        flat[2, 32:64] = torch.linspace(-3e-7, 5e-7, 32)  # FP16 subnormals
    if flat.shape[0] >= 4 and shape[-1] >= 32:
        flat[3, :32] = torch.arange(32.0) * 0.25 - 2.0  # min and max exactly representable in FP16
    return flat.reshape(shape).to(dtype)


QUANT_SHAPES = [(1, 32), (7, 64), (2, 33, 64), (3, 1, 128)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", QUANT_SHAPES)
def test_quantize_pack_bit_exact(bits, shape):
    """Kernel bytes == the library's quantize with its FP16 min/scale rounded down/up as documented."""
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        z = _latents(shape, seed=10 * bits + i, dtype=dtype)
        # the expectation is computed on the CPU: the library's semantics, whatever device runs the kernel
        got, want = quantize_pack(z, bits, 32, impl="triton"), quant.quantize(z.cpu(), bits, 32)
        for name, a, b in zip(("codes", "mins", "scales"), got, want):
            assert _same_bytes(a, b), f"{name} differ for bits={bits} shape={shape} dtype={dtype}"
        # the promise behind the rounding: every coordinate is on the stored grid, within half a step
        err = (quant.dequantize(got, bits, 32) - z.float().clamp(-16376, 16376)).abs()
        half_step = got.scales.float().repeat_interleave(32, dim=-1) / 2
        assert (err <= half_step + z.float().abs() * 2.0**-21 + 1e-30).all()  # + float32 rounding


@pytest.mark.parametrize("group", [16, 64])
def test_quantize_pack_other_group_sizes(group):
    """-gNN serves latents in other groups: powers of two run on the kernel, bit-exact; others (80 for
    d_c 160) fall back to the library under impl="auto" and are refused by name under impl="triton"."""
    z = _latents((3, 5, 128), seed=group)
    for bits in (2, 4):
        got, want = quantize_pack(z, bits, group, impl="triton"), quant.quantize(z.cpu(), bits, group)
        assert all(_same_bytes(a, b) for a, b in zip(got, want)), (group, bits)
    wide = _latents((2, 160), seed=80)
    assert all(_same_bytes(a, b) for a, b in zip(quantize_pack(wide, 4, 80), quant.quantize(wide.cpu(), 4, 80)))
    with pytest.raises(ValueError, match="group_size=80, a power of two"):
        quantize_pack(wide, 4, 80, impl="triton")


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_pack_matches_library_as_is(bits):
    z = _latents((2, 33, 64), seed=bits)
    got, want = quantize_pack(z, bits, 32, impl="triton"), quant.quantize(z.cpu(), bits, 32)
    assert all(_same_bytes(a, b) for a, b in zip(got, want))


def test_quantize_pack_empty_and_dispatch():
    z = torch.zeros(0, 64, device=DEV)
    p = quantize_pack(z, 4, 32, impl="triton")
    assert p.codes.shape == (0, 32) and p.mins.shape == (0, 2)
    with pytest.raises(ValueError, match="impl"):
        quantize_pack(z, 4, 32, impl="cuda")
    if DEVICE == "cpu":  # auto never picks the kernel for CPU tensors
        assert not _common.use_triton("auto", z)


# ---------------------------------------------------------------------------------------------
# L2 top-k retrieval


def _assert_clear_gaps(q, refs_f, n_avail, k):
    """The ranks the test compares are not within float rounding of each other (see the tie rule)."""
    d = (refs_f.float().pow(2).sum(-1)[:, None, :] - 2 * q.float() @ refs_f.float().transpose(1, 2)).cpu()
    for t, a in enumerate(n_avail.tolist()):
        a = min(a, refs_f.shape[1])
        if a >= 2:
            srt = d[:, t, :a].sort(-1).values
            upto = min(k + 1, a)
            assert (srt[:, 1:upto] - srt[:, : upto - 1]).min() > 1e-3, "test data has a near tie; change the seed"


TOPK_CASES = [  # B, T, R, d, k
    (2, 1, 3, 64, 4),  # fewer references than k: -1 padding
    (2, 7, 5, 64, 4),
    (1, 33, 70, 96, 4),  # several reference tiles, d not a multiple of the d-block
    (2, 17, 40, 32, 2),
    (1, 5, 0, 64, 4),  # no references yet
    (1, 9, 20, 64, 1), (2, 9, 20, 64, 3), (1, 9, 20, 48, 5),  # other k (odd ones too), a narrower head
]


@pytest.mark.parametrize("B,T,R,d,k", TOPK_CASES)
@pytest.mark.parametrize("stored", ["fp8", "fp16", "decoded"])
def test_topk_l2_matches_reference(B, T, R, d, k, stored):
    q = _randn(B, T, d, seed=T + R)
    raw = _randn(B, R, d, seed=R + 1, scale=2.0)
    fmt = "fp16" if stored == "fp16" else "fp8"
    refs = encode_ref(raw, fmt)
    refs_f = decode_ref(refs, fmt)
    # causal availability as the store computes it: non-decreasing, starting anywhere in [0, R]
    n_avail = torch.randint(0, R + 1, (T,), generator=_gen(T)).sort().values.to(DEV)
    _assert_clear_gaps(q, refs_f, n_avail, k)
    arg, fmt_arg = (refs_f, None) if stored == "decoded" else (refs, fmt)
    got = topk_l2(q, arg, n_avail, k, ref_format=fmt_arg, impl="triton", block_r=16)
    want = topk_refs(q, refs_f, n_avail, k)
    assert got.dtype == torch.long and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("B,T,R,d,k", [(2, 1, 70, 64, 4), (1, 20, 45, 32, 4)])
def test_topk_l2_split_references_merge(B, T, R, d, k):
    """A decode step splits the references over several programs; the merged lists are the same."""
    q = _randn(B, T, d, seed=R)
    refs = encode_ref(_randn(B, R, d, seed=R + 2, scale=2.0), "fp8")
    refs_f = decode_ref(refs, "fp8")
    n_avail = torch.randint(0, R + 1, (T,), generator=_gen(R)).sort().values.to(DEV)
    n_avail[-1] = R
    _assert_clear_gaps(q, refs_f, n_avail, k)
    want = topk_refs(q, refs_f, n_avail, k)
    for splits in (3, 5):
        got = topk_l2(q, refs, n_avail, k, ref_format="fp8", impl="triton", block_r=16, r_splits=splits)
        assert torch.equal(got.cpu(), want.cpu()), splits


def test_topk_l2_tie_rule_prefers_smaller_index():
    # two identical references: equal distances, the kernel keeps index order
    refs = encode_ref(torch.tensor([[[1.0] * 16, [3.0] * 16, [1.0] * 16, [-5.0] * 16]]), "fp8").to(DEV)
    q = torch.full((1, 1, 16), 1.0, device=DEV)
    for splits in (1, 2):  # also across splits: reference 2 lives in the second one
        got = topk_l2(q, refs, torch.tensor([4], device=DEV), 3, ref_format="fp8", impl="triton", block_r=2,
                      r_splits=splits)
        assert got.tolist() == [[[0, 2, 1]]]


# ---------------------------------------------------------------------------------------------
# reconstruct-selected


def _store_tensors(B, C, R, H, D, d_c, k, bits, ref_format, seed):
    d_kv = 2 * H * D
    codes = quant.quantize(_randn(B, C, d_c, seed=seed), bits, 32)
    refs = encode_ref(_randn(B, R, d_kv, seed=seed + 1, scale=2.0), ref_format)
    g = _gen(seed + 2)
    ridx = torch.randint(-1, R, (B, C, k), generator=g)
    ridx[..., 0] = torch.randint(0, R, (B, C), generator=g)  # every token has at least one reference
    ridx[0, 0, :] = -1  # ... except one, whose mean is then zero (count clamped to 1, as the reference)
    return codes, quant.pack_indices(ridx.to(DEV), quant.index_bits(R)), refs


def _selection(B, C, n_sel, seed):
    sel = torch.randint(0, C, (B, n_sel), generator=_gen(seed))
    if n_sel >= 3 and B >= 2:
        sel[1, -2:] = -1  # a ragged row: padding slots come back as zeros
    return sel.to(DEV)


def _close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.numel():
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max()


RECON_CASES = [  # B, C, R, H, D, d_c, n_sel
    (2, 9, 5, 2, 32, 64, 7),
    (1, 4, 3, 2, 32, 64, 1),
    (2, 40, 6, 1, 64, 32, 33),
    (2, 9, 5, 2, 32, 64, 0),  # empty index set
    (1, 12, 4, 2, 48, 32, 5),  # a head of 48 coordinates (not a power of two)
]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("B,C,R,H,D,d_c,n_sel", RECON_CASES)
def test_reconstruct_selected_matches_reference(bits, B, C, R, H, D, d_c, n_sel):
    codes, ridx, refs = _store_tensors(B, C, R, H, D, d_c, 4, bits, "fp8", seed=C + n_sel)
    codec = LayerCodec(CodecDims(2 * H * D, d_c, 16)).to(DEV)
    sel = _selection(B, C, n_sel, seed=n_sel)
    cos, sin = _randn(B, n_sel, D, seed=1), _randn(B, n_sel, D, seed=2)
    kw = dict(bits=bits, group=32, num_kv_heads=H)
    got = reconstruct_selected(codes, ridx, refs, codec, sel, cos, sin, impl="triton", **kw)
    want = reconstruct_selected_reference(codes, ridx, refs, codec, sel, cos, sin, **kw)
    assert got[0].shape == (B, H, n_sel, D)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("variant", ["bf16-weights-and-out", "identity-codec", "fp16-refs", "k2"])
def test_reconstruct_selected_variants(variant):
    B, C, R, H, D, d_c, n_sel, bits = 2, 12, 5, 2, 32, 64, 9, 4
    identity = variant == "identity-codec"
    fmt = "fp16" if variant == "fp16-refs" else "fp8"
    k = 2 if variant == "k2" else 4
    codes, ridx, refs = _store_tensors(B, C, R, H, D, 2 * H * D if identity else d_c, k, bits, fmt, seed=7)
    codec = LayerCodec(CodecDims(2 * H * D, 2 * H * D if identity else d_c, 16, "identity" if identity else "swiglu"))
    out_dtype, tol = torch.float32, 1e-5
    if variant.startswith("bf16"):
        codec, out_dtype, tol = codec.to(torch.bfloat16), torch.bfloat16, 3e-2
    codec = codec.to(DEV)
    sel = _selection(B, C, n_sel, seed=3)
    cos, sin = _randn(1, n_sel, D, seed=1), _randn(1, n_sel, D, seed=2)  # broadcast over the batch
    kw = dict(bits=bits, group=32, num_kv_heads=H, ref_format=fmt, out_dtype=out_dtype)
    got = reconstruct_selected(codes, ridx, refs, codec, sel, cos, sin, impl="triton", **kw)
    want = reconstruct_selected_reference(codes, ridx, refs, codec, sel, cos, sin, **kw)
    for a, b in zip(got, want):
        _close(a, b, tol)


def _every_fp8_byte(rows: int) -> torch.Tensor:
    """[1, rows, 256] uint8: every finite e4m3fn byte (zeros, subnormals, both signs, ±448), rows rolled
    so each row holds the bytes in another order; the two NaN bytes (never stored: the encoder saturates)
    become 0."""
    b = torch.arange(256, dtype=torch.uint8)
    b[(b == 0x7F) | (b == 0xFF)] = 0
    return torch.stack([b.roll(37 * i) for i in range(rows)])[None].to(DEV)


def test_kernels_decode_every_fp8_byte_as_torch_does():
    """The kernels decode e4m3 bytes with integer ops (tl.float8e4nv needs sm_89): every finite byte must
    come out as torch's float8_e4m3fn conversion, exactly."""
    refs = _every_fp8_byte(4)
    H, D, C = 1, 128, 8
    codec = LayerCodec(CodecDims(2 * H * D, 2 * H * D, 16, "identity")).to(DEV)
    codes = quant.quantize(torch.zeros(1, C, 2 * H * D, device=DEV), 4, 32)  # zero residual: x = its reference
    ridx = torch.full((1, C, 4), -1)
    ridx[..., 0] = torch.arange(C) % 4
    ridx = quant.pack_indices(ridx.to(DEV), quant.index_bits(4))
    sel = torch.arange(C, device=DEV)[None]
    cos, sin = torch.ones(1, C, D, device=DEV), torch.zeros(1, C, D, device=DEV)
    k, v = reconstruct_selected(codes, ridx, refs, codec, sel, cos, sin, bits=4, group=32, num_kv_heads=H,
                                impl="triton")
    want = decode_ref(refs, "fp8")[0, torch.arange(C) % 4]
    assert torch.equal(torch.cat([k[0, 0], v[0, 0]], -1).cpu(), want.cpu())
    q = _randn(1, 3, 256, seed=4)
    n_avail = torch.full((3,), 4, device=DEV)
    _assert_clear_gaps(q, decode_ref(refs, "fp8"), n_avail, 3)
    got = topk_l2(q, refs, n_avail, 3, ref_format="fp8", impl="triton")
    assert torch.equal(got.cpu(), topk_refs(q, decode_ref(refs, "fp8"), n_avail, 3).cpu())


@pytest.mark.parametrize("R", [255, 256, 700, 5000])
def test_reconstruct_selected_unpacks_wide_indices(R):
    """Indices of 8, 9, 10 and 13 bits: the kernel unpacks those that straddle bytes as the library does."""
    B, C, H, D, d_c, n_sel = 2, 24, 1, 32, 32, 20
    codes, ridx, refs = _store_tensors(B, C, R, H, D, d_c, 4, 4, "fp8", seed=R)
    assert ridx.bits == R.bit_length() and ridx.data.shape[-1] == (4 * ridx.bits + 7) // 8
    codec = LayerCodec(CodecDims(2 * H * D, d_c, 16)).to(DEV)
    sel = _selection(B, C, n_sel, seed=5)
    cos, sin = _randn(B, n_sel, D, seed=1), _randn(B, n_sel, D, seed=2)
    kw = dict(bits=4, group=32, num_kv_heads=H)
    got = reconstruct_selected(codes, ridx, refs, codec, sel, cos, sin, impl="triton", **kw)
    want = reconstruct_selected_reference(codes, ridx, refs, codec, sel, cos, sin, **kw)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


def test_reconstruct_selected_rope_from_positions_and_out_views():
    """RoPE angles computed in the kernel from positions (the model's inv_freq, llama3 scaling), and
    results written into slices of a preallocated [B, H, N, D] attention buffer."""
    B, C, R, H, D, d_c, n_sel, bits = 2, 12, 5, 2, 32, 64, 9, 4
    codes, ridx, refs = _store_tensors(B, C, R, H, D, d_c, 4, bits, "fp8", seed=11)
    codec = LayerCodec(CodecDims(2 * H * D, d_c, 16)).to(DEV)
    sel = _selection(B, C, n_sel, seed=4)
    scaling = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RopeTable.from_config(tiny_llama_config(head_dim=D, rope_parameters=scaling))
    positions = torch.randint(0, 300_000, (1, n_sel), generator=_gen(0)).to(DEV)  # long contexts: big angles
    cos, sin = rope.cos_sin(positions, torch.float32)
    inv_freq, scale = rope_params(rope)
    assert torch.equal(torch.cat(rope_from_positions(positions, inv_freq, scale)), torch.cat((cos, sin)))
    kw = dict(bits=bits, group=32, num_kv_heads=H)
    want = reconstruct_selected_reference(codes, ridx, refs, codec, sel, cos, sin, **kw)
    buf_k = torch.full((B, H, n_sel + 5, D), 7.0, device=DEV)
    buf_v = buf_k.clone()
    out = (buf_k[:, :, 3 : 3 + n_sel], buf_v[:, :, 3 : 3 + n_sel])
    got = reconstruct_selected(codes, ridx, refs, codec, sel, positions=positions, inv_freq=inv_freq,
                               rope_scale=scale, out=out, impl="triton", **kw)
    assert got[0].data_ptr() == out[0].data_ptr()
    _close(buf_k[:, :, 3 : 3 + n_sel], want[0], 2e-4)  # libdevice vs torch sin/cos of angles up to 3e5
    _close(buf_v[:, :, 3 : 3 + n_sel], want[1], 1e-5)
    assert (buf_k[:, :, :3] == 7).all() and (buf_k[:, :, 3 + n_sel :] == 7).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_reconstruct_selected_equals_what_the_store_reads(bits):
    """End to end on real library state: a ResidualStore written by the library, re-read by the kernel."""
    H, D, T = 2, 32, 45
    cfg = ResidualKVConfig(stride=4, n_sink=2, bits=bits)
    torch.manual_seed(0)
    codec = LayerCodec(CodecDims(2 * H * D, 64, 48)).to(DEV)
    store = ResidualStore(codec, cfg, ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha))
    with torch.no_grad():
        for chunk in (30, 1, 14):  # a prefill, then decode-sized writes
            store.write(_randn(2, chunk, 2 * H * D, seed=chunk))
        full = store.read()  # [B, T, 2·d_k] pre-RoPE
    is_ref = store.schedule.is_ref(0, T)
    code_pos = torch.nonzero(~is_ref).flatten()  # the position of every code ordinal
    sel = torch.tensor([[0, 5, 3, len(code_pos) - 1], [2, 2, 7, 1]], device=DEV)  # repeats are fine
    positions = code_pos.to(DEV)[sel]
    rope = RopeTable.from_config(tiny_llama_config(head_dim=D, num_attention_heads=4, num_key_value_heads=H))
    cos, sin = rope.cos_sin(positions, torch.float32)
    k, v = reconstruct_selected(store.codes, store.indices, store.refs, codec, sel, cos, sin, bits=bits,
                                group=32, num_kv_heads=H, impl="triton")
    want = full[torch.arange(2, device=DEV)[:, None], positions]
    want_k = apply_rope(want[..., : H * D].reshape(2, 4, H, D).transpose(1, 2), cos, sin)
    want_v = want[..., H * D :].reshape(2, 4, H, D).transpose(1, 2)
    _close(k, want_k, 1e-4)
    _close(v, want_v, 1e-4)


# ---------------------------------------------------------------------------------------------
# KIVI full-layer decode attention


def _kivi_store(B, H, D, chunks, bits, seed):
    st = KiviStore(ResidualKVConfig(full_bits=bits))
    for i, c in enumerate(chunks):
        st.write(_randn(B, H, c, D, seed=seed + i), _randn(B, H, c, D, seed=seed + 100 + i))
    return st


KIVI_CASES = [  # B, H, Hq, D, writes
    (2, 2, 4, 32, [100]),  # 3 packed groups + a 4-token window, GQA 2
    (1, 1, 1, 64, [1]),  # one token, window only
    (2, 2, 2, 32, [7]),
    (1, 2, 8, 32, [33, 1, 1, 30]),  # prefill then decode steps; GQA 4
    (2, 1, 2, 32, [64]),  # whole groups, empty window
    (2, 2, 4, 32, [40, 30, 64, 1, 33]),  # groups appended in place: every (b, h) strided past its spare room
    (1, 2, 4, 80, [70, 1]),  # a head of 80 coordinates: value groups of 16 (stores.kivi_value_group)
]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("B,H,Hq,D,writes", KIVI_CASES)
def test_kivi_decode_attention_matches_reference(bits, B, H, Hq, D, writes):
    st = _kivi_store(B, H, D, writes, bits, seed=sum(writes))
    q = _randn(B, Hq, 1, D, seed=5)
    want = kivi_decode_attention_reference(q, st)
    for n_splits in (None, 2):
        _close(kivi_decode_attention(q, st, impl="triton", n_splits=n_splits), want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kivi_decode_attention_half_precision(dtype):
    st = _kivi_store(2, 2, 32, [70, 1], 4, seed=3)
    q = _randn(2, 4, 1, 32, seed=6).to(dtype)
    got = kivi_decode_attention(q, st, impl="triton", scale=0.1)
    _close(got, kivi_decode_attention_reference(q, st, scale=0.1), 1e-2 if dtype == torch.float16 else 3e-2)


# ---------------------------------------------------------------------------------------------
# the kernels also compile for a real GPU (sm_90) - checked here without one


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: lower every kernel to an sm_90 cubin, in a
    fresh process (compiling needs triton.language decorated *without* the interpreter)."""
    if DEVICE != "cpu":
        pytest.skip("on a GPU the tests above already ran compiled")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    root = Path(__file__).resolve().parents[1]
    # sm_80 (A100) too: FP8 references are decoded without tl.float8e4nv, which compiles only from sm_89
    run = subprocess.run([sys.executable, "-m", "kernels._compile_check", "--arch", "90,80", "--quick"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok  ") == 10, run.stdout  # quant_pack, topk_l2, reconstruct, kivi + merge, twice


# ---------------------------------------------------------------------------------------------
# the library on the kernels: a whole model run through the cache with kernel_impl="triton"


@pytest.mark.parametrize("mode,layer_d_c,reuse", [("standalone", None, False), ("omnikv", None, False),
                                                  ("snapkv", None, False), ("omnikv", {2: 64}, False),
                                                  ("omnikv", None, True)])
def test_cache_on_kernels_matches_cache_on_torch(mode, layer_d_c, reuse):
    """Prefill + decode through `ResidualKVCache` with every hot path on the Triton kernels (top-k,
    quantise-and-pack on write; fused reconstruction with RoPE on full and selective reads; decode
    attention of the KIVI layers on their packed bytes) gives the same stored bytes, the same tokens and
    near-identical logits as the torch path; also with another latent size in one layer, and with the
    sparse layers' reuse buffer (the kernel reconstructs only the tokens a step adds)."""
    from transformers import LlamaForCausalLM

    from residualkv.attention import install
    from residualkv.cache import ResidualKVCache
    from residualkv.codec import ResidualCodec

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval().to(DEV)
    install(model)
    # filter layers 0 and 1: layer 1 chooses I_t (reads K), layer 0 decodes on the fused KIVI kernel
    cfg = ResidualKVConfig(full_attention_layers=(0, 1), stride=4, n_sink=2, mode=mode, select_budget=12, n_recent=4,
                           select_reuse=reuse)
    codec = ResidualCodec.for_model(model.config, cfg, d_c=32, d_ff=48, seed=0, layer_d_c=layer_d_c).to(DEV)
    ids = torch.randint(0, 128, (2, 40), generator=_gen(1)).to(DEV)
    runs = {}
    for impl in ("torch", "triton"):
        cache = ResidualKVCache.from_model(model, codec, cfg, kernel_impl=impl)
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        runs[impl] = (out, cache)
    (a, ca), (b, cb) = runs["torch"], runs["triton"]
    assert ca.fused_full is None
    assert cb.fused_full.steps == 5 * (1 if mode == "omnikv" else 2)  # 5 decode steps x fused KIVI layers
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    for i, (x, y) in enumerate(zip(ca.layers, cb.layers)):
        if i in cfg.full_attention_layers:
            continue
        for sx, sy in zip(_row_stores(x), _row_stores(y)):
            assert _same_bytes(sx.refs, sy.refs)
            # the same k references per token, but for near-ties: the kernel sums distances in another
            # order (and lists equal distances in index order)
            same = (sx.indices.unpack().sort(-1).values == sy.indices.unpack().sort(-1).values).all(-1)
            assert same.float().mean() > 0.95, same
            # the mean of the k references is summed in another order: a code may land one step away
            diff = [(p.view(torch.uint8) != q.view(torch.uint8)).float().mean().item() for p, q in zip(sx.codes, sy.codes)]
            assert max(diff) < 0.01, diff
            assert (sx.codes_decoded, sx.refs_decoded) == (sy.codes_decoded, sy.refs_decoded)


def test_full_layers_decode_on_fused_kivi_kernel_left_padded():
    """A cache of KIVI layers only (the kivi4 baseline) on a left-padded batch: decode attention runs on
    the packed stores through the fused kernel (one store per row group, so padding needs no mask) and
    matches dequantise-then-SDPA; the counts of what attention read stay those of the torch path."""
    from transformers import LlamaForCausalLM

    from residualkv.cache import ResidualKVCache

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval().to(DEV)
    cfg = ResidualKVConfig(full_attention_layers=(0, 1, 2, 3), full_group_size=16, full_window=16)
    ids = torch.randint(1, 128, (3, 37), generator=_gen(2)).to(DEV)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    runs = {}
    for impl in ("torch", "triton"):
        cache = ResidualKVCache.from_model(model, None, cfg, kernel_impl=impl)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=5, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        runs[impl] = (out, cache)
    (a, ca), (b, cb) = runs["torch"], runs["triton"]
    assert cb.fused_full.steps == 4 * 4 and len(cb.rows.groups) == 3
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    assert [(x.tokens_read, x.tokens_available) for x in ca.layers] == [(x.tokens_read, x.tokens_available) for x in cb.layers]
    assert ca.nbytes() == cb.nbytes()


@pytest.mark.parametrize("group", [8, 24])
def test_full_layers_with_a_key_group_the_kernel_cannot_tile_decode_on_torch(group):
    """The config accepts any multiple of 8 as full_group_size; the kernel tiles only powers of two >= 16,
    so such layers decode on the reference path instead of raising at the first decode step."""
    from transformers import LlamaForCausalLM

    from residualkv.cache import ResidualKVCache

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval().to(DEV)
    cfg = ResidualKVConfig(full_attention_layers=(0, 1, 2, 3), full_group_size=group, full_window=group)
    ids = torch.randint(1, 128, (2, 50), generator=_gen(3)).to(DEV)
    seqs = {}
    for impl in ("torch", "triton"):
        cache = ResidualKVCache.from_model(model, None, cfg, kernel_impl=impl)
        with torch.no_grad():
            seqs[impl] = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert cache.fused_full is None or cache.fused_full.steps == 0
    assert torch.equal(seqs["torch"], seqs["triton"])
    store = cache.layers[0].stores[0]
    q = _randn(2, 4, 1, store.win_k.shape[-1], seed=5)
    torch.testing.assert_close(kivi_decode_attention(q, store, impl="auto"), kivi_decode_attention_reference(q, store))
    with pytest.raises(ValueError, match=f"full_group_size={group}"):
        kivi_decode_attention(q, store, impl="triton")


def _row_stores(layer) -> list:
    """A layer's ResidualStores; after a SnapKV eviction a group's store is one store per row."""
    return [one for s in layer.stores for one in getattr(s, "stores", [s])]


def _filled_stores(d_kv: int, seed: int, window: int = 0) -> dict[str, ResidualStore]:
    """The same 37 tokens written into a store on each implementation (the newest `window` held in FP16)."""
    codec = LayerCodec(CodecDims(d_kv=d_kv, d_c=64, d_ff=32))
    kv = _randn(2, 37, d_kv, seed=seed).cpu()
    stores = {}
    for impl in ("torch", "triton"):
        c = ResidualKVConfig(kernel_impl=impl, stride=4, n_sink=2, k=3, bits=4, group_size=32, recent_window=window)
        stores[impl] = ResidualStore(codec, c, ReferenceSchedule(c.n_sink, c.stride, c.stride_alpha))
        with torch.no_grad():
            stores[impl].write(kv)
    return stores


def test_decode_step_write_decodes_only_the_references_its_mean_uses(monkeypatch):
    """On the kernels a one-token write reads the references' bytes for its top-k search and decodes
    only the k it averages: nothing in a decode step's write grows with the reference history."""
    import residualkv.stores as stores_mod

    stores = _filled_stores(384, seed=5)
    decoded_rows = []

    def counting(stored, fmt, dtype=torch.float32):
        decoded_rows.append(stored.numel() // stored.shape[-1])
        return decode_ref(stored, fmt, dtype)

    monkeypatch.setattr(stores_mod, "decode_ref", counting)
    new = _randn(2, 1, 384, seed=9).cpu()  # ordinal 37: a code under stride 4 after 2 sinks
    outs = {}
    for impl, store in stores.items():
        assert not bool(store.schedule.is_ref(store.n, store.n + 1).any())
        decoded_rows.clear()
        with torch.no_grad():
            outs[impl] = store.write(new)
        if impl == "triton":
            assert 0 < sum(decoded_rows) <= 2 * store.cfg.k, decoded_rows  # 2 rows x k references
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)


def test_store_reads_on_kernels_split_wide_rows_into_tiles():
    """2·d_k = 384 (SmolLM2) is reconstructed as 2 tiles of 96 per K and V: read() and read_selected()
    on the kernel equal the torch path."""
    stores = _filled_stores(384, seed=3)
    sel = torch.tensor([[0, 5, 9, 36], [3, 4, 20, 21]])
    with torch.no_grad():
        torch.testing.assert_close(stores["triton"].read(), stores["torch"].read(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stores["triton"].read_selected(sel), stores["torch"].read_selected(sel),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (1, 256)])
def test_store_reads_with_rope_fused_on_kernels(heads, head_dim, window):
    """read(rope) / read_selected(rope) return K (rotated at each token's position) and V per head. On the
    kernel, codes are rotated inside the fused reconstruction where a head fits its tile (D <= 128) and
    references by torch; a 256-wide head falls back to the identity rotation + torch RoPE. Both equal the
    torch path, which rotates everything after reconstructing."""
    d_kv = 2 * heads * head_dim
    pos = torch.stack([torch.arange(37), torch.arange(37) + 100])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_from_positions(pos, inv_freq)
    sel = torch.tensor([[0, 5, 9, 36], [3, 4, 20, 21]])
    cos_sel, sin_sel = cos.gather(1, sel[..., None].expand(-1, -1, head_dim)), sin.gather(1, sel[..., None].expand(-1, -1, head_dim))
    reads = {}
    with torch.no_grad():
        for impl, st in _filled_stores(d_kv, seed=4, window=window).items():
            reads[impl] = (st.read((cos, sin, heads)), st.read_selected(sel, (cos_sel, sin_sel, heads)), st.read())
    (k_all, v_all), (k_sel, v_sel), flat = reads["torch"]
    # the torch path is the definition: unflatten the flat read, rotate the keys
    k_flat, v_flat = flat.split(d_kv // 2, dim=-1)
    k_def = apply_rope(k_flat.reshape(2, 37, heads, head_dim).transpose(1, 2), cos, sin)
    torch.testing.assert_close(k_all, k_def)
    torch.testing.assert_close(v_all, v_flat.reshape(2, 37, heads, head_dim).transpose(1, 2))
    assert reads["triton"][0][0].shape == k_all.shape  # the window (ordinals 29..36 when held) read too
    for got, want in zip(reads["triton"][:2], reads["torch"][:2]):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
