"""The MLflow registry and the serving loader, on a real embedded store (SQLite + local artifacts).

Tiny random codecs (4-layer Llama shape) keep each test to seconds; everything else is real:
MLflow's SQLAlchemy store, artifact upload/download, aliases, 8 concurrent registering processes.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from residualkv.codec import WEIGHTS, CodecError, ResidualCodec
from residualkv.config import ResidualKVConfig
from tests.conftest import tiny_llama_config


def make_codec(directory: Path, *, seed: int = 0, backbone: str = "tiny-llama", layer_d_c=None, kv_digest: str = "",
               **config_overrides) -> Path:
    cfg = tiny_llama_config(**config_overrides)
    codec = ResidualCodec.for_model(cfg, ResidualKVConfig(full_attention_layers=(0,)), d_c=32, d_ff=64,
                                    backbone=backbone, seed=seed, layer_d_c=layer_d_c)
    codec.kv_digest = kv_digest  # as training records it (the digest of the model's K/V weights)
    return codec.save(directory)


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """A fresh embedded MLflow store under a temporary data directory."""
    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'data' / 'mlflow' / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    import registry

    return registry


def test_env_defaults_live_under_data_dir(tmp_path):
    from registry import env

    values = env.service_defaults(tmp_path)
    assert values["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    assert values["PREFECT_HOME"] == str(tmp_path / "prefect")
    assert values["PREFECT_SERVER_DATABASE_CONNECTION_URL"].endswith(f"{tmp_path}/prefect/prefect.db")
    assert values["MLFLOW_DISABLE_TELEMETRY"] == "true" and values["DO_NOT_TRACK"] == "true"
    assert values["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert values["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    assert env.artifact_root_for(values["MLFLOW_TRACKING_URI"]) == (tmp_path / "mlflow" / "artifacts").as_uri()


def test_register_load_by_alias_and_version(store, tmp_path):
    codec_dir = make_codec(tmp_path / "codec")
    reg = store.register_codec(codec_dir, metrics={"rel_score": 0.97, "kr_measured": 0.19, "cr": 1.0},
                               tags={"trainer_steps": 5}, suite={"suite": "unit"})
    assert reg.name == "rkv-tiny-llama" and reg.version == "1"
    mv = store.get_version(f"models:/{reg.name}@candidate")
    assert str(mv.version) == "1" and mv.run_id == reg.run_id
    assert mv.tags["rkv.complete"] == "true"
    assert mv.tags["backbone"] == "tiny-llama" and len(mv.tags["sha256"]) == 64 and mv.tags["fingerprint_hash"]
    assert store.version_metrics(mv) == {"rel_score": 0.97, "kr_measured": 0.19, "cr": 1.0}
    # artifacts live beside the SQLite file, not in the working directory
    assert str(tmp_path / "data" / "mlflow" / "artifacts") in mv.source
    model_config = tiny_llama_config()
    for uri in (f"models:/{reg.name}@candidate", f"models:/{reg.name}/1"):
        codec = store.load_codec(uri, model_config=model_config)
        assert codec.backbone == "tiny-llama" and codec.layer_ids == [1, 2, 3]
    from registry.store import client

    run = client().get_run(reg.run_id)
    assert run.data.metrics["rel_score"] == pytest.approx(0.97)
    assert "layer_d_c" not in mv.tags and mv.tags["d_c"] == "32"
    # a codec with another latent size in one layer says so in its tags, and loads with that shape
    sized = store.register_codec(make_codec(tmp_path / "sized", layer_d_c={2: 64}), metrics={"rel_score": 0.9})
    mv2 = store.get_version(f"models:/{sized.name}/{sized.version}")
    assert mv2.tags["layer_d_c"] == '{"2": 64}'
    assert store.load_codec(f"models:/{sized.name}/{sized.version}", model_config=model_config).layer_d_c == {2: 64}


def test_promotion_rule_is_explicit_and_logged(store, tmp_path):
    suite = {"suite": "unit"}
    v1 = store.register_codec(make_codec(tmp_path / "c1", seed=1), metrics={"rel_score": 0.95, "kr_measured": 0.20}, suite=suite)
    d1 = store.promote_if_not_worse(v1.name, v1.version)
    assert d1.promoted and d1.reason == "no champion yet"
    v2 = store.register_codec(make_codec(tmp_path / "c2", seed=2), metrics={"rel_score": 0.90, "kr_measured": 0.20}, suite=suite)
    assert str(store.get_version(f"models:/{v2.name}@candidate").version) == "2"
    d2 = store.promote_if_not_worse(v2.name, v2.version)
    assert not d2.promoted and "rel_score 0.9000 < champion 0.9500" in d2.reason
    assert str(store.get_version(f"models:/{v1.name}@champion").version) == "1"
    v3 = store.register_codec(make_codec(tmp_path / "c3", seed=3), metrics={"rel_score": 0.945, "kr_measured": 0.21}, suite=suite)
    rule = store.PromotionRule(score_tol=0.01, kr_tol=0.005)
    d3 = store.promote_if_not_worse(v3.name, v3.version, rule)
    assert not d3.promoted and "kr_measured 0.2100 > champion 0.2000" in d3.reason
    v4 = store.register_codec(make_codec(tmp_path / "c4", seed=4), metrics={"rel_score": 0.945, "kr_measured": 0.2}, suite=suite)
    d4 = store.promote_if_not_worse(v4.name, v4.version, rule)
    assert d4.promoted, d4.reason  # within the score tolerance, same bytes
    assert str(store.get_version(f"models:/{v1.name}@champion").version) == "4"
    # no task signal on either side (scores 0): the perplexity guard still catches a worse codec
    v6 = store.register_codec(make_codec(tmp_path / "c6", seed=6), suite=suite,
                              metrics={"rel_score": 0.945, "kr_measured": 0.2, "ppl_rel": 13.0})
    v7 = store.register_codec(make_codec(tmp_path / "c7", seed=7), suite=suite,
                              metrics={"rel_score": 0.945, "kr_measured": 0.2, "ppl_rel": 226.0})
    assert store.promote_if_not_worse(v6.name, v6.version, rule).promoted
    d7 = store.promote_if_not_worse(v7.name, v7.version, rule)
    assert not d7.promoted and "ppl_rel 226.0000 > champion 13.0000 * (1 + 0.05)" in d7.reason
    assert str(store.get_version(f"models:/{v1.name}@champion").version) == v6.version
    # the decision and the rule are on the version and in its run (tag + text artifact)
    from registry.store import client

    mv2 = store.get_version(f"models:/{v2.name}/2")
    assert "NOT" not in mv2.tags["rkv.promotion_rule"] and "rel_score" in mv2.tags["rkv.promotion_rule"]
    run = client().get_run(v2.run_id)
    assert run.data.tags["rkv.promotion.v2"].startswith("not promoted")
    text = Path(client().download_artifacts(v2.run_id, "promotion/decision_v2.txt", str(tmp_path))).read_text()
    assert "NOT promoted" in text and "rule: promote iff" in text
    # a champion benchmarked on another suite is not compared blindly
    v5 = store.register_codec(make_codec(tmp_path / "c5", seed=5), metrics={"rel_score": 0.99, "kr_measured": 0.2, "ppl_rel": 12.0},
                              suite={"suite": "other"})
    d5 = store.promote_if_not_worse(v5.name, v5.version)
    assert not d5.promoted and "different suites" in d5.reason
    d5b = store.promote_if_not_worse(v5.name, v5.version, champion_metrics={"rel_score": 0.95, "kr_measured": 0.2, "ppl_rel": 13.0})
    assert d5b.promoted
    # trained on another checkpoint of the same shape (its K/V weights differ): never promoted under this name
    good = {"rel_score": 0.99, "kr_measured": 0.2, "ppl_rel": 12.0}
    v8 = store.register_codec(make_codec(tmp_path / "c8", seed=8, kv_digest="a" * 64), metrics=good, suite={"suite": "other"})
    assert store.get_version(f"models:/{v8.name}/{v8.version}").tags["kv_digest"] == "a" * 64
    assert store.promote_if_not_worse(v8.name, v8.version).promoted  # the champion before it records none
    v9 = store.register_codec(make_codec(tmp_path / "c9", seed=9, kv_digest="b" * 64), metrics=good, suite={"suite": "other"})
    d9 = store.promote_if_not_worse(v9.name, v9.version)
    assert not d9.promoted and "other weights of the same shape" in d9.reason


def _promote_two_at_once(store, tmp_path, monkeypatch):
    """v2 and v3 promoted at once against champion v1; v2's decision stalls until v3's promotion ends."""
    import threading

    from registry import codecs

    suite = {"suite": "unit"}
    regs = [store.register_codec(make_codec(tmp_path / f"c{i}", seed=i), suite=suite,
                                 metrics={"rel_score": score, "kr_measured": 0.2})
            for i, score in enumerate((0.90, 0.92, 0.95), start=1)]
    assert store.promote_if_not_worse(regs[0].name, "1").promoted
    v2_deciding, v3_done = threading.Event(), threading.Event()
    real_decide = codecs._decide

    def decide(rule, cand, *args):
        result = real_decide(rule, cand, *args)
        if str(cand.version) == "2":
            v2_deciding.set()
            v3_done.wait(timeout=3)  # with the store lock v3 cannot finish meanwhile: the wait times out
        return result

    monkeypatch.setattr(codecs, "_decide", decide)
    decisions = {}

    def promote(version, before=None):
        if before is not None:
            before.wait(timeout=30)
        decisions[version] = store.promote_if_not_worse(regs[0].name, version)
        if version == "3":
            v3_done.set()

    threads = [threading.Thread(target=promote, args=("2",)), threading.Thread(target=promote, args=("3", v2_deciding))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert str(store.get_version(f"models:/{regs[0].name}@champion").version) == "3"
    return decisions


def test_concurrent_promotions_are_serialised_on_an_embedded_store(store, tmp_path, monkeypatch):
    decisions = _promote_two_at_once(store, tmp_path, monkeypatch)
    # v3 waited for v2's whole read-decide-write and was compared against it, not against the stale v1
    assert decisions["2"].promoted and decisions["2"].champion_before == "1"
    assert decisions["3"].promoted and decisions["3"].champion_before == "2"


def test_concurrent_promotions_recheck_the_champion_without_a_lock(store, tmp_path, monkeypatch):
    import contextlib

    from registry import codecs

    # a tracking server: no shared file to lock, so only the re-read before the alias write protects
    monkeypatch.setattr(codecs, "store_lock", lambda purpose: contextlib.nullcontext())
    decisions = _promote_two_at_once(store, tmp_path, monkeypatch)
    assert decisions["3"].promoted and decisions["3"].champion_before == "1"
    assert not decisions["2"].promoted and decisions["2"].champion_before == "3"
    assert "worse than the champion: rel_score 0.9200 < champion 0.9500" in decisions["2"].reason


def test_corrupted_artifact_is_refused(store, tmp_path):
    reg = store.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    stored = Path(reg.source.removeprefix("file://")) / WEIGHTS
    data = bytearray(stored.read_bytes())
    data[-8] ^= 0xFF  # flip bits inside a tensor
    stored.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="corrupted"):
        store.load_codec(f"models:/{reg.name}@candidate", model_config=tiny_llama_config())
    # a verified copy is never left behind in the serving cache
    from registry.serving import cache_root

    assert not list((cache_root() / reg.name).glob("v1-*"))


def test_corrupted_cached_copy_is_replaced(store, tmp_path):
    reg = store.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    uri = f"models:/{reg.name}/{reg.version}"
    store.load_codec(uri)
    from registry.serving import cache_root

    (cached,) = (cache_root() / reg.name).glob("v1-*")
    (cached / WEIGHTS).write_bytes(b"garbage")
    assert store.load_codec(uri).layer_ids == [1, 2, 3]  # re-downloaded from the store and verified
    assert (cached / WEIGHTS).stat().st_size > 100


def test_a_loader_never_deletes_a_copy_another_loader_handed_out(store, tmp_path, monkeypatch):
    """Two cold loaders of one version: the second to finish finds the first's verified copy in place (and
    maybe already in a caller's hands, fetch_codec_dir): it keeps that copy and drops its own. A copy that
    no longer verifies is replaced. Temporary folders of killed downloads are swept once they are old."""
    import os
    import shutil

    from registry import serving

    reg = store.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    uri = f"models:/{reg.name}/{reg.version}"
    dest = serving.fetch_codec_dir(uri)  # loader A's copy, handed to its caller
    inode = (dest / WEIGHTS).stat().st_ino
    mv = store.get_version(uri)
    for corrupt in (False, True):
        tmp = tmp_path / f"b-tmp-{corrupt}"
        tmp.mkdir()
        ours = shutil.copytree(dest, tmp / "download")  # loader B's verified download, finished second
        if corrupt:
            (dest / WEIGHTS).write_bytes(b"garbage")
        assert serving._place(ours, dest, tmp, mv, uri, None) == dest
        if not corrupt:
            assert (dest / WEIGHTS).stat().st_ino == inode  # A's copy, untouched
        assert ResidualCodec.load(dest).layer_ids == [1, 2, 3]
    # where the file system cannot swap two folders, a bad copy in place is left alone and ours kept beside it
    swap = serving.exchange_paths
    monkeypatch.setattr(serving, "exchange_paths", lambda a, b: False)
    tmp = tmp_path / "c-tmp"
    tmp.mkdir()
    ours = shutil.copytree(dest, tmp / "download")
    (dest / WEIGHTS).write_bytes(b"garbage")
    private = serving._place(ours, dest, tmp, mv, uri, None)
    assert private != dest and private.parent == dest.parent and ResidualCodec.load(private).layer_ids == [1, 2, 3]
    assert (dest / WEIGHTS).read_bytes() == b"garbage"
    shutil.rmtree(private)
    monkeypatch.setattr(serving, "exchange_paths", swap)
    old, young = dest.parent / ".v1-killed", dest.parent / ".v1-live"
    old.mkdir()
    young.mkdir()
    os.utime(old, (0, 0))
    shutil.rmtree(dest)
    serving.fetch_codec_dir(uri)
    assert not old.exists() and young.exists()


def test_codec_for_another_backbone_is_refused(store, tmp_path):
    reg = store.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    other = tiny_llama_config(num_key_value_heads=4)  # another KV shape
    with pytest.raises(CodecError, match="does not fit this model") as info:
        store.load_codec(f"models:/{reg.name}@candidate", model_config=other)
    assert "num_kv_heads" in str(info.value) and "tiny-llama" in str(info.value)
    other_rope = tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(CodecError, match="rope"):
        store.load_codec(f"models:/{reg.name}@candidate", model_config=other_rope)


def test_half_written_version_is_never_served(store, tmp_path):
    good = store.register_codec(make_codec(tmp_path / "good", seed=1), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    from registry import codecs
    from registry.store import client

    real = client().set_model_version_tag

    def crash_on_complete(name, version, key, value):
        if key == codecs.COMPLETE_TAG:
            raise RuntimeError("killed before the version was marked complete")
        return real(name, version, key, value)

    client().set_model_version_tag = crash_on_complete  # the process dies right before the last write
    try:
        with pytest.raises(RuntimeError, match="killed"):
            store.register_codec(make_codec(tmp_path / "half", seed=2), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    finally:
        del client().set_model_version_tag
    half = client().get_model_version(good.name, "2")  # the version row exists ...
    assert half.tags.get("rkv.complete") is None
    with pytest.raises(CodecError, match="not complete"):  # ... but is never served
        store.load_codec(f"models:/{good.name}/2")
    assert str(store.get_version(f"models:/{good.name}@candidate").version) == "1"  # alias never moved to it
    d = store.promote_if_not_worse(good.name, "2")
    assert not d.promoted and "not complete" in d.reason


def test_bad_uris_say_what_to_write(store, tmp_path):
    with pytest.raises(CodecError, match="models:/<name>@<alias>"):
        store.load_codec("models:/only-a-name")
    with pytest.raises(CodecError, match="no registered model 'nope'"):
        store.load_codec("models:/nope@champion")
    reg = store.register_codec(make_codec(tmp_path / "codec"), metrics={"rel_score": 1.0, "kr_measured": 0.2})
    with pytest.raises(CodecError, match="@candidate=v1"):
        store.load_codec(f"models:/{reg.name}@champion")


def test_registering_a_corrupted_codec_directory_is_refused(store, tmp_path):
    codec_dir = make_codec(tmp_path / "codec")
    (codec_dir / WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(CodecError, match="corrupted"):
        store.register_codec(codec_dir, metrics={"rel_score": 1.0})
    from registry.store import client

    assert client().search_registered_models() == []


def _register_worker(codec_dir: str, queue) -> None:
    try:
        import registry

        reg = registry.register_codec(codec_dir, name="rkv-concurrent", metrics={"rel_score": 0.9, "kr_measured": 0.2})
        queue.put(("ok", reg.version, reg.run_id))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(error), ""))


def test_eight_concurrent_registrations_yield_eight_versions(store, tmp_path):
    dirs = [str(make_codec(tmp_path / f"codec{i}", seed=i)) for i in range(8)]
    from registry.store import client

    client()  # the parent creates the schema; the children race on versions, runs and aliases
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_register_worker, args=(d, queue)) for d in dirs]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors
    versions = sorted(int(r[1]) for r in results)
    assert versions == list(range(1, 9))
    assert len({r[2] for r in results}) == 8
    listed = store.list_versions("rkv-concurrent")
    assert [int(v.version) for v in listed] == list(range(1, 9))
    assert all(v.tags.get("rkv.complete") == "true" for v in listed)
    assert str(store.get_version("models:/rkv-concurrent@candidate").version) == "8"  # the newest, whatever finished last
    shas = {v.tags["sha256"] for v in listed}
    assert len(shas) == 8  # each version carries its own codec
    for v in listed:
        store.load_codec(f"models:/rkv-concurrent/{v.version}", model_config=tiny_llama_config())


def _paired(diff: float, lo: float, hi: float, n: int = 16) -> list[dict]:
    return [{"context_len": 2048, "n_samples": n, "difference": diff, "ci": [lo, hi]}]


def test_promotion_judges_scores_on_the_same_samples_when_given_paired_differences(store, tmp_path):
    suite = {"suite": "unit"}
    reg = lambda i, rel: store.register_codec(make_codec(tmp_path / f"c{i}", seed=i), suite=suite,  # noqa: E731
                                              metrics={"rel_score": rel, "kr_measured": 0.2})
    v1 = reg(1, 0.95)
    assert store.promote_if_not_worse(v1.name, "1").promoted
    # 0.85 is 0.10 below the champion's point score, but on the same samples the interval reaches +0.10: noise
    reg(2, 0.85)
    d2 = store.promote_if_not_worse(v1.name, "2", paired=_paired(-0.10, -0.30, 0.10), paired_champion="1")
    assert d2.promoted and "not worse on the same samples" in d2.reason and d2.paired[0]["ci"] == [-0.30, 0.10]
    assert "paired rel_score ctx2048 (16 samples)" in d2.text() and "no 95% interval" in d2.text()
    # a point score above the champion's does not hide an interval wholly below -score_tol
    reg(3, 0.90)
    d3 = store.promote_if_not_worse(v1.name, "3", paired=_paired(-0.20, -0.35, -0.05), paired_champion="2")
    assert not d3.promoted and "wholly below -0.01" in d3.reason
    # differences measured against another version than the champion are not used: the point clause is
    d3b = store.promote_if_not_worse(v1.name, "3", paired=_paired(-0.20, -0.35, -0.05), paired_champion="1")
    assert d3b.promoted and not d3b.paired and "measured against v1, the champion is v2" in d3b.paired_note
    # none passed: the point clause, and the decision says why
    reg(4, 0.80)
    d4 = store.promote_if_not_worse(v1.name, "4", paired_note="no per-sample predictions stored for the champion")
    assert not d4.promoted and "rel_score 0.8000 < champion 0.9000 - 0.01" in d4.reason
    assert "point clause: no per-sample predictions stored" in d4.text()
    # a rule without `paired` keeps the point clause even when differences are passed
    d4b = store.promote_if_not_worse(v1.name, "4", store.PromotionRule(paired=False),
                                     paired=_paired(0.0, -0.2, 0.2), paired_champion="3")
    assert not d4b.promoted and d4b.paired == [] and d4b.paired_note == ""


def test_promotion_refuses_a_candidate_whose_right_answers_became_less_likely(store, tmp_path):
    suite = {"suite": "unit"}
    reg = lambda i: store.register_codec(make_codec(tmp_path / f"c{i}", seed=i), suite=suite,  # noqa: E731
                                         metrics={"rel_score": 0.9, "kr_measured": 0.2})
    v1 = reg(1)
    assert store.promote_if_not_worse(v1.name, "1").promoted
    same = _paired(0.0, -0.1, 0.1)  # the scores tie on the same samples...
    nll = lambda d, lo, hi: [{**_paired(d, lo, hi)[0], "quantity": "answer_nll"}]  # noqa: E731
    reg(2)
    d2 = store.promote_if_not_worse(v1.name, "2", paired=same + nll(0.30, 0.20, 0.40), paired_champion="1")
    assert not d2.promoted and "answer_nll at 2048 tokens +0.3000 nats/token above" in d2.reason
    assert "wholly above +0.05" in d2.reason and "paired answer_nll ctx2048" in d2.text()
    assert "no 95% interval of answer_nll" in d2.text()
    # ...an interval reaching below the tolerance is noise
    d2b = store.promote_if_not_worse(v1.name, "2", paired=same + nll(0.04, -0.02, 0.10), paired_champion="1")
    assert d2b.promoted and "answer_nll paired 95% CI lower bound(s) -0.0200 at 2048 <= +0.05" in d2b.reason
    # the clause is off without a tolerance; NLL evidence alone leaves rel_score to the point clause, and says so
    reg(3)
    d3 = store.promote_if_not_worse(v1.name, "3", store.PromotionRule(answer_nll_tol=None),
                                    paired=same + nll(0.30, 0.20, 0.40), paired_champion="2")
    assert d3.promoted, d3.reason
    reg(4)
    d4 = store.promote_if_not_worse(v1.name, "4", paired=nll(0.0, -0.1, 0.1), paired_champion="3",
                                    paired_note="no paired comparison of scores")
    assert d4.promoted and "rel_score judged by the point clause: no paired comparison of scores" in d4.text()


def test_the_champion_baseline_comes_with_its_stored_predictions(store, tmp_path):
    """The pieces the retrain flow and bench-regress chain: the champion's stored predictions, a paired
    judgement against a candidate's, and the registry's decision on it (no model: predictions written by hand)."""
    import json

    from registry.store import client
    from tasks.paired import PREDICTIONS_ARTIFACT, baseline_of, judge_paired

    def rows(method, right):
        return [{"method": method, "context_len": 2048, "id": f"{t}-{i}", "task": t, "seed": 0, "answers": ["a"],
                 "prediction": "a" if ok else "b", "score": float(ok)} for t, oks in right.items() for i, ok in enumerate(oks)]

    suite = {"suite": "unit"}
    full = rows("full", {"t": [1] * 8, "u": [1] * 8})
    v1 = store.register_codec(make_codec(tmp_path / "c1", seed=1), suite=suite, metrics={"rel_score": 0.9375, "kr_measured": 0.2})
    champion = full + rows("residualkv", {"t": [1] * 8, "u": [1] * 7 + [0]})
    client().log_text(v1.run_id, "".join(json.dumps(r) + "\n" for r in champion), PREDICTIONS_ARTIFACT)
    assert store.promote_if_not_worse(v1.name, "1").promoted
    store.register_codec(make_codec(tmp_path / "c2", seed=2), suite=suite, metrics={"rel_score": 0.875, "kr_measured": 0.2})
    candidate = full + rows("residualkv", {"t": [1] * 7 + [0], "u": [1] * 6 + [0, 1]})  # one answer fewer of 16

    never = lambda d: pytest.fail("same suite: the stored metrics and predictions are used, nothing re-measured")  # noqa: E731
    base = baseline_of(store.get_version(f"models:/{v1.name}@champion"), suite, never, "residualkv")
    assert base["version"] == "1" and not base["remeasured"] and len(base["predictions"]) == len(champion)
    checks, note = judge_paired(candidate, base["predictions"], "residualkv", 0.01, side="champion")
    assert note == "" and checks[0].n_samples == 16 and checks[0].ci[0] < -0.01 < checks[0].ci[1]
    d = store.promote_if_not_worse(v1.name, "2", paired=[c.as_dict() for c in checks], paired_champion=base["version"])
    assert d.promoted, d.reason  # the point clause (0.875 < 0.9375 - 0.01) would have refused it
    # a version without stored predictions: no paired checks, and the note says which side lacks them
    v3 = store.register_codec(make_codec(tmp_path / "c3", seed=3), suite=suite, metrics={"rel_score": 0.9, "kr_measured": 0.2})
    bare = baseline_of(store.get_version(f"models:/{v3.name}/3"), suite, never, "residualkv")
    assert bare["predictions"] is None
    assert judge_paired(candidate, None, "residualkv", 0.01, side="champion") == (
        [], "no per-sample predictions stored for the champion")


def test_rkv_registry_lists_shows_and_rolls_an_alias_back(store, tmp_path, capsys):
    """A platform team's view: the versions, one version's tags, and a rollback of `champion` to an earlier
    version, refused for a version whose artifacts no longer verify."""
    from residualkv.cli import main

    first = store.register_codec(make_codec(tmp_path / "a", seed=1), metrics={"rel_score": 0.9, "kr_measured": 0.2})
    second = store.register_codec(make_codec(tmp_path / "b", seed=2), metrics={"rel_score": 0.8, "kr_measured": 0.2})
    name = first.name
    assert main(["registry", "alias", name, "champion", second.version]) == 0
    assert "@champion: unset -> v2" in capsys.readouterr().out
    assert main(["registry", "alias", name, "champion", first.version]) == 0  # the rollback
    assert f"{name}@champion: v2 -> v1" in capsys.readouterr().out
    mv = store.get_version(f"models:/{name}@champion")
    assert str(mv.version) == "1" and "rkv.champion_set_by_hand" in mv.tags

    assert main(["registry", "list", name]) == 0
    listing = capsys.readouterr().out
    assert "champion" in listing and "0.9000" in listing and "0.8000" in listing
    assert main(["registry", "list"]) == 0 and f"{name}  (@candidate=v2, @champion=v1)" in capsys.readouterr().out
    assert main(["registry", "show", f"models:/{name}@champion"]) == 0
    import json

    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == "1" and shown["complete"] and "champion" in shown["aliases"]

    # a version whose stored weights were damaged is never pointed at
    weights = Path(store.get_version(f"models:/{name}/2").source.removeprefix("file://")) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    assert main(["registry", "alias", name, "champion", "2"]) == 2
    assert "is corrupted" in capsys.readouterr().err
    assert str(store.get_version(f"models:/{name}@champion").version) == "1"
    assert main(["registry", "list", "no-such-model"]) == 2
