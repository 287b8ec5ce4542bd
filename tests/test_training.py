"""Codec training on a tiny random Llama: the loss, where gradients go, checkpoints, SIGKILL + resume, the CLI."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from residualkv.cache import ResidualKVCache
from residualkv.codec import CodecError, ResidualCodec
from residualkv.config import ResidualKVConfig
from residualkv.training.packing import DataError, LocalSource, insert_recalls, pack_documents
from residualkv.training.trainer import (CodecObjective, CodecTrainer, TrainConfig, TrainError, cpu_has_native_bf16,
                                         enable_mlp_checkpointing, freeze_backbone, heldout_losses, heldout_metrics, linear_warmup_decay, replanned, served_split,
                                         train_codec, trained_reading)

from .conftest import tiny_llama_config
from .test_packing import tiny_tokenizer, write_corpus

REPO = Path(__file__).resolve().parents[1]
SEQ = 64
CACHE_CFG = ResidualKVConfig(full_attention_layers=(0,), n_sink=2, stride=4)


def tiny_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def tiny_codec(model, seed: int = 0) -> ResidualCodec:
    return ResidualCodec.for_model(model.config, CACHE_CFG, d_c=32, d_ff=48, backbone="tiny", seed=seed)


def fast(**kw) -> TrainConfig:
    """A config that trains in a second: higher LR than the seed's, log every step, no held-out eval."""
    return TrainConfig(**({"seq_len": SEQ, "steps": 12, "lr": 3e-3, "log_every": 1, "ckpt_every": 100,
                           "eval_blocks": 0} | kw))


# tiny matrices: a second OpenMP thread only adds synchronisation (and stalls on a busy machine)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return pack_documents(LocalSource(write_corpus(root / "corpus")), tiny_tokenizer(), SEQ, root=root / "packed")


def _losses(result_codec_path):
    meta = json.loads((Path(result_codec_path) / "codec.json").read_text())
    return meta["extra"]["training"]


def _objective_on(model, codec, ids, **config):
    with torch.no_grad():
        return {k: float(v) for k, v in CodecObjective(model, codec, fast(**config))(ids).items()}


def test_loss_decreases_and_codec_is_saved(tmp_path, packed):
    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    probe = torch.tensor(packed.heldout[0:4]["input_ids"])  # the same blocks before and after
    before = _objective_on(model, codec, probe)
    seen = []
    result = train_codec(model, codec, packed.train, tmp_path / "run", fast(steps=30, lr=1e-2, eval_blocks=2),
                         heldout_data=packed.heldout, data_info={"source": "test"},
                         on_metrics=lambda step, m: seen.append((step, m)), progress=False)
    after = _objective_on(model, codec, probe)
    assert after["loss"] < 0.95 * before["loss"] and after["rec"] < 0.95 * before["rec"]
    assert after["ntp"] < before["ntp"] + 0.01  # the NTP term is not traded away

    summary = _losses(result.codec_path)
    assert result.steps == 30 and len(summary["loss_history"]) == 30
    assert {"loss", "rec", "ntp", "lr", "tokens_per_second", "grad_norm"} <= set(seen[0][1])
    assert "eval/ppl_ratio" in seen[-1][1] and result.metrics["eval/blocks"] == 2
    assert summary["tokens"] == 30 * SEQ and summary["loss"] == "rec+ntp" and summary["seq_len"] == SEQ
    saved = ResidualCodec.load(result.codec_path, model_config=model.config)
    assert saved.extra["training"]["steps"] == 30
    assert _objective_on(model, saved, probe)["loss"] == pytest.approx(after["loss"], rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-30"]


def test_gradients_reach_every_codec_layer_and_never_the_backbone(packed):
    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    ids = torch.tensor(packed.train[0:2]["input_ids"])
    for loss in ("ntp", "rec", "rec+ntp", "rec+kd"):  # NTP alone reaches the codec through the frozen backbone
        codec.zero_grad(set_to_none=True)
        CodecObjective(model, codec, fast(loss=loss))(ids)["loss"].backward()
        for name, p in codec.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{loss}: no gradient for codec {name}"
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    assert not model.training


def test_kd_loss_is_the_kl_from_the_full_cache_to_the_compressed_one(packed):
    from residualkv.cache import ResidualKVCache

    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    ids = torch.tensor(packed.train[0:2]["input_ids"])
    with torch.no_grad():
        out = CodecObjective(model, codec, fast(loss="rec+kd", rec_weight=0.5))(ids)
        p = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
        cache = ResidualKVCache.from_model(model, codec, trained_reading(codec))
        q = model(input_ids=ids, cache=cache, use_cache=True).logits[:, :-1].float().log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl > 0 and float(out["kd"]) == pytest.approx(kl, rel=1e-4)
    assert float(out["loss"]) == pytest.approx(0.5 * float(out["rec"]) + kl, rel=1e-4)
    assert float(out["ntp"]) > 0  # the next-token loss is still reported


def test_served_reading_scores_the_rest_of_a_block_through_the_prompts_compressed_history(tmp_path, packed):
    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    ids = torch.tensor(packed.train[0:2]["input_ids"])
    p = served_split(SEQ, torch.Generator().manual_seed(5))
    assert SEQ // 4 <= p < 3 * SEQ // 4
    with torch.no_grad():
        out = CodecObjective(model, codec, fast(reading="served"))(ids, p)
        # by hand, as a server runs it: prefill the prompt (reads itself exact), then score the rest
        cache = ResidualKVCache.from_model(model, codec, codec.config.replace(mode="standalone", new_kv="exact"))
        model(input_ids=ids[:, :p], cache=cache, use_cache=True)
        rest = model(input_ids=ids[:, p:], cache=cache, use_cache=True, labels=ids[:, p:])
        whole = CodecObjective(model, codec, fast())(ids)
    assert float(out["ntp"]) == pytest.approx(float(rest.loss), rel=1e-5)
    assert float(out["ntp"]) != pytest.approx(float(whole["ntp"]), rel=1e-3)  # not the seed's reading
    # the rest's loss alone reaches the encoder too, through the history the prompt wrote
    codec.zero_grad(set_to_none=True)
    CodecObjective(model, codec, fast(reading="served", loss="ntp"))(ids)["loss"].backward()
    for name, prm in codec.named_parameters():
        assert prm.grad is not None and prm.grad.abs().sum() > 0, f"served: no gradient for codec {name}"
    # a codec trained this way is served the way it was trained: prompt prefilled exact
    result = train_codec(model, codec, packed.train, tmp_path / "run", fast(steps=2, reading="served"), progress=False)
    saved = ResidualCodec.load(result.codec_path, model_config=model.config)
    assert saved.config.new_kv == "exact" and saved.extra["training"]["reading"] == "served"
    # held-out metrics read it the same way: the second half of each block through the first half's history
    blocks = torch.tensor(packed.heldout[0:2]["input_ids"])
    m = heldout_metrics(model, saved, blocks)
    h = SEQ // 2
    with torch.no_grad():
        full = sum(float(model(input_ids=b[None], labels=torch.cat([torch.full((1, h + 1), -100), b[None, h + 1:]], 1)).loss)
                   for b in blocks) / 2
        mine = 0.0
        for b in blocks:
            cache = ResidualKVCache.from_model(model, saved)
            model(input_ids=b[None, :h], cache=cache, use_cache=True)
            mine += float(model(input_ids=b[None, h:], cache=cache, use_cache=True, labels=b[None, h:]).loss) / 2
    assert m["eval/scored_from"] == h and m["eval/ntp_full"] == pytest.approx(full, rel=1e-5)
    assert m["eval/ntp_codec"] == pytest.approx(mine, rel=1e-5)
    with pytest.raises(TrainError, match="reading"):
        fast(reading="prefix")


def test_rec_only_ablation_and_rec_reductions(tmp_path, packed):
    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    ids = torch.tensor(packed.train[0:2]["input_ids"])
    with torch.no_grad():
        s = CodecObjective(model, codec, fast(loss="rec"))(ids)
        m = CodecObjective(model, codec, fast(loss="rec", rec_reduction="mean"))(ids)
        lm = CodecObjective(model, codec, fast(loss="rec", rec_reduction="layer-mean"))(ids)
    assert float(s["ntp"]) == 0.0 and float(s["loss"]) == float(s["rec"])
    n_coords = SEQ * len(codec.layer_ids) * codec.dims.d_kv  # per sequence
    assert float(m["rec"]) == pytest.approx(float(s["rec"]) / n_coords, rel=1e-5)
    # the authors' code: each layer's MSE, summed over the layers
    assert float(lm["rec"]) == pytest.approx(float(m["rec"]) * len(codec.layer_ids), rel=1e-5)

    probe = torch.tensor(packed.heldout[0:4]["input_ids"])
    before = _objective_on(model, codec, probe)
    result = train_codec(model, codec, packed.train, tmp_path / "rec", fast(loss="rec", steps=30, lr=1e-2),
                         progress=False)
    assert _objective_on(model, codec, probe)["rec"] < 0.95 * before["rec"]
    summary = _losses(result.codec_path)
    assert summary["loss"] == "rec" and all(row[3] == 0.0 for row in summary["loss_history"])  # ntp column


def test_residual_pairs_take_a_latent_group_size_that_does_not_divide_2dk():
    """The Fisher-PCA init records residual pairs before anything is quantised, so a codec trained in
    groups that divide its d_c but not 2·d_k (80 for SmolLM2's d_c 160 and 2·d_k 384) warm-starts on the
    same pairs as one in groups of 32."""
    from residualkv.training.warmstart import residual_pairs

    codec = tiny_codec(tiny_model())
    g = next(g for g in (24, 40, 48, 56, 80, 88) if codec.dims.d_kv % g)
    kv = torch.randn(2, SEQ, codec.dims.d_kv, generator=torch.Generator().manual_seed(0))
    ref = residual_pairs(kv, codec.config)
    assert all(torch.equal(x, y) for x, y in zip(ref, residual_pairs(kv, codec.config.replace(group_size=g))))


def test_a_codec_carrying_a_serving_window_trains_and_is_scored_without_it(tmp_path, packed):
    """recent_window is a serving setting: a codec whose config holds one (a backbone YAML may set it)
    trains, warm-starts and is scored exactly as without it, and is saved still carrying it."""
    from residualkv.training.warmstart import residual_pairs, warm_start

    model = tiny_model()
    freeze_backbone(model)
    plain, windowed = tiny_codec(model), tiny_codec(model)
    windowed.config = windowed.config.replace(recent_window=16)
    ids = torch.tensor(packed.train[0:2]["input_ids"])
    for reading in ("reconstructed", "served"):
        torch.manual_seed(3)
        a = _objective_on(model, plain, ids, reading=reading)
        torch.manual_seed(3)
        assert _objective_on(model, windowed, ids, reading=reading) == a  # bit-equal: the window is not read
    kv = torch.randn(2, SEQ, plain.dims.d_kv)
    assert all(torch.equal(x, y) for x, y in zip(residual_pairs(kv, plain.config), residual_pairs(kv, windowed.config)))
    blocks = torch.tensor(packed.train[0:2]["input_ids"])
    assert (warm_start(model, plain, blocks, steps=3, progress=False)["warmstart/rec_mse_first"]
            == warm_start(model, windowed, blocks, steps=3, progress=False)["warmstart/rec_mse_first"])
    result = train_codec(model, windowed, packed.train, tmp_path / "run", fast(steps=2, eval_blocks=1),
                         heldout_data=packed.heldout, progress=False)
    assert ResidualCodec.load(result.codec_path, model_config=model.config).config.recent_window == 16


def test_mlp_checkpointing_keeps_the_cache_and_the_gradients(packed):
    ids = torch.tensor(packed.train[0:1]["input_ids"])
    grads = []
    for checkpointing in (False, True):
        model = tiny_model()
        freeze_backbone(model)
        if checkpointing:
            assert enable_mlp_checkpointing(model) == 4
        codec = tiny_codec(model)
        CodecObjective(model, codec, fast())(ids)["loss"].backward()
        grads.append(torch.cat([p.grad.flatten() for p in codec.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_grad_accumulation_and_bf16_autocast(tmp_path, packed):
    model = tiny_model()
    result = train_codec(model, tiny_codec(model), packed.train, tmp_path / "run",
                         fast(steps=3, grad_accum=2, bf16=True, eval_blocks=1), heldout_data=packed.heldout,
                         progress=False)
    assert result.steps == 3 and result.tokens == 3 * 2 * SEQ  # each optimizer step saw two blocks
    assert result.metrics["eval/ppl_ratio"] > 0
    assert next(ResidualCodec.load(result.codec_path).parameters()).dtype == torch.float32  # weights stay fp32


@pytest.mark.parametrize("amx, avx512_bf16, native", [(True, False, True), (False, True, True), (False, False, False)])
def test_bf16_warning_reads_the_cpus_bf16_units(monkeypatch, capsys, tmp_path, packed, amx, avx512_bf16, native):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert cpu_has_native_bf16() is native
    model = tiny_model()
    train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=1, bf16=True), progress=False)
    assert ("emulates bf16" in capsys.readouterr().err) is not native


@pytest.mark.parametrize("native", [True, False])
def test_bf16_auto_trains_in_bf16_only_where_the_cpu_runs_it(monkeypatch, native):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = fast(steps=1, bf16="auto")
    assert config.bf16 is native  # resolved once: the run's record, resume check and precision read a bool
    assert fast(steps=1, bf16=True).bf16 is True and fast(steps=1).bf16 is False  # explicit settings stay
    with pytest.raises(TrainError, match=r"invalid bf16='on'.*\"auto\""):
        fast(steps=1, bf16="on")


def test_time_budget_plans_the_schedule_and_stops_cleanly(tmp_path, packed):
    model = tiny_model()
    t0 = time.monotonic()
    planned = train_codec(model, tiny_codec(model), packed.train, tmp_path / "planned",
                          fast(steps=None, minutes=0.06), progress=False)
    assert planned.total_steps > 3  # planned from the measured step time
    # on a busy machine later steps can be slower than the measured one: then the budget still wins
    assert planned.steps == planned.total_steps or planned.stopped_early
    assert time.monotonic() - t0 < 0.06 * 60 + 3
    assert _losses(planned.codec_path)["total_steps"] == planned.total_steps

    t0 = time.monotonic()
    capped = train_codec(model, tiny_codec(model), packed.train, tmp_path / "capped",
                         fast(steps=100_000, minutes=0.03), progress=False)
    assert time.monotonic() - t0 < 0.03 * 60 + 3
    info = ResidualCodec.load(capped.codec_path).extra["training"]
    assert 0 < capped.steps <= capped.total_steps <= 100_000 == info["planned_steps"]
    # re-planned to end at the cap; a slow machine can reach the cap before the first re-plan (it needs 6
    # steps): then it stopped there
    assert (info["replans"] and capped.total_steps < 100_000) or capped.stopped_early, info
    assert info["stopped_early"] == capped.stopped_early


def test_two_processes_train_as_one_and_agree_on_their_time_budget(tmp_path):
    """`torchrun --nproc_per_node 2` on CPUs: DDP over gloo (the codec's weights stay equal across processes),
    and the decisions a wall clock makes (the planned length, when to stop) are the main process's, even
    when the other measures its steps 5x slower. Taken apart, one process stopped early while the other
    waited in the next gradient all-reduce for ever."""
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from pathlib import Path
        from tests.test_training import tiny_model, tiny_codec, fast
        from tests.test_packing import tiny_tokenizer, write_corpus
        from residualkv.training.packing import LocalSource, pack_documents
        from residualkv.training import trainer as T
        root, rank = Path(sys.argv[1]), int(os.environ["RANK"])
        packed = pack_documents(LocalSource(write_corpus(root / f"corpus{{rank}}")), tiny_tokenizer(), 64,
                                root=root / f"packed{{rank}}")
        if rank == 1:  # this process measures slower steps, and its clock runs out sooner
            calibrate, elapsed = T.CodecTrainer._calibrate, T.CodecTrainer.elapsed
            T.CodecTrainer._calibrate = lambda self: 5 * calibrate(self)
            T.CodecTrainer.elapsed = lambda self: 2 * elapsed(self)
        model = tiny_model()
        codec = tiny_codec(model)
        trainer = T.CodecTrainer(model, codec, packed.train, root / "run", fast(steps=None, minutes=0.05), progress=False)
        result = trainer.train()
        w = float(next(codec.parameters()).detach().double().sum())
        print("RESULT", rank, type(trainer.objective).__name__, result.steps, result.total_steps, repr(w), flush=True)
    """))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
    run = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = sorted(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("RESULT"))
    assert len(results) == 2, run.stdout
    (r0, kind0, *rest0), (r1, kind1, *rest1) = results
    assert kind0 == kind1 == "DistributedDataParallel"
    assert rest0 == rest1, results  # the same steps, the same plan, the same weights
    assert int(rest0[0]) > 0 and (tmp_path / "run" / "codec" / "codec.json").is_file()


def test_a_replanned_schedule_decays_from_where_it_stands_to_the_new_end():
    replans = []
    f = replanned(100, 0.02, replans)
    assert [f(0), f(1), f(51)] == [0.5, 1.0, pytest.approx(0.5)]  # as planned until a re-plan
    replans.append([51, 76])  # read at every call: applies from its step on
    assert f(50) == linear_warmup_decay(100, 0.02)(50) and f(51) == pytest.approx(0.5)
    assert f(76) == 0.0 and f(63.5) == pytest.approx(0.25)
    replans.append([61, 66])  # a second one continues from the first's factor at its step
    assert f(61) == pytest.approx(0.5 * 15 / 25) and f(66) == 0.0 and f(70) == 0.0


def test_a_time_budget_run_replans_when_its_steps_run_slower_than_calibrated(tmp_path, packed, monkeypatch):
    """Calibration times two forward/backward passes; later steps can run slower (a shared machine). The
    run then re-plans to end inside the budget, and its learning rate decays to 0 by the last step,
    instead of the budget stopping it part-way down the schedule."""
    from residualkv.training import trainer as T

    calibrate = T.CodecTrainer._calibrate
    monkeypatch.setattr(T.CodecTrainer, "_calibrate", lambda self: calibrate(self) / 4)  # plans 4x too many
    lrs = []
    model = tiny_model()
    result = train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=None, minutes=0.05),
                         on_metrics=lambda step, m: lrs.append(m.get("lr")), progress=False)
    info = _losses(result.codec_path)
    assert info["replans"] and info["planned_steps"] > info["total_steps"] == result.total_steps, info["replans"]
    # a step far slower than the recent ones can still meet the budget check (a busy machine): it stops then
    if not result.stopped_early:
        assert result.steps == result.total_steps
        assert [x for x in lrs if x is not None][-1] < 0.1 * fast().lr  # the last step's rate: the decay's end


def test_a_steps_run_under_a_budget_shrinks_its_schedule_only_when_the_steps_do_not_fit(tmp_path, packed):
    """--steps with --minutes (the default profile's 179 steps, 58 min): on a machine too slow for the steps
    the schedule shrinks so the learning rate still reaches 0 inside the cap, rather than the cap stopping
    the run part-way down the schedule; where the steps fit, the schedule is the one asked for."""
    model = tiny_model()
    lrs = []
    slow = train_codec(model, tiny_codec(model), packed.train, tmp_path / "slow", fast(steps=100_000, minutes=0.08),
                       on_metrics=lambda step, m: lrs.append(m.get("lr")), progress=False)
    info = _losses(slow.codec_path)
    assert info["planned_steps"] == 100_000 > info["total_steps"] == slow.total_steps, info
    assert info["replans"] and info["replans"][0][0] > CodecTrainer.REPLAN_EVERY, info["replans"]  # a pace needs 5 steps
    if not slow.stopped_early:  # as in the calibrated case, a step far slower than the rest can still meet the cap
        assert slow.steps == slow.total_steps and [x for x in lrs if x is not None][-1] < 0.1 * fast().lr

    fits = train_codec(model, tiny_codec(model), packed.train, tmp_path / "fits", fast(steps=8, minutes=5),
                       progress=False)
    info = _losses(fits.codec_path)
    assert (fits.steps, fits.total_steps, info["planned_steps"], info["replans"]) == (8, 8, 8, [])


def test_lr_schedule_warms_up_then_decays_linearly():
    f = linear_warmup_decay(100, 0.02)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(51) == pytest.approx(0.5) and f(99) == pytest.approx(1 / 98) and f(100) == 0.0


def test_resume_refuses_changed_settings(tmp_path, packed):
    model = tiny_model()
    train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=2), progress=False)
    with pytest.raises(TrainError, match="seed=1 .* used 0"):
        train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=2, seed=1), progress=False)
    with pytest.raises(TrainError, match="--steps 2"):
        train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=5), progress=False)
    with pytest.raises(TrainError, match="--steps N"):
        TrainConfig(steps=None, minutes=None)
    with pytest.raises(TrainError, match="value_weight"):
        TrainConfig(steps=1, value_weight=0)


def test_resume_refuses_another_backbone_or_codec_shape_before_loading_weights(tmp_path, packed):
    """A checkpoint's weights belong to one backbone and one codec: resuming them onto another model of the
    same shape would stamp the codec with the wrong kv_digest (so check_weights would accept it there)."""
    model = tiny_model()
    train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=2), progress=False)
    other = tiny_model()
    with torch.no_grad():
        other.model.layers[1].self_attn.v_proj.weight.mul_(1.5)  # a fine-tune: same shape, other weights
    with pytest.raises(TrainError, match="backbone's weights"):
        train_codec(other, tiny_codec(other), packed.train, tmp_path / "run", fast(steps=2), progress=False)
    two_bit = ResidualCodec.for_model(model.config, CACHE_CFG.replace(bits=2), d_c=32, d_ff=48, backbone="tiny")
    with pytest.raises(TrainError, match=r"cache settings \(bits: bits=4 there, bits=2 here\)"):
        train_codec(model, two_bit, packed.train, tmp_path / "run", fast(steps=2), progress=False)
    wider = ResidualCodec.for_model(model.config, CACHE_CFG, d_c=64, d_ff=48, backbone="tiny")
    with pytest.raises(TrainError, match="codec's dims"):  # not a raw size mismatch from load_state_dict
        train_codec(model, wider, packed.train, tmp_path / "run", fast(steps=2), progress=False)
    with pytest.raises(TrainError, match="bf16=True but the run .* used False"):
        train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=2, bf16=True), progress=False)
    # a checkpoint written before a cache setting existed had its default: it still resumes
    state = tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.json"
    saved = json.loads(state.read_text())
    del saved["codec"]["cache_config"]["stride_alpha"]
    state.write_text(json.dumps(saved))
    assert train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=2),
                       progress=False).resumed_from == 2


def test_served_reading_resumes_bit_for_bit(tmp_path, packed):
    """Each block's split point follows the data position, not torch's global RNG (which a resumed run's
    extra DataLoader iterator draws from): a run resumed from a checkpoint ends bit-equal to one that was not
    interrupted."""
    model = tiny_model()
    config = fast(steps=6, ckpt_every=3, reading="served")
    ref = ResidualCodec.load(train_codec(model, tiny_codec(model), packed.train, tmp_path / "ref", config,
                                         progress=False).codec_path)
    out = tmp_path / "run"
    train_codec(model, tiny_codec(model), packed.train, out, config, progress=False)
    shutil.rmtree(out / "checkpoints" / "step-6")  # as if killed between step 3's checkpoint and the end
    shutil.rmtree(out / "codec")
    done = train_codec(model, tiny_codec(model), packed.train, out, config, progress=False)
    assert done.resumed_from == 3 and done.steps == 6
    for (name, a), b in zip(ResidualCodec.load(done.codec_path).state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_logged_lr_is_the_rate_each_step_used(tmp_path, packed):
    seen = []
    model = tiny_model()
    train_codec(model, tiny_codec(model), packed.train, tmp_path / "run", fast(steps=4, warmup_frac=0.25),
                progress=False, on_metrics=lambda step, m: seen.append((step, m["lr"])))
    f = linear_warmup_decay(4, 0.25)
    assert [lr for _, lr in seen] == pytest.approx([3e-3 * f(i) for i in range(4)])
    assert seen[-1][1] > 0  # no step trains at a rate of 0


def test_codec_refuses_a_model_with_another_config(tmp_path):
    model = tiny_model()
    path = tiny_codec(model).save(tmp_path / "codec")
    other = tiny_model(num_key_value_heads=4)  # same d_kv per head, other KV layout
    with pytest.raises(CodecError, match="num_kv_heads"):
        ResidualCodec.load(path, model_config=other.config)
    with pytest.raises(CodecError, match="does not fit"):
        ResidualKVCache.from_model(tiny_model(rope_theta=5e5), ResidualCodec.load(path), CACHE_CFG)


def test_a_trained_codec_without_a_weight_digest_says_it_cannot_be_checked(tmp_path, recwarn):
    """Codecs trained before the K/V digest was recorded attach unchecked, and say so; an untrained
    codec (no `training` record) has nothing to check and stays quiet."""
    model = tiny_model()
    ResidualKVCache.from_model(model, tiny_codec(model), CACHE_CFG)
    assert not [w for w in recwarn if "digest" in str(w.message)]
    old = tiny_codec(model)
    old.extra = {"training": {"steps": 3}}
    with pytest.warns(UserWarning, match="records no digest of the K/V weights .* retrain it"):
        ResidualKVCache.from_model(model, ResidualCodec.load(old.save(tmp_path / "old")), CACHE_CFG)


# ---------------------------------------------------------------------------------------------
# A run killed with SIGKILL resumes from its last checkpoint, reads the same data, and finishes.

RUNNER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    from tests.test_training import tiny_model, tiny_codec, fast, SEQ
    from tests.test_packing import tiny_tokenizer
    from residualkv.training.packing import LocalSource, pack_documents
    from residualkv.training.trainer import train_codec

    corpus, packed_root, out, delay = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(1)
    packed = pack_documents(LocalSource(corpus), tiny_tokenizer(), SEQ, root=packed_root)
    model = tiny_model()
    # the delay stands in for a long step, so the parent can kill the run mid-way
    result = train_codec(model, tiny_codec(model), packed.train, out, fast(steps=16, ckpt_every=4), progress=False,
                         on_metrics=lambda step, m: time.sleep(delay))
    print("RESULT", result.resumed_from, result.steps, result.codec_path, flush=True)
""")


def test_sigkill_then_resume_finishes_the_run(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(repo=str(REPO)))
    out = tmp_path / "run"
    args = [sys.executable, str(script), str(corpus), str(tmp_path / "packed"), str(out)]
    env = os.environ | {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}

    proc = subprocess.Popen(args + ["0.3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + 120
    while not list(ckpts.glob("step-*/trainer_state.json")):
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(int(p.parent.name.split("-")[1]) for p in ckpts.glob("step-*/trainer_state.json"))
    assert saved and saved[-1] < 16 and not (out / "codec").exists()

    # the rerun (in this process: only the killed run needs its own) continues from the newest checkpoint
    packed = pack_documents(LocalSource(corpus), tiny_tokenizer(), SEQ, root=tmp_path / "packed")
    model = tiny_model()
    done = train_codec(model, tiny_codec(model), packed.train, out, fast(steps=16, ckpt_every=4), progress=False)
    assert done.resumed_from == saved[-1] and done.steps == 16
    codec = ResidualCodec.load(done.codec_path, model_config=model.config)
    assert codec.extra["training"]["steps"] == 16 and codec.extra["training"]["tokens"] == 16 * SEQ

    # same data order and state: the interrupted run ends where an uninterrupted one does
    ref = train_codec(model, tiny_codec(model), packed.train, tmp_path / "ref", fast(steps=16, ckpt_every=4),
                      progress=False)
    ref_codec = ResidualCodec.load(ref.codec_path)
    for (name, a), b in zip(codec.state_dict().items(), ref_codec.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------


def _cli_backbone_and_corpus(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A tiny saved backbone and a corpus for `rkv train`, with the data dir under tmp_path."""
    folder = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path / "rkv-data"))
    return folder, write_corpus(tmp_path / "corpus")


def test_rkv_train_cli_end_to_end(tmp_path, monkeypatch, capsys):
    from residualkv import cli

    folder, corpus = _cli_backbone_and_corpus(tmp_path, monkeypatch)
    argv = ["train", "--backbone", str(folder), "--data", str(corpus), "--seq-len", str(SEQ), "--steps", "3",
            "--d-c", "32", "--d-ff", "48", "--eval-blocks", "1", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)  # stdout holds the result alone; progress goes to stderr
    codec_path = Path(result["codec"])
    assert codec_path.parent.parent == tmp_path / "rkv-data" / "codecs" / "tiny-llama"
    assert result["steps"] == 3 and "eval/ppl_ratio" in result
    assert ResidualCodec.load(codec_path).extra["training"]["data"]["source"] == str(corpus)
    from residualkv.backbones import kv_digest
    from transformers import AutoModelForCausalLM

    assert ResidualCodec.load(codec_path).kv_digest == kv_digest(AutoModelForCausalLM.from_pretrained(folder))
    assert len((codec_path.parent / "metrics.jsonl").read_text().splitlines()) >= 2
    # the same command again finds the finished run instead of starting over
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resumed_from"] == 3
    # --restart starts over: no metrics row nor codec of the discarded run outlives it
    shutil.rmtree(codec_path.parent / "checkpoints")  # (only so the check below sees what --restart removes)
    (codec_path.parent / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    assert cli.main(argv[:-3] + ["--steps", "2", "--eval-blocks", "0", "--restart", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert Path(result["codec"]) == codec_path and result["resumed_from"] is None and result["steps"] == 2
    steps = [json.loads(line)["step"] for line in (codec_path.parent / "metrics.jsonl").read_text().splitlines()]
    assert 99 not in steps and steps[-1] == 2 and ResidualCodec.load(codec_path).extra["training"]["steps"] == 2


def test_rkv_train_init_from_goes_on_from_a_saved_codec(tmp_path, monkeypatch, capsys):
    from residualkv import cli

    folder, corpus = _cli_backbone_and_corpus(tmp_path, monkeypatch)
    common = ["train", "--backbone", str(folder), "--data", str(corpus), "--seq-len", str(SEQ), "--eval-blocks", "0",
              "--json"]
    assert cli.main(common + ["--steps", "3", "--d-c", "32", "--d-ff", "48", "--stride", "5", "--lr", "1e-2",
                              "--layer-d-c", "1-2=64", "--group-size", "16"]) == 0
    start = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["codec"])
    assert "-stride5-groupsize16-l1_2_64-" in start.parent.name  # another shape, another run
    # a step at a vanishing LR: the result is the codec it started from (shape, stride and weights)
    assert cli.main(common + ["--steps", "1", "--lr", "1e-12", "--init-from", str(start), "--recall-spans", "2",
                              "--recall-span-len", "8"]) == 0
    out = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["codec"])
    assert f"-recall2x8-from-{start.parent.name[:40]}" in out.parent.name  # its own run, never the start's
    # named by the start's weights too: models:/NAME@champion moved to other weights starts another run
    assert f"-{ResidualCodec.load(start).weights_digest()[:8]}" in out.parent.name
    a, b = ResidualCodec.load(start), ResidualCodec.load(out)
    assert (b.dims.d_c, b.dims.d_ff, b.config.stride, b.layer_d_c) == (32, 48, 5, {1: 64, 2: 64})
    assert a.config.group_size == b.config.group_size == 16  # trained in groups of 16, served so
    assert cli.main(common + ["--steps", "1", "--lr", "1e-12", "--init-from", str(start), "--group-size", "32"]) == 0
    regrouped = ResidualCodec.load(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["codec"])
    assert regrouped.config.group_size == 32 and regrouped.config.stride == 5  # goes on in groups of 32
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)
    training = b.extra["training"]
    assert training["init"] == "codec" and training["init_from"] == str(start) and training["recall_spans"] == 2
    assert cli.main(common + ["--steps", "1", "--init-from", str(start), "--d-c", "16"]) == 2
    assert re.search("--d-c 16 but the codec .* has d_c 32", capsys.readouterr().err)
    assert cli.main(common + ["--steps", "1", "--init-from", str(start), "--init", "fisher-pca"]) == 2
    assert re.search("--init fisher-pca and --init-from", capsys.readouterr().err)
    assert cli.main(common + ["--steps", "1", "--init-from", str(start), "--layer-d-c", "1=32"]) == 2
    assert re.search("--layer-d-c: the codec in .* keeps its latent sizes", capsys.readouterr().err)
    assert cli.main(common + ["--steps", "1", "--d-c", "32", "--d-ff", "48", "--group-size", "24"]) == 2
    assert re.search(r"--group-size 24 does not divide the latent size d_c \[32\]", capsys.readouterr().err)
    assert cli.main(common + ["--steps", "1", "--d-c", "32", "--d-ff", "48", "--layer-d-c", "7=64"]) == 2
    assert re.search("layer 7 has no codec", capsys.readouterr().err)


def test_recall_spans_copy_earlier_text_and_mark_what_needs_it():
    ids = torch.arange(200).reshape(2, 100)  # every token distinct, so a copy shows where it came from
    out, mask = insert_recalls(ids, 3, 10, torch.Generator().manual_seed(0))
    assert torch.equal(out[:, :50], ids[:, :50])  # sources stay as they were
    for b in range(2):
        starts = [d for d in range(50, 100, 10) if not torch.equal(out[b, d:d + 10], ids[b, d:d + 10])]
        assert len(starts) == 3 and mask[b].sum() == 3 * 9
        for d in starts:
            src = int(out[b, d]) - 100 * b
            assert 0 <= src <= 40 and torch.equal(out[b, d:d + 10], ids[b, src:src + 10])
            assert not mask[b, d] and mask[b, d + 1:d + 10].all()  # the first copied token is not predictable
    again, _ = insert_recalls(ids, 3, 10, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    with pytest.raises(DataError, match="6 recall spans of 10 tokens do not fit"):
        insert_recalls(ids, 6, 10, torch.Generator())
    with pytest.raises(TrainError, match="recall_spans=5.*0 to 4 spans"):
        TrainConfig(steps=1, seq_len=64, recall_spans=5, recall_span_len=8)


def test_recall_training_is_reproducible_and_differs_from_plain_text(tmp_path, packed):
    model = tiny_model()
    runs = {}
    for name, spans in (("a", 2), ("b", 2), ("plain", 0)):
        result = train_codec(model, tiny_codec(model), packed.train, tmp_path / name,
                             fast(steps=3, recall_spans=spans, recall_span_len=8), progress=False)
        runs[name] = ResidualCodec.load(result.codec_path).state_dict()
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["plain"][k]) for k in runs["a"])


def test_heldout_metrics_score_text_and_the_recall_probe(packed):
    model = tiny_model()
    codec = tiny_codec(model)
    blocks = torch.randint(0, model.config.vocab_size, (2, 192), generator=torch.Generator().manual_seed(0))
    m = heldout_metrics(model, codec, blocks)
    assert m["eval/blocks"] == 2
    assert m["eval/ppl_ratio"] == pytest.approx(math.exp(m["eval/ntp_codec"] - m["eval/ntp_full"]))
    assert m["eval/recall_ppl_ratio"] == pytest.approx(math.exp(m["eval/recall_nll_codec"] - m["eval/recall_nll_full"]))
    assert m["eval/kl"] > 0  # an untrained codec changes what the model says
    # the full cache's losses computed once and handed in give the same metrics (the probe is deterministic)
    full = heldout_losses(model, blocks)
    assert heldout_metrics(model, codec, blocks, full=full) == m
    with pytest.raises(ValueError, match="1 blocks given for 2"):
        heldout_metrics(model, codec, blocks, full=heldout_losses(model, blocks[:1]))
    # without a probe that fits, only the text metrics
    assert "eval/recall_nll_full" not in heldout_metrics(model, codec, blocks[:, :100])


def test_rec_warmstart_fits_captured_kv_before_joint_training(tmp_path, packed):
    from residualkv.training.warmstart import capture_kv, warm_start

    model = tiny_model()
    freeze_backbone(model)
    codec = tiny_codec(model)
    blocks = torch.tensor(packed.train[0:4]["input_ids"])
    kv = capture_kv(model, blocks, codec.layer_ids)
    assert all(v.shape == (4, SEQ, codec.dims.d_kv) for v in kv.values())
    stats = warm_start(model, codec, blocks, steps=60, lr=1e-2, progress=False)
    assert stats["warmstart/rec_mse_last"] < 0.8 * stats["warmstart/rec_mse_first"]
    # wired into the trainer: a fresh run warm-starts, then trains jointly
    result = train_codec(model, tiny_codec(model), packed.train, tmp_path / "run",
                         fast(steps=2, init="rec-warmstart", warmstart_steps=5, warmstart_blocks=2), progress=False)
    assert result.steps == 2


def test_capture_fisher_is_the_gradient_wrt_pre_rope_kv(packed):
    """Llama's k_proj/v_proj outputs are the pre-RoPE K/V: the captured Fisher must be built from their gradients."""
    from residualkv.training.warmstart import capture

    model = tiny_model()
    freeze_backbone(model)
    layers = [1, 3]
    ids = torch.tensor(packed.train[0:1]["input_ids"])
    kv, fim = capture(model, ids, layers, fisher=True)
    got: dict = {}

    def hook(key):
        def fn(mod, inp, out):
            out = out.detach().requires_grad_()
            got[key] = out
            return out
        return fn

    handles = [getattr(model.model.layers[i].self_attn, p).register_forward_hook(hook((i, p)))
               for i in layers for p in ("k_proj", "v_proj")]
    try:
        loss = model(input_ids=ids, labels=ids).loss
        grads = torch.autograd.grad(loss, [got[(i, p)] for i in layers for p in ("k_proj", "v_proj")])
    finally:
        for h in handles:
            h.remove()
    for j, i in enumerate(layers):
        true_kv = torch.cat([got[(i, "k_proj")], got[(i, "v_proj")]], -1).detach()
        torch.testing.assert_close(kv[i], true_kv, atol=1e-5, rtol=1e-4)
        g = torch.cat([grads[2 * j], grads[2 * j + 1]], -1)[0].double()
        torch.testing.assert_close(fim[i], g.T @ g, atol=1e-12, rtol=1e-4)


def test_weighted_pca_is_optimal_and_reduces_to_pca():
    from residualkv.training.warmstart import weighted_pca

    torch.manual_seed(0)
    r = torch.randn(4000, 12) * torch.linspace(3, 0.1, 12)  # energy concentrated in the first coordinates
    enc, dec, kept = weighted_pca(r, torch.eye(12), d_c=4, alpha=1.0)
    err = (r - (r @ enc) @ dec.T).pow(2).sum(1).mean()
    ev = torch.linalg.eigvalsh((r.T @ r / r.shape[0]).double()).flip(0)
    assert err.item() == pytest.approx(ev[4:].sum().item(), rel=1e-3)  # Eckart–Young: the discarded energy
    assert kept == pytest.approx((ev[:4].sum() / ev.sum()).item(), rel=1e-6)
    # a metric that only values the last coordinate makes the code keep it, whatever its energy
    fisher = torch.diag(torch.tensor([0.0] * 11 + [1.0]))
    enc, dec, _ = weighted_pca(r, fisher, d_c=1, alpha=0.0)
    rec = (r @ enc) @ dec.T
    assert (rec[:, -1] - r[:, -1]).abs().max() < 1e-3


def test_weighted_pca_value_weight_moves_the_code_to_the_values():
    from residualkv.training.warmstart import weighted_pca

    torch.manual_seed(0)
    r = torch.randn(4000, 12)  # keys = the first 6 coordinates, values = the last 6, equal energy
    errors = {}
    for w in (1.0, 9.0):
        enc, dec, _ = weighted_pca(r, torch.eye(12), d_c=6, alpha=1.0, value_weight=w)
        e = r - (r @ enc) @ dec.T
        errors[w] = (e[:, :6].pow(2).mean().item(), e[:, 6:].pow(2).mean().item())
    # weighted 9:1, the 6 dimensions go to the values: almost no value error, the keys' energy lost instead
    assert errors[9.0][1] < 0.05 * errors[1.0][1] + 1e-3
    assert errors[9.0][0] > errors[1.0][0]


def test_fisher_pca_init_fits_the_encoder_and_beats_the_random_codec(tmp_path, packed):
    from residualkv.schedule import ReferenceSchedule
    from residualkv.training.warmstart import capture_kv, fisher_pca_init
    from residualkv.stores import ResidualStore

    model = tiny_model()
    freeze_backbone(model)
    blocks = torch.tensor(packed.train[0:4]["input_ids"])
    held_out = capture_kv(model, torch.tensor(packed.train[4:6]["input_ids"]), [1, 2, 3])

    def rec_mse(codec):  # through the cache's write path, on sequences the init never saw
        cfg = codec.config
        with torch.no_grad():
            return sum((ResidualStore(codec.layer(i), cfg, ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha))
                        .write(held_out[i]) - held_out[i]).pow(2).mean().item() for i in codec.layer_ids)

    codec = tiny_codec(model)
    before = rec_mse(codec)
    stats = fisher_pca_init(model, codec, blocks, steps=150, progress=False)
    assert 0 < stats["warmstart/fisher_energy_kept"] <= 1
    # random weights give zero-centred K/V, which a bias-free SwiGLU fits poorly (real models: ~1%, module docstring)
    assert stats["warmstart/encoder_fit_rel_err"] < 0.9
    assert rec_mse(codec) < 0.8 * before
    # wired into the trainer
    result = train_codec(model, tiny_codec(model), packed.train, tmp_path / "run",
                         fast(steps=1, init="fisher-pca", warmstart_steps=20, warmstart_blocks=2), progress=False)
    assert result.steps == 1


def test_swiglu_encoder_fits_a_linear_code_on_offset_data():
    """Real K/V sit away from the origin (large per-channel offsets): there f_c(x) - f_c(m) is close to its
    Jacobian times x - m, so the bias-free SwiGLU can be regressed onto the closed-form linear code."""
    from residualkv.config import CodecDims
    from residualkv.codec import LayerCodec
    from residualkv.training.warmstart import fit_encoder

    g = torch.Generator().manual_seed(0)
    mu = torch.randn(32, generator=g) * 4
    x = mu + torch.randn(6000, 32, generator=g)
    m = mu + torch.randn(6000, 32, generator=g)
    enc = torch.randn(32, 8, generator=g) / 32 ** 0.5
    torch.manual_seed(0)
    layer = LayerCodec(CodecDims(d_kv=32, d_c=8, d_ff=96))
    err = fit_encoder(layer, x, m, (x - m) @ enc, steps=300, batch=512, lr=3e-3, generator=g)
    assert err < 0.05
