"""LowRAM's learnt predictor starts (seed 003): the warm start, the FOMAML meta-init, their folder."""

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from residualkv.config import ConfigError, LowRAMConfig
from residualkv.lowram import LowRAMCache
from residualkv.lowram.meta import capture_pairs, learn_starts, meta_train, relative_error, slim_starts
from residualkv.lowram.starts import META, WEIGHTS, PredictorStarts
from residualkv.lowram.values import Predictor, fit_loss, fit_predictor
from residualkv.methods import build_cache

from .conftest import tiny_llama_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=5)).eval()


def _ids(batch, n, seed=0):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def starts(model):
    return learn_starts(model, _ids(8, 256), _ids(2, 256, seed=1), LowRAMConfig(layer_group=2), warm_steps=25,
                        meta_steps=40, accumulate=4, eval_steps=(0, 2), progress=False, backbone="tiny")


def _prefill(model, ids, cache):
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def test_captured_pairs_are_what_the_cache_fits_on(model):
    cfg = LowRAMConfig(layer_group=2, fit_steps=0)
    ids = _ids(1, 300, seed=3)
    keys, values = capture_pairs(model, ids, cfg)
    assert keys.shape == values.shape == (1, 5 * 2, 300, 16)
    # the cache drops its exact values once fitted: keep them by stopping before the fit
    cache, exact = _prefill(model, ids, LowRAMCache.from_model(model, cfg)), _prefill(model, ids, DynamicCache(config=model.config))
    for i in range(5):
        assert torch.equal(cache.layers[i].stores[0].prompt_keys()[0], keys[0, 2 * i:2 * i + 2])
        assert torch.equal(exact.layers[i].values.float()[0], values[0, 2 * i:2 * i + 2])


def test_meta_init_adapts_in_two_steps_better_than_its_warm_start(model, starts):
    errors = starts.meta["heldout_relative_error"]
    assert errors["warm"]["0"] < errors["slim"]["0"]  # pooled pre-training already predicts unseen contexts
    assert errors["meta"]["2"] < errors["warm"]["2"] < errors["slim"]["2"]
    assert len(starts.meta["meta"]["adapted_loss"]) == 40


def test_meta_train_takes_first_order_steps_from_the_adapted_weights(model):
    # one outer step with one context: Adam's first step is lr·g/(|g| + eps), so where |g| >> eps the
    # step is lr·sign(g) of the loss gradient at the 2-step adapted weights, as FOMAML prescribes
    cfg = LowRAMConfig(layer_group=2)
    keys, values = capture_pairs(model, _ids(1, 128, seed=4), cfg)
    start = slim_starts(model, cfg, torch.Generator().manual_seed(0))
    out = meta_train(keys, values, start, outer_steps=1, accumulate=1, outer_lr=1e-4)
    adapted = fit_predictor(keys[0], values[0], start, steps=2, lr=1e-3)
    params = [t.requires_grad_(True) for t in adapted]
    grads = torch.autograd.grad(fit_loss(Predictor(*params), keys[0], values[0]), params)
    n_checked = 0
    for new, old, g in zip(out, start, grads):
        big = g.abs() > 1e-4
        assert torch.allclose((old - new)[big], 1e-4 * torch.sign(g[big]), rtol=1e-3, atol=0)
        n_checked += int(big.sum())
    assert n_checked > 1000


def test_saved_starts_round_trip_and_the_cache_starts_from_them(model, starts, tmp_path):
    folder = starts.save(tmp_path / "starts")
    loaded = PredictorStarts.load(folder, model)
    for kind in ("warm", "meta"):
        for a, b in zip(starts.layers[kind], loaded.layers[kind]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    ids = _ids(1, 300, seed=5)
    slim = _prefill(model, ids, LowRAMCache.from_model(model, LowRAMConfig(layer_group=2, fit_steps=0)))
    meta = _prefill(model, ids, LowRAMCache.from_model(
        model, LowRAMConfig(layer_group=2, fit_steps=0, start="meta", starts_path=str(folder))))
    for i in range(5):
        s, m = slim.layers[i].stores[0], meta.layers[i].stores[0]
        assert torch.equal(s.prompt_keys(), m.prompt_keys())  # the same xKV draws: only the values' start differs
        assert all(torch.equal(x, y.half()) for x, y in zip(m.predictor, starts.layers["meta"][i]))
    # two online steps from the meta start predict this unseen context better than two from Slim's
    keys, values = capture_pairs(model, ids, LowRAMConfig(layer_group=2))
    err = {}
    for name, start in (("slim", slim_starts(model, LowRAMConfig(), torch.Generator().manual_seed(0))),
                        ("meta", loaded.layers["meta"])):
        if isinstance(start, list):
            start = Predictor(*(torch.cat(ts) for ts in zip(*start)))
        err[name] = relative_error(fit_predictor(keys[0], values[0], start, steps=2, lr=1e-3), keys[0], values[0])
    assert err["meta"] < err["slim"], err


def test_starts_are_found_for_their_model_and_refused_for_another(model, starts, tmp_path, monkeypatch):
    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="rkv lowram-init"):
        build_cache("lowram-meta", model)
    folder = starts.save(tmp_path / "lowram" / "tiny" / "run")
    # a save in progress (hidden folder) is never picked, even when newer
    hidden = tmp_path / "lowram" / "tiny" / ".run.tmp"
    hidden.mkdir()
    (hidden / META).write_text((folder / META).read_text())
    cache = build_cache("lowram-meta", model)
    assert (cache.config.start, cache.config.fit_steps) == ("meta", 2)
    assert build_cache("lowram-warm", model).config.start == "warm"
    # read once, shared by the caches that start from them (the file re-read only when it changes)
    assert build_cache("lowram-meta", model).starts[0] is cache.starts[0]
    q = build_cache("lowram-q-meta", model)
    assert (q.config.ratio, q.config.key_bits, q.config.residual_bits, q.config.start) == (5.0, 4, 2, "meta")

    torch.manual_seed(1)
    other = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=5)).eval()  # same shape, other weights
    with pytest.raises(ConfigError, match="rkv lowram-init"):
        LowRAMCache.from_model(other, LowRAMConfig(start="meta"))
    with pytest.raises(ConfigError, match="starts_path"):
        LowRAMCache.from_model(other, LowRAMConfig(start="meta", starts_path=str(folder)))

    meta = json.loads((folder / META).read_text())
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ConfigError, match="sha256"):
        PredictorStarts.load(folder, model)
    assert meta["kinds"] == ["meta", "warm"]


def test_starts_learnt_for_the_key_layout_in_use_are_preferred(model, starts, tmp_path, monkeypatch):
    """The predictors map keys as stored to values: starts learnt for another ratio, layer group or key
    width are taken only where none match, with a warning that says so."""
    import os
    import shutil

    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path))
    grouped = starts.save(tmp_path / "lowram" / "tiny" / "g2")  # learnt with layer_group=2, 4x, FP16 keys
    q = Path(shutil.copytree(grouped, tmp_path / "lowram" / "tiny" / "g2-q"))
    meta = json.loads((q / META).read_text())
    meta["lowram_config"].update(ratio=5.0, key_bits=4)
    (q / META).write_text(json.dumps(meta))
    os.utime(q / META, (2e9, 2e9))  # the newest
    assert PredictorStarts.resolve(None, model, LowRAMConfig(layer_group=2)).meta["path"] == str(grouped)
    assert PredictorStarts.resolve(None, model, LowRAMConfig(layer_group=2, ratio=5.0, key_bits=4)).meta["path"] == str(q)
    with pytest.warns(UserWarning, match="no LowRAM starts learnt for .*'layer_group': 3"):
        assert PredictorStarts.resolve(None, model, LowRAMConfig(layer_group=3)).meta["path"] == str(q)


def test_an_interrupted_run_resumes_from_its_checkpoint(model, tmp_path, monkeypatch):
    import residualkv.lowram.meta as meta

    args = (model, _ids(4, 128), _ids(1, 128, seed=1), LowRAMConfig(layer_group=2))
    kw = dict(warm_steps=5, meta_steps=12, accumulate=2, eval_steps=(0,), progress=False, checkpoint_every=5)
    whole = learn_starts(*args, **kw)
    calls, real_fit = [], meta.fit_predictor

    def crashing_fit(*a, **k):  # one call for the warm start, then `accumulate` per outer step
        calls.append(1)
        if len(calls) == 1 + 2 * 7 + 1:
            raise KeyboardInterrupt("killed during outer step 8")
        return real_fit(*a, **k)

    ckpt = tmp_path / "ck.pt"
    monkeypatch.setattr(meta, "fit_predictor", crashing_fit)
    with pytest.raises(KeyboardInterrupt):
        learn_starts(*args, checkpoint=ckpt, **kw)
    assert torch.load(ckpt, weights_only=True)["meta"]["step"] == 5
    calls.clear()
    monkeypatch.setattr(meta, "fit_predictor", lambda *a, **k: (calls.append(1), real_fit(*a, **k))[1])
    resumed = learn_starts(*args, checkpoint=ckpt, **kw)
    # steps 6-12, then the held-out fits from slim, warm and meta at 0 and inner_steps online steps
    assert len(calls) == 2 * (12 - 5) + 3 * 2
    for kind in ("warm", "meta"):
        for a, b in zip(whole.layers[kind], resumed.layers[kind]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert resumed.meta["meta"]["adapted_loss"] == whole.meta["meta"]["adapted_loss"]
    # other settings do not pick up this checkpoint, nor does a run asking for fewer outer steps than it holds
    other = learn_starts(*args, checkpoint=ckpt, **{**kw, "warm_steps": 6})
    assert not torch.equal(other.layers["warm"][0].w2, whole.layers["warm"][0].w2)
    resumed_12 = torch.load(ckpt, weights_only=True)
    assert resumed_12["meta"]["step"] == 12 and resumed_12["settings"]["warm_steps"] == 6
    shorter = learn_starts(*args, checkpoint=ckpt, **{**kw, "warm_steps": 6, "meta_steps": 4})
    assert len(shorter.meta["meta"]["adapted_loss"]) == 4


def test_rkv_lowram_init_saves_starts_that_the_methods_find(tmp_path, monkeypatch, capsys):
    from residualkv import cli
    from residualkv.backbones import load_backbone

    from .test_training import _cli_backbone_and_corpus

    folder, corpus = _cli_backbone_and_corpus(tmp_path, monkeypatch)
    argv = ["lowram-init", "--backbone", str(folder), "--data", str(corpus), "--seq-len", "64", "--contexts", "4",
            "--heldout", "1", "--warm-steps", "3", "--meta-steps", "4", "--accumulate", "2", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    path = Path(out["path"])
    assert path.parent == tmp_path / "rkv-data" / "lowram" / "tiny-llama" and set(out["heldout_relative_error"]) == {
        "slim", "warm", "meta"}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the checkpoint is gone once saved
    model = load_backbone(folder)[0]
    cache = build_cache("lowram-meta", model)
    saved = PredictorStarts.load(path)
    assert all(torch.equal(a, b) for a, b in zip(cache.starts[1], saved.layers["meta"][1]))
    assert cli.main([*argv, "--contexts", "10000"]) == 2
    assert "ask for fewer --contexts" in capsys.readouterr().err


def test_eval_leaves_them_out_by_default_and_fails_fast_without_starts(model, tmp_path, monkeypatch):
    from residualkv.evaluation.cli import default_methods
    from residualkv.evaluation.harness import evaluate

    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path))
    default = default_methods().split(",")
    assert "lowram" in default and not {"lowram-warm", "lowram-meta", "lowram-q-meta"} & set(default)
    with pytest.raises(ConfigError, match="rkv lowram-init"):  # before any sample runs (no tokenizer needed)
        evaluate(model, None, ["full", "lowram-meta-f5"], samples=[], context_len=None, progress=False)


def test_start_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match="start="):
        LowRAMConfig(start="fast")
    with pytest.raises(ConfigError, match="starts_path"):
        LowRAMConfig(starts_path="/somewhere")
    with pytest.raises(ConfigError, match="not a saved LowRAM starts folder"):
        PredictorStarts.load("/nonexistent/folder")


def test_starts_learnt_on_smollm2_predict_unseen_text(smollm2):
    """On the real backbone, a few minutes' worth scaled down: contexts of training text teach starts
    that predict held-out text's values better than Slim's linear map, before and after 2 online steps."""
    from residualkv.data import offline_text

    model, tok, _ = smollm2
    train = tok(offline_text(40_000, heldout=False), return_tensors="pt").input_ids[0, :6 * 384].view(6, 384)
    held = tok(offline_text(6_000), return_tensors="pt").input_ids[0, :384].view(1, 384)
    starts = learn_starts(model, train, held, warm_steps=25, meta_steps=6, accumulate=3, progress=False)
    err = starts.meta["heldout_relative_error"]
    assert err["warm"]["0"] < err["slim"]["0"] and err["meta"]["2"] < err["slim"]["2"], err
