"""Quality benchmark of KV-cache methods against the FP16 full cache (SPEC §5).

    from residualkv.evaluation import evaluate
    rows = evaluate(model, tok, ["full", "kivi2", "snapkv", "residualkv"], codec, base_config,
                    suite="synthetic", context_len=[2048, 4096], out_dir="runs/eval")

Modules: samples (format, JSONL, prompts), scoring (string match), synthetic (RULER-style tasks),
perplexity (held-out text through the cache), hub (LongBench/RULER/SCBench loaders), harness (the
runner and the result rows), report (JSON/CSV/markdown/plot), cli (`rkv eval`).
"""

from .harness import build_method_cache, evaluate, measure, summarize
from .hub import load_benchmark, rows_to_samples
from .samples import Sample, encode_prompt, load_jsonl, prompt_text
from .scoring import score
from .synthetic import SUITES, TASKS, SyntheticGenerator

__all__ = ["evaluate", "build_method_cache", "measure", "summarize", "load_benchmark", "rows_to_samples", "Sample",
           "encode_prompt", "load_jsonl", "prompt_text", "score", "SUITES", "TASKS", "SyntheticGenerator"]
