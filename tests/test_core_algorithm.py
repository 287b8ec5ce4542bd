"""The algorithm pieces against the seed's formulas: schedule, retrieval, Theorem IV.1, quantisation, RoPE."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from residualkv.codec import LayerCodec
from residualkv.config import CodecDims, ConfigError, ResidualKVConfig
from residualkv.quant import (decode_ref, dequantize, encode_ref, index_bits, pack_bits, pack_indices, quant_error_bound,
                              quantize, ref_roundtrip, unpack_bits, unpack_indices)
from residualkv.retrieval import mean_of_refs, topk_refs
from residualkv.rope import RopeTable, apply_rope, invert_rope
from residualkv.schedule import ReferenceSchedule

from .conftest import tiny_llama_config


# ---- reference schedule (seed §2.6) ----

@pytest.mark.parametrize("n", [10, 100, 4096, 262_144])
def test_fixed_stride_count_matches_formula(n):
    s = ReferenceSchedule(n_sink=8, stride=10)
    assert abs(s.count(n) - s.formula_count(n)) < 1  # ceil vs exact division


@pytest.mark.parametrize("alpha,s0", [(0.001, 10), (0.02, 10), (0.05, 4)])
@pytest.mark.parametrize("n", [4096, 32_768, 262_144])
def test_dynamic_stride_count_matches_formula(alpha, s0, n):
    exact = ReferenceSchedule(n_sink=8, stride=s0, alpha=alpha).count(n)
    # The closed form drops floor(). With it, each gap lies in (s0 - 1 + a(p - n_sink), s0 + a(p - n_sink)],
    # so the exact count is bracketed by the formula at stride s0 and at stride s0 - 1 (plus one for the
    # reference at p_0).
    lo = ReferenceSchedule(n_sink=8, stride=s0, alpha=alpha).formula_count(n)
    hi = ReferenceSchedule(n_sink=8, stride=s0 - 1, alpha=alpha).formula_count(n) + 1
    assert lo - 1 <= exact <= hi, (lo, exact, hi)


def test_schedule_recurrence_and_incremental():
    s = ReferenceSchedule(n_sink=4, stride=5, alpha=0.1)
    refs = s.ref_ordinals(200).tolist()
    assert refs[:4] == [0, 1, 2, 3] and refs[4] == 4
    for a, b in zip(refs[4:], refs[5:]):
        assert b == a + 5 + math.floor(0.1 * (a - 4))
    step = ReferenceSchedule(n_sink=4, stride=5, alpha=0.1)
    mask = torch.cat([step.is_ref(i, i + 1) for i in range(200)])  # token by token, as in decoding
    assert mask.nonzero().flatten().tolist() == refs
    # the grown schedule answers shorter spans as a fresh one does, and a caller's edit cannot reach it
    fresh = ReferenceSchedule(n_sink=4, stride=5, alpha=0.1)
    assert step.ref_ordinals(57).tolist() == fresh.ref_ordinals(57).tolist() == [r for r in refs if r < 57]
    assert step.is_ref(13, 90).tolist() == fresh.is_ref(13, 90).tolist() == mask[13:90].tolist()
    step.ref_ordinals(200).zero_()
    assert step.ref_ordinals(200).tolist() == refs and step.count(200) == len(refs)
    # count_in (the write path's "any reference in this chunk?") agrees with the mask on every span,
    # empty and reversed ones included, and extends a fresh schedule as is_ref does
    for a, b in [(0, 0), (0, 4), (3, 5), (5, 6), (13, 90), (150, 260), (90, 13)]:
        assert ReferenceSchedule(n_sink=4, stride=5, alpha=0.1).count_in(a, b) == int(step.is_ref(a, b).sum())


def test_table_vi_reference_counts_order_of_magnitude():
    # Table VI (Qwen2.5-7B, 262K tokens): alpha=0 -> 26,189 refs, alpha=0.001 -> 3,354, alpha=0.02 -> 319
    n = 262_144
    assert abs(ReferenceSchedule(0, 10, 0.0).count(n) - 26_189) / 26_189 < 0.01
    assert abs(ReferenceSchedule(0, 10, 0.001).count(n) - 3_354) / 3_354 < 0.05
    assert abs(ReferenceSchedule(0, 10, 0.02).count(n) - 319) / 319 < 0.1


# ---- retrieval (seed §2.2) and Theorem IV.1 (§2.8) ----

def test_retrieval_is_causal_and_uses_min_k():
    torch.manual_seed(0)
    refs = torch.randn(1, 6, 8)
    q = torch.randn(1, 4, 8)
    n_avail = torch.tensor([1, 2, 5, 6])
    idx = topk_refs(q, refs, n_avail, k=4)
    for t in range(4):
        valid = idx[0, t][idx[0, t] >= 0]
        assert len(valid) == min(4, int(n_avail[t]))
        assert (valid < n_avail[t]).all()
        d = ((refs[0, : n_avail[t]] - q[0, t]) ** 2).sum(-1)
        assert set(valid.tolist()) == set(d.topk(len(valid), largest=False).indices.tolist())


def test_theorem_iv1_decomposition():
    torch.manual_seed(1)
    refs = torch.randn(3, 50, 64)
    q = torch.randn(3, 20, 64)
    idx = topk_refs(q, refs, torch.full((20,), 50), k=4)
    mean = mean_of_refs(refs, idx)
    rows = torch.arange(3)[:, None, None]
    chosen = refs[rows, idx]  # [B, T, k, d]
    rho2 = ((q.unsqueeze(2) - chosen) ** 2).sum(-1).mean(-1)
    delta2 = ((q - mean) ** 2).sum(-1)
    v = ((chosen - mean.unsqueeze(2)) ** 2).sum(-1).mean(-1)
    torch.testing.assert_close(rho2, delta2 + v, rtol=1e-5, atol=1e-5)


def test_encoder_encodes_then_subtracts():
    torch.manual_seed(0)
    codec = LayerCodec(CodecDims(d_kv=64, d_c=32, d_ff=48))
    kv, ref = torch.randn(5, 64), torch.randn(5, 64)
    z = codec.encode(kv, ref)
    torch.testing.assert_close(z, codec.f_c(kv) - codec.f_c(ref))
    assert not torch.allclose(z, codec.f_c(kv - ref), atol=1e-4)
    assert codec.w_d.bias is None


# ---- quantisation (seed §2.4, §2.8, §3.3) ----

@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    q = torch.randint(0, 2**bits, (3, 7, 64), dtype=torch.uint8)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(packed, bits), q)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_is_codes_times_scale_plus_minimum_also_into_a_strided_view(bits):
    torch.manual_seed(0)
    z = torch.randn(2, 5, 64, 96) * 3
    p = quantize(z, bits, 32)
    # the reference reads each code out of its byte one coordinate at a time
    i = torch.arange(96)
    q = (p.codes[..., i * bits // 8] >> ((i * bits) % 8)) & ((1 << bits) - 1)
    expect = q.float() * p.scales.float().repeat_interleave(32, -1) + p.mins.float().repeat_interleave(32, -1)
    assert torch.equal(dequantize(p, bits, 32), expect)
    buf = torch.full((2, 5, 96, 64), float("nan")).transpose(-1, -2)  # the shape of z, not contiguous
    assert dequantize(p, bits, 32, out=buf) is buf
    assert torch.equal(buf, expect)
    with pytest.raises(ValueError, match="float32"):
        dequantize(p, bits, 32, out=torch.empty(2, 5, 64, 96, dtype=torch.float16))


def test_fp16_rounding_goes_to_the_nearest_fp16_on_the_asked_side():
    from residualkv.quant import _round_fp16

    torch.manual_seed(0)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = every[torch.isfinite(every) & (every.float().abs() < 16000)].float()
    x = torch.cat([every, every + every.abs() * 2.0**-13, torch.randn(100_000) * 10.0 ** torch.randint(-8, 4, (100_000,))])
    inf = torch.full_like(x, float("inf")).half()
    up, down = _round_fp16(x, float("inf")), _round_fp16(x, float("-inf"))
    assert up.dtype == down.dtype == torch.float16
    assert (up.float() >= x).all() and (torch.nextafter(up, -inf).float() < x).all()  # the least FP16 >= x
    assert (down.float() <= x).all() and (torch.nextafter(down, inf).float() > x).all()  # the greatest <= x


def _adversarial(d=96):
    g = torch.linspace(0, 1, 32)
    return torch.stack([
        torch.randn(d) * 1e3,  # wide range
        torch.randn(d) * 1e-4,  # tiny range
        torch.full((d,), 3.3),  # constant groups
        torch.cat([torch.zeros(d - 1), torch.tensor([500.0])]),  # one outlier
        (g * 15 + 0.5 / 15).repeat(d // 32),  # every value at a half step (worst rounding)
        torch.cat([torch.full((32,), -7.0), torch.randn(d - 32)]),  # mix of constant and random groups
        torch.tensor([(-1.0) ** i * 1e4 for i in range(d)]),  # alternating extremes
    ])


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_quantisation_error_bound(bits, kind):
    torch.manual_seed(0)
    z = torch.randn(256, 96) * torch.rand(256, 1) * 10 if kind == "random" else _adversarial()
    p = quantize(z, bits, 32)
    err = (dequantize(p, bits, 32) - z).norm(dim=-1)
    tight, loose = quant_error_bound(z, bits, 32)
    # FP16 storage of min/scale adds at most one FP16 ulp of the group's magnitude per coordinate
    ulp = (z.abs().reshape(z.shape[0], -1, 32).amax(-1) * 2.0**-10).pow(2).mul(32).sum(-1).sqrt()
    assert (err <= tight * (1 + 2.0**-9) + ulp).all()
    assert (tight <= loose + 1e-6).all()


@pytest.mark.parametrize("bits,ratio", [(4, 0.3125), (2, 0.1875)])
def test_packed_bytes_are_b_over_16_plus_2_over_32(bits, ratio):
    z = torch.randn(1000, 96)
    p = quantize(z, bits, 32)
    assert p.codes.dtype == torch.uint8 and p.mins.dtype == torch.float16 and p.scales.dtype == torch.float16
    assert p.nbytes() / (z.numel() * 2) == pytest.approx(ratio)


def test_fp8_references_are_one_byte():
    x = torch.randn(10, 384) * 100
    stored = encode_ref(x, "fp8")
    assert stored.dtype == torch.uint8 and stored.numel() == x.numel()
    rt = ref_roundtrip(x, "fp8")
    assert ((rt - x).abs() <= x.abs() * 2**-3 + 2**-9).all()  # e4m3: 3 mantissa bits
    assert torch.isfinite(ref_roundtrip(torch.tensor([1e6, -1e6]), "fp8")).all()  # saturates, no NaN


@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_reference_indices_pack_into_as_few_bits_as_the_references_need(k):
    # every width up to 2^20 references, with unused slots (-1) and the largest index of each width
    for bits in range(1, 21):
        idx = torch.randint(-1, (1 << bits) - 1, (5, 9, k), generator=torch.Generator().manual_seed(bits))
        idx[0, 0] = (1 << bits) - 2
        p = pack_indices(idx, bits)
        assert p.data.dtype == torch.uint8 and p.data.shape == (5, 9, math.ceil(k * bits / 8))
        assert torch.equal(p.unpack(), idx) and torch.equal(unpack_indices(p.data, bits, k), idx)
        # a row decodes alone: its bytes are its own
        assert torch.equal(unpack_indices(p.data[2:3, 4:6], bits, k), idx[2:3, 4:6])
    # 255 references (+ the unused mark) fit 8 bits: 4 bytes for k = 4 where int16 took 8
    assert index_bits(255) == 8 and index_bits(256) == 9 and index_bits(0) == 1
    with pytest.raises(ValueError, match=r"\[-1, 255\)"):
        pack_indices(torch.tensor([[255]]), 8)
    with pytest.raises(ValueError, match="bytes per code"):
        unpack_indices(torch.zeros(2, 3, dtype=torch.uint8), 8, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_decode_matches_torch_on_every_byte(dtype):
    # the CPU decode works on the bits; every one of the 256 patterns (±0, subnormals, ±448, NaN) must
    # come out as torch's own conversion does, in any layout
    b = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    ours, torchs = decode_ref(b, "fp8", dtype), b.view(torch.float8_e4m3fn).to(dtype)
    assert ours.dtype == dtype and ours.shape == b.shape
    assert torch.equal(ours.isnan(), torchs.isnan()) and int(ours.isnan().sum()) == 2
    assert torch.equal(ours.nan_to_num(), torchs.nan_to_num())
    assert torch.equal(ours.signbit()[~ours.isnan()], torchs.signbit()[~torchs.isnan()])  # -0 stays -0
    assert torch.equal(decode_ref(b.t(), "fp8", dtype).nan_to_num(), torchs.t().nan_to_num())


# ---- RoPE ----

@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_unrotate_rerotate_exact(scaling):
    params = {"rope_theta": 500000.0, "rope_type": "default"} if scaling is None else {"rope_theta": 500000.0, **scaling}
    cfg = tiny_llama_config(rope_parameters=params)
    table = RopeTable.from_config(cfg)
    pos = torch.tensor([[0, 1, 7, 100, 900, 1000]])
    cos, sin = table.cos_sin(pos, torch.float32)
    k = torch.randn(1, 2, 6, 16)
    rotated = apply_rope(k, cos, sin)
    # the model's own rotation, bit for bit (the cache re-rotates with the model's numbers)
    assert torch.equal(rotated, apply_rotary_pos_emb(k, k, cos, sin)[1])
    torch.testing.assert_close(invert_rope(rotated, cos, sin), k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(invert_rope(rotated, cos, sin), cos, sin), rotated, rtol=1e-6, atol=1e-6)


def test_rope_table_hands_out_its_last_cos_sin_again_for_equal_positions():
    """Every compressed layer of a decode step asks for the same positions: built once, equal to a fresh build."""
    table, other = RopeTable.from_config(tiny_llama_config()), RopeTable.from_config(tiny_llama_config())
    pos = torch.tensor([[0, 1, 7, 100]])
    cos, sin = table.cos_sin(pos, torch.float32)
    again = table.cos_sin(pos.clone().to(torch.int32), torch.float32)
    assert again[0] is cos and again[1] is sin
    moved = table.cos_sin(pos + 1, torch.float32)
    assert moved[0] is not cos and all(torch.equal(a, b) for a, b in zip(moved, other.cos_sin(pos + 1, torch.float32)))
    assert table.cos_sin(pos + 1, torch.float64)[0].dtype == torch.float64
    assert table.cos_sin(pos[:, :3], torch.float32)[0].shape == (1, 3, 16)
    # a caller that reuses its tensor for other positions gets theirs, not the stale answer
    table.cos_sin(pos, torch.float32)
    pos += 5
    assert torch.equal(table.cos_sin(pos, torch.float32)[0], other.cos_sin(pos, torch.float32)[0])


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="bits=3"):
        ResidualKVConfig(bits=3)
    with pytest.raises(ConfigError, match="stride"):
        ResidualKVConfig(stride=0)
    with pytest.raises(ConfigError, match="full_attention_layers"):
        ResidualKVConfig(full_attention_layers=(0, 40)).check_model(30)
