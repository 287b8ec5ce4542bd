"""`rkv eval`: every method side by side on the same inputs; JSON rows + CSV, markdown and a plot.

    rkv eval --backbone smollm2-135m --methods full,kivi2,snapkv,residualkv --context-len 2048,4096 --json out/eval.json
    rkv eval --methods full,kivi4 --tasks my_tasks.jsonl --json out/mine.json
    rkv eval --methods full,residualkv --suite ppl --ppl-context 4096 --ppl-tokens 128 --json out/ppl.json
    rkv pool out/seed0_predictions.jsonl out/seed1_predictions.jsonl --json out/pooled.json

Contract (other tools rely on it): OUT is a JSON list of rows with at least
method, kr_measured, cr, score, rel_score (plus context_len, per-task scores, ppl, time). Without
--codec, methods that need one use the latest trained codec for the backbone (clear error if none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import InputError


def default_methods() -> str:
    """Every registered method but those that need `rkv lowram-init` first or are run only when named, plus
    the SnapKV baseline when the registry does not list it yet."""
    from ..methods import METHODS

    names = [name for name, m in METHODS.items() if m.in_default and not m.learnt_starts]
    return ",".join(names + ([] if "snapkv" in names else ["snapkv"]))


def _int_list(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--context-len takes integers, comma-separated (e.g. 2048,4096); got {text!r}") from None
    if not values or any(v < 16 for v in values):
        raise InputError(f"--context-len needs lengths of at least 16 tokens; got {text!r}")
    return values


def register(subparsers) -> None:
    from ..cli import at_least
    from .harness import VARIANTS_HELP

    e = subparsers.add_parser("eval", help="benchmark cache methods side by side (quality vs measured bytes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--backbone", default="smollm2-135m", help="registered name, backbone YAML, local folder or HF id")
    e.add_argument("--methods", default=None,
                   help="comma list of methods (default: every registered method and snapkv, but the lowram ones that "
                        "read `rkv lowram-init`'s starts); 'full' is always run "
                        "as the reference; " + VARIANTS_HELP.replace("%", "%%"))
    e.add_argument("--codec", default=None, help="codec directory or models:/NAME@ALIAS (default: latest trained)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--tasks", default=None, metavar="FILE.jsonl",
                     help='JSONL rows {"id","context","question","answers"} (+ "max_new_tokens", "answer_prefix", "metric")')
    src.add_argument("--suite", default=None,
                     help="synthetic (default), synthetic-all, ppl, or a hub benchmark "
                          "longbench|longbench-v2|ruler|scbench[:SUBSET][@OWNER/REPO]")
    e.add_argument("--synthetic-tasks", default=None, help="comma list of synthetic task names (instead of a suite's)")
    e.add_argument("--context-len", default=None,
                   help="prompt length(s) in tokens, comma-separated (default 2048 for synthetic suites; with --tasks "
                        "or a hub suite, longer prompts are middle-truncated to it)")
    e.add_argument("--json", required=True, metavar="OUT", help="write the result rows here (a JSON list)")
    e.add_argument("--n-samples", type=at_least(1, "samples"), default=5, help="samples per synthetic task (per hub benchmark: in total)")
    e.add_argument("--out-dir", default=None, help="CSV, markdown, plot and predictions (default: next to --json)")
    e.add_argument("--ppl-context", type=at_least(1, "tokens"), default=None, help="perplexity context tokens (default: each context length)")
    e.add_argument("--ppl-tokens", type=at_least(0, "tokens"), default=64, help="continuation tokens scored one by one (0 skips perplexity)")
    e.add_argument("--ppl-windows", type=at_least(1, "windows"), default=1,
                   help="disjoint held-out windows (context + continuation each) pooled into one perplexity")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--full-from", action="append", default=[], metavar="RUN_predictions.jsonl",
                   help="reuse the full cache's answers of an earlier run on the same backbone (its predictions "
                        "file; repeatable): samples it holds at the same seed, length and budget are not generated "
                        "again, the rest run as usual")
    e.add_argument("--threads", type=at_least(1, "threads"), default=None, help="torch CPU threads")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--no-answer-nll", action="store_true",
                   help="skip scoring each sample's gold answer teacher-forced through every cache (answer_nll)")
    e.set_defaults(func=cmd_eval)

    p = subparsers.add_parser("pool", help="pool the per-sample predictions of several rkv eval runs into one result",
                              description="Scores over more samples than one run holds (e.g. --seed 0 and --seed 1 runs, "
                                          "or methods run as parallel jobs): rows as rkv eval writes them, computed "
                                          "from every sample of every run, shared samples counted once.")
    p.add_argument("predictions", nargs="+", metavar="RUN_predictions.jsonl[:METHODS]",
                   help="the _predictions.jsonl of each run; ':m1,m2' after a file takes only those methods from it "
                        "(and its full-cache rows), e.g. when another run scored a different variant under the same name; "
                        "':m1=name' takes m1 under another name (two codecs both run as residualkv-standalone)")
    p.add_argument("--methods", default=None, help="comma list: pool only these methods (the full cache is always kept)")
    p.add_argument("--json", required=True, metavar="OUT", help="write the pooled rows here (the rkv eval contract)")
    p.add_argument("--compare", action="append", default=[], metavar="A,B",
                   help="rel_score of A minus B on the samples both ran, with a paired bootstrap interval and the "
                        "share of resamples where A is ahead, per context length (repeatable; written to "
                        "<OUT stem>_compare.json)")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=M1,M2,...",
                   help="name the methods that are training runs of one recipe (repeatable), for --compare-recipes")
    p.add_argument("--compare-recipes", action="append", default=[], metavar="A,B",
                   help="recipe A's mean over its runs minus recipe B's, in rel_score and answer NLL, with intervals "
                        "that draw the samples and each recipe's runs (repeatable; written to <OUT stem>_recipes.json)")
    p.set_defaults(func=cmd_pool)


def _recipes(args, records) -> list[tuple[str, str, list[str], list[str]]]:
    """--recipe and --compare-recipes checked against the pooled records: [(A, B, runs of A, runs of B)]."""
    recipes: dict[str, list[str]] = {}
    for spec in args.recipe:
        name, _, methods = spec.partition("=")
        runs = [m.strip() for m in methods.split(",") if m.strip()]
        if not name.strip() or not runs:
            raise InputError(f"--recipe {spec!r}: write NAME=M1,M2,... (the methods that are runs of recipe NAME)")
        if name.strip() in recipes:
            raise InputError(f"--recipe {name.strip()!r} is given twice: name each recipe once")
        missing = [m for m in runs if not any(r["method"] == m for r in records)]
        if missing:
            raise InputError(f"--recipe {spec!r}: no rows of method(s) {missing} in these runs (name a run with "
                             "FILE:residualkv-standalone=RUN)")
        recipes[name.strip()] = runs
    pairs = []
    for spec in args.compare_recipes:
        names = [m.strip() for m in spec.split(",")]
        if len(names) != 2 or not all(names):
            raise InputError(f"--compare-recipes {spec!r}: give two recipe names, A,B")
        unknown = [n for n in names if n not in recipes]
        if unknown:
            raise InputError(f"--compare-recipes {spec!r}: recipe(s) {unknown} not named by --recipe NAME=M1,M2,...")
        if set(recipes[names[0]]) & set(recipes[names[1]]):
            raise InputError(f"--compare-recipes {spec!r}: the two recipes share runs "
                             f"{sorted(set(recipes[names[0]]) & set(recipes[names[1]]))}")
        pairs.append((names[0], names[1], recipes[names[0]], recipes[names[1]]))
    return pairs


def _print_recipe_comparison(a: str, b: str, c: dict) -> None:
    L = c["context_len"]
    if c["difference"] is None:
        print(f"recipe {a} - {b} at {L} tokens: too few shared samples (at least 2 per task the full cache scores on)")
    else:
        runs = ", ".join(f"{m} {v:.3f}" for m, v in c["rel_runs"].items())
        n_a, n_b = (f"{len(c[k])} run{'s' * (len(c[k]) > 1)}" for k in "ab")
        print(f"recipe {a} ({n_a}) - {b} ({n_b}) at {L} tokens, {c['n_samples']} shared "
              f"samples: rel. score {c['rel_a']:.3f} - {c['rel_b']:.3f} = {c['difference']:+.3f} (95% CI "
              f"{c['ci'][0]:+.3f} .. {c['ci'][1]:+.3f}, samples and runs drawn); {a} ahead in {c['p_a_ahead']:.0%} "
              f"of resamples; runs: {runs}")
    if c["answer_nll_difference"] is not None:
        ci = ("" if c["answer_nll_ci"] is None else
              f" (95% CI {c['answer_nll_ci'][0]:+.3f} .. {c['answer_nll_ci'][1]:+.3f})")
        runs = ", ".join(f"{m} {v:.3f}" for m, v in c["answer_nll_runs"].items())
        print(f"  answer NLL, recipe {a} - {b}, {c['answer_nll_samples']} shared samples: "
              f"{c['answer_nll_difference']:+.3f} nats/token{ci}; runs: {runs}")
    if min(len(c["a"]), len(c["b"])) < 3:
        print("  (a recipe with fewer than 3 runs: the run draw understates the training spread; see the runs)")


def cmd_pool(args) -> int:
    import json

    from .harness import REFERENCE, compare_by_length, compare_recipes_by_length, pool_records, pooled_rows
    from .report import markdown_table, read_predictions, write_outputs

    runs = []
    for spec in args.predictions:
        f, only = Path(spec), None
        if not f.is_file() and ":" in spec and Path(spec.rsplit(":", 1)[0]).is_file():
            path, names = spec.rsplit(":", 1)
            # 'method=alias' takes a method under another name: two codecs run as the same method compare
            picks = [m.strip().split("=", 1) for m in names.split(",") if m.strip()]
            f, only = Path(path), {pick[0].strip(): pick[-1].strip() for pick in picks} | {REFERENCE: REFERENCE}
        if not f.is_file():
            raise InputError(f"{spec}: no such predictions file (rkv eval writes <stem>_predictions.jsonl next to --json)")
        try:
            run = read_predictions(f)
        except json.JSONDecodeError as err:
            raise InputError(f"{spec}: not a predictions JSONL ({err})") from None
        runs.append(run if only is None else [r | {"method": only[r.get("method")]} for r in run if r.get("method") in only])
    if args.methods:  # before pooling: a run may hold another variant under a name left out here
        wanted = {m.strip() for m in args.methods.split(",") if m.strip()} | {REFERENCE}
        runs = [[r for r in run if r.get("method") in wanted] for run in runs]
    try:
        records = pool_records(runs)
    except (KeyError, TypeError) as err:
        raise InputError(f"a predictions row lacks the field {err}: pass the _predictions.jsonl files of rkv eval runs") from None
    except ValueError as err:
        raise InputError(str(err)) from None
    if not any(r["method"] == REFERENCE for r in records):
        raise InputError(f"no {REFERENCE!r} rows in these runs: scores are relative to the full cache, which every rkv eval run records")
    pairs = []
    for spec in args.compare:
        names = [m.strip() for m in spec.split(",")]
        if len(names) != 2 or not all(names):
            raise InputError(f"--compare {spec!r}: give two method names, A,B")
        missing = [m for m in names if not any(r["method"] == m for r in records)]
        if missing:
            raise InputError(f"--compare {spec!r}: no rows of method(s) {missing} in these runs")
        pairs.append(names)
    recipe_pairs = _recipes(args, records)
    rows = pooled_rows(records)
    sources = [str(p) for p in args.predictions]
    for r in rows:
        r.update({"pooled_from": sources, "seeds": sorted({x.get("seed") for x in records if x.get("seed") is not None})})
    json_path = Path(args.json)
    write_outputs(rows, json_path=json_path, stem=json_path.stem, records=records)
    print(markdown_table(rows))
    if pairs:
        out = []
        for a, b in pairs:
            for c in compare_by_length(records, a, b):
                out.append(c)
                L = c["context_len"]
                if c["difference"] is None:
                    print(f"{a} - {b} at {L} tokens: too few shared samples (at least 2 per task the full cache scores on)")
                else:
                    print(f"{a} - {b} at {L} tokens, {c['n_samples']} shared samples: {c['difference']:+.3f} "
                          f"(95% CI {c['ci'][0]:+.3f} .. {c['ci'][1]:+.3f}); {a} ahead in {c['p_a_ahead']:.0%} "
                          "of resamples")
                if c["answer_nll_difference"] is not None:
                    ci = ("" if c["answer_nll_ci"] is None else
                          f" (95% CI {c['answer_nll_ci'][0]:+.3f} .. {c['answer_nll_ci'][1]:+.3f}); {a} lower in "
                          f"{c['answer_nll_p_a_lower']:.0%} of resamples")
                    print(f"  answer NLL, {a} - {b}, {c['answer_nll_samples']} shared samples: "
                          f"{c['answer_nll_difference']:+.3f} nats/token{ci}")
        (json_path.parent / f"{json_path.stem}_compare.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if recipe_pairs:
        out = []
        for a, b, runs_a, runs_b in recipe_pairs:
            for c in compare_recipes_by_length(records, runs_a, runs_b):
                out.append({"recipe_a": a, "recipe_b": b, **c})
                _print_recipe_comparison(a, b, c)
        (json_path.parent / f"{json_path.stem}_recipes.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"[rkv pool] {len(records)} samples from {len(runs)} runs -> {json_path} (+ .csv, .md, plot, predictions)",
          file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    import torch

    from ..backbones import load_backbone, load_tokenizer
    from ..cli import base_config, check_codec_ref, latest_codec_path, resolve_codec
    from .harness import VARIANTS_HELP, check_suite, evaluate, known_method, method_needs_codec, suite_samples
    from .report import markdown_table
    from .samples import load_jsonl

    methods = [m.strip() for m in (args.methods or default_methods()).split(",") if m.strip()]
    for m in methods:
        if not known_method(m):
            try:
                method_needs_codec(m)
            except ValueError as err:
                raise InputError(f"{err}, snapkv, and variants: {VARIANTS_HELP}") from None
    lengths = _int_list(args.context_len)
    samples = load_jsonl(args.tasks) if args.tasks else None
    suite = args.suite or "synthetic"
    tasks = [t.strip() for t in args.synthetic_tasks.split(",")] if args.synthetic_tasks else None
    if samples is None and check_suite(suite, tasks) is not None:
        # a hub benchmark needs no tokenizer: fetched before the model, so a bad name fails in seconds
        samples = suite_samples(suite, None, None, args.n_samples, args.seed)
    if samples is None and lengths is None and (suite.startswith("synthetic") or tasks or suite == "ppl"):
        lengths = [2048]
    if args.threads:
        torch.set_num_threads(args.threads)

    reference = _full_records(args.full_from, args.backbone)  # its files checked before the model loads
    needs_codec = any(method_needs_codec(m) for m in methods)
    if needs_codec and args.codec is None:
        _fail_early_without_codec(args.backbone)
    elif needs_codec:
        check_codec_ref(args.codec)
    prepared = None
    if samples is None and lengths and check_suite(suite, tasks) is None and suite != "ppl":
        # the synthetic samples need only the tokenizer: made before the model loads, so a task too long
        # for --context-len fails in seconds
        tokenizer = load_tokenizer(args.backbone)
        if tokenizer is not None:
            prepared = {L: suite_samples(suite, tokenizer, L, args.n_samples, args.seed, tasks) for L in lengths}
    print(f"[rkv eval] loading {args.backbone}", file=sys.stderr, flush=True)
    model, tok, spec = load_backbone(args.backbone)
    cfg = base_config(spec)
    codec, codec_note = None, None
    if needs_codec:
        codec = resolve_codec(args.codec, model, spec)  # CodecError with how to train one when there is none
        codec_note = args.codec or (latest_codec_path(spec.name) if spec else None) or "latest trained"
    json_path = Path(args.json)
    rows = evaluate(model, tok, methods, codec, cfg, samples=samples, suite=suite, tasks=tasks,
                    context_len=lengths if lengths is None or len(lengths) > 1 else lengths[0],
                    n_samples=args.n_samples, seed=args.seed, ppl_context=args.ppl_context,
                    ppl_tokens=args.ppl_tokens, ppl_windows=args.ppl_windows, reference=reference,
                    out_dir=args.out_dir or json_path.parent, stem=json_path.stem,
                    json_path=json_path, progress=not args.no_progress, score_answers=not args.no_answer_nll,
                    extra={"backbone": args.backbone, "codec": str(codec_note) if codec_note else None,
                           "suite": args.tasks or suite, "seed": args.seed}, prepared=prepared)
    print(markdown_table(rows))
    print(f"[rkv eval] wrote {json_path} (+ .csv, .md, _score_vs_kr.png, _predictions.jsonl in "
          f"{args.out_dir or json_path.parent})", file=sys.stderr)
    return 0


def _full_records(paths: list[str], backbone: str) -> list[dict]:
    """The full-cache records of earlier runs' predictions files (--full-from), checked to come from
    `backbone` where the run's JSON beside them names one."""
    import json

    from .harness import REFERENCE
    from .report import read_predictions

    out = []
    for spec in paths:
        f = Path(spec)
        if not f.is_file():
            raise InputError(f"--full-from {spec}: no such predictions file (rkv eval writes <stem>_predictions.jsonl "
                             "next to --json)")
        rows_file = f.with_name(f.name.removesuffix("_predictions.jsonl") + ".json")
        if rows_file.is_file():
            named = {r.get("backbone") for r in json.loads(rows_file.read_text(encoding="utf-8")) if r.get("backbone")}
            if named and named != {backbone}:
                raise InputError(f"--full-from {spec}: that run evaluated {', '.join(sorted(named))}, not {backbone}; "
                                 "the full cache's answers belong to their backbone: drop --full-from or pass a run "
                                 f"of --backbone {backbone}")
        try:
            run = read_predictions(f)
        except json.JSONDecodeError as err:
            raise InputError(f"--full-from {spec}: not a predictions JSONL ({err})") from None
        out += [r for r in run if r.get("method") == REFERENCE]
    return out


def _fail_early_without_codec(backbone: str) -> None:
    """Say there is no codec before spending time loading the model (registered backbones only)."""
    from ..backbones import get_backbone
    from ..cli import latest_codec_path, resolve_codec

    try:
        spec = get_backbone(backbone)
    except (KeyError, FileNotFoundError, ValueError):
        return  # an HF id or a local folder: resolve_codec decides after loading
    if latest_codec_path(spec.name) is None:
        resolve_codec(None, None, spec)  # raises CodecError naming `rkv train --backbone ...`
