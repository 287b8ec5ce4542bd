"""Measurement tasks over a trained codec: the KR/CR table, the quality benchmark, decode throughput.

Each is cached by input hash (backbone fingerprint, codec weights sha256, settings, source of the code
it runs): a re-run of the flow reuses a finished measurement. `bench-regress` passes use_cache=False.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from residualkv.codec import META, ResidualCodec

from .cache import cached_step, code_hash
from .common import backbone_identity, cache_defaults, shared_backbone



KR_CR_DECODE_STEPS = 8  # greedy steps after the prefill, so the table's CR is measured, not the prefill's 1.0


def _bar(total: int, desc: str):
    """A progress bar on stderr, as the evaluation's: these steps run for minutes without other output."""
    from tqdm.auto import tqdm

    return tqdm(total=total, file=sys.stderr, desc=desc, unit="run", dynamic_ncols=True)


def _codec_sha(codec_dir: str | None) -> str:
    if not codec_dir:
        return ""
    return json.loads((Path(codec_dir) / META).read_text()).get("weights_sha256", "")


def _load(backbone_ref: str, codec_dir: str | None):
    model, tokenizer, spec = shared_backbone(backbone_ref)
    codec = ResidualCodec.load(codec_dir, model_config=model.config) if codec_dir else None
    return model, tokenizer, spec, codec


# ---------------------------------------------------------------------------------------------- KR / CR


def measure_kr_cr(backbone_ref: str, codec_dir: str | None, config: dict[str, Any], *, use_cache: bool = True) -> dict[str, Any]:
    model, tokenizer, spec, codec = _load(backbone_ref, codec_dir)
    payload = {"backbone": backbone_identity(model, spec), "codec": _codec_sha(codec_dir),
               "config": {k: config[k] for k in ("methods", "context_lens")},
               "code": code_hash("tasks.measure", "tasks.common")}

    def compute(folder: Path) -> dict[str, Any]:
        from residualkv.cli import context_ids, prefill_then_decode
        from residualkv.evaluation import build_method_cache, measure

        base = cache_defaults(spec)
        n_layers = model.config.num_hidden_layers
        beta = len(base.full_attention_layers) / n_layers
        rows = []
        bar = _bar(len(config["context_lens"]) * len(config["methods"]), "KR/CR table")
        for L in config["context_lens"]:
            ids = context_ids(tokenizer, int(L))
            for m in config["methods"]:
                bar.set_postfix_str(f"{m} @ {L}")
                cache = build_method_cache(m, model, codec, base)
                prefill_then_decode(model, ids, cache, KR_CR_DECODE_STEPS)
                rep = measure(cache)
                bar.update()
                rows.append({"method": m, "context_len": int(L), "decode_steps": KR_CR_DECODE_STEPS,
                             "kr_measured": rep["kr_measured"],
                             "kr_formula": rep.get("kr_formula", rep["kr_measured"]), "cr": rep["cr"],
                             "total_bytes": rep.get("total_bytes"), "fp16_bytes": rep.get("fp16_bytes"),
                             "kr_gap_unexplained": rep.get("unexplained"),
                             "kr_window": (rep.get("gap") or {}).get("recent_window_fp16", 0.0),
                             "kr_gap": json.dumps(rep.get("gap") or {}, sort_keys=True)})
        bar.close()
        (folder / "kr_cr.json").write_text(json.dumps(rows, indent=2))
        return {"rows": rows, "beta": beta, "full_attention_layers": list(base.full_attention_layers),
                "num_layers": n_layers}

    return cached_step("kr_cr", payload, compute, use_cache=use_cache)


@task(name="kr-cr-table", cache_policy=NO_CACHE)
def kr_cr_table(backbone_ref: str, codec_dir: str | None, config: dict[str, Any]) -> dict[str, Any]:
    """Measured KR, the seed's formula KR, and CR of every method after a prefill at each context length."""
    return measure_kr_cr(backbone_ref, codec_dir, config)


# ---------------------------------------------------------------------------------------------- quality


def run_evaluation(backbone_ref: str, codec_dir: str | None, config: dict[str, Any], *, use_cache: bool = True,
                   progress: bool = True) -> dict[str, Any]:
    model, tokenizer, spec, codec = _load(backbone_ref, codec_dir)
    options = dict(config.get("options") or {})
    payload = {"backbone": backbone_identity(model, spec), "codec": _codec_sha(codec_dir),
               "methods": list(config["methods"]), "options": options,
               "code": code_hash("tasks.measure", "tasks.common")}

    def compute(folder: Path) -> dict[str, Any]:
        from residualkv.evaluation import evaluate

        t0 = time.perf_counter()
        rows = evaluate(model, tokenizer, list(config["methods"]), codec, cache_defaults(spec), out_dir=folder,
                        stem="benchmark", progress=progress, **options)
        return {"rows": rows, "files": sorted(str(p) for p in folder.glob("benchmark*")),
                "seconds": time.perf_counter() - t0}

    return cached_step("evaluate", payload, compute, use_cache=use_cache)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_codec(backbone_ref: str, codec_dir: str | None, config: dict[str, Any]) -> dict[str, Any]:
    """The quality benchmark (residualkv.evaluation.evaluate): every method side by side on the same inputs."""
    return run_evaluation(backbone_ref, codec_dir, config)


# ---------------------------------------------------------------------------------------------- speed


def _decode_run(model, cache, ids, n_new: int) -> tuple[float, list[float]]:
    import torch

    from residualkv.memory import prefill as run_prefill

    n = ids.shape[1]
    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = run_prefill(model, cache, ids)
        prefill = time.perf_counter() - t0
        steps = []
        for i in range(n_new):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True,
                        position_ids=torch.tensor([[n + i]], device=ids.device))
            nxt = out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t0)
    return prefill, steps


def measure_throughput(backbone_ref: str, codec_dir: str | None, config: dict[str, Any], *, use_cache: bool = True,
                       gpu_bench: bool = True) -> dict[str, Any]:
    """Prefill and decode tokens/s, methods side by side in one process, rounds interleaved (CPU here), and
    each method's tensor memory (prefill peak, decode-step peak, cache held; residualkv.memory).

    With CUDA present and `gpu_bench`, `benchmarks/gpu_bench.py` (the Triton kernels' benchmark) is also
    run when it exists; its JSON is attached.
    """
    import torch

    model, tokenizer, spec, codec = _load(backbone_ref, codec_dir)
    payload = {"backbone": backbone_identity(model, spec), "codec": _codec_sha(codec_dir),
               "config": {k: config[k] for k in ("methods", "context_lens", "new_tokens", "repeats")},
               "host": platform.node(), "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
               "code": code_hash("tasks.measure", "tasks.common")}

    def compute(folder: Path) -> dict[str, Any]:
        from residualkv.cli import context_ids
        from residualkv.evaluation import build_method_cache
        from residualkv.memory import cache_memory

        base = cache_defaults(spec)
        rows = []
        repeats = int(config.get("repeats", 1))
        # per length: the timed rounds, then one memory pass per method
        bar = _bar(len(config["context_lens"]) * len(config["methods"]) * (repeats + 1), "throughput")
        for L in config["context_lens"]:
            ids = context_ids(tokenizer, int(L))
            per = {m: {"prefill": [], "steps": []} for m in config["methods"]}
            for k in range(repeats):
                for m in config["methods"]:  # interleaved: load on the shared CPU hits every method alike
                    bar.set_postfix_str(f"{m} @ {L}, round {k + 1}/{repeats}")
                    cache = build_method_cache(m, model, codec, base)
                    prefill, steps = _decode_run(model, cache, ids, int(config["new_tokens"]))
                    per[m]["prefill"].append(prefill)
                    per[m]["steps"].extend(steps[1:] or steps)  # the first step pays for warm-up
                    del cache
                    bar.update()
            full_tok_s = None
            for m in config["methods"]:
                step = statistics.median(per[m]["steps"])
                # tensor memory from a pass of its own: tracing allocations slows the run it watches
                bar.set_postfix_str(f"{m} @ {L}, tensor memory")
                mem = cache_memory(model, build_method_cache(m, model, codec, base), ids)
                bar.update()
                row = {"method": m, "context_len": int(L), "device": "cpu", "threads": torch.get_num_threads(),
                       "prefill_tok_s": int(L) / statistics.median(per[m]["prefill"]), "decode_tok_s": 1.0 / step,
                       "decode_ms_per_token": 1000 * step, "decode_steps_timed": len(per[m]["steps"]),
                       **{k: mem[k] for k in ("prefill_peak_mib", "decode_step_peak_mib", "cache_held_mib")}}
                if m == "full":
                    full_tok_s = row["decode_tok_s"]
                rows.append(row)
            for r in rows:
                if r["context_len"] == int(L) and full_tok_s:
                    r["decode_speedup_vs_full"] = r["decode_tok_s"] / full_tok_s
        bar.close()
        result: dict[str, Any] = {"rows": rows, "gpu": None}
        if torch.cuda.is_available() and gpu_bench:
            result["gpu"] = _gpu_bench(folder, config)
        (folder / "throughput.json").write_text(json.dumps(result, indent=2))
        return result

    return cached_step("throughput", payload, compute, use_cache=use_cache)


def _gpu_bench(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    from residualkv.paths import repo_root

    root = repo_root()
    script = (root / config.get("gpu_script", "benchmarks/gpu_bench.py")) if root else None
    if script is None or not script.is_file():
        return {"status": "skipped", "reason": f"no GPU benchmark script at {script}"}
    out = folder / "gpu"
    proc = subprocess.run([sys.executable, str(script), "--out", str(out), "--skip-tests"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    found = sorted(out.glob("*.json"))
    return {"status": "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
            "json": [json.loads(p.read_text()) for p in found][:1], "files": [str(p) for p in out.glob("*")],
            "stderr_tail": proc.stderr[-2000:]}


@task(name="profile-throughput", cache_policy=NO_CACHE)
def profile_throughput(backbone_ref: str, codec_dir: str | None, config: dict[str, Any]) -> dict[str, Any]:
    return measure_throughput(backbone_ref, codec_dir, config)
