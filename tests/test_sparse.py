"""OmniKV dynamic selection, the sparse attention path, SnapKV eviction and CR accounting (issue #4)."""

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from residualkv import accounting
from residualkv.attention import (ATTN_IMPLEMENTATION, install, latent_value_attention, select_tokens,
                                  snapkv_aggregate, snapkv_token_scores, sparse_attention_forward)
from residualkv.cache import OmniKVCache, ResidualKVCache, ResidualLayer
from residualkv.stores import Latents, ResidualStore, RowStores
from residualkv.codec import ResidualCodec
from residualkv.config import ConfigError, ResidualKVConfig
from residualkv.evaluation.cli import default_methods
from residualkv.methods import build_cache
from residualkv.reuse import assign, put
from residualkv.schedule import ReferenceSchedule

from .conftest import tiny_llama_config

CFG = ResidualKVConfig(full_attention_layers=(1,), stride=4, n_sink=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_llama_config()).eval()
    install(m)
    return m


@pytest.fixture(scope="module")
def codec(model):
    return ResidualCodec.for_model(model.config, CFG, d_c=32, d_ff=48, seed=0)


def _ids(n, seed=0, batch=1):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache=None, mask=None, n=10):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, cache=cache, output_scores=True, return_dict_in_generate=True)


def _cache(model, codec, **changes):
    return ResidualKVCache.from_model(model, codec, CFG, **changes)


# ---- the index set ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 9, 40, 300])
@pytest.mark.parametrize("budget", [0, 3, 50])
def test_index_set_always_holds_sinks_and_recent_window(n, budget):
    g = torch.Generator().manual_seed(n + budget)
    scores = torch.randn(3, n, generator=g)
    scores[:, :4] = -1e9  # the worst-scored tokens are the sinks and the newest ones
    scores[:, -8:] = float("-inf")
    sel = select_tokens(scores, 4, 8, budget)
    assert sel.shape[0] == 3 and sel.shape[1] == min(n, min(n, 4) + max(0, min(8, n - 4)) + budget)
    for row, s in zip(scores, sel):
        got = set(s.tolist())
        assert got >= set(range(min(n, 4))) | set(range(max(0, n - 8), n))
        assert s.tolist() == sorted(got) and len(got) == len(s)
        others = [i for i in range(4, n - 8)]
        if others and budget:  # the best-scored middle tokens are the ones chosen
            best = sorted(others, key=lambda i: -row[i].item())[:budget]
            assert set(best) <= got


def test_every_decode_selection_holds_sinks_and_recent_window(model, codec):
    cache = _cache(model, codec, mode="omnikv", select_budget=6, n_recent=5)
    seen = []
    choose = cache.sparse.choose

    def spy(h, scores):
        choose(h, scores)
        seen.append((cache.rows.n_slots - 1, [s.clone() for s in cache.sparse.selection]))

    cache.sparse.choose = spy
    _generate(model, _ids(60), cache, n=8)
    assert len(seen) == 7  # one choice per decode step (one filter layer)
    for n, (sel,) in seen:
        got = set(sel[0].tolist())
        assert got >= {0, 1} | set(range(n - 5, n)) and len(got) == 2 + 5 + 6 and max(got) < n


# ---- exactness ------------------------------------------------------------------------------------------


def test_custom_attention_without_selection_is_exactly_sdpa(model):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 16, generator=g) for h, t in ((4, 5), (2, 9), (2, 9)))
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)
    mask[1, :, :, :3] = False
    attn = model.model.layers[0].self_attn
    for m in (None, mask):
        a, _ = sparse_attention_forward(attn, q, k, v, m, scaling=0.25)
        b, _ = sdpa_attention_forward(attn, q, k, v, m, scaling=0.25)
        assert torch.equal(a, b)
    # a whole model with the custom attention and a plain DynamicCache equals SDPA bit for bit
    ids = _ids(30)
    sdpa = LlamaForCausalLM(tiny_llama_config()).eval()
    sdpa.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION and sdpa.config._attn_implementation == "sdpa"
    with torch.no_grad():
        la = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits
        lb = sdpa(ids, cache=DynamicCache(config=sdpa.config), use_cache=True).logits
    assert torch.equal(la, lb)
    a, b = _generate(model, ids, n=6), _generate(sdpa, ids, n=6)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


@pytest.mark.parametrize("shortcut", [False, True])
@pytest.mark.parametrize("changes", [dict(select_ratio=1.0), dict(select_budget=10_000),
                                     dict(select_ratio=1.0, recent_window=24)])
def test_full_budget_reproduces_standalone(model, codec, changes, shortcut):
    ids = _ids(120, seed=1)
    ref = _generate(model, ids, _cache(model, codec, recent_window=changes.get("recent_window", 0)), n=12)
    cache = _cache(model, codec, mode="omnikv", **changes)
    cache.sparse.full_read_shortcut = shortcut  # False: gather and decode I_t = everything via read_selected
    out = _generate(model, ids, cache, n=12)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    rep = accounting.report(cache)
    assert rep["cr"] == 1.0 and rep["decode_steps"] == 11


def _filled_store(stride: int, n_sink: int, seed: int, tokens: int, window: int = 0) -> ResidualStore:
    """A compressed-layer store of the tiny Llama's width holding `tokens` random tokens in 2 rows."""
    torch.manual_seed(seed)
    cfg = ResidualKVConfig(stride=stride, n_sink=n_sink, recent_window=window)
    codec = ResidualCodec.for_model(tiny_llama_config(), cfg, d_c=32, d_ff=48).layer(0)
    store = ResidualStore(codec, cfg, ReferenceSchedule(n_sink, stride))
    store.write(torch.randn(2, tokens, 64))
    return store


def test_read_selected_equals_read_and_reads_only_what_it_needs():
    store = _filled_store(stride=5, n_sink=3, seed=0, tokens=50)
    store.write(torch.randn(2, 7, 64))
    full = store.read()
    ords = torch.stack([torch.tensor([0, 3, 4, 8, 9, 30, 56]), torch.tensor([1, 2, 7, 13, 20, 44, 55])])
    before = (store.codes_decoded, store.refs_decoded)
    got = store.read_selected(ords)
    torch.testing.assert_close(got, full.gather(1, ords[..., None].expand(-1, -1, 64)), rtol=1e-6, atol=1e-6)
    is_ref = store.schedule.is_ref(0, store.n)
    assert store.codes_decoded - before[0] == int((~is_ref[ords]).sum())
    # the references read: the selected ones and the ones the selected codes average, each once
    ref_ords = store.schedule.ref_ordinals(store.n)
    need = set()
    for b in range(2):
        for o in ords[b].tolist():
            if is_ref[o]:
                need.add((b, int((ref_ords == o).nonzero())))
            else:
                c = o - int((ref_ords < o).sum())
                need |= {(b, int(r)) for r in store.indices.unpack()[b, c].tolist() if r >= 0}
    assert store.refs_decoded - before[1] == len(need) < store.n_refs * 2


# ---- values decoded after the softmax (attention.LatentValues) ----------------------------------------


def _with_values_decoded(v, z, w_v):
    """V + Z W_v^T in the [B, H, n, D] layout."""
    B, H, n, D = v.shape
    return v + (z[:, 0] @ w_v.T).reshape(B, n, H, D).transpose(1, 2)


@pytest.mark.parametrize("window", [0, 6])
def test_latent_read_returns_the_values_less_their_decoder_term(window):
    store = _filled_store(stride=4, n_sink=2, seed=3, tokens=45, window=window)
    n, H, D = store.n, 2, 16
    g = torch.Generator().manual_seed(1)
    rope = (torch.randn(2, n, D, generator=g), torch.randn(2, n, D, generator=g), H)
    k, v = store.read(rope)
    kl, vl, lat = store.read(rope, latent=True)
    # only the codes have latents: references and window tokens are not carried at all
    whole = store.schedule.is_ref(0, n) | (torch.arange(n) >= store.n_coded)
    assert torch.equal(lat.cols, (~whole).nonzero()[:, 0].expand(2, -1)) and lat.z.shape == (2, int((~whole).sum()), 32)
    z = lat.dense(n)
    torch.testing.assert_close(kl, k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_with_values_decoded(vl, z, store.codec.value_decoder()), v, rtol=1e-5, atol=1e-5)
    # references and window tokens have no latent: their values come back whole
    assert bool((z[:, :, whole] == 0).all()) and bool((z[:, :, ~whole] != 0).any())
    assert torch.equal(vl[:, :, whole], v[:, :, whole])
    # a selection reads the same columns
    ords = torch.tensor([[0, 3, 5, 6, 20, n - 2], [1, 2, 9, 10, 30, n - 1]])
    pick = lambda t: t.gather(1, ords[..., None].expand(-1, -1, D))  # noqa: E731
    ks, vs, zs = store.read_selected(ords, (pick(rope[0]), pick(rope[1]), H), latent=True)
    cols = ords[:, None, :, None]
    torch.testing.assert_close(ks, kl.gather(2, cols.expand(-1, H, -1, D)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vs, vl.gather(2, cols.expand(-1, H, -1, D)))
    assert torch.equal(zs.dense(ords.shape[1]), z.gather(2, cols.expand(-1, 1, -1, 32)))
    # the two rows selected different numbers of codes: the shorter one is padded with zero latents
    n_codes = (~whole)[ords].sum(1)
    assert n_codes[0] != n_codes[1] and zs.cols.shape[1] == int(n_codes.max())
    assert bool((zs.z[int(n_codes.argmin()), int(n_codes.min()):] == 0).all())
    with pytest.raises(ValueError, match="RoPE"):
        store.read(latent=True)


def test_latent_value_attention_equals_sdpa_over_the_decoded_values(model):
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    z, w_v = torch.randn(2, 1, 9, 8, generator=g), torch.randn(32, 8, generator=g)
    z[:, :, ::3] = 0  # whole tokens among the codes
    padded = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    padded[1, :, :, :4] = False
    additive = torch.zeros(2, 1, 1, 9).masked_fill(~padded, torch.finfo(torch.float32).min)
    attn = model.model.layers[0].self_attn
    z[1, :, 4] = 0  # row 1 holds one code fewer: its Latents are padded
    rows = [(z[b, 0, :, 0] != 0).nonzero()[:, 0] for b in range(2)]
    lat = Latents.place([(b, Latents(c[None], z[b, 0, c][None]), 0) for b, c in enumerate(rows)], 2)
    assert lat.cols.shape == (2, 6) and torch.equal(lat.dense(9), z)
    for mask in (None, padded, additive):
        got = latent_value_attention(q, k, v, mask, lat, w_v, 0.3)
        want, _ = sdpa_attention_forward(attn, q, k, _with_values_decoded(v, z, w_v), mask, scaling=0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one query position"):
        latent_value_attention(q.expand(2, 4, 3, 16), k, v, None, lat, w_v, 0.3)


def _one_step_both_ways(model, cache, token, mask):
    """Logits of the next decode step from two forks of `cache`: values decoded after the softmax
    (latent) and before it. One step: a later step would read what each fork wrote, and a code written
    from hidden states a rounding apart can land one quantisation step away (as with another thread
    count), so only a step's own output is comparable to float rounding."""
    latent, decoded = cache.fork(), cache.fork()
    decoded.latent = None
    with torch.no_grad():
        a = model(token, attention_mask=mask, cache=latent).logits
        b = model(token, attention_mask=mask, cache=decoded).logits
    return a, b, latent


@pytest.mark.parametrize("mode", ["standalone", "omnikv", "snapkv"])
def test_values_decoded_after_the_softmax_decode_as_the_decoded_values(model, codec, mode):
    """A left-padded batch: every compressed layer's decode step hands its values over latent (on the
    sparse paths too), and a step's output is that of decoding the values first, to float rounding."""
    ids, mask = _ids(60, seed=4, batch=2), torch.ones(2, 60, dtype=torch.long)
    mask[1, :9] = 0
    cache = _cache(model, codec, mode=mode, select_budget=12, n_recent=4)
    out = _generate(model, ids, cache, mask, n=8)
    assert cache.latent.steps == 7 * 3  # 7 decode steps x 3 compressed layers
    assert (accounting.report(cache)["cr"] < 1) == (mode != "standalone")  # the sparse reads carried them too
    mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long)], dim=1)
    a, b, latent = _one_step_both_ways(model, cache, out.sequences[:, -1:], mask)
    assert latent.latent.steps == 3
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_values_are_decoded_before_the_softmax_in_prefill_and_under_gradients(model, codec):
    cache = _cache(model, codec)
    ids = _ids(30, seed=5)
    with torch.no_grad():
        tok = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    assert cache.latent.steps == 0  # the prompt attends densely (SDPA)
    model(tok, cache=cache)  # a step under autograd (training reads): the plain reading
    assert cache.latent.steps == 0
    with torch.no_grad():
        model(tok, cache=cache)
    assert cache.latent.steps == 3
    identity = ResidualCodec.for_model(model.config, CFG, d_c=64, d_ff=48, kind="identity")
    assert _cache(model, identity).latent is None  # ResidualKV†: no decoder, nothing to move
    # values handed over latent to an attention that would not add their decoder term: refused
    cache = _cache(model, codec)
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="decoder term"):
            _generate(model, ids, cache, n=3)
    finally:
        install(model)


def test_sparse_layers_reconstruct_only_the_selection(model, codec):
    cache = _cache(model, codec, mode="omnikv", select_budget=12, n_recent=6)
    _generate(model, _ids(200, seed=2), cache, n=6)
    rep = accounting.report(cache)
    layer0 = rep["reconstruction_per_layer_per_step"]["0"]
    # layer 0 comes before the filter layer 1: it reads everything; layers 2-3 read |I_t| = 2 + 6 + 12
    assert layer0["attended"] == layer0["history"] and layer0["codes_decoded"] + layer0["refs_read"] >= layer0["history"]
    for i in ("2", "3"):
        per = rep["reconstruction_per_layer_per_step"][i]
        assert per["attended"] == 20 and per["codes_decoded"] <= 20
        assert per["codes_decoded"] + per["refs_read"] <= 20 + CFG.k * 20
        assert per["codes_decoded"] + per["refs_read"] < per["history"] / 2
    for layer in (cache.layers[2], cache.layers[3]):
        for hist, att, codes, refs in layer.decode_log:
            assert att == 20 and codes <= 20 and refs <= 20 + 4 * codes
    assert rep["cr_per_layer"][2] == pytest.approx(20 * 5 / sum(200 + t for t in range(5)))
    assert rep["cr"] == pytest.approx(rep["cr_formula"])
    assert len(rep["tokens_reconstructed_per_step"]) == 5
    # standalone reconstructs the whole history on every compressed layer (0, 2 and 3); the sparse path
    # all of it only at layer 0, before the filter layer, and at most 20 codes + their refs at 2 and 3
    full = _cache(model, codec)
    _generate(model, _ids(200, seed=2), full, n=6)
    assert min(accounting.report(full)["tokens_reconstructed_per_step"]) > 1.5 * max(rep["tokens_reconstructed_per_step"])


def test_cr_matches_beta_plus_one_minus_beta_r(model, codec):
    cfg = CFG.replace(full_attention_layers=(0, 2))
    codec2 = ResidualCodec.for_model(model.config, cfg, d_c=32, d_ff=48, seed=0)
    cache = ResidualKVCache.from_model(model, codec2, cfg, mode="omnikv", select_ratio=0.25, n_recent=4)
    _generate(model, _ids(150, seed=3), cache, n=5)
    rep = accounting.report(cache)
    beta, r = 0.5, rep["cr_inputs"]["r_measured"]
    assert rep["cr"] == pytest.approx(beta + (1 - beta) * r)
    assert rep["cr"] == pytest.approx(rep["cr_formula"], abs=1e-9)
    assert 0.25 < r < 0.35
    # an FP16 recent window longer than n_recent is always read: the formula counts it as the selection does
    windowed = ResidualKVCache.from_model(model, codec2, cfg, mode="omnikv", select_ratio=0.25, n_recent=4,
                                          recent_window=24)
    _generate(model, _ids(150, seed=3), windowed, n=5)
    rep = accounting.report(windowed)
    assert rep["cr"] == pytest.approx(rep["cr_formula"], abs=1e-9)


# ---- batches --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 12])
@pytest.mark.parametrize("mode", ["standalone", "omnikv", "snapkv"])
def test_left_padded_batch_equals_single_runs(model, codec, mode, window):
    a, b = _ids(90, seed=4), _ids(61, seed=5)
    changes = dict(mode=mode, select_budget=16, n_recent=8, snapkv_window=8, recent_window=window)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 29, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 90), torch.cat([torch.zeros(1, 29), torch.ones(1, 61)], 1)]).long()
    both = _generate(model, batch, _cache(model, codec, **changes), mask, n=20)
    one = _generate(model, a, _cache(model, codec, **changes), n=20)
    two = _generate(model, b, _cache(model, codec, **changes), n=20)
    assert both.sequences[0, 90:].tolist() == one.sequences[0, 90:].tolist()
    assert both.sequences[1, 90:].tolist() == two.sequences[0, 61:].tolist()
    for s_both, s_one, s_two in zip(both.scores, one.scores, two.scores):
        torch.testing.assert_close(s_both[0], s_one[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s_both[1], s_two[0], rtol=1e-4, atol=1e-4)


def test_same_start_rows_share_a_group_and_select_independently(model, codec):
    ids = _ids(80, seed=6, batch=2)
    cache = _cache(model, codec, mode="omnikv", select_budget=10, n_recent=4)
    both = _generate(model, ids, cache, n=8)
    for i in range(2):
        alone = _generate(model, ids[i : i + 1], _cache(model, codec, mode="omnikv", select_budget=10, n_recent=4), n=8)
        n = alone.sequences.shape[1]  # a row that reaches EOS (id 2) alone stops there
        assert both.sequences[i, :n].tolist() == alone.sequences[0].tolist()


# ---- the reuse buffer (select_reuse) -----------------------------------------------------------------------


@pytest.mark.parametrize("n,m,empty", [(12, 12, 0), (12, 9, 0), (12, 9, 4), (12, 0, 0)])
def test_assign_keeps_chosen_ids_in_their_slots_and_fills_freed_ones(n, m, empty):
    g = torch.Generator().manual_seed(n + m + empty)
    universe = 30
    held = torch.stack([torch.randperm(universe, generator=g)[:n] for _ in range(6)]).view(2, 3, n)
    held[..., :empty] = -1
    wanted = torch.stack([torch.randperm(universe, generator=g)[:m] for _ in range(6)]).view(2, 3, m)
    before = held.clone()
    ids, slots, visible = assign(held, wanted, universe)
    new = [[set(w.tolist()) - set(b.tolist()) for w, b in zip(W, B)] for W, B in zip(wanted, before)]
    assert ids.shape[-1] == max(len(x) for row in new for x in row)
    for e in [(i, j) for i in range(2) for j in range(3)]:
        h, b, w = held[e], before[e], set(wanted[e].tolist())
        assert sorted(h[visible[e]].tolist()) == sorted(w)  # every wanted id held once, nothing else visible
        assert torch.equal(h[slots[e]], ids[e])
        assert set(ids[e].tolist()) >= new[e[0]][e[1]]  # the new ones, plus held ones rebuilt in place
        for s in range(n):
            if b[s].item() in w:
                assert h[s] == b[s]  # a chosen id keeps its slot


def test_put_writes_whole_rows_at_each_entrys_own_slots():
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 3, 10, 4, generator=g).half()
    at = torch.stack([torch.randperm(10, generator=g)[:5] for _ in range(6)]).view(2, 3, 5)
    rows = torch.randn(2, 3, 5, 4, generator=g)
    want = buf.clone()
    for i in range(2):
        for h in range(3):
            want[i, h, at[i, h]] = rows[i, h].half()
    put(buf, at, rows)
    assert torch.equal(buf, want)


@pytest.mark.parametrize("changes", [dict(select_budget=12, n_recent=6), dict(select_budget=12, n_recent=6, recent_window=8),
                                     dict(select_ratio=0.2, n_recent=4)], ids=["budget", "fp16-window", "ratio"])
def test_reuse_buffer_attends_as_a_fresh_read_and_reconstructs_less(model, codec, changes):
    """With select_reuse the sparse layers keep what they reconstructed and decode only the tokens a
    step's I_t adds: the same tokens, logits within the buffer's FP16 rounding, the same tokens attended
    (CR), fewer codes decoded; the buffer is working memory, reported beside KR. A ratio budget grows the
    buffer; FP16 window tokens are read again once coded."""
    ids = _ids(200, seed=2)
    fresh = _cache(model, codec, mode="omnikv", **changes)
    kept = _cache(model, codec, mode="omnikv", select_reuse=True, **changes)
    a, b = _generate(model, ids, fresh, n=12), _generate(model, ids, kept, n=12)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)  # the buffer keeps FP16
    ra, rb = accounting.report(fresh), accounting.report(kept)
    assert rb["cr_per_layer"] == ra["cr_per_layer"]
    assert rb["tokens_attended_per_step"] == ra["tokens_attended_per_step"]
    assert rb["kr_measured"] == ra["kr_measured"] and ra["working_vs_fp16"] == 0
    for i in (2, 3):  # the sparse layers, after filter layer 1
        fa, fb = fresh.layers[i].decode_log, kept.layers[i].decode_log
        assert fb[0] == fa[0]  # the first decode step fills the buffer
        assert sum(e[2] for e in fb[1:]) < 0.8 * sum(e[2] for e in fa[1:])
    H, D = model.config.num_key_value_heads, model.config.head_dim
    slots = [layer.buffers[0].ids.shape[1] for layer in kept.layers[2:]]
    assert all(s >= ra["reconstruction_per_layer_per_step"]["2"]["attended"] for s in slots)
    # per slot: K and V in FP16 (the model computes in float32), its ordinal (int64) and whether it is visible
    assert rb["reuse_buffer_bytes"] == sum(s * (2 * H * D * 2 + 8 + 1) for s in slots)
    assert rb["working_vs_fp16"] == pytest.approx(rb["reuse_buffer_bytes"] / rb["fp16_bytes"])
    if "select_budget" in changes:
        n_recent = max(changes["n_recent"], changes.get("recent_window", 0))
        assert slots == [2 + n_recent + 12] * 2  # a fixed budget keeps a fixed buffer


def test_reuse_buffer_with_row_groups_and_fork(model, codec):
    """Left-padded and same-start rows (each row group its own buffer; rows of a group adding different
    counts rebuild as many), and a fork into select_reuse from a filled cache: the same tokens."""
    a, b = _ids(90, seed=4, batch=2), _ids(61, seed=5)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 29, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[2, :29] = 0
    changes = dict(mode="omnikv", select_budget=16, n_recent=8)
    fresh = _generate(model, batch, _cache(model, codec, **changes), mask, n=12)
    kept_cache = _cache(model, codec, select_reuse=True, **changes)
    kept = _generate(model, batch, kept_cache, mask, n=12)
    assert torch.equal(fresh.sequences, kept.sequences)
    for x, y in zip(fresh.scores, kept.scores):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)  # the buffer keeps FP16
    assert [buf.ids.shape[0] for buf in kept_cache.layers[2].buffers.values()] == [2, 1]
    ref = _cache(model, codec, **changes)
    with torch.no_grad():
        tok = model(a[:1], cache=ref, use_cache=True).logits[:, -1:].argmax(-1)
        forked = ref.fork(select_reuse=True)
        for _ in range(6):
            x, y = model(tok, cache=ref).logits, model(tok, cache=forked).logits
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)  # the buffer keeps FP16
            tok = x[:, -1:].argmax(-1)
    assert forked.layers[2].buffer_bytes() > 0 == ref.layers[2].buffer_bytes()
    with pytest.raises(ConfigError, match="select_reuse"):
        CFG.replace(select_reuse="yes")


# ---- SnapKV combination ---------------------------------------------------------------------------------


def _check_no_evicted_reference(store: ResidualStore):
    R = store.n_refs
    idx = store.indices.unpack()
    assert bool(((idx >= -1) & (idx < R)).all())
    # each code points only at kept references that come before it (causal retrieval survives the remap)
    ref_ord = store.ref_ord.long()
    for c in range(idx.shape[1]):
        used = idx[0, c][idx[0, c] >= 0]
        assert used.numel() >= 1
        assert bool((ref_ord[used] < store.code_ord[c]).all())


def test_snapkv_never_references_an_evicted_reference(model, codec):
    ids = torch.cat([_ids(150, seed=7), torch.cat([torch.zeros(1, 20, dtype=torch.long), _ids(130, seed=8)], 1)])
    mask = torch.cat([torch.ones(1, 150), torch.cat([torch.zeros(1, 20), torch.ones(1, 130)], 1)]).long()
    cache = _cache(model, codec, mode="snapkv", select_budget=20, snapkv_window=8)
    _generate(model, ids, cache, mask, n=12)
    n_checked = 0
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, ResidualLayer):
            continue
        for store in layer.stores:
            for one in (store.stores if isinstance(store, RowStores) else [store]):
                assert one.ref_ord is not None, "every compressed layer evicted"
                _check_no_evicted_reference(one)
                vis = one.visible_ordinals()[0]
                n_prompt = one.n - 11
                assert int((vis < n_prompt).sum()) == 2 + 8 + 20 and bool((vis >= n_prompt).sum() == 11)
                n_checked += 1
    assert n_checked == 3 * 2
    rep = accounting.report(cache)
    assert rep["evicted_tokens"] > 0 and rep["eviction"]["irreversible"]
    assert rep["bytes"]["eviction_ordinals"] > 0 and abs(rep["unexplained"]) < 0.02


def test_snapkv_eviction_keeps_survivors_exact_and_is_irreversible():
    store = _filled_store(stride=4, n_sink=2, seed=1, tokens=60)
    before = store.read()
    rows = store.split_rows()
    keeps = [torch.tensor([0, 1, 5, 7, 11, 23, 40, 57, 58, 59]), torch.tensor([0, 1, 3, 9, 10, 31, 33, 57, 58, 59])]
    for b, (one, keep) in enumerate(zip(rows, keeps)):
        info = one.evict(keep)
        assert info["evicted_codes"] > 0 and info["evicted_refs"] > 0
        _check_no_evicted_reference(one)
        assert one.visible_ordinals()[0].tolist() == keep.tolist()
        torch.testing.assert_close(one.read(), before[b, keep][None], rtol=1e-6, atol=1e-6)
        with pytest.raises(IndexError, match="evicted"):
            one.read_selected(torch.tensor([[4]]))  # a code nobody kept
        new = one.write(torch.randn(1, 9, 64))  # decoding goes on with the kept references only
        _check_no_evicted_reference(one)
        torch.testing.assert_close(one.read()[:, -9:], new, rtol=1e-6, atol=1e-6)
        assert one.visible_ordinals()[0].tolist() == keep.tolist() + list(range(60, 69))
        # reading every kept token, the cache's way (check=False), takes the counts from the store: the device's
        vis = one.visible_ordinals()
        assert one._plan(vis, check=False)[4:] == one._plan(vis, check=True)[4:]
        assert torch.equal(one.read_selected(vis, check=False), one.read())


def test_an_eviction_that_keeps_no_reference_decodes_on():
    """SnapKV with no sinks and no budget keeps only the window: every reference is evicted. Tokens coded
    after it have no reference to average (their means are 0) and read back as written."""
    store = _filled_store(stride=4, n_sink=0, seed=2, tokens=41)
    row = store.split_rows()[0]
    row.evict(torch.tensor([], dtype=torch.long))
    assert row.n_refs == 0
    new = row.write(torch.randn(1, 3, 64))  # ordinals 41-43: codes
    torch.testing.assert_close(row.read(), new, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row.read_selected(torch.tensor([[42]])), new[:, 1:2], rtol=1e-6, atol=1e-6)
    vis = row.visible_ordinals()
    assert row._plan(vis, check=False)[4:] == row._plan(vis, check=True)[4:] == (0, 3)


@pytest.mark.parametrize("window", [0, 24])
def test_snapkv_accounting_explains_every_byte(window):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(head_dim=32, num_attention_heads=2, num_key_value_heads=1)).eval()
    cfg = ResidualKVConfig(full_attention_layers=(0,), stride=10, n_sink=8)
    codec = ResidualCodec.for_model(model.config, cfg, d_c=32, d_ff=48)
    cache = ResidualKVCache.from_model(model, codec, cfg, mode="snapkv", select_budget=64, snapkv_window=16,
                                       recent_window=window)
    _generate(model, _ids(300, seed=5), cache, n=4)
    rep = accounting.report(cache)
    assert abs(rep["unexplained"]) < 1e-9
    assert rep["kr_measured"] < accounting.report(_filled(model, codec, cfg))["kr_measured"]
    assert (rep["gap"].get("recent_window_fp16", 0) > 0) == bool(window)
    # CR: the full layer reads everything, the compressed ones read the 8 + 16 + 64 survivors + new tokens
    # (the observation window widened to the FP16 window, which is never evicted)
    kept = 8 + max(16, window) + 64
    assert rep["cr_per_layer"][0] == 1.0
    assert rep["cr_per_layer"][1] == pytest.approx(sum(kept + t for t in range(3)) / sum(300 + t for t in range(3)))


def test_recent_window_is_always_attended_and_never_evicted(model, codec):
    """The FP16 window costs no reconstruction: OmniKV reads it at every step even when it is wider than
    n_recent, and SnapKV keeps it whole (its observation window widened to it)."""
    cache = _cache(model, codec, mode="omnikv", select_budget=6, n_recent=3, recent_window=10)
    seen = []
    choose = cache.sparse.choose

    def spy(h, scores):
        choose(h, scores)
        seen.append((cache.rows.n_slots - 1, cache.sparse.selection[0][0].tolist()))

    cache.sparse.choose = spy
    _generate(model, _ids(60), cache, n=6)
    for n, sel in seen:
        assert set(sel) >= {0, 1} | set(range(n - 10, n)) and len(sel) == 2 + 10 + 6
    snap = _cache(model, codec, mode="snapkv", select_budget=20, snapkv_window=4, recent_window=16)
    _generate(model, _ids(150, seed=7), snap, n=5)
    for layer in snap.layers:
        if isinstance(layer, ResidualLayer):
            (store,) = layer.stores
            assert store.n_win == 16 and store.ref_ord is not None
            vis = store.visible_ordinals()[0]
            assert vis.tolist() == sorted(set(vis.tolist()))
            assert set(range(150 - 16, store.n)) <= set(vis.tolist())  # the prompt's window + decoded tokens
            assert int((vis < 150).sum()) == 2 + 20 + 16
    rep = accounting.report(snap)
    assert rep["bytes"]["recent_window_fp16"] == 3 * 16 * 64 * 2 and abs(rep["unexplained"]) < 0.02


def _filled(model, codec, cfg):
    cache = ResidualKVCache.from_model(model, codec, cfg)
    _generate(model, _ids(300, seed=5), cache, n=4)
    return cache


# ---- OmniKV without compression, methods, wiring --------------------------------------------------------


def test_omnikv_baseline_on_the_full_cache(model):
    ids = _ids(100, seed=9)
    full = _generate(model, ids, DynamicCache(config=model.config), n=10)
    cache = build_cache("omnikv", model, None, CFG, select_ratio=1.0)
    out = _generate(model, ids, cache, n=10)
    assert isinstance(cache, OmniKVCache) and torch.equal(out.sequences, full.sequences)
    for a, b in zip(out.scores, full.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    small = build_cache("omnikv", model, None, CFG, select_budget=8, n_recent=4)
    _generate(model, ids, small, n=10)
    rep = accounting.report(small)
    # the FP16 cache plus the positions it stores, explained to the byte
    assert rep["kr_measured"] == pytest.approx(1.0 + rep["gap"]["positions"]) and rep["unexplained"] == 0.0
    assert 0 < rep["gap"]["positions"] < 0.02 and rep["cr_per_layer"][2] == pytest.approx(14 / 104.0, rel=0.05)
    assert rep["tokens_reconstructed_per_step"] == [0] * 9  # nothing to decode: exact K/V are gathered


def test_methods_registry_sparse_methods(model, codec):
    ids = _ids(70, seed=10)
    for name, mode in [("residualkv", "omnikv"), ("residualkv-standalone", "standalone"),
                       ("residualkv-snapkv", "snapkv")]:
        cache = build_cache(name, model, codec, select_budget=8)
        assert cache.config.mode == mode and cache.config.select_budget == 8
        _generate(model, ids, cache, n=3)
    reuse = build_cache("residualkv-reuse", model, codec, select_budget=8, n_recent=4)
    assert reuse.config.mode == "omnikv" and reuse.config.select_reuse
    _generate(model, ids, reuse, n=3)
    assert accounting.report(reuse)["working_vs_fp16"] > 0
    assert "residualkv-reuse" not in default_methods().split(",")  # a speed variant: run when named
    with pytest.raises(ValueError, match="mode"):
        build_cache("residualkv", model, codec, mode="snapkv")
    with pytest.raises(ConfigError, match="select_ratio"):
        CFG.replace(select_ratio=1.5)


def test_fork_reads_the_same_bytes_in_another_mode(model, codec):
    ids = _ids(100, seed=11)
    standalone = _cache(model, codec)
    ref = _cache(model, codec, mode="omnikv", select_budget=10, n_recent=4)
    with torch.no_grad():
        tok = model(ids, cache=standalone, use_cache=True).logits[:, -1:].argmax(-1)
        model(ids, cache=ref, use_cache=True)
        fork = standalone.fork(mode="omnikv", select_budget=10, n_recent=4)
        again = standalone.fork()
        for _ in range(4):
            a, b = model(tok, cache=fork).logits, model(tok, cache=ref).logits
            assert torch.equal(a, b)
            c, d = model(tok, cache=standalone).logits, model(tok, cache=again).logits
            assert torch.equal(c, d) and not torch.equal(a, c)
            tok = a[:, -1:].argmax(-1)
    assert accounting.report(fork)["cr"] < 1.0 == accounting.report(standalone)["cr"]
    for bad in (dict(stride=3), dict(mode="snapkv")):
        with pytest.raises(ValueError):
            standalone.fork(**bad)
    # a SnapKV cache forks into a copy of itself after its eviction: the copy reads the same survivors
    snap = _cache(model, codec, mode="snapkv", select_budget=20, n_recent=4)
    with torch.no_grad():
        tok = model(ids, cache=snap, use_cache=True).logits[:, -1:].argmax(-1)
        copy = snap.fork()
        assert copy.sparse.evicted == snap.sparse.evicted and snap.sparse.evicted
        for _ in range(4):
            a, b = model(tok, cache=snap).logits, model(tok, cache=copy).logits
            assert torch.equal(a, b)
            tok = a[:, -1:].argmax(-1)
    with pytest.raises(ValueError, match="SnapKV"):
        snap.fork(mode="standalone")


def test_sparse_mode_without_the_attention_function_fails_loudly(codec):
    torch.manual_seed(0)
    plain = LlamaForCausalLM(tiny_llama_config()).eval()  # left on "sdpa"
    from residualkv.rope import RopeTable

    cache = ResidualKVCache(codec, CFG.replace(mode="omnikv"), num_layers=4, num_kv_heads=2, head_dim=16,
                            rope=RopeTable.from_model(plain))
    with pytest.raises(RuntimeError, match="install"):
        _generate(plain, _ids(30), cache, n=3)


# host syncs a decode step may force on a GPU, per step of the tiny model (2 compressed layers, both sparse
# in the sparse modes): per sparse read, the count of its references and codes (not SnapKV's: the store
# knows how many tokens it kept) and the list of references to decode (on the kernel path, which GPUs take,
# the kernel's own: none); the reuse buffer also sizes its rebuild (1 more); the schedule's device layout,
# recomputed ahead every eighth of the history (< 0.25)
HOST_SYNC_BOUNDS = {"standalone": 0.25, "standalone-window": 0.25, "omnikv": 4.25, "omnikv-reuse": 6.25,
                    "snapkv": 2.25, "omnikv-fp16": 0.0}
KERNEL_HOST_SYNC_BOUNDS = {"standalone": 0.25, "omnikv": 2.25, "omnikv-reuse": 4.25, "snapkv": 0.25}


@pytest.mark.parametrize("method", sorted(HOST_SYNC_BOUNDS))
def test_decode_steps_ask_the_device_few_questions(method):
    """Counted on the CPU with benchmarks/host_syncs.py: the operations that would stall a GPU (a tensor
    made a Python bool or int, nonzero, boolean-mask indexing, torch.equal, tolist). A step used to force
    15 (standalone) to 41 (SnapKV) of them on this model; this keeps them from growing back."""
    from benchmarks.host_syncs import count_decode, tiny_setup

    steps = 8
    counter = count_decode(*tiny_setup(), method, context=300, steps=steps)
    assert counter.total <= HOST_SYNC_BOUNDS[method] * steps, counter.where.most_common()


@pytest.mark.parametrize("method", sorted(KERNEL_HOST_SYNC_BOUNDS))
def test_decode_steps_on_the_kernel_path_ask_only_for_each_selections_size(method):
    """The fused reconstruction kernel decodes the references its codes need itself: their count (for the
    accounting) stays on the device until a report reads it, and a batch's padded code layout is sized from
    what the host knows, so an OmniKV read asks the device only how many references and codes its selection
    holds, and a SnapKV read (every token the row kept, counts the store knows) asks nothing. Batch 2."""
    from benchmarks.host_syncs import count_decode, tiny_setup

    steps, batch = 4, 2
    counter = count_decode(*tiny_setup(kernels=True), method, context=300, steps=steps, batch=batch)
    assert counter.total <= KERNEL_HOST_SYNC_BOUNDS[method] * steps, counter.where.most_common()
    assert not any(what == "nonzero" or "stores.py" in here and what == "_local_scalar_dense"
                   for what, here in counter.where), counter.where.most_common()


def test_a_selection_is_planned_once_for_the_sparse_layers_that_read_it():
    """One filter layer, three sparse layers after it: they read one selection, whose count (one host sync)
    is taken once per step, not per layer; each layer still lists the references its codes need (one each)."""
    from benchmarks.host_syncs import count_decode, tiny_setup

    model, _, cfg = tiny_setup()
    cfg = cfg.replace(full_attention_layers=(0,))
    codec = ResidualCodec.for_model(model.config, cfg, d_c=16, d_ff=32, seed=0)
    steps = 4
    counter = count_decode(model, codec, cfg, "omnikv", context=300, steps=steps)
    per_step = {}
    for (what, _), n in counter.where.items():
        per_step[what] = per_step.get(what, 0) + n / steps
    assert per_step.get("tolist") == 1 and per_step.get("nonzero") == 3, counter.where.most_common()


def test_snapkv_scores_respect_causality_and_padding():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False
    votes = snapkv_token_scores(q, k, mask, 0.35, window=3)
    assert votes.shape == (2, 4, 6) and bool((votes[1, :, :2] == 0).all()) and bool((votes[0] > 0).all())
    torch.testing.assert_close(votes.sum(-1), torch.ones(2, 4))  # each query's attention sums to one
    causal = snapkv_token_scores(q, k, None, 0.35, window=3)
    torch.testing.assert_close(causal[0], votes[0])
    # pooled within the row's own tokens, GQA heads averaged, then max over KV heads
    agg = snapkv_aggregate(votes[1:, :, 2:], n_kv_heads=2, pool=3)
    alone = snapkv_aggregate(snapkv_token_scores(q[1:, :, 2:], k[1:, :, 2:], None, 0.35, 3), 2, 3)
    torch.testing.assert_close(agg, alone)
    assert agg.shape == (1, 4)


def test_omnikv_full_budget_reproduces_standalone_smollm2(smollm2):
    model, tok, spec = smollm2
    cfg = ResidualKVConfig(full_attention_layers=tuple(spec.full_attention_layers), stride=10, n_sink=8)
    codec = ResidualCodec.for_model(model.config, cfg, d_c=96, d_ff=64, kind="identity")
    ids = tok("The history of the printing press begins " * 30, return_tensors="pt").input_ids[:, :160]
    try:
        ref = _generate(model, ids, ResidualKVCache.from_model(model, codec, cfg), n=6)
        full = ResidualKVCache.from_model(model, codec, cfg, mode="omnikv", select_ratio=1.0)
        full.sparse.full_read_shortcut = False  # exercise the gather path with I_t = everything
        out = _generate(model, ids, full, n=6)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        small = ResidualKVCache.from_model(model, codec, cfg, mode="omnikv", select_budget=16, n_recent=8)
        _generate(model, ids, small, n=6)
        rep = accounting.report(small)
        assert rep["cr"] == pytest.approx(rep["cr_formula"]) and rep["cr"] < 0.4
        per = rep["reconstruction_per_layer_per_step"]["5"]
        assert per["attended"] == 8 + 8 + 16 and per["codes_decoded"] <= 32 < per["history"]
        # with a 12-token FP16 window the selection holds it whole and decodes no code for it
        win = ResidualKVCache.from_model(model, codec, cfg, mode="omnikv", select_budget=16, n_recent=8,
                                         recent_window=12)
        _generate(model, ids, win, n=6)
        rep = accounting.report(win)
        per = rep["reconstruction_per_layer_per_step"]["5"]
        assert per["attended"] == 8 + 12 + 16 and per["codes_decoded"] <= 36 - 12
        assert abs(rep["unexplained"]) < 1e-3 and rep["gap"]["recent_window_fp16"] > 0
    finally:
        model.set_attn_implementation("sdpa")  # leave the session-scoped model as the fixture made it


def test_values_decoded_after_the_softmax_smollm2(smollm2):
    """SmolLM2-135M with a codec of the default shape (d_c 160): a decode step with the values' decoder
    applied after the softmax gives the output of decoding the values first, in both deployments.
    The step's own token is kept exact: coded, it is quantised in every layer from hidden states a
    rounding apart, and with two threads one of its codes landed a step away (logits 1.4e-3 apart)."""
    model, tok, spec = smollm2
    cfg = ResidualKVConfig(full_attention_layers=tuple(spec.full_attention_layers), stride=11, n_sink=8, new_kv="exact")
    codec = ResidualCodec.for_model(model.config, cfg, d_c=160, d_ff=spec.codec["d_ff"], seed=0)
    ids = tok("The history of the printing press begins " * 30, return_tensors="pt").input_ids[:, :300]
    try:
        for changes in (dict(mode="standalone"), dict(mode="omnikv", select_budget=64, n_recent=16)):
            cache = ResidualKVCache.from_model(model, codec, cfg, **changes)
            out = _generate(model, ids, cache, n=4)
            assert cache.latent.steps == 3 * len(codec.layer_ids)
            a, b, _ = _one_step_both_ways(model, cache, out.sequences[:, -1:], torch.ones_like(out.sequences))
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    finally:
        model.set_attn_implementation("sdpa")  # leave the session-scoped model as the fixture made it


def test_reuse_buffer_smollm2(smollm2):
    """SmolLM2-135M with a codec of the default shape: with select_reuse the sparse layers decode fewer
    codes per step and generate the tokens the plain OmniKV deployment generates (logits within what the
    buffer's FP16 rounding moves them)."""
    model, tok, spec = smollm2
    cfg = ResidualKVConfig(full_attention_layers=tuple(spec.full_attention_layers), stride=11, n_sink=8)
    codec = ResidualCodec.for_model(model.config, cfg, d_c=160, d_ff=spec.codec["d_ff"], seed=0)
    ids = tok("The history of the printing press begins " * 40, return_tensors="pt").input_ids[:, :400]
    changes = dict(mode="omnikv", select_budget=96, n_recent=16)
    try:
        plain = ResidualKVCache.from_model(model, codec, cfg, **changes)
        kept = ResidualKVCache.from_model(model, codec, cfg, select_reuse=True, **changes)
        a, b = _generate(model, ids, plain, n=8), _generate(model, ids, kept, n=8)
        assert torch.equal(a.sequences, b.sequences)
        for x, y in zip(a.scores, b.scores):
            # the buffer's FP16 K/V, through 30 layers: logits (max ~21, std ~3) moved by up to 0.12 when
            # measured (kept in float32 instead, by 1e-4: the rest is FP16 rounding, not a wrong token)
            torch.testing.assert_close(x, y, rtol=0, atol=0.25)
        ra, rb = accounting.report(plain), accounting.report(kept)
        assert rb["tokens_attended_per_step"] == ra["tokens_attended_per_step"]
        assert sum(rb["tokens_reconstructed_per_step"][1:]) < 0.8 * sum(ra["tokens_reconstructed_per_step"][1:])
        assert 0 < rb["working_vs_fp16"] < 1 and ra["working_vs_fp16"] == 0
    finally:
        model.set_attn_implementation("sdpa")  # leave the session-scoped model as the fixture made it
