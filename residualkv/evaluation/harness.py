"""The evaluation harness: every method on the same inputs, side by side, in one run.

For each context length, each sample is run through every method in turn (a fresh cache per run:
prefill the whole prompt in one call, then greedy decoding one token at a time through the cache), so
methods see identical prompts and share the machine's load fluctuations. Perplexity of held-out text
is measured through each method's cache as well (`perplexity.py`).

Per (method, context length) row:
  kr_measured, kr_formula, cr   mean over the task samples of `accounting.report(cache)` taken after that
                                sample's prefill + generation (the ppl run's report when there are no samples)
  working_vs_fp16               memory the method holds beside its stored bytes (the reuse buffers of
                                lowram-sr-reuse and residualkv-reuse),
                                / FP16 cache bytes, averaged the same way; 0 for methods that keep none
  score                         mean over tasks of the task's mean sample score (fractions in [0, 1])
  rel_score                     sum of the method's task scores / sum of the full cache's task scores, over
                                the tasks where the full cache scores > 0 (tasks without signal are left out);
                                None when the full cache scores 0 on every task. Equals score / full score
                                when every task has signal; exactly 1.0 for the full cache.
  rel_score_ci                  [lo, hi]: 95% paired bootstrap interval of rel_score over the samples,
                                stratified by task (stats.py); None for the full cache and without signal
  tasks / rel_tasks             per-task scores and score / full score (None where the full score is 0)
  ppl, nll, ppl_rel             perplexity through the cache and ppl / full ppl
  time_s, s_per_sample, prefill_tok_s, decode_tok_s   wall-clock figures of this process (records reused from
                                an earlier run, `reference` below, keep that run's figures)
  reused_samples                how many of the row's samples were taken from that earlier run
  answer_nll                    mean over tasks of the mean NLL per token (nats) of a correct answer written
                                after the prompt, teacher-forced through the method's cache (`answer_nll`):
                                a continuous reading of the same question, far less noisy than string match
  latent_bits, codec_bits       for a trained-codec method: the latent width it serves and the one its codec
                                was trained at (they differ for residualkv-int2 on an INT4 codec; None otherwise)
  answer_nll_delta, _ci         answer_nll minus the full cache's on the same samples (paired; > 0: the
                                cache makes the right answer less likely), and its 95% bootstrap interval
The full FP16 cache is always run (added first when not requested): quality is relative to it.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .. import accounting
from ..config import InputError
from ..snapkv import SnapKVCache, snapkv_report
from .perplexity import cache_perplexity, heldout_ids
from .report import REFERENCE
from .samples import Sample, encode_prompt, generation_budget, gold_answer_ids, gold_basis
from .scoring import score as score_prediction
from .stats import compare, compare_recipes, mean_difference, rel_score_interval

_SNAPKV = re.compile(r"^snapkv(?:-(\d+))?$")
# Variants of registered methods, by suffix, as VARIANTS_HELP tells the CLIs' users: -rNN (select_ratio), then on
# ResidualKV methods only -wNN, -gNN, -sNN, -aNN, -bNN (the _CODEC_SUFFIXES' config fields), in this order; on LowRAM
# methods -kNN (evict_keep, where the method evicts) then -fNN (fit_steps)
_VARIANT = re.compile(r"^(?P<base>.+?)(?:-r(?P<ratio>\d+))?(?:-w(?P<window>\d+))?(?:-g(?P<group>\d+))?"
                      r"(?:-s(?P<stride>\d+))?(?:-a(?P<alpha>\d+))?(?:-b(?P<full_bits>\d+))?(?:-k(?P<keep>\d+))?"
                      r"(?:-f(?P<fit>\d+))?$")
# config field and how the suffix's integer reads: -aNN is the seed's dynamic-stride growth alpha in thousandths
_CODEC_SUFFIXES = {"window": ("recent_window", int), "group": ("group_size", int), "stride": ("stride", int),
                   "alpha": ("stride_alpha", lambda n: int(n) / 1000), "full_bits": ("full_bits", int)}
# what the CLIs print about the names above (argparse help: escape the % signs)
VARIANTS_HELP = ("snapkv-NN keeps NN% of the prompt; residualkv-rNN / omnikv-rNN select NN% of the history per "
                 "decode step; residualkv-snapkv-rNN keeps NN% of the prompt on the compressed layers; on a "
                 "residualkv method, then, -wNN holds the newest NN tokens of its compressed layers in FP16, -gNN "
                 "quantises its latents in groups of NN, -sNN places a reference every NN tokens, -aNN lets that "
                 "stride grow with the position by alpha = NN/1000 (the seed's long-context setting: -a1), -bNN "
                 "quantises its full-attention layers KIVI-style in NN bits instead of the codec's own (4 by default) "
                 "(residualkv-standalone-w64, residualkv-r08-w32-g80, residualkv-standalone-s10, residualkv-a1, "
                 "residualkv-r08-b2); on a lowram method -fNN fits each context in NN Adam steps (lowram-warm-f25), "
                 "and on an evicting one (lowram-e, lowram-eq) -kNN keeps NN% of the prompt (lowram-eq-k25)")
_RATIO_BASES = ("residualkv", "residualkv-reuse", "omnikv", "residualkv-snapkv")


def _snapkv_ratio(name: str) -> float | None:
    m = _SNAPKV.match(name)
    if not m:
        return None
    return int(m.group(1)) / 100 if m.group(1) else 0.2


def _variant(name: str) -> tuple[str, dict[str, Any]] | None:
    """A suffixed variant -> (registered method, config changes); None when `name` is not one."""
    m = _VARIANT.match(name)
    if not m or all(m[g] is None for g in ("ratio", "keep", "fit", *_CODEC_SUFFIXES)):
        return None
    base, changes = m["base"], {}
    if m["fit"] is not None or m["keep"] is not None:
        if not base.startswith("lowram") or base not in _methods() or any(m[g] for g in ("ratio", *_CODEC_SUFFIXES)):
            return None
        if m["keep"] is not None:
            if not _methods()[base].evicts or not 0 < int(m["keep"]) <= 100:
                return None
            changes["evict_keep"] = int(m["keep"]) / 100
        if m["fit"] is not None:
            changes["fit_steps"] = int(m["fit"])
        return base, changes
    if m["ratio"] is not None:
        if base not in _RATIO_BASES or not 0 < int(m["ratio"]) <= 100:
            return None
        changes["select_ratio"] = int(m["ratio"]) / 100
    codec_changes = {field: read(m[g]) for g, (field, read) in _CODEC_SUFFIXES.items() if m[g] is not None}
    if codec_changes:
        METHODS = _methods()
        if base not in METHODS or not METHODS[base].needs_codec:  # the codec methods are the ResidualKV ones
            return None
        changes.update(codec_changes)
    return base, changes


def _methods():
    from ..methods import METHODS

    return METHODS


def known_method(name: str) -> bool:
    from ..methods import METHODS

    return name in METHODS or _snapkv_ratio(name) is not None or _variant(name) is not None


def method_needs_codec(name: str) -> bool:
    from ..methods import METHODS, get_method

    variant = _variant(name)
    if variant is not None:
        name = variant[0]
    if name in METHODS:
        return get_method(name).needs_codec
    if _snapkv_ratio(name) is not None:
        return False
    get_method(name)  # raises the registry's "unknown method" error
    return False


def build_method_cache(name: str, model, codec=None, base=None):
    """A fresh cache for one run of a registered method or a variant (VARIANTS_HELP); `snapkv` keeps 20% of
    the prompt."""
    from ..methods import METHODS, build_cache

    variant = _variant(name)
    if variant is not None:
        return build_cache(variant[0], model, codec, base, **variant[1])
    if name in METHODS:
        return build_cache(name, model, codec, base)
    ratio = _snapkv_ratio(name)
    if ratio is not None:
        return SnapKVCache.from_model(model, ratio=ratio, window=32)
    return build_cache(name, model, codec, base)  # raises with the list of known methods


def measure(cache) -> dict[str, Any]:
    if isinstance(cache, SnapKVCache):
        return snapkv_report(cache)
    return accounting.report(cache)


# ---------------------------------------------------------------------------------------------
# One run


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    prefill_s: float
    decode_s: float
    decode_steps: int  # one-token forward calls after the prefill
    answer_nll: float | None = None  # mean NLL per token of the gold answer, teacher-forced through the cache
    answer_tokens: int = 0
    answer_nll_s: float = 0.0


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def snapshot(cache):
    """An independent copy of a filled cache (bytes copied, modules shared), to read on without touching it."""
    import copy

    from ..cache import ResidualKVCache

    return cache.fork() if isinstance(cache, ResidualKVCache) else copy.deepcopy(cache)


@torch.no_grad()
def answer_nll(model, cache, first_logits: torch.Tensor, answer_ids: Sequence[int], start: int) -> float:
    """Mean NLL per token of `answer_ids` written after the prompt: the first token scored from the prefill's
    last logits, each next one after feeding the previous gold token through `cache` (a decode step, so
    the sparse modes select and SnapKV reads its survivors as they do while generating)."""
    device = first_logits.device
    total = -float(torch.log_softmax(first_logits.float(), -1)[answer_ids[0]])
    for j, tok in enumerate(answer_ids[:-1]):
        out = model(input_ids=torch.tensor([[tok]], device=device), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[start + j]], device=device))
        total -= float(torch.log_softmax(out.logits[0, -1].float(), -1)[answer_ids[j + 1]])
    return total / len(answer_ids)


@torch.no_grad()
def greedy(model, tokenizer, cache, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: set[int],
           answer_ids: Sequence[int] | None = None) -> Generation:
    """Prefill the prompt into `cache` in one call, then decode greedily one token per step. With
    `answer_ids`, also score the gold answer teacher-forced (`answer_nll`) on a snapshot of the cache
    taken after the prefill, so the generation runs exactly as without it."""
    device = next(model.parameters()).device
    n = len(prompt_ids)
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    first = out.logits[0, -1]
    t_snap = time.perf_counter()
    scored = snapshot(cache) if answer_ids else None
    t1 = time.perf_counter()
    nxt = int(first.argmax())
    generated: list[int] = []
    steps = 0
    while nxt not in stop_ids:
        generated.append(nxt)
        if len(generated) >= max_new_tokens:
            break
        steps += 1
        out = model(input_ids=torch.tensor([[nxt]], device=device), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[n + len(generated) - 1]], device=device))
        nxt = int(out.logits[0, -1].argmax())
    t2 = time.perf_counter()
    g = Generation(generated, tokenizer.decode(generated, skip_special_tokens=True), prefill_s, t2 - t1, steps)
    if answer_ids:  # its time (the snapshot and the teacher-forced steps) is kept apart from the generation's
        g.answer_nll, g.answer_tokens = answer_nll(model, scored, first, answer_ids, n), len(answer_ids)
        g.answer_nll_s = (t1 - t_snap) + (time.perf_counter() - t2)
    return g


def truncate_middle(ids: list[int], max_len: int | None) -> list[int]:
    """LongBench's rule for prompts longer than the budget: keep the head and the tail."""
    if max_len is None or len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - (max_len - half):]


# ---------------------------------------------------------------------------------------------
# Inputs


def check_suite(suite: str, tasks: Sequence[str] | None = None) -> tuple[str, str | None, str | None] | None:
    """Fail on an unknown suite or synthetic task name (before anything is loaded); a hub benchmark's
    (source, subset, repo), else None."""
    from . import hub, synthetic

    for name in tasks or ():
        synthetic.get_task(name)
    if suite == "ppl" or suite in synthetic.SUITES or tasks:
        return None
    parsed = hub.parse_suite(suite)
    if parsed is None:
        raise InputError(f"unknown suite {suite!r}: use {', '.join(list(synthetic.SUITES) + ['ppl'])}, or "
                         f"{'|'.join(hub.SOURCES)}[:SUBSET][@OWNER/REPO] for a hub benchmark")
    return parsed


def suite_samples(suite: str, tokenizer, context_len: int | None, n_samples: int, seed: int,
                  tasks: Sequence[str] | None = None) -> list[Sample]:
    """Samples of a named suite: a synthetic suite generated at context_len, 'ppl' (none), or a hub benchmark."""
    from . import hub, synthetic

    hub_suite = check_suite(suite, tasks)
    if suite == "ppl":
        return []
    if hub_suite is None:
        if context_len is None:
            raise InputError("synthetic tasks need a context length")
        names = list(tasks) if tasks else synthetic.suite_tasks(suite)
        return synthetic.SyntheticGenerator(tokenizer, seed).generate(names, context_len, n_samples)
    source, subset, repo = hub_suite
    return hub.load_benchmark(source, subset, path=repo, limit=n_samples)


# ---------------------------------------------------------------------------------------------
# The entry point


def evaluate(model, tokenizer, methods: Sequence[str], codec=None, base_config=None, *,
             samples: Sequence[Sample] | None = None, suite: str = "synthetic", tasks: Sequence[str] | None = None,
             context_len: int | Sequence[int] | None = 2048, n_samples: int = 5, seed: int = 0,
             ppl_context: int | None = None, ppl_tokens: int = 64, ppl_windows: int = 1,
             min_new_tokens: int | None = None, reference: Sequence[dict[str, Any]] | None = None,
             out_dir: str | Path | None = None, stem: str = "eval", json_path: str | Path | None = None,
             progress: bool = True, extra: dict[str, Any] | None = None, score_answers: bool = True,
             prepared: Mapping[int | None, Sequence[Sample]] | None = None) -> list[dict[str, Any]]:
    """Run `methods` side by side on the same inputs; return one row per (method, context length).

    Inputs: `samples` (e.g. `load_jsonl`) -- prompts longer than a context length are middle-truncated to
    it, and without a context length they run as they are -- or a `suite` ("synthetic", "synthetic-all",
    "ppl", "longbench:SUBSET", ...), with `tasks` choosing synthetic tasks (names or `synthetic.TaskConfig`s).
    `context_len` may be a list: every length gets its own rows (and its own synthetic samples; `prepared`
    {length: samples} gives them ready-made, as `suite_samples` makes them).
    Perplexity: `ppl_tokens` scored after `ppl_context` tokens (default: the row's context length, 2048
    without one), in each of `ppl_windows` consecutive, disjoint windows of the held-out corpus, pooled
    over every scored token (one cache per window); 0 tokens skips it.
    Files: with `out_dir`, writes <stem>.json/.csv/.md, <stem>_score_vs_kr.png and, when anything was
    generated, <stem>_predictions.jsonl (the JSON at `json_path` instead when given). `extra` fields are
    copied into every row.
    `reference`: the full cache's records of an earlier run (its predictions file) on the same backbone. A
    sample they hold -- same context length, id, answers, seed, prompt length and generation budget -- takes
    the stored full-cache answer instead of generating it again (greedy decoding of the same model gives
    the same answer; the record keeps its original timings and says it was reused); any other sample runs.
    `score_answers`: also score each sample's gold answer teacher-forced through every method's cache
    (`answer_nll`; a snapshot of the cache after the prefill, so generation is unchanged).
    """
    from tqdm.auto import tqdm

    methods = list(dict.fromkeys(methods))
    for m in methods:
        if not known_method(m):
            method_needs_codec(m)  # raises with the list of known methods
    methods = [REFERENCE] + [m for m in methods if m != REFERENCE]  # the reference runs first, always
    bits: dict[str, dict[str, Any]] = {}
    for m in methods:  # a method that cannot be built (no codec, no learnt starts) fails now, not hours in
        built = build_method_cache(m, model, codec, base_config)
        if codec is not None and method_needs_codec(m):
            served = getattr(getattr(built, "config", None), "bits", None)
            bits[m] = {"latent_bits": served, "codec_bits": codec.config.bits}
            if served is not None and served != codec.config.bits:
                # a codec learns its weights for its own grid: another width is post-training quantisation
                print(f"[rkv eval] {m} serves INT{served} latents from a codec trained at INT{codec.config.bits}: "
                      f"its row measures the codec on a grid it was not trained for (train one with --bits {served} "
                      "for that setting)", file=sys.stderr)
    lengths: list[int | None] = list(context_len) if isinstance(context_len, (list, tuple)) else [context_len]
    stop = eos_ids(model, tokenizer)

    groups: list[tuple[int | None, list[Sample]]] = []
    for L in lengths:
        if samples is not None:
            groups.append((L, list(samples)))
        elif prepared is not None and L in prepared:  # generated by the caller (rkv eval: before the model loaded)
            groups.append((L, list(prepared[L])))
        else:
            groups.append((L, suite_samples(suite, tokenizer, L, n_samples, seed, tasks)))
    ppl_runs = ppl_tokens > 0
    if ppl_runs and ppl_windows < 1:
        raise InputError(f"ppl_windows={ppl_windows}: score at least one window (or set ppl_tokens=0)")
    total = (sum(len(s) for _, s in groups) * len(methods)
             + (len(groups) * len(methods) * ppl_windows if ppl_runs else 0))

    stored = _reference_index(reference, seed)
    records: list[dict[str, Any]] = []
    ppl_results: dict[tuple[str, int], dict[str, Any]] = {}
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, desc="eval", unit="run", dynamic_ncols=True)
    try:
        for L, group in groups:
            for sample in group:
                ids = truncate_middle(encode_prompt(tokenizer, sample), L)
                budget = generation_budget(tokenizer, sample, min_new_tokens)
                gold = gold_answer_ids(tokenizer, sample) if score_answers else None
                inputs = inputs_sha(ids, gold)
                for m in methods:
                    bar.set_postfix_str(f"{L or ''} {sample.task} {m}")
                    known = (stored.get((L, sample.id, tuple(sample.answers), len(ids), budget, inputs))
                             if m == REFERENCE else None)
                    if known is not None:
                        records.append(known)
                        bar.update(1)
                        continue
                    cache = build_method_cache(m, model, codec, base_config)
                    t0 = time.perf_counter()
                    g = greedy(model, tokenizer, cache, ids, budget, stop, gold)
                    wall = time.perf_counter() - t0 - g.answer_nll_s
                    rep = measure(cache)
                    records.append({
                        "method": m, "context_len": L, "id": sample.id, "task": sample.task,
                        "score": score_prediction(g.text, sample.answers, sample.metric), "prediction": g.text,
                        "answers": sample.answers, "metric": sample.metric, "prompt_tokens": len(ids),
                        "new_tokens": len(g.token_ids), "max_new_tokens": budget, "prefill_s": g.prefill_s,
                        "decode_s": g.decode_s, "decode_steps": g.decode_steps, "wall_s": wall, "kr_measured": rep["kr_measured"],
                        "kr_formula": rep.get("kr_formula"), "cr": rep["cr"], "seed": seed,
                        "working_vs_fp16": rep.get("working_vs_fp16", 0.0),
                        "answer_nll": g.answer_nll, "answer_tokens": g.answer_tokens, "answer_nll_s": g.answer_nll_s,
                        "inputs_sha": inputs,
                    })
                    del cache
                    bar.update(1)
            if ppl_runs:
                n_ctx = ppl_context or L or 2048
                n_win = n_ctx + ppl_tokens
                windows = heldout_ids(tokenizer, n_win * ppl_windows).view(ppl_windows, 1, n_win)
                for m in methods:
                    bar.set_postfix_str(f"{L or ''} ppl@{n_ctx} {m}")
                    key = (m, n_ctx)
                    if key in ppl_results:
                        bar.update(ppl_windows)
                        continue
                    parts = []
                    for w in windows:
                        cache = build_method_cache(m, model, codec, base_config)
                        t0 = time.perf_counter()
                        res = cache_perplexity(model, cache, w, n_ctx)
                        res["wall_s"] = time.perf_counter() - t0
                        rep = measure(cache)
                        res.update({k: rep.get(k) for k in ("kr_measured", "kr_formula", "cr")})
                        res["working_vs_fp16"] = rep.get("working_vs_fp16", 0.0)
                        parts.append(res)
                        del cache
                        bar.update(1)
                    ppl_results[key] = _pool_windows(parts, n_ctx)
    finally:
        bar.close()

    rows = summarize(records, ppl_results, methods, lengths, ppl_context if ppl_runs else None, ppl_tokens)
    for r in rows:
        r.update(bits.get(r["method"], {"latent_bits": None, "codec_bits": None}))
        r.update(extra or {})
    if out_dir is not None or json_path is not None:
        from .report import write_outputs

        write_outputs(rows, out_dir=out_dir, stem=stem, json_path=json_path, records=records)
    return rows


def inputs_sha(prompt_ids: Sequence[int], gold_ids: Sequence[int] | None) -> str:
    """What a full-cache record was computed from: the prompt's tokens and the gold answer's (answer_nll)."""
    text = ",".join(map(str, prompt_ids)) + "|" + ("-" if gold_ids is None else ",".join(map(str, gold_ids)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _reference_index(reference: Sequence[dict[str, Any]] | None, seed: int) -> dict[tuple, dict[str, Any]]:
    """An earlier run's full-cache records of this seed, by what makes a generation the same one: the
    sample's id, answers, prompt length and budget, and the hash of the very tokens it read (synthetic
    answers do not depend on the haystack, so two prompts can share everything else). Records written
    before the hash existed are never reused: their samples run again."""
    out, unhashed = {}, 0
    for r in reference or ():
        if r.get("method") == REFERENCE and r.get("seed", seed) == seed:
            if not r.get("inputs_sha"):
                unhashed += 1
                continue
            key = (r.get("context_len"), r.get("id"), tuple(r.get("answers") or ()), r.get("prompt_tokens"),
                   r.get("max_new_tokens"), r["inputs_sha"])
            out[key] = {**r, "seed": seed, "reused": True}
    if unhashed:
        print(f"[rkv eval] {unhashed} earlier full-cache records carry no inputs_sha (written before 2026-12-06): "
              "not reused (their samples run again unless another --full-from file holds them with the hash)", file=sys.stderr)
    return out


def sample_key(record: dict[str, Any]) -> tuple:
    """One sample of a predictions record: ids restart at 0 every seed, the answers do not."""
    return record.get("context_len"), record["id"], tuple(record["answers"]), record.get("seed")


def answer_key(record: dict[str, Any]) -> tuple:
    """sample_key plus the gold answer its answer_nll scored (samples.gold_basis): two records' answer NLLs
    pair only where both scored the same answer, so rows from before 2026-12-06 never pair with newer ones
    on the tasks whose gold answer changed that day."""
    return (*sample_key(record), gold_basis(record))


def _by_length(records: Sequence[dict[str, Any]]):
    """(context length, its records) for each length the records hold, in their order."""
    for L in dict.fromkeys(r.get("context_len") for r in records):
        yield L, [r for r in records if r.get("context_len") == L]


def compare_by_length(records: Sequence[dict[str, Any]], a: str, b: str) -> list[dict[str, Any]]:
    """stats.compare of methods a and b (relative to the full cache) at each context length the records hold,
    with the difference of their answer NLL (stats.mean_difference) beside it."""
    out = []
    for L, recs in _by_length(records):
        nll = mean_difference(recs, a, b, answer_key)
        out.append({"context_len": L, **compare(recs, a, b, REFERENCE, sample_key),
                    "answer_nll_difference": nll["difference"], "answer_nll_ci": nll["ci"],
                    "answer_nll_p_a_lower": nll["p_a_lower"], "answer_nll_samples": nll["n_samples"]})
    return out


def compare_recipes_by_length(records: Sequence[dict[str, Any]], runs_a: Sequence[str], runs_b: Sequence[str]
                              ) -> list[dict[str, Any]]:
    """stats.compare_recipes (each recipe: several training runs, each a method) at each context length."""
    return [{"context_len": L, **compare_recipes(recs, runs_a, runs_b, REFERENCE, sample_key, nll_key=answer_key)}
            for L, recs in _by_length(records)]


def pool_records(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The per-sample records of several runs (predictions files) as one run, for scores over more samples
    than one run holds: a sample that several runs share (the full cache's rows of jobs run side by side on
    the same seed) counts once (a sample: `sample_key`, per method). Refuses a sample that two runs
    answered differently under one method name (two codecs evaluated as `residualkv`): pooling them would
    mix methods. Records written before predictions carried a seed take the seed of the record with
    the same id and answers, so they pool with newer runs of the same samples; of two records of one sample,
    the one with inputs_sha is kept (its answer NLL pairs with today's rows)."""
    seeds: dict[tuple, set] = defaultdict(set)
    for run in runs:
        for r in run:
            if r.get("seed") is not None:
                seeds[sample_key(r)[:3]].add(r["seed"])
    pooled: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        for r in run:
            known = seeds.get(sample_key(r)[:3], set())
            if r.get("seed") is None and len(known) == 1:
                r = r | {"seed": next(iter(known))}
            key = (r["method"], *sample_key(r))
            old = pooled.setdefault(key, r)
            if old is not r and (old["prediction"], old["score"]) != (r["prediction"], r["score"]):
                raise ValueError(f"sample {r['id']} (context {r.get('context_len')}) has two different answers under "
                                 f"method {r['method']!r}: {old['prediction']!r} and {r['prediction']!r}; these runs "
                                 "evaluated different things under one name, pool them separately")
            if old is not r and r.get("inputs_sha") and not old.get("inputs_sha"):
                pooled[key] = r  # the same answer, and an answer_nll on the current gold answer (answer_key)
    return list(pooled.values())


def pooled_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Contract rows from pooled records (`pool_records`): each method scored relative to the full cache
    on the samples that method ran (runs pooled from different sets give methods different samples), the
    full cache's own row over all of its samples."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    lengths = list(dict.fromkeys(r.get("context_len") for r in records))
    rows = summarize(records, {}, [REFERENCE], lengths)
    for m in methods:
        if m == REFERENCE:
            continue
        mine = {sample_key(r) for r in records if r["method"] == m}
        same = [r for r in records if r["method"] == m or (r["method"] == REFERENCE and sample_key(r) in mine)]
        rows += [r for r in summarize(same, {}, [REFERENCE, m], lengths) if r["method"] == m and r["n_samples"]]
    return sorted(rows, key=lambda r: (lengths.index(r["context_len"]), methods.index(r["method"])))


def _answer_nll_fields(recs: list[dict[str, Any]], m: str, task_names: list[str]) -> dict[str, Any]:
    by_task = defaultdict(list)
    for r in recs:
        if r["method"] == m and r.get("answer_nll") is not None:
            by_task[r["task"]].append(r["answer_nll"])
    nll = _mean([sum(v) / len(v) for t in task_names if (v := by_task.get(t))])
    delta = mean_difference(recs, m, REFERENCE, answer_key) if nll is not None and m != REFERENCE else None
    return {"answer_nll": nll, "answer_nll_delta": 0.0 if m == REFERENCE and nll is not None else
            (delta or {}).get("difference"), "answer_nll_delta_ci": (delta or {}).get("ci")}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _pool_windows(parts: list[dict[str, Any]], n_ctx: int) -> dict[str, Any]:
    """Perplexity over several windows: the mean NLL of every scored token; KR and CR averaged."""
    tokens = sum(p["tokens"] for p in parts)
    nll = sum(p["nll"] * p["tokens"] for p in parts) / tokens
    return {"nll": nll, "ppl": math.exp(nll), "tokens": tokens, "windows": len(parts), "ppl_context": n_ctx,
            "wall_s": sum(p["wall_s"] for p in parts), "prefill_s": sum(p["prefill_s"] for p in parts),
            "decode_s": sum(p["decode_s"] for p in parts), "kr_measured": _mean([p["kr_measured"] for p in parts]),
            "kr_formula": _mean([p.get("kr_formula") for p in parts]), "cr": _mean([p["cr"] for p in parts]),
            "working_vs_fp16": _mean([p.get("working_vs_fp16") for p in parts])}


def summarize(records: list[dict[str, Any]], ppl_results: dict[tuple[str, int], dict[str, Any]],
              methods: Sequence[str], lengths: Sequence[int | None], ppl_context: int | None = None,
              ppl_tokens: int = 0) -> list[dict[str, Any]]:
    """Aggregate per-run records into the contract rows (see the module docstring for every field)."""
    rows: list[dict[str, Any]] = []
    for L in lengths:
        recs = [r for r in records if r["context_len"] == L]
        task_names = list(dict.fromkeys(r["task"] for r in recs))
        per: dict[str, dict[str, float]] = {}
        for m in methods:
            by_task = defaultdict(list)
            for r in recs:
                if r["method"] == m:
                    by_task[r["task"]].append(r["score"])
            per[m] = {t: sum(v) / len(v) for t, v in by_task.items()}
        ref = per.get(REFERENCE, {})
        signal = [t for t in task_names if ref.get(t, 0) > 0]
        n_ctx = ppl_context or L or 2048
        ref_ppl = ppl_results.get((REFERENCE, n_ctx))
        for m in methods:
            mine = [r for r in recs if r["method"] == m]
            scores = per[m]
            score = _mean([scores.get(t) for t in task_names]) if task_names else None
            rel = (sum(scores.get(t, 0.0) for t in signal) / sum(ref[t] for t in signal)) if signal else None
            ppl = ppl_results.get((m, n_ctx))
            kr_src = mine if mine else ([ppl] if ppl else [])
            steps, decode_s = sum(r["decode_steps"] for r in mine), sum(r["decode_s"] for r in mine)
            row: dict[str, Any] = {
                "method": m,
                "context_len": L,
                "kr_measured": _mean([r["kr_measured"] for r in kr_src]),
                "kr_formula": _mean([r.get("kr_formula") for r in kr_src]),
                # a sample that decoded nothing (its first token ended it) measured no sparse read
                "cr": _mean([r["cr"] for r in kr_src if r.get("decode_steps", 1)] or [r["cr"] for r in kr_src]),
                "working_vs_fp16": _mean([r.get("working_vs_fp16") for r in kr_src]),
                "score": score,
                "rel_score": rel,
                "rel_score_ci": (rel_score_interval(recs, m, REFERENCE, sample_key)
                                 if rel is not None and m != REFERENCE and all("id" in r for r in recs) else None),
                "tasks": {t: scores.get(t) for t in task_names},
                "rel_tasks": {t: (scores.get(t, 0.0) / ref[t] if t in signal else None) for t in task_names},
                "tasks_without_signal": [t for t in task_names if t not in signal],
                "n_samples": len(mine),
                "reused_samples": sum(1 for r in mine if r.get("reused")),
                **_answer_nll_fields(recs, m, task_names),
                "ppl": ppl["ppl"] if ppl else None,
                "nll": ppl["nll"] if ppl else None,
                "ppl_rel": (ppl["ppl"] / ref_ppl["ppl"]) if ppl and ref_ppl else None,
                "ppl_context": ppl["ppl_context"] if ppl else None,
                "ppl_tokens": ppl["tokens"] if ppl else None,
                "ppl_windows": ppl["windows"] if ppl else None,
                "time_s": sum(r["wall_s"] for r in mine) + (ppl["wall_s"] if ppl else 0.0),
                "s_per_sample": _mean([r["wall_s"] for r in mine]),
                "prefill_tok_s": (sum(r["prompt_tokens"] for r in mine) / sum(r["prefill_s"] for r in mine)) if mine else None,
                "decode_tok_s": steps / decode_s if decode_s > 0 else None,
                "ppl_decode_tok_s": (ppl["tokens"] / ppl["decode_s"]) if ppl and ppl["decode_s"] > 0 else None,
                "kr_source": ("mean over samples of accounting.report after prefill + generation" if mine else
                              "accounting.report after the perplexity run" if ppl else None),
            }
            rows.append(row)
    return rows
