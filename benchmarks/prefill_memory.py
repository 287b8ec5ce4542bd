"""CPU prefill speed and tensor memory: every method against the full cache, side by side (SPEC §5).

Each method prefills the same prompt through the model with its own cache (a real compressed prefill:
the codec encodes while the prompt runs), then decodes greedily. Two passes per method and context,
methods interleaved in each:
- timed: prefill tokens/s, then decode tokens/s (median over the steps after a warm-up step);
- traced (residualkv.memory, torch's allocator events; slower, so not timed): the prefill's peak
  tensor memory above where it began (the cache it builds plus the activations and the compression's
  working tensors at their worst), the peak of a decode step above the level before it (what a step
  needs beyond the cache), and what the cache holds at the end, beside the accounting's `held_bytes`
  (stored + spare + working + bookkeeping; `unnamed_bytes` is the difference, 0 when every byte is named).
The model's weights are the same for every method and are not in these figures (`weights_mib`).
Under this float32 model the full cache holds float32 K/V: twice the FP16 bytes KR is measured against.

    python benchmarks/prefill_memory.py                 # 2K, 4K, 8K tokens; full, kivi4, snapkv, ResidualKV
    python benchmarks/prefill_memory.py --quick         # smoke test: 256 and 512 tokens
    python benchmarks/prefill_memory.py --methods full,residualkv-standalone,lowram

Writes benchmarks/results/prefill_memory_cpu{_quick}.json and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv import accounting  # noqa: E402
from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.cli import base_config, context_ids  # noqa: E402
from residualkv.memory import cache_memory, prefill  # noqa: E402
from residualkv.methods import build_cache, get_method  # noqa: E402
from decode_speed import decode_steps, get_codec  # noqa: E402
from trees import describe  # noqa: E402

METHODS = "full,kivi4,snapkv,residualkv-standalone,residualkv"
MIB = 2**20


def timed(model, cache, ids, steps: int, chunk: int | None) -> dict:
    t0 = time.perf_counter()
    token = prefill(model, cache, ids, chunk)
    prefill_s = time.perf_counter() - t0
    times, _ = decode_steps(model, cache, token, steps + 1)  # the first step warms up
    return {"prefill_s": prefill_s, "step_s": statistics.median(times[1:])}


def measured(model, cache, ids, steps: int, chunk: int | None) -> dict:
    mem = cache_memory(model, cache, ids, steps, prefill_chunk=chunk)
    rep = accounting.report(cache)
    return {**mem, "stored_mib": rep["total_bytes"] / MIB, "unnamed_bytes": mem["cache_held_bytes"] - rep["held_bytes"],
            "kr_measured": rep["kr_measured"], "cr": rep.get("cr", 1.0)}


def run_context(model, tok, codec, cfg, ctx: int, methods: list[str], args) -> dict:
    ids = context_ids(tok, ctx)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for m in methods:  # interleaved: load on the shared CPU hits every method alike
            runs[m].append(timed(model, build_cache(m, model, codec, cfg), ids, args.steps, args.prefill_chunk))
    rows = []
    for m in methods:
        prefill_s = statistics.median(r["prefill_s"] for r in runs[m])
        step_s = statistics.median(r["step_s"] for r in runs[m])
        rows.append({"method": m, "context": ctx, "prefill_s": prefill_s, "prefill_tok_s": ctx / prefill_s,
                     "decode_tok_s": 1 / step_s, **measured(model, build_cache(m, model, codec, cfg), ids, args.memory_steps,
                                                           args.prefill_chunk)})
    base = next((r for r in rows if r["method"] == "full"), None)
    for r in rows if base else []:
        r["prefill_vs_full"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_vs_full"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["prefill_peak_vs_full"] = r["prefill_peak_mib"] / base["prefill_peak_mib"]
        r["cache_held_vs_full"] = r["cache_held_mib"] / base["cache_held_mib"]
    return {"context": ctx, "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| context | method | prefill tok/s | vs full | decode tok/s | vs full | KR | prefill peak MiB | vs full "
             "| decode step peak MiB | cache held MiB | vs full | unnamed bytes |", "|" + "---|" * 13]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {r['context']} | {r['method']} | {r['prefill_tok_s']:.0f} | {r.get('prefill_vs_full', 1):.2f}x "
                         f"| {r['decode_tok_s']:.2f} | {r.get('decode_vs_full', 1):.2f}x | {100 * r['kr_measured']:.1f}% "
                         f"| {r['prefill_peak_mib']:.1f} | {r.get('prefill_peak_vs_full', 1):.2f}x "
                         f"| {r['decode_step_peak_mib']:.1f} | {r['cache_held_mib']:.1f} | {r.get('cache_held_vs_full', 1):.2f}x "
                         f"| {r['unnamed_bytes']} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in results[0]["rows"]]
    ctx = [res["context"] for res in results]
    panels = [("prefill_tok_s", "prefill tokens/s"), ("prefill_peak_mib", "prefill peak tensor memory (MiB)"),
              ("cache_held_mib", "cache held after decode (MiB)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, label) in zip(axes, panels):
        for m in methods:
            ax.plot(ctx, [next(r[key] for r in res["rows"] if r["method"] == m) for res in results], "o-", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.set_xlabel("context tokens")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--methods", default=METHODS, help=f"comma-separated method names (default {METHODS})")
    ap.add_argument("--codec", type=Path, default=None, help="codec folder (default: the latest trained one, "
                    "else an untrained codec of the default shape: speed and memory do not depend on the weights)")
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps after one warm-up step")
    ap.add_argument("--memory-steps", type=int, default=2, help="traced decode steps (the peak is their maximum)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds per method (interleaved)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill in calls of this many tokens (methods "
                    "that write incrementally; later chunks attend over the cache as stored)")
    ap.add_argument("--quick", action="store_true", help="256 and 512 tokens, for a smoke test")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)  # an unknown name fails here, with the list of known ones
        if args.prefill_chunk and (m.startswith(("snapkv", "lowram")) or m == "residualkv-snapkv"):
            ap.error(f"--prefill-chunk: {m} compresses or evicts its first call as the whole prompt; leave it out "
                     "or prefill in one call")
    contexts = args.contexts or ([256, 512] if args.quick else [2048, 4096, 8192])
    torch.set_num_threads(args.threads)
    out_json = args.out or ROOT / "benchmarks" / "results" / f"prefill_memory_cpu{'_quick' if args.quick else ''}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)

    model, tok, spec = load_backbone("smollm2-135m")
    cfg = base_config(spec)
    codec, codec_note = get_codec(model, spec, cfg, args.codec)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    load = os.getloadavg()
    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads, load average {load[0]:.1f}; codec: {codec_note}")
    results, t_all = [], time.perf_counter()
    for ctx in contexts:
        results.append(run_context(model, tok, codec, cfg, ctx, methods, args))
        print(f"  {ctx} tokens done ({time.perf_counter() - t_all:.0f}s)", flush=True)
    print(table(results))
    note = (f"SmolLM2-135M fp32, CPU {torch.get_num_threads()} thread(s), load {load[0]:.1f}; weights {weights:.0f} MiB "
            "(not included); tensor memory from torch's allocator events"
            + (f"; prefill in {args.prefill_chunk}-token calls" if args.prefill_chunk else ""))
    payload = {"benchmark": "prefill_memory_cpu", "backbone": "smollm2-135m", "dtype": "float32", "codec": codec_note,
               "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_average_start": load,
               "load_average_end": os.getloadavg(), "machine": platform.machine(), "processor": _cpu_name(),
               "torch": torch.__version__, "commit": describe(ROOT), "weights_mib": weights,
               "prefill_chunk": args.prefill_chunk,
               "protocol": {"timed_rounds": args.repeats, "decode_steps_timed": args.steps, "warmup_steps": 1,
                            "traced_decode_steps": args.memory_steps, "statistic": "median",
                            "memory": "residualkv.memory.traced (torch profiler allocator events, one-op resolution)"},
               "results": results, "wall_s": time.perf_counter() - t_all}
    out_json.write_text(json.dumps(payload, indent=2))
    plot(results, out_json.with_suffix(".png"), note)
    print(f"wrote {out_json} and {out_json.with_suffix('.png')}")
    return 0


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
