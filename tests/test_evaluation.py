"""The evaluation harness (issue #3 item 3): synthetic tasks, scoring, loaders, SnapKV, output contract.

Unit tests use the tiny random Llama from conftest with the real SmolLM2 tokenizer (loaded alone, cheap);
one integration test runs the real SmolLM2 at 512 tokens (full vs kivi4) through `rkv eval`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

from residualkv.config import InputError
from residualkv.evaluation import Sample, encode_prompt, evaluate, load_jsonl, score
from residualkv.evaluation.harness import build_method_cache, greedy, measure, summarize
from residualkv.evaluation.hub import load_benchmark, parse_suite, rows_to_samples
from residualkv.evaluation.report import CONTRACT, write_outputs
from residualkv.evaluation.samples import generation_budget, prompt_text, write_jsonl
from residualkv.evaluation.synthetic import TASKS, LengthError, SyntheticGenerator, TaskConfig, insert_at_depths
from residualkv.snapkv import SnapKVCache, snapkv_report

from .conftest import tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "data" / "backbones" / "smollm2-135m"


@pytest.fixture(scope="module")
def tok():
    if not (SMOL / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 is not cached: run `python -m residualkv.backbones fetch smollm2-135m`")
    return AutoTokenizer.from_pretrained(SMOL)


@pytest.fixture(scope="module")
def tiny_lm(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=len(tok), max_position_embeddings=2048, num_hidden_layers=2)).eval()


# ---------------------------------------------------------------------------------------------
# synthetic tasks

SMALL = {  # the registered tasks at sizes that fit a 384-token prompt
    "cwe": TaskConfig("cwe", "cwe", {"n_common": 3, "freq_common": 6, "freq_rare": 2}, 16),
    "cwe_ruler": TaskConfig("cwe_ruler", "cwe", {"n_common": 4, "freq_common": 5, "freq_rare": 3}, 16),
    "fwe": TaskConfig("fwe", "fwe", {"alpha": 2.0, "word_len": 5, "vocab": 12}, 16),
}


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [384, 700])
def test_synthetic_hits_exact_length_and_holds_its_answers(tok, task, length):
    gen = SyntheticGenerator(tok, seed=3)
    cfg = SMALL.get(task, TASKS[task])
    s = gen.sample(cfg, length, 0)
    assert len(encode_prompt(tok, s)) == length
    for a in s.answers:
        assert a in s.context, (task, a)
    assert s.answer_prefix and s.metric == "all"


def test_synthetic_is_deterministic_and_seeded(tok):
    a = SyntheticGenerator(tok, seed=1).sample("niah_multikey", 400, 2)
    b = SyntheticGenerator(tok, seed=1).sample("niah_multikey", 400, 2)
    c = SyntheticGenerator(tok, seed=2).sample("niah_multikey", 400, 2)
    assert a.context == b.context and a.answers == b.answers
    assert a.answers != c.answers
    # whatever the generator made before: a longer sample first (a bigger filler stream) changes nothing
    g = SyntheticGenerator(tok, seed=1)
    g.sample("niah_single", 7000, 0)
    assert g.sample("niah_multikey", 400, 2).context == a.context


def test_synthetic_answers_are_well_formed(tok):
    gen = SyntheticGenerator(tok, seed=0)
    mv = gen.sample("niah_multivalue", 500, 0)
    assert len(mv.answers) == 4 and all(len(a) == 7 and a.isdigit() for a in mv.answers)
    mq = gen.sample("niah_multiquery", 500, 0)
    assert len(mq.answers) == 4 and mq.context.count("One of the special magic numbers") == 4
    vt = gen.sample("vt", 500, 0)
    assert len(vt.answers) == 5 and all(f"VAR {v} =" in vt.context for v in vt.answers)
    kv = gen.sample("kv_retrieval", 500, 0)
    assert kv.answers[0] in kv.context and kv.answers[0] not in kv.question
    fwe = gen.sample(SMALL["fwe"], 500, 0)
    counts = [fwe.context.split().count(w) for w in fwe.answers]
    assert counts == sorted(counts, reverse=True) and counts[2] > 0


def test_synthetic_refuses_a_context_too_short(tok):
    with pytest.raises(LengthError, match=r"cwe: 1 item\(s\) already exceed context_len=200 \(\d+ tokens\); use a "
                                          "longer --context-len, or leave cwe out with --synthetic-tasks"):
        SyntheticGenerator(tok).sample("cwe", 200, 0)


def test_rkv_eval_says_a_task_is_too_long_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """The synthetic samples need only the tokenizer: `rkv eval` makes them before the model loads, so a task
    too long for --context-len fails in seconds (it used to load the model first)."""
    import residualkv.backbones as backbones
    from residualkv.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the samples were made")

    monkeypatch.setattr(backbones, "load_backbone", no_model)
    code = main(["eval", "--backbone", "smollm2-135m", "--suite", "synthetic", "--synthetic-tasks", "cwe",
                 "--context-len", "200", "--methods", "full", "--json", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert code == 2 and "cwe: 1 item(s) already exceed context_len=200" in err and "Traceback" not in err, err


def test_needles_land_between_sentences():
    text = insert_at_depths("A b. C d. E f. G h.", ["N1.", "N2."], [0.0, 1.0])
    assert text == "N1. A b. C d. E f. G h. N2."


# ---------------------------------------------------------------------------------------------
# scoring, JSONL, prompts

def test_string_match_scoring():
    assert score("The numbers are 123 and 456.", ["123", "456"], "all") == 1.0
    assert score("the numbers are 123", ["123", "456"], "all") == 0.5
    assert score("ABC", ["abc"], "all") == 1.0  # case-insensitive, like RULER
    assert score("only 456", ["123", "456"], "any") == 1.0
    assert score("nothing", ["123", "456"], "any") == 0.0
    assert score("in New\nYork, twice", ["new york"]) == 1.0 and score("Paris.", [" Paris\n"]) == 1.0  # whitespace
    with pytest.raises(ValueError, match="empty answer"):  # it would be a substring of every prediction
        Sample(id="e", task="t", context="c", question="q", answers=["x", " "])


def test_jsonl_loader_defaults_and_max_new_tokens(tmp_path, tok):
    path = write_jsonl([
        {"id": "a", "context": "ctx", "question": "q?", "answers": ["x"]},
        {"id": "b", "context": "ctx", "question": "q?", "answers": "y", "max_new_tokens": 70, "metric": "any"},
        {"id": "c", "context": "ctx", "question": "q?", "answers": ["word " * 40]},
    ], tmp_path / "t.jsonl")
    a, b, c = load_jsonl(path)
    assert a.task == "t" and a.max_new_tokens == 32 and a.metric == "all"
    assert b.answers == ["y"] and b.metric == "any"
    assert generation_budget(tok, a) == 32
    assert generation_budget(tok, b) == 70  # a row's own budget is respected ...
    assert generation_budget(tok, b, floor=16) == 70  # ... and never lowered
    assert generation_budget(tok, c) >= 40  # the default grows to fit a long answer


def test_jsonl_loader_rejects_bad_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "c", "question": "q"}\n')
    with pytest.raises(ValueError, match="answers"):
        load_jsonl(bad)


def test_generation_respects_max_new_tokens(tiny_lm, tok):
    s = Sample(id="x", task="t", context="hello " * 20, question="q?", answers=["zzz"], max_new_tokens=40)
    g = greedy(tiny_lm, tok, DynamicCache(config=tiny_lm.config), encode_prompt(tok, s), 40, stop_ids=set())
    assert len(g.token_ids) == 40


def test_chat_template_is_applied(tok):
    s = Sample(id="x", task="t", context="CTX", question="QQ", answers=["a"], answer_prefix="Answer:")
    text = prompt_text(tok, s)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\nAnswer:")
    assert "CTX\n\nQQ" in text


# ---------------------------------------------------------------------------------------------
# hub loaders on local fixtures in each benchmark's layout

def test_longbench_layout_from_local_jsonl_and_parquet(tmp_path):
    rows = [{"input": "Who?", "context": "Alice met Bob.", "answers": ["Alice", "alice"], "length": 3,
             "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "id0"},
            {"input": "Where?", "context": "In Paris.", "answers": ["Paris"], "length": 2,
             "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "id1"}]
    jl = write_jsonl(rows, tmp_path / "lb.jsonl")
    samples = load_benchmark("longbench", "hotpotqa", data_files=jl)
    assert [s.id for s in samples] == ["id0", "id1"]
    s = samples[0]
    assert s.task == "longbench/hotpotqa" and s.context == "Alice met Bob." and s.question == "Question: Who?"
    assert s.answers == ["Alice", "alice"] and s.metric == "any" and s.max_new_tokens == 32
    import pandas as pd

    pq = tmp_path / "lb.parquet"
    pd.DataFrame(rows).to_parquet(pq)
    assert [x.to_dict() for x in load_benchmark("longbench", "hotpotqa", data_files=pq)] == [x.to_dict() for x in samples]


def test_ruler_scbench_longbench_v2_layouts():
    r = rows_to_samples([{"context": "c", "question": "q", "answer_prefix": "A:", "answer": ["1", "2"],
                          "task": "niah_multivalue", "max_new_tokens": 128}], "ruler")[0]
    assert r.answers == ["1", "2"] and r.max_new_tokens == 128 and r.answer_prefix == "A:" and r.task == "ruler/niah_multivalue"
    assert r.max_new_tokens_given
    # rows without a budget of their own: the harness fits the budget to the answers (a UUID is ~37 tokens)
    bare = rows_to_samples([{"context": "c", "question": "q", "answer": ["x"]}], "ruler")[0]
    assert not bare.max_new_tokens_given
    sc = rows_to_samples([{"id": 7, "context": "ctx", "multi_turns": [{"input": "q1", "answer": "a1"},
                                                                      {"input": "q2", "answer": "a2"}]}], "scbench", "scbench_kv")
    assert [(s.id, s.question, s.answers) for s in sc] == [("7-0", "q1", ["a1"]), ("7-1", "q2", ["a2"])]
    assert not any(s.max_new_tokens_given for s in sc)
    v2 = rows_to_samples([{"_id": "z", "question": "Q", "choice_A": "a", "choice_B": "b", "choice_C": "c",
                           "choice_D": "d", "answer": "C", "context": "ctx", "domain": "Code"}], "longbench-v2")[0]
    assert v2.answers == ["(C)"] and "(D) d" in v2.question
    assert parse_suite("longbench:qasper@me/mirror") == ("longbench", "qasper", "me/mirror")
    assert parse_suite("synthetic") is None
    with pytest.raises(ValueError, match="layout"):
        rows_to_samples([{"context": "x"}], "longbench")


# ---------------------------------------------------------------------------------------------
# SnapKV

def _snap_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def test_snapkv_keeps_budget_plus_window_and_the_window():
    model = _snap_model()
    ids = torch.randint(0, 128, (1, 150))
    cache = SnapKVCache.from_model(model, window=16, budget=20)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        ref = model(input_ids=ids, cache=full).logits
        out = model(input_ids=ids, cache=cache).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the prefill's own attention is unchanged
    for layer, whole in zip(cache.layers, full.layers):
        assert layer.keys.shape[-2] == 20 + 16
        # which prompt token each kept key is (the cache keeps no indices): its exact match among the prompt's
        same = (layer.keys[0, :, :, None, :] == whole.keys[0, :, None, :, :]).all(-1)  # [H, kept, 150]
        assert (same.sum(-1) == 1).all()
        idx = same.float().argmax(-1)
        assert torch.equal(idx[:, -16:], torch.arange(134, 150).expand(idx.shape[0], 16))
        assert (idx[:, :20] < 134).all() and (idx.diff(dim=-1) > 0).all()
        assert torch.equal(layer.values[0], whole.values[0].gather(1, idx[..., None].expand(-1, -1, whole.values.shape[-1])))
    assert cache.get_seq_length() == 150
    rep = snapkv_report(cache)
    assert rep["kr_measured"] == pytest.approx(36 / 150)
    # ratio budget: round(0.2 * 150) = 30 prompt tokens kept in total, window included
    c2 = SnapKVCache.from_model(model, window=16, ratio=0.2)
    with torch.no_grad():
        model(input_ids=ids, cache=c2)
    assert all(layer.keys.shape[-2] == 30 for layer in c2.layers)


def test_snapkv_decoding_after_eviction_is_causal_and_positioned():
    model = _snap_model()
    ids = torch.randint(0, 128, (1, 120))
    nxt = torch.randint(0, 128, (1, 3))
    a, b = (SnapKVCache.from_model(model, window=8, budget=10) for _ in range(2))
    with torch.no_grad():
        model(input_ids=ids, cache=a)
        model(input_ids=ids, cache=b)
        together = model(input_ids=nxt, cache=a).logits
        one_by_one = torch.cat([model(input_ids=nxt[:, i:i + 1], cache=b).logits for i in range(3)], dim=1)
    torch.testing.assert_close(together, one_by_one, rtol=1e-4, atol=1e-4)
    assert a.get_seq_length() == 123 and a.layers[0].keys.shape[-2] == 18 + 3
    # nothing evicted when the budget covers the prompt: identical to the full cache
    c, d = SnapKVCache.from_model(model, window=8, budget=500), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=c), model(input_ids=ids, cache=d)
        torch.testing.assert_close(model(input_ids=nxt, cache=c).logits, model(input_ids=nxt, cache=d).logits)


@pytest.mark.parametrize("budget", [16, 70])
def test_snapkv_left_padded_batch_equals_rows_alone(budget):
    """Padding never wins a vote, each row is pooled over its own tokens, and a row shorter than the kept
    count keeps all its tokens with its padding still masked: every row of a left-padded batch generates
    what it generates alone, and KR/CR count real tokens only."""
    model = _snap_model()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(1, 128, (1, 90), generator=g), torch.randint(1, 128, (1, 61), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 29, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 90), torch.cat([torch.zeros(1, 29), torch.ones(1, 61)], 1)]).long()

    def run(ids, m):
        cache = SnapKVCache.from_model(model, window=8, budget=budget)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=m, cache=cache, max_new_tokens=6, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return out, cache

    both, cache = run(batch, mask)
    for row, ids in enumerate((a, b)):
        alone, _ = run(ids, torch.ones_like(ids))
        assert both.sequences[row, 90:].tolist() == alone.sequences[0, ids.shape[1]:].tolist()
        for x, y in zip(both.logits, alone.logits):
            torch.testing.assert_close(x[row], y[0], rtol=1e-4, atol=1e-4)
    layer = cache.layers[0]
    kept = budget + 8
    assert layer.pads == [0, 29] and layer.pads_kept == [0, max(0, kept - 61)]
    rep = snapkv_report(cache)
    real = 90 + 61 + 2 * 5  # the prompts' real tokens and the five decoded tokens each row stores
    assert rep["kr_measured"] == pytest.approx((2 * kept + 2 * 5) / real)  # slots held (padding too) / real tokens
    assert rep["unexplained"] == pytest.approx(0.0, abs=1e-12)
    # five decode steps, each reading the kept tokens (and earlier decoded ones) of 90 + 61 real + decoded
    read = sum(kept + min(kept, 61) + 2 * i for i in range(5))
    assert rep["cr"] == pytest.approx(read / sum(90 + 61 + 2 * i for i in range(5)))


def test_snapkv_with_generate():
    model = _snap_model()
    ids = torch.randint(0, 128, (1, 90))
    out = model.generate(ids, cache=SnapKVCache.from_model(model, ratio=0.3), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 94


# ---------------------------------------------------------------------------------------------
# harness, rows, files

def test_summarize_rel_score_definition():
    def rec(m, t, s):
        return {"method": m, "context_len": 10, "task": t, "score": s, "kr_measured": 1.0, "kr_formula": 1.0, "cr": 1.0,
                "wall_s": 1.0, "prompt_tokens": 10, "prefill_s": 1.0, "decode_s": 1.0, "decode_steps": 2, "new_tokens": 3}
    records = [rec("full", "a", 0.8), rec("full", "b", 0.0), rec("x", "a", 0.4), rec("x", "b", 1.0)]
    rows = {r["method"]: r for r in summarize(records, {}, ["full", "x"], [10])}
    assert rows["full"]["rel_score"] == 1.0
    assert rows["x"]["rel_score"] == pytest.approx(0.5)  # task b has no signal in the full cache: left out
    assert rows["x"]["rel_tasks"] == {"a": pytest.approx(0.5), "b": None}
    assert rows["x"]["tasks_without_signal"] == ["b"]
    assert rows["x"]["score"] == pytest.approx(0.7)
    silent = {r["method"]: r for r in summarize([rec("full", "a", 0.0), rec("x", "a", 0.0)], {}, ["full", "x"], [10])}
    assert silent["full"]["rel_score"] is None and silent["x"]["rel_score"] is None
    # CR is what decode steps read: a sample whose first token ended it (no step, CR 1.0 by default) is left out
    sparse = [rec("full", "a", 1.0), dict(rec("x", "a", 1.0), cr=0.3), dict(rec("x", "b", 1.0), cr=1.0, decode_steps=0)]
    assert {r["method"]: r for r in summarize(sparse, {}, ["full", "x"], [10])}["x"]["cr"] == pytest.approx(0.3)


def _sample_rec(m, sample, task, answer, score, seed, pred=None):
    return {"method": m, "context_len": 10, "id": sample, "task": task, "answers": [answer], "score": score,
            "prediction": pred or f"{m} {score}", "seed": seed, "kr_measured": 1.0 if m == "full" else 0.2,
            "kr_formula": None, "cr": 1.0, "wall_s": 1.0, "prompt_tokens": 10, "prefill_s": 1.0, "decode_s": 1.0,
            "decode_steps": 2, "new_tokens": 3}


def test_bootstrap_interval_and_paired_comparison_by_hand():
    from residualkv.evaluation.harness import sample_key
    from residualkv.evaluation.stats import compare, rel_score_interval

    # one task, two samples: full [1, 1], a [1, 1], b [1, 0] -> rel 1.0 and 0.5; a resample holds b's
    # second sample twice (1/4), once (1/2) or not at all (1/4), so a is ahead in 3/4 + 1/2 * 1/4 = 0.875
    recs = [_sample_rec(m, f"t-{i}", "t", str(i), s, 0) for m, scores in
            (("full", (1.0, 1.0)), ("a", (1.0, 1.0)), ("b", (1.0, 0.0))) for i, s in enumerate(scores)]
    assert rel_score_interval(recs, "a", "full", sample_key) == [1.0, 1.0]  # same answers as full: no spread
    lo, hi = rel_score_interval(recs, "b", "full", sample_key)
    assert lo == 0.0 and hi == 1.0
    c = compare(recs, "a", "b", "full", sample_key)
    assert c["n_samples"] == 2 and c["difference"] == pytest.approx(0.5) and c["ci"] == [0.0, 1.0]
    assert c["p_a_ahead"] == pytest.approx(0.875, abs=0.03)
    assert compare(recs, "a", "b", "full", sample_key) == c  # fixed draws: the same answer every run
    rows = {r["method"]: r for r in summarize(recs, {}, ["full", "a", "b"], [10])}
    assert rows["full"]["rel_score_ci"] is None and rows["b"]["rel_score_ci"] == [0.0, 1.0]
    silent = [_sample_rec(m, f"t-{i}", "t", str(i), 0.0, 0) for m in ("full", "a", "b") for i in range(2)]
    assert rel_score_interval(silent, "a", "full", sample_key) is None
    assert compare(silent, "a", "b", "full", sample_key)["difference"] is None
    single = [r for r in recs if r["id"] == "t-1"]  # one sample per task: resampling cannot vary it
    assert rel_score_interval(single, "b", "full", sample_key) is None

    # the statistic is recomputed on each draw: task u counts only on draws where the full cache scores there.
    # full: t [1, 1], u [1, 0]; m: t [0, 0], u [0, 1]. Observed rel = (0 + 0.5) / (1 + 0.5) = 1/3. A draw of
    # u's second sample alone leaves u without signal: rel = 0, never the 1/1 a fixed task set would give
    drawn = [_sample_rec(m, f"{t}-{i}", t, str(i), s, 0) for m, per in
             (("full", {"t": (1.0, 1.0), "u": (1.0, 0.0)}), ("m", {"t": (0.0, 0.0), "u": (0.0, 1.0)}))
             for t, scores in per.items() for i, s in enumerate(scores)]
    row = {r["method"]: r for r in summarize(drawn, {}, ["full", "m"], [10])}["m"]
    assert row["rel_score"] == pytest.approx(1 / 3)
    lo, hi = rel_score_interval(drawn, "m", "full", sample_key)
    # u's draws: its first sample twice -> 0 / 2; its second twice -> no signal on u, 0 / 1; one of each -> 1/3
    assert lo == 0.0 and hi == pytest.approx(1 / 3)


def test_rkv_pool_compares_two_codecs_run_under_one_method_name(tmp_path, capsys):
    from residualkv.cli import main

    # two codecs, each evaluated as residualkv-standalone; the older file predates the seed field
    old = [_sample_rec("full", f"t-{i}", "t", str(i), 1.0, None) for i in range(4)]
    old += [_sample_rec("residualkv-standalone", f"t-{i}", "t", str(i), s, None) for i, s in enumerate((1, 0, 0, 0))]
    new = [_sample_rec("full", f"t-{i}", "t", str(i), 1.0, 0) for i in range(4)]
    new += [_sample_rec("residualkv-standalone", f"t-{i}", "t", str(i), s, 0) for i, s in enumerate((1, 1, 1, 0))]
    files = [tmp_path / "old_predictions.jsonl", tmp_path / "new_predictions.jsonl"]
    for f, run in zip(files, (old, new)):
        f.write_text("".join(json.dumps(r) + "\n" for r in run))
    out = tmp_path / "rows.json"
    assert main(["pool", f"{files[0]}:residualkv-standalone=base", f"{files[1]}:residualkv-standalone=candidate",
                 "--compare", "candidate,base", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert rows["full"]["n_samples"] == 4  # the seedless full rows took seed 0 from the same samples
    assert rows["base"]["rel_score"] == pytest.approx(0.25) and rows["candidate"]["rel_score"] == pytest.approx(0.75)
    lo, hi = rows["candidate"]["rel_score_ci"]
    assert 0 <= lo <= 0.75 <= hi <= 1
    (c,) = json.loads((tmp_path / "rows_compare.json").read_text())
    assert c["a"] == "candidate" and c["b"] == "base" and c["n_samples"] == 4 and c["difference"] == pytest.approx(0.5)
    assert "candidate - base at 10 tokens, 4 shared samples: +0.500" in capsys.readouterr().out
    capsys.readouterr()
    assert main(["pool", str(files[1]), "--compare", "candidate,base", "--json", str(out)]) == 2
    assert "no rows of method" in capsys.readouterr().err


def test_rkv_pool_scores_several_runs_as_one_and_counts_shared_samples_once(tmp_path, capsys):
    from residualkv.cli import main

    def rec(m, sample, task, answer, score, seed, pred=None):
        return {"method": m, "context_len": 10, "id": sample, "task": task, "answers": [answer], "score": score,
                "prediction": pred or f"{m} {score}", "seed": seed, "kr_measured": 1.0 if m == "full" else 0.2,
                "kr_formula": None, "cr": 1.0, "wall_s": 1.0, "prompt_tokens": 10, "prefill_s": 1.0, "decode_s": 1.0,
                "decode_steps": 2, "new_tokens": 3}

    # two seeds (ids restart at 0 each seed) and, at seed 1, two jobs run side by side that share the full rows
    seed0 = [rec("full", "a-0", "a", "111", 0.0, 0), rec("x", "a-0", "a", "111", 0.0, 0),
             rec("full", "b-0", "b", "222", 1.0, 0), rec("x", "b-0", "b", "222", 1.0, 0)]
    job1 = [rec("full", "a-0", "a", "333", 1.0, 1), rec("x", "a-0", "a", "333", 1.0, 1)]
    job2 = [rec("full", "a-0", "a", "333", 1.0, 1), rec("y", "a-0", "a", "333", 0.5, 1)]
    files = []
    for name, run in (("s0", seed0), ("j1", job1), ("j2", job2)):
        files.append(tmp_path / f"{name}_predictions.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in run))
    out = tmp_path / "pooled" / "rows.json"
    assert main(["pool", *map(str, files), "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert all(k in r for r in rows.values() for k in CONTRACT)
    assert rows["full"]["n_samples"] == 3  # the full rows the two seed-1 jobs share count once
    assert rows["x"]["n_samples"] == 3 and rows["y"]["n_samples"] == 1
    assert rows["x"]["tasks"] == {"a": 0.5, "b": 1.0} and rows["x"]["rel_score"] == pytest.approx(1.0)
    assert rows["full"]["tasks"] == {"a": 0.5, "b": 1.0} and rows["x"]["seeds"] == [0, 1]
    # y ran one sample only: relative to the full cache on that sample (1.0), not on all of full's (0.5)
    assert rows["y"]["tasks"] == {"a": 0.5} and rows["y"]["rel_score"] == pytest.approx(0.5)
    assert len((tmp_path / "pooled" / "rows_predictions.jsonl").read_text().splitlines()) == 3 + 3 + 1
    assert main(["pool", *map(str, files), "--methods", "y", "--json", str(out)]) == 0
    assert [r["method"] for r in json.loads(out.read_text())] == ["full", "y"]
    # one sample, one method name, two different answers: two codecs evaluated under one name
    clash = tmp_path / "clash_predictions.jsonl"
    clash.write_text(json.dumps(rec("x", "a-0", "a", "333", 0.0, 1, pred="other")) + "\n")
    capsys.readouterr()
    assert main(["pool", str(files[1]), str(clash), "--json", str(out)]) == 2
    assert "two different answers under method 'x'" in capsys.readouterr().err
    assert main(["pool", str(files[1]), f"{clash}:y", "--json", str(out)]) == 0  # ':METHODS' takes only those
    assert {r["method"]: r["n_samples"] for r in json.loads(out.read_text())} == {"full": 1, "x": 1}
    capsys.readouterr()
    assert main(["pool", str(tmp_path / "missing.jsonl"), "--json", str(out)]) == 2
    assert "no such predictions file" in capsys.readouterr().err


def test_harness_writes_every_output_with_the_contract(tmp_path, tiny_lm, tok):
    samples = [Sample(id=f"s{i}", task=t, context=f"The code is {i}{i}{i}. " + "Filler text. " * 30,
                      question="What is the code?", answers=[f"{i}{i}{i}"], max_new_tokens=3)
               for i, t in enumerate(["alpha", "alpha", "beta"])]
    rows = evaluate(tiny_lm, tok, ["kivi2", "snapkv", "residualkv-dagger"], samples=samples, context_len=[64, 128],
                    ppl_context=48, ppl_tokens=4, out_dir=tmp_path, stem="run", progress=False)
    assert [r["method"] for r in rows[:4]] == ["full", "kivi2", "snapkv", "residualkv-dagger"]  # full added first
    assert {r["context_len"] for r in rows} == {64, 128}
    for name in ("run.json", "run.csv", "run.md", "run_score_vs_kr.png", "run_predictions.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "run.json").read_text())
    assert data == json.loads(json.dumps(rows))
    for r in data:
        assert all(k in r for k in CONTRACT)
        assert set(r["tasks"]) == {"alpha", "beta"} and r["n_samples"] == 3
        assert r["ppl"] > 0 and r["time_s"] > 0
    full = next(r for r in data if r["method"] == "full")
    assert full["kr_measured"] == 1.0 and full["ppl_rel"] == 1.0
    snap = next(r for r in data if r["method"] == "snapkv" and r["context_len"] == 128)
    assert snap["kr_measured"] < 0.6 and snap["cr"] < 1.0
    preds = [json.loads(x) for x in (tmp_path / "run_predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 2 * 3 * 4 and all(p["prompt_tokens"] <= p["context_len"] for p in preds)
    assert {p["seed"] for p in preds} == {0}  # what `rkv pool` tells seeds apart by
    assert "| method |" in (tmp_path / "run.md").read_text()


def test_full_from_reuses_the_full_cache_answers_of_an_earlier_run(tmp_path, tiny_lm, tok):
    """--full-from: the full cache's answers of an earlier run on the same samples are not generated again;
    a sample the earlier run lacks, or one with another budget, runs."""
    from residualkv.evaluation.cli import _full_records
    from residualkv.evaluation.report import read_predictions

    samples = [Sample(id=f"s{i}", task="t", context=f"The code is {i}{i}{i}. " + "Filler text. " * 20,
                      question="What is the code?", answers=[f"{i}{i}{i}"], max_new_tokens=3) for i in range(3)]
    first = evaluate(tiny_lm, tok, ["kivi4"], samples=samples[:2], context_len=None, ppl_tokens=0,
                     out_dir=tmp_path, stem="first", progress=False)
    earlier = read_predictions(tmp_path / "first_predictions.jsonl")
    longer = Sample(id="s1", task="t", context=samples[1].context, question=samples[1].question,
                    answers=samples[1].answers, max_new_tokens=4)  # same id, another budget: not the same run
    rows = evaluate(tiny_lm, tok, ["kivi4"], samples=[samples[0], longer, samples[2]], context_len=None, ppl_tokens=0,
                    reference=earlier, out_dir=tmp_path, stem="second", progress=False)
    full = {r["id"]: r for r in read_predictions(tmp_path / "second_predictions.jsonl") if r["method"] == "full"}
    old = {r["id"]: r for r in earlier if r["method"] == "full"}
    assert full["s0"]["reused"] and full["s0"]["prediction"] == old["s0"]["prediction"]
    assert full["s0"]["wall_s"] == old["s0"]["wall_s"]  # the stored record, not a new generation
    assert not full["s1"].get("reused") and full["s1"]["max_new_tokens"] == 4
    assert not full["s2"].get("reused")
    by = {r["method"]: r for r in rows}
    assert by["full"]["reused_samples"] == 1 and by["kivi4"]["reused_samples"] == 0
    assert by["full"]["n_samples"] == 3 and first[0]["reused_samples"] == 0
    # another seed's records are not this run's samples
    assert evaluate(tiny_lm, tok, ["full"], samples=samples[:1], context_len=None, ppl_tokens=0, seed=1,
                    reference=earlier, progress=False)[0]["reused_samples"] == 0
    # same id, answers, length and budget over another haystack (synthetic answers do not depend on it): runs
    other = Sample(id="s0", task="t", context="The code is 999. " + "Filler text. " * 20, question=samples[0].question,
                   answers=samples[0].answers, max_new_tokens=3)
    assert len(encode_prompt(tok, other)) == len(encode_prompt(tok, samples[0]))
    assert evaluate(tiny_lm, tok, ["full"], samples=[other], context_len=None, ppl_tokens=0,
                    reference=earlier, progress=False)[0]["reused_samples"] == 0
    # records written before the inputs hash are never reused
    unhashed = [{k: v for k, v in r.items() if k != "inputs_sha"} for r in earlier]
    assert evaluate(tiny_lm, tok, ["full"], samples=samples[:1], context_len=None, ppl_tokens=0,
                    reference=unhashed, progress=False)[0]["reused_samples"] == 0
    # the CLI reads the predictions file and refuses a run of another backbone
    assert len(_full_records([str(tmp_path / "first_predictions.jsonl")], "tiny")) == 2
    (tmp_path / "first.json").write_text(json.dumps([{"method": "full", "backbone": "other-model"}]))
    with pytest.raises(InputError, match="evaluated other-model, not tiny"):
        _full_records([str(tmp_path / "first_predictions.jsonl")], "tiny")
    with pytest.raises(InputError, match="no such predictions file"):
        _full_records([str(tmp_path / "missing_predictions.jsonl")], "tiny")


def test_perplexity_pools_disjoint_windows(tmp_path, tiny_lm, tok):
    """--ppl-windows: consecutive held-out windows, each through its own cache, pooled per token."""
    import math

    from residualkv.evaluation.perplexity import cache_perplexity, heldout_ids

    (tmp_path / "ppl_predictions.jsonl").write_text("{}\n")  # an earlier run's, under the same stem
    rows = evaluate(tiny_lm, tok, ["kivi4"], samples=[], context_len=None, ppl_context=40, ppl_tokens=5,
                    ppl_windows=3, out_dir=tmp_path, stem="ppl", progress=False)
    assert (tmp_path / "ppl.json").exists() and not (tmp_path / "ppl_predictions.jsonl").exists()
    windows = heldout_ids(tok, 3 * 45).view(3, 1, 45)
    for r in rows:
        each = [cache_perplexity(tiny_lm, build_method_cache(r["method"], tiny_lm), w, 40)["nll"] for w in windows]
        assert r["ppl_windows"] == 3 and r["ppl_tokens"] == 15
        assert math.isclose(r["nll"], sum(each) / 3, rel_tol=1e-9)
        assert len(set(round(x, 6) for x in each)) == 3  # three different windows
    with pytest.raises(ValueError, match="ppl_windows"):
        evaluate(tiny_lm, tok, ["full"], samples=[], context_len=None, ppl_tokens=5, ppl_windows=0, progress=False)


def test_full_rel_score_is_one_when_full_scores(tmp_path, tiny_lm, tok):
    # an answer that every prediction contains ("" is a substring of anything) gives the full cache signal;
    # a task file cannot hold one (Sample refuses it), so it is set after construction
    samples = [Sample(id="s", task="t", context="x " * 30, question="q", answers=["x"], max_new_tokens=2)]
    samples[0].answers = [""]
    rows = evaluate(tiny_lm, tok, ["full", "kivi4"], samples=samples, context_len=None, ppl_tokens=0, progress=False)
    assert rows[0]["method"] == "full" and rows[0]["rel_score"] == 1.0 and rows[1]["rel_score"] == 1.0
    assert rows[0]["ppl"] is None


def test_every_registered_method_runs_through_the_harness(tiny_lm, tok, tmp_path, monkeypatch, capsys):
    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig, LowRAMConfig
    from residualkv.lowram.meta import learn_starts
    from residualkv.methods import METHODS

    # the lowram-warm / -meta methods read starts learnt for this model from the data dir
    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path))
    ids = torch.randint(0, 100, (3, 48), generator=torch.Generator().manual_seed(0))
    learn_starts(tiny_lm, ids[:2], ids[2:], LowRAMConfig(), warm_steps=2, meta_steps=2, accumulate=2,
                 progress=False).save(tmp_path / "lowram" / "tiny" / "run")
    base = ResidualKVConfig(full_attention_layers=(0,))
    codec = ResidualCodec.for_model(tiny_lm.config, base, d_c=32, d_ff=64)
    samples = [Sample(id="s", task="t", context="The code is 777. " + "Filler. " * 40, question="Code?",
                      answers=["777"], max_new_tokens=3)]
    rows = evaluate(tiny_lm, tok, list(METHODS) + ["snapkv"], codec, base, samples=samples, context_len=None,
                    ppl_context=40, ppl_tokens=3, progress=False)
    assert [r["method"] for r in rows] == list(dict.fromkeys(["full", *METHODS, "snapkv"]))
    by = {r["method"]: r for r in rows}
    # each row says which latent width it served and which one the codec learnt
    assert (by["residualkv-int2"]["latent_bits"], by["residualkv-int2"]["codec_bits"]) == (2, codec.config.bits)
    assert (by["residualkv-standalone"]["latent_bits"], by["residualkv-standalone"]["codec_bits"]) == (4, 4)
    assert by["kivi2"]["latent_bits"] is None and by["residualkv-dagger"]["codec_bits"] is None
    assert "residualkv-int2 serves INT2 latents from a codec trained at INT4" in capsys.readouterr().err
    for r in rows:
        # OmniKV keeps the FP16 cache and its positions: a little over 1
        assert 0 < r["kr_measured"] <= (1.02 if r["method"] == "omnikv" else 1.0), r["method"]
        assert 0 < r["cr"] <= 1.0 and r["ppl"] > 0, r["method"]
        # memory kept beside the stored bytes: none here (LowRAM-SR's buffer needs a prompt it selects from)
        assert r["working_vs_fp16"] == 0.0, r["method"]


def test_methods_built_fresh_and_measured(tiny_lm):
    for name in ("full", "kivi2", "snapkv", "snapkv-10"):
        a, b = build_method_cache(name, tiny_lm), build_method_cache(name, tiny_lm)
        assert a is not b
        with torch.no_grad():
            tiny_lm(input_ids=torch.randint(0, 100, (1, 80)), cache=a)
        assert 0 < measure(a)["kr_measured"] <= 1.0
    with pytest.raises(ValueError, match="unknown method"):
        build_method_cache("nope", tiny_lm)


def test_selection_ratio_variants(tiny_lm):
    from residualkv.config import ResidualKVConfig
    from residualkv.evaluation.harness import known_method, method_needs_codec

    assert known_method("omnikv-r15") and known_method("residualkv-r10") and not known_method("kivi2-r10")
    assert method_needs_codec("residualkv-r10") and not method_needs_codec("omnikv-r15")
    cache = build_method_cache("omnikv-r15", tiny_lm, base=ResidualKVConfig(full_attention_layers=(0,)))
    assert cache.config.select_ratio == 0.15 and cache.config.mode == "omnikv"
    # ResidualKV + SnapKV at the SnapKV baseline's ratio (its default 2048-token budget keeps a 2K prompt whole)
    from residualkv.codec import ResidualCodec

    assert known_method("residualkv-snapkv-r20") and method_needs_codec("residualkv-snapkv-r20")
    assert not known_method("snapkv-r20")
    codec = ResidualCodec.for_model(tiny_lm.config, ResidualKVConfig(full_attention_layers=(0,)), d_c=32, d_ff=16)
    cache = build_method_cache("residualkv-snapkv-r20", tiny_lm, codec)
    assert cache.config.select_ratio == 0.2 and cache.config.mode == "snapkv"
    cache = build_method_cache("residualkv-reuse-r08", tiny_lm, codec)
    assert cache.config.select_ratio == 0.08 and cache.config.select_reuse


def test_write_outputs_refuses_rows_without_the_contract(tmp_path):
    with pytest.raises(ValueError, match="contract"):
        write_outputs([{"method": "full"}], out_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# the CLI on the real backbone

def test_rkv_eval_cli_contract_with_a_jsonl_and_two_lengths(tmp_path, tiny_lm, tok):
    folder = tmp_path / "tiny-backbone"
    tiny_lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    tasks = write_jsonl([{"id": f"r{i}", "context": "The code is 4242. " + "More text here. " * (10 * i),
                          "question": "What is the code?", "answers": ["4242"], "max_new_tokens": 3} for i in range(3)],
                        tmp_path / "mine.jsonl")
    out = tmp_path / "out" / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "residualkv.cli", "eval", "--backbone", str(folder), "--methods",
                           "kivi2,snapkv", "--tasks", str(tasks), "--context-len", "64,128", "--ppl-tokens", "0",
                           "--json", str(out), "--out-dir", str(tmp_path / "extra"), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["method"], r["context_len"]) for r in rows] == [
        ("full", 64), ("kivi2", 64), ("snapkv", 64), ("full", 128), ("kivi2", 128), ("snapkv", 128)]
    for r in rows:
        assert all(k in r for k in CONTRACT) and r["suite"] == str(tasks) and r["codec"] is None
        assert set(r["tasks"]) == {"mine"} and r["n_samples"] == 3
    for name in ("rows.csv", "rows.md", "rows_score_vs_kr.png", "rows_predictions.jsonl"):
        assert (tmp_path / "extra" / name).is_file()
    assert "| method |" in proc.stdout


def test_rkv_eval_cli_smollm2_full_vs_kivi4(tmp_path, tok):
    if not (SMOL / "model.safetensors").is_file():
        pytest.skip("SmolLM2 is not cached")
    out = tmp_path / "res" / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "residualkv.cli", "eval", "--backbone", "smollm2-135m",
                           "--methods", "full,kivi4", "--synthetic-tasks", "niah_single", "--context-len", "512",
                           "--n-samples", "1", "--ppl-context", "256", "--ppl-tokens", "4", "--json", str(out),
                           "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["full", "kivi4"]
    for r in rows:
        assert all(k in r for k in CONTRACT) and r["context_len"] == 512 and r["backbone"] == "smollm2-135m"
    full, kivi = rows
    assert full["kr_measured"] == 1.0 and 0.2 < kivi["kr_measured"] < 0.5
    if full["score"]:
        assert full["rel_score"] == 1.0
    assert (out.parent / "eval.csv").is_file() and (out.parent / "eval_score_vs_kr.png").is_file()


def test_rkv_eval_cli_needs_a_codec_only_when_asked(tmp_path):
    from residualkv.evaluation.harness import method_needs_codec

    assert method_needs_codec("residualkv") and not method_needs_codec("snapkv") and not method_needs_codec("kivi2")
    env = {**__import__("os").environ, "RKV_DATA_DIR": str(tmp_path / "empty-data")}
    proc = subprocess.run([sys.executable, "-m", "residualkv.cli", "eval", "--methods", "full,nope", "--json",
                           str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 2 and "unknown method" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "residualkv.cli", "eval", "--methods", "full,kivi2,residualkv",
                           "--json", str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=env)
    assert proc.returncode == 2 and "rkv train --backbone smollm2-135m" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_loss_by_task_adds_up_to_what_rel_score_leaves():
    """benchmarks/loss_by_task.py splits 1 - rel_score into per-task shares; on a committed pooled run
    (written by the harness's own rel_score) the shares add up exactly."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("loss_by_task", root / "benchmarks" / "loss_by_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = json.loads((root / "benchmarks/results/retrained/synthetic_2k_pooled.json").read_text())
    split = mod.loss_by_task(rows)
    assert len(split) == len(rows) - 1 and all(d["counted"] for d in split.values())
    for d in split.values():
        assert abs(sum(d["loss"].values()) - (1 - d["rel_score"])) < 1e-9, d


def test_user_facts_writes_a_user_jsonl_that_fits_and_holds_its_answers(tmp_path, tok):
    """benchmarks/user_facts.py: contract fields only, each prompt within 32 tokens under the length (so
    `rkv eval --context-len` never truncates it), the fact stated once in the context, deterministic."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("user_facts", ROOT / "benchmarks" / "user_facts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    samples = mod.make_samples(tok, 512, 6, seed=1)
    assert len({s.id for s in samples}) == 6
    for s in samples:
        assert 512 - mod.SLACK <= len(encode_prompt(tok, s)) <= 512
        (answer,) = s.answers
        assert s.context.count(s.meta["fact"]) == 1 and answer in s.meta["fact"]
    again = mod.make_samples(tok, 512, 6, seed=1)
    assert [s.context for s in again] == [s.context for s in samples]
    assert [s.context for s in mod.make_samples(tok, 512, 6, seed=2)] != [s.context for s in samples]
    out = tmp_path / "facts.jsonl"
    write_jsonl(mod.user_rows(samples), out)
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line).keys() == {"id", "context", "question", "answers"} for line in lines)
    assert [s.context for s in load_jsonl(out)] == [s.context for s in samples]


def _generated(model, codec, name: str):
    """A cache of method `name` after a 90-token prompt and 4 greedy tokens."""
    cache = build_method_cache(name, model, codec)
    ids = torch.randint(1, 100, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, cache=cache)
    return cache


def test_recent_window_variants(tiny_lm):
    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig
    from residualkv.evaluation.harness import known_method, method_needs_codec

    for name in ("residualkv-standalone-w64", "residualkv-r08-w32", "residualkv-snapkv-r20-w16", "residualkv-w8"):
        assert known_method(name) and method_needs_codec(name), name
    for name in ("kivi2-w64", "omnikv-w64", "snapkv-w64", "full-w8", "residualkv-w64-r08"):
        assert not known_method(name), name
    codec = ResidualCodec.for_model(tiny_lm.config, ResidualKVConfig(full_attention_layers=(0,)), d_c=32, d_ff=16)
    cache = build_method_cache("residualkv-r08-w32", tiny_lm, codec)
    assert (cache.config.recent_window, cache.config.select_ratio, cache.config.mode) == (32, 0.08, "omnikv")
    cache = _generated(tiny_lm, codec, "residualkv-standalone-w64")
    assert (cache.config.recent_window, cache.config.mode) == (64, "standalone")
    rep = measure(cache)
    assert rep["bytes"]["recent_window_fp16"] > 0 and rep["gap"]["recent_window_fp16"] > 0


def _suffix_reports(tiny_lm, variant: str, known: tuple[str, ...], unknown: tuple[str, ...]):
    """Checks which names a method suffix is accepted on, then measures residualkv-standalone and `variant`
    on one tiny codec: (codec, base report, variant report)."""
    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig
    from residualkv.evaluation.harness import known_method

    for name in (variant, *known):
        assert known_method(name), name
    for name in unknown:
        assert not known_method(name), name
    codec = ResidualCodec.for_model(tiny_lm.config, ResidualKVConfig(full_attention_layers=(0,)), d_c=64, d_ff=16)
    return codec, *(measure(_generated(tiny_lm, codec, name)) for name in ("residualkv-standalone", variant))


def test_group_size_variants(tiny_lm):
    """-gNN quantises a ResidualKV method's latents in groups of NN: fewer FP16 mins and scales, the
    same codes; a group that does not divide d_c is refused by name before anything is written."""
    from residualkv.config import ConfigError

    codec, base, wide = _suffix_reports(
        tiny_lm, "residualkv-standalone-g64",
        known=("residualkv-r08-w32-g16", "residualkv-snapkv-r20-g32"),
        unknown=("kivi2-g64", "omnikv-g64", "residualkv-g64-w32", "full-g8"))
    assert wide["bytes"]["latent_codes"] == base["bytes"]["latent_codes"]
    # one FP16 pair per 64 values, not per 32
    assert wide["bytes"]["latent_mins_scales"] * 2 == base["bytes"]["latent_mins_scales"]
    assert abs(wide["unexplained"]) < 1e-9
    with pytest.raises(ConfigError, match="group_size=48.*divides d_c"):
        build_method_cache("residualkv-standalone-g48", tiny_lm, codec)


def test_stride_variants(tiny_lm):
    """-sNN serves a ResidualKV method with a reference every NN tokens instead of the codec's stride: more
    references, fewer codes, every byte explained; after the other suffixes only, ResidualKV methods only."""
    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig
    from residualkv.evaluation.harness import known_method

    for name in ("residualkv-standalone-s4", "residualkv-r08-w32-g16-s5", "residualkv-snapkv-s6"):
        assert known_method(name), name
    for name in ("kivi2-s4", "omnikv-s4", "residualkv-s4-w32", "residualkv-standalone-s"):
        assert not known_method(name), name
    codec = ResidualCodec.for_model(tiny_lm.config, ResidualKVConfig(full_attention_layers=(0,), stride=10), d_c=64,
                                    d_ff=16)
    reps = {}
    for name in ("residualkv-standalone", "residualkv-standalone-s5"):
        cache = _generated(tiny_lm, codec, name)
        assert cache.rows.schedule.stride == (5 if name.endswith("-s5") else 10)
        reps[name] = measure(cache)
        assert abs(reps[name]["unexplained"]) < 1e-9
    base, dense = reps["residualkv-standalone"]["bytes"], reps["residualkv-standalone-s5"]["bytes"]
    assert dense["references"] > base["references"] and dense["latent_codes"] < base["latent_codes"]

    # -aNN: the seed's dynamic stride, alpha = NN/1000; references thin out along the prompt, bytes explained
    assert known_method("residualkv-a1") and known_method("residualkv-standalone-s5-a100")
    assert not known_method("residualkv-a1-s5") and not known_method("omnikv-a1")
    grown = _generated(tiny_lm, codec, "residualkv-standalone-a100")
    assert grown.rows.schedule.alpha == 0.1 and grown.rows.schedule.stride == 10
    rep = measure(grown)
    assert rep["bytes"]["references"] < base["references"] and abs(rep["unexplained"]) < 1e-9


def test_full_bits_variants(tiny_lm):
    """-bNN quantises the full-attention (filter) layers in NN bits instead of KIVI-4: half their codes at 2
    bits, the compressed layers' bytes untouched, every byte explained; a width the packer lacks is refused by name."""
    from residualkv.config import ConfigError

    codec, base, thin = _suffix_reports(
        tiny_lm, "residualkv-standalone-b2", known=("residualkv-r08-b2", "residualkv-standalone-s5-a100-b8"),
        unknown=("kivi2-b2", "omnikv-b2", "residualkv-b2-s5", "full-b2"))
    assert thin["inputs"]["full_bits"] == 2 and base["inputs"]["full_bits"] == 4
    assert thin["bytes"]["full_layer_codes"] * 2 == base["bytes"]["full_layer_codes"]
    assert thin["bytes"]["latent_codes"] == base["bytes"]["latent_codes"]
    assert thin["kr_measured"] < base["kr_measured"] and abs(thin["unexplained"]) < 1e-9
    with pytest.raises(ConfigError, match="full_bits"):
        build_method_cache("residualkv-standalone-b3", tiny_lm, codec)


# ---------------------------------------------------------------------------------------------
# the gold answer's NLL, teacher-forced through each cache


def test_gold_answer_ids_join_every_answer_and_follow_the_prompt(tok):
    from residualkv.evaluation.samples import gold_answer_ids

    all_ = Sample(id="a", task="t", context="c", question="q", answers=["123", " 456"], answer_prefix="The numbers are")
    any_ = Sample(id="b", task="t", context="c", question="q", answers=["Paris", "paris, France"], metric="any")
    assert tok.decode(gold_answer_ids(tok, all_)) == " 123, 456"  # after "...are": a space, every answer
    assert prompt_text(tok, any_).endswith("\n")  # SmolLM2's chat template ends the prompt on a newline
    assert tok.decode(gold_answer_ids(tok, any_)) == "Paris"  # no space after it, the first alternative only
    quoted = Sample(id="k", task="t", context="c", question="q", answers=["3b28"], answer_prefix='The value is "')
    assert tok.decode(gold_answer_ids(tok, quoted)) == "3b28"  # straight after an opening quote
    vt = SyntheticGenerator(tok, seed=0).sample("vt", 600, 0)  # its one-shot example lists names with spaces
    assert tok.decode(gold_answer_ids(tok, vt)) == " " + " ".join(vt.answers)


def test_answer_nll_is_the_teacher_forced_nll_and_leaves_generation_unchanged(tiny_lm, tok):
    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig
    from residualkv.evaluation.samples import gold_answer_ids

    base = ResidualKVConfig(full_attention_layers=(0,), select_budget=16, n_recent=4, n_sink=2)
    codec = ResidualCodec.for_model(tiny_lm.config, base, d_c=32, d_ff=64)
    samples = [Sample(id=f"s{i}", task=t, context=f"The code is {i}{i}7. " + "Filler text here. " * 30,
                      question="Code?", answers=[f"{i}{i}7", "x"], max_new_tokens=4)
               for i, t in enumerate(["a", "a", "b", "b"])]
    methods = ["residualkv-standalone", "residualkv", "residualkv-snapkv", "snapkv", "kivi2", "omnikv"]
    on = evaluate(tiny_lm, tok, methods, codec, base, samples=samples, context_len=None, ppl_tokens=0,
                  out_dir=None, progress=False)
    off = evaluate(tiny_lm, tok, methods, codec, base, samples=samples, context_len=None, ppl_tokens=0,
                   progress=False, score_answers=False)
    for a, b in zip(on, off):  # the scoring reads a snapshot: every method generates exactly as without it
        assert (a["method"], a["tasks"], a["kr_measured"], a["cr"]) == (b["method"], b["tasks"], b["kr_measured"], b["cr"])
        assert b["answer_nll"] is None and a["answer_nll"] > 0, a["method"]
    by = {r["method"]: r for r in on}
    assert by["full"]["answer_nll_delta"] == 0.0 and by["full"]["answer_nll_delta_ci"] is None
    for m in methods:
        lo, hi = by[m]["answer_nll_delta_ci"]  # 2 samples per task: an interval
        assert lo <= by[m]["answer_nll_delta"] <= hi, m
    # the full cache's value is the NLL of the answer tokens in one dense forward over prompt + answer
    nlls = []
    for s in samples:
        ids, gold = encode_prompt(tok, s), gold_answer_ids(tok, s)
        with torch.no_grad():
            logits = tiny_lm(torch.tensor([ids + gold])).logits[0, len(ids) - 1 : -1].float()
        nlls.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(gold))))
    assert by["full"]["answer_nll"] == pytest.approx(((nlls[0] + nlls[1]) / 2 + (nlls[2] + nlls[3]) / 2) / 2, rel=1e-4)


def test_mean_difference_by_hand():
    from residualkv.evaluation.harness import sample_key
    from residualkv.evaluation.stats import mean_difference

    recs = []
    for i, (t, a, b) in enumerate([("x", 1.0, 0.5), ("x", 2.0, 1.0), ("y", 3.0, 3.0), ("y", 1.0, 2.0)]):
        for m, v in (("A", a), ("B", b)):
            recs.append({"method": m, "id": str(i), "task": t, "answers": ["1"], "context_len": 8, "seed": 0,
                         "answer_nll": v})
    recs.append({"method": "A", "id": "9", "task": "y", "answers": ["1"], "context_len": 8, "seed": 0,
                 "answer_nll": 5.0})  # B lacks it: not paired, left out
    d = mean_difference(recs, "A", "B", sample_key)
    assert d["n_samples"] == 4 and d["difference"] == pytest.approx(((0.5 + 1.0) / 2 + (0.0 - 1.0) / 2) / 2)
    assert d["ci"][0] <= d["difference"] <= d["ci"][1] and 0 <= d["p_a_lower"] <= 1
    one = mean_difference(recs[:2], "A", "B", sample_key)  # one sample: a point, no interval
    assert one["difference"] == 0.5 and one["ci"] is None


def _recipe_recs(scores: dict[str, tuple], nll: dict[str, tuple] | None = None) -> list[dict]:
    """One task, one row per (method, sample); answer_nll where `nll` gives it."""
    return [_sample_rec(m, f"t-{i}", "t", str(i), s, 0) | ({"answer_nll": nll[m][i]} if nll and m in nll else {})
            for m, per in scores.items() for i, s in enumerate(per)]


def test_compare_recipes_draws_the_runs_as_well_as_the_samples():
    from residualkv.evaluation.harness import sample_key
    from residualkv.evaluation.stats import compare_recipes

    full = (1.0, 1.0, 1.0, 1.0)
    # recipe B's two runs agree (each half right), then disagree (one all right, one all wrong): the same mean
    agree = _recipe_recs({"full": full, "a1": full, "a2": full, "b1": (1, 1, 0, 0), "b2": (1, 1, 0, 0)},
                         nll={"a1": (1, 1, 1, 1), "a2": (1, 1, 1, 1), "b1": (2, 2, 2, 2), "b2": (2, 2, 2, 2)})
    split = _recipe_recs({"full": full, "a1": full, "a2": full, "b1": full, "b2": (0, 0, 0, 0)},
                         nll={"a1": (1, 1, 1, 1), "a2": (1, 1, 1, 1), "b1": (1, 1, 1, 1), "b2": (3, 3, 3, 3)})
    c = compare_recipes(agree, ["a1", "a2"], ["b1", "b2"], "full", sample_key)
    d = compare_recipes(split, ["a1", "a2"], ["b1", "b2"], "full", sample_key)
    assert c["n_samples"] == d["n_samples"] == 4
    assert c["difference"] == d["difference"] == pytest.approx(0.5)
    assert c["rel_runs"] == {"a1": 1.0, "a2": 1.0, "b1": 0.5, "b2": 0.5} and d["rel_runs"]["b2"] == 0.0
    # split: every sample answers alike within a run, so only the run draw moves it: b's mean is 1 (both
    # draws b1, 1/4), 0 (both b2, 1/4) or 1/2 -> a ahead in 3/4 of draws, tied (counted half) in 1/4
    assert d["ci"] == [0.0, 1.0] and d["p_a_ahead"] == pytest.approx(0.875, abs=0.03)
    assert 0.0 <= c["ci"][0] and c["ci"][1] <= 1.0 and c["p_a_ahead"] > d["p_a_ahead"]
    # answer NLL: the same -1 nat on both, from agreeing runs (no spread at all) and from split ones
    assert c["answer_nll_difference"] == d["answer_nll_difference"] == pytest.approx(-1.0)
    assert c["answer_nll_ci"] == [-1.0, -1.0] and c["answer_nll_p_a_lower"] == 1.0
    assert d["answer_nll_ci"] == [-2.0, 0.0] and d["answer_nll_runs"] == {"a1": 1.0, "a2": 1.0, "b1": 1.0, "b2": 3.0}
    assert compare_recipes(split, ["a1", "a2"], ["b1", "b2"], "full", sample_key) == d  # fixed draws
    with pytest.raises(ValueError, match="one recipe once"):
        compare_recipes(split, ["a1", "b1"], ["b1", "b2"], "full", sample_key)


def test_rkv_pool_compares_recipes_of_several_runs(tmp_path, capsys):
    from residualkv.cli import main

    full = (1.0, 1.0, 1.0, 1.0)
    files = []
    for name, scores in {"a1": full, "a2": (1, 1, 1, 0), "b1": (1, 1, 0, 0), "b2": (1, 0, 0, 0), "b3": (1, 1, 0, 0)}.items():
        f = tmp_path / f"{name}_predictions.jsonl"  # each run evaluated as residualkv-standalone
        recs = _recipe_recs({"full": full, "residualkv-standalone": scores},
                            nll={"residualkv-standalone": tuple(2.0 - s for s in scores)})
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
        files.append(f"{f}:residualkv-standalone={name}")
    out = tmp_path / "rows.json"
    assert main(["pool", *files, "--recipe", "long=a1,a2", "--recipe", "short=b1,b2,b3",
                 "--compare-recipes", "long,short", "--json", str(out)]) == 0
    (c,) = json.loads((tmp_path / "rows_recipes.json").read_text())
    assert (c["recipe_a"], c["recipe_b"], c["a"], c["b"]) == ("long", "short", ["a1", "a2"], ["b1", "b2", "b3"])
    assert c["rel_a"] == pytest.approx(0.875) and c["rel_b"] == pytest.approx(5 / 12)
    assert c["answer_nll_difference"] == pytest.approx(-(0.875 - 5 / 12))
    printed = capsys.readouterr().out
    assert "recipe long (2 runs) - short (3 runs) at 10 tokens, 4 shared samples: rel. score 0.875 - 0.417 = +0.458" in printed
    assert "understates the training spread" in printed  # two runs a side
    for bad, why in ((["--compare-recipes", "long,short"], "not named by --recipe"),
                     (["--recipe", "long=a1,zz", "--compare-recipes", "long,long"], "no rows of method(s) ['zz']"),
                     (["--recipe", "long=a1,a2", "--recipe", "short=a2,b1", "--compare-recipes", "long,short"],
                      "share runs ['a2']"),
                     (["--recipe", "long"], "write NAME=M1,M2")):
        assert main(["pool", *files, *bad, "--json", str(out)]) == 2
        assert why in capsys.readouterr().err


def test_the_benchmark_scripts_parse():
    """BENCHMARKS.md cites these scripts as the commands behind its figures; they run for minutes to hours, so
    CI cannot run them, but a syntax error must not wait for the next person who needs a figure again."""
    folder = Path(__file__).parent.parent / "benchmarks"
    scripts = sorted(folder.glob("*.sh"))
    assert scripts
    for script in scripts:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
    for script in sorted(folder.glob("*.py")):  # compiled, not run (nor imported: some need a GPU)
        compile(script.read_text(), str(script), "exec")


def test_answer_nll_pairs_only_records_that_scored_the_same_gold_answer(tmp_path):
    """vt's and kv retrieval's gold answers changed on 2026-12-06: an older record of those tasks (no inputs_sha)
    never pairs with a newer one, in a comparison or against the full cache; other tasks pair across the date."""
    from residualkv.cli import main
    from residualkv.evaluation.harness import answer_key, pool_records
    from residualkv.evaluation.samples import gold_basis
    from residualkv.evaluation.stats import mean_difference

    def rec(m, task, nll, new):
        return _sample_rec(m, f"{task}-0", task, "7", 1.0, 0) | {"answer_nll": nll} | ({"inputs_sha": "ab"} if new else {})

    assert gold_basis(rec("x", "vt", 1.0, False)) != gold_basis(rec("x", "vt", 1.0, True))
    assert gold_basis(rec("x", "niah_single", 1.0, False)) == gold_basis(rec("x", "niah_single", 1.0, True))
    old_run = [rec("full", t, 0.5, False) for t in ("vt", "niah_single")] + [rec("old", "vt", 1.0, False),
                                                                           rec("old", "niah_single", 1.0, False)]
    new_run = [rec("full", t, 0.4, True) for t in ("vt", "niah_single")] + [rec("new", "vt", 3.0, True),
                                                                          rec("new", "niah_single", 2.0, True)]
    d = mean_difference(old_run + new_run, "new", "old", answer_key)
    assert d["n_samples"] == 1 and d["difference"] == pytest.approx(1.0)  # niah alone: vt's two golds differ
    # pooled, a sample's full-cache record with inputs_sha wins (same answer), so the newer codec's vt pairs
    pooled = pool_records([old_run, new_run])
    assert {r["task"]: r.get("inputs_sha") for r in pooled if r["method"] == "full"} == {"vt": "ab", "niah_single": "ab"}
    files = []
    for name, run in (("old", old_run), ("new", new_run)):
        files.append(tmp_path / f"{name}_predictions.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in run))
    out = tmp_path / "rows.json"
    assert main(["pool", *map(str, files), "--compare", "new,old", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert rows["new"]["answer_nll_delta"] == pytest.approx(((3.0 - 0.4) + (2.0 - 0.4)) / 2)
    assert rows["old"]["answer_nll_delta"] == pytest.approx(1.0 - 0.4)  # its vt has no full row on its gold
    (c,) = json.loads((tmp_path / "rows_compare.json").read_text())
    assert c["answer_nll_samples"] == 1 and c["answer_nll_difference"] == pytest.approx(1.0)


def test_plot_zooms_the_kr_axis_onto_the_compressed_methods(tmp_path):
    from residualkv.evaluation.report import kr_axis, plot_score_vs_kr

    rows = [{"method": "full", "context_len": 2048, "kr_measured": 1.0, "rel_score": 1.0, "answer_nll_delta": 0.0},
            {"method": "kivi2", "context_len": 2048, "kr_measured": 0.196, "rel_score": 0.3, "rel_score_ci": [0.1, 0.6],
             "answer_nll_delta": 0.8, "answer_nll_delta_ci": [0.7, 0.9]},
            {"method": "residualkv", "context_len": 2048, "kr_measured": 0.215, "rel_score": 0.6}]
    lo, hi, full_off = kr_axis(rows)
    assert full_off and lo == 15.0 and 21.5 < hi < 25  # both methods inside, a point apart still visible
    assert plot_score_vs_kr(rows, tmp_path / "p.png").stat().st_size > 0
    # a method near the full cache's bytes (OmniKV on FP16) keeps the whole axis, full cache drawn as a point
    assert kr_axis(rows + [{"method": "omnikv", "context_len": 2048, "kr_measured": 1.0, "rel_score": 1.0}]) == (0.0, 108.0, False)
