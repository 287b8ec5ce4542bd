"""CPU decode speed: full FP16 cache vs ResidualKV standalone vs ResidualKV + OmniKV (issue #4).

All three run side by side in one process on the same prompt: one dense prefill fills the full cache;
a ResidualKV cache is filled from that prefill's keys and values (`cache.update`: the bytes a
compressed prefill would store, without paying the model's prefill again; compressing during a real
prefill would feed the codec's error forward, which does not change decode speed), and
`ResidualKVCache.fork(mode="omnikv")` copies those bytes for the OmniKV deployment.
Then every method decodes greedily from its own cache; per round each method runs N steps
(rounds interleave the methods so that load on the shared CPU hits them alike), after W warm-up
steps. tokens/s = 1 / median step time over all rounds. Tokens reconstructed per step (latent codes
decoded + references read, summed over the compressed layers) come from the cache's own counters.

    python benchmarks/decode_speed.py            # 2K, 4K, 8K tokens of context
    python benchmarks/decode_speed.py --quick    # smoke test: 256 and 512 tokens
    python benchmarks/decode_speed.py --values-first   # + each deployment with its values decoded before
                                                       #   the softmax, to time LatentValues side by side
    python benchmarks/decode_speed.py --lowram         # + LowRAM (4x) and LowRAM-SR (4x, selective reconstruction)
                                                       #   fitted to the same prefill, beside them
                                                       #   (--lowram-methods: any lowram-*; LowRAM-E's prefill runs
                                                       #   through the model, its eviction needs the queries)
    python benchmarks/decode_speed.py --reuse          # + ResidualKV + OmniKV with select_reuse (the sparse layers
                                                       #   keep their reconstructed tokens between steps)
    python benchmarks/decode_speed.py --ratios 8       # + ResidualKV + OmniKV selecting 8% of the history per step
                                                       #   (`rkv eval`'s residualkv-r8, issue #4's CR <= 30% setting)

Writes benchmarks/results/decode_speed_cpu{_quick}.json and a PNG plot next to it.
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

from transformers import DynamicCache  # noqa: E402

from residualkv import accounting  # noqa: E402
from residualkv.attention import install  # noqa: E402
from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.cache import ResidualKVCache  # noqa: E402
from residualkv.cli import base_config, context_ids, latest_codec_path, untrained_codec  # noqa: E402
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.methods import build_cache  # noqa: E402
from trees import describe  # noqa: E402

METHODS = ("full", "residualkv-standalone", "residualkv+omnikv")
VALUES_FIRST = ":values-first"  # --values-first: a deployment read with the values decoded before the softmax
REUSE = "residualkv+omnikv:reuse"  # --reuse: OmniKV's sparse layers with their reuse buffer (select_reuse)
RATIO = "residualkv+omnikv-r"  # --ratios NN: OmniKV choosing NN% of the history per step, not a token count


def get_codec(model, spec, cfg, path=None):
    path = path or latest_codec_path(spec.name)
    if path is not None:
        return ResidualCodec.load(path, model_config=model.config), f"trained ({path})"
    return untrained_codec(model, spec, cfg), (f"untrained, backbone dims d_c={spec.codec['d_c']} "
                                               f"d_ff={spec.codec['d_ff']} (no trained codec found; decode speed "
                                               "does not depend on the weights)")


@torch.no_grad()
def fill_from(full: DynamicCache, cache: ResidualKVCache, n: int, chunk: int = 1024) -> float:
    """Store the prompt's keys/values (already rotated, as the model hands them over) in `cache`."""
    t0 = time.perf_counter()
    for s in range(0, n, chunk):
        pos = torch.arange(s, min(n, s + chunk))[None]
        for i, layer in enumerate(full.layers):
            cache.update(layer.keys[:, :, s : s + chunk], layer.values[:, :, s : s + chunk], i, position_ids=pos)
    return time.perf_counter() - t0


@torch.no_grad()
def decode_steps(model, cache, token: torch.Tensor, n: int) -> tuple[list[float], torch.Tensor]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return times, token


def run_context(model, tok, codec, cfg, ctx: int, args) -> dict:
    ids = context_ids(tok, ctx)
    full = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with torch.no_grad():
        first = model(input_ids=ids, cache=full, use_cache=True).logits[:, -1:].argmax(-1)
    prefill_s = time.perf_counter() - t0
    standalone = ResidualKVCache.from_model(model, codec, cfg, mode="standalone")
    fill_s = fill_from(full, standalone, ctx)
    caches = {"full": full, "residualkv-standalone": standalone,
              "residualkv+omnikv": standalone.fork(mode="omnikv", select_budget=args.budget, n_recent=args.recent)}
    if args.reuse:
        caches[REUSE] = standalone.fork(mode="omnikv", select_budget=args.budget, n_recent=args.recent,
                                        select_reuse=True)
    for pct in args.ratios:
        caches[f"{RATIO}{pct}"] = standalone.fork(mode="omnikv", select_ratio=pct / 100, n_recent=args.recent)
    lowram_fill_s = {}
    if args.lowram:  # the prompt handed over in one call, as LowRAM's prefill sees it; the fit happens here
        for name in args.lowram_methods.split(","):
            caches[name] = build_cache(name, model)
            if caches[name].config.evict_keep is None:
                lowram_fill_s[name] = fill_from(full, caches[name], ctx, chunk=ctx)
                continue
            # LowRAM-E votes with the prefill's queries, which a hand-over of keys and values lacks: a real prefill
            t0 = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, cache=caches[name], use_cache=True)
            lowram_fill_s[name] = time.perf_counter() - t0
    if args.values_first:  # the same deployments with the values decoded before the softmax (no LatentValues)
        for name in METHODS[1:]:
            caches[name + VALUES_FIRST] = caches[name].fork()
            caches[name + VALUES_FIRST].latent = None
    tokens = {name: first.clone() for name in caches}
    times: dict[str, list[float]] = {name: [] for name in caches}
    for name, c in caches.items():  # warm-up
        _, tokens[name] = decode_steps(model, c, tokens[name], args.warmup)
    steps_before = {name: len(c.layers[-1].decode_log) for name, c in caches.items() if name != "full"}
    for _ in range(args.repeats):
        for name, c in caches.items():
            t, tokens[name] = decode_steps(model, c, tokens[name], args.steps)
            times[name].extend(t)
    out = {"context": ctx, "prefill_full_s": prefill_s, "fill_s": fill_s, "methods": {}}
    if args.lowram:
        out["lowram_fill_s"] = lowram_fill_s
        out["lowram_key_ranks"] = {name: caches[name].key_ranks for name in lowram_fill_s}
    for name, c in caches.items():
        med = statistics.median(times[name])
        rec = {"median_step_s": med, "tokens_per_s": 1.0 / med, "step_times_s": times[name]}
        if name.startswith("lowram"):
            # a step rebuilds each layer's prompt keys (A B) and values (f + residuals): all of them, or with
            # selective reconstruction the chosen chunks (with the reuse buffer, those the step before lacked),
            # as counted by the cache
            rep = accounting.report(c)
            sel = rep["selective"]
            rebuilt = (statistics.mean(sel["tokens_rebuilt_per_step"][steps_before[name]:]) if sel is not None
                       else sum(layer.stores[0].n_prompt for layer in c.layers))
            rec.update({"kr_measured": rep["kr_measured"], "cr": rep["cr"],
                        "tokens_reconstructed_per_step": rebuilt,
                        "reuse_buffer_vs_fp16": rep["working_vs_fp16"],
                        "tokens_attended_per_step_all_layers": statistics.mean(
                            rep["tokens_attended_per_step"][steps_before[name]:])})
        elif name != "full":
            rep = accounting.report(c)
            per_step = rep["tokens_reconstructed_per_step"][steps_before[name]:]
            attended = rep["tokens_attended_per_step"][steps_before[name]:]
            history = rep["history_tokens_per_step"][steps_before[name]:]
            rec.update({"kr_measured": rep["kr_measured"], "cr": rep["cr"], "cr_formula": rep["cr_formula"],
                        "working_vs_fp16": rep["working_vs_fp16"],
                        "latent_value_layer_steps": c.latent.steps if c.latent is not None else 0,
                        "tokens_reconstructed_per_step": statistics.mean(per_step),
                        "tokens_reconstructed_per_step_per_sparse_layer": _per_sparse_layer(rep, cfg),
                        "history_tokens_per_step_all_layers": statistics.mean(history),
                        "tokens_attended_per_step_all_layers": statistics.mean(attended)})
        else:
            rec.update({"kr_measured": 1.0, "cr": 1.0, "tokens_reconstructed_per_step": 0})
        out["methods"][name] = rec
    base = out["methods"]["full"]["tokens_per_s"]
    for rec in out["methods"].values():
        rec["speed_vs_full"] = rec["tokens_per_s"] / base
    return out


def _per_sparse_layer(rep, cfg) -> float:
    per = rep["reconstruction_per_layer_per_step"]
    ids = [i for i in per if int(i) not in cfg.full_attention_layers]
    return statistics.mean(per[i]["codes_decoded"] + per[i]["refs_read"] for i in ids) if ids else 0.0


def table(results: list[dict]) -> str:
    lines = [f"{'context':>7} {'method':37} {'tok/s':>8} {'vs full':>8} {'KR':>7} {'CR':>7} "
             f"{'reconstructed/step':>19} {'per sparse layer':>17}"]
    for r in results:
        for name, m in r["methods"].items():
            lines.append(f"{r['context']:>7} {name:37} {m['tokens_per_s']:8.2f} {m['speed_vs_full']:7.2f}x "
                         f"{m['kr_measured']:7.1%} {m['cr']:7.1%} {m['tokens_reconstructed_per_step']:19,.0f} "
                         f"{m.get('tokens_reconstructed_per_step_per_sparse_layer', 0):17,.0f}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ctx = [r["context"] for r in results]
    names = [*METHODS, REUSE, *(n for n in results[0]["methods"] if n.startswith((RATIO, "lowram")))]
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
              "tab:olive", "tab:cyan")
    for name, color in zip(names, colors):
        if name not in results[0]["methods"]:
            continue
        a.plot(ctx, [r["methods"][name]["tokens_per_s"] for r in results], marker="o", label=name, color=color)
        if name != "full":
            b.plot(ctx, [r["methods"][name]["tokens_reconstructed_per_step"] for r in results], marker="o", label=name,
                   color=color)
    a.set(xlabel="context tokens", ylabel="decode tokens/s (median)", xscale="log", title="CPU decode speed")
    b.set(xlabel="context tokens", ylabel="tokens reconstructed per step", xscale="log", yscale="log",
          title="tokens rebuilt per step, all compressed layers\n(ResidualKV: codes + references; LowRAM: prompt tokens)",
          )
    for ax in (a, b):
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _percents(text: str) -> list[int]:
    try:
        pcts = [int(x) for x in text.split(",") if x]
    except ValueError:
        pcts = []
    if not pcts or not all(0 < pct <= 100 for pct in pcts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of whole percents in 1..100 "
                                         "(e.g. --ratios 8 selects 8% of the history per step)")
    return pcts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: contexts 256 and 512, fewer steps")
    p.add_argument("--contexts", type=int, nargs="*", default=None)
    p.add_argument("--steps", type=int, default=None, help="decode steps per method per round")
    p.add_argument("--repeats", type=int, default=None, help="rounds (methods interleaved)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--codec", type=Path, default=None,
                   help="codec directory (default: the latest trained one for the backbone, else an untrained one)")
    p.add_argument("--values-first", action="store_true",
                   help="also time each ResidualKV deployment with its values decoded before the softmax "
                        "(cache.latent = None), side by side: what decoding them after it (LatentValues) saves")
    p.add_argument("--lowram", action="store_true",
                   help="also time the --lowram-methods (their 150-step fits to the prompt are not timed as decode)")
    p.add_argument("--lowram-methods", default="lowram,lowram-sr",
                   help="with --lowram: comma list of LowRAM methods (default: lowram,lowram-sr; e.g. + lowram-sr16)")
    p.add_argument("--ratios", type=_percents, default=[],
                   help="comma list of percents: also time ResidualKV + OmniKV selecting that share of the history "
                        "per step (as rkv eval's residualkv-rNN), beside the --budget row")
    p.add_argument("--reuse", action="store_true",
                   help=f"also time {REUSE}: ResidualKV + OmniKV whose sparse layers keep their reconstructed tokens "
                        "and decode only those a step adds (select_reuse; working memory reported as working_vs_fp16)")
    p.add_argument("--budget", type=int, default=2048, help="OmniKV tokens chosen per step (besides sinks/recent)")
    p.add_argument("--recent", type=int, default=128)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared, oversubscribed CPU more threads spin and run slower)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--replot", type=Path, default=None, help="only redraw the table and plot of an existing JSON")
    args = p.parse_args(argv)
    if args.replot:
        payload = json.loads(args.replot.read_text())
        print(table(payload["results"]))
        plot(payload["results"], args.replot.with_suffix(".png"), payload.get("plot_note", ""))
        return 0
    if args.quick:
        args.contexts = args.contexts or [256, 512]
        args.steps, args.repeats = args.steps or 3, args.repeats or 2
        args.budget = min(args.budget, 64)
        args.recent = min(args.recent, 32)
    args.contexts = args.contexts or [2048, 4096, 8192]
    args.steps, args.repeats = args.steps or 4, args.repeats or 3
    torch.set_num_threads(args.threads)
    out_json = args.out or ROOT / "benchmarks" / "results" / f"decode_speed_cpu{'_quick' if args.quick else ''}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)

    model, tok, spec = load_backbone("smollm2-135m")
    install(model)  # "residualkv_sparse" = SDPA for the full cache; the sparse path for the OmniKV cache
    cfg = base_config(spec)
    codec, codec_note = get_codec(model, spec, cfg, args.codec)
    load = os.getloadavg()
    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads, load average {load[0]:.1f} "
          f"on {os.cpu_count()} cores (shared machine: absolute numbers move with the load, ratios less so)")
    print(f"codec: {codec_note}")
    print(f"OmniKV: budget {args.budget} + {cfg.n_sink} sinks + {args.recent} recent; filter layers "
          f"{list(cfg.full_attention_layers)}; {args.warmup} warm-up + {args.repeats} rounds x {args.steps} steps")
    results = []
    t_all = time.perf_counter()
    for ctx in args.contexts:
        r = run_context(model, tok, codec, cfg, ctx, args)
        results.append(r)
        print(f"  {ctx} tokens done ({time.perf_counter() - t_all:.0f}s; full prefill {r['prefill_full_s']:.1f}s, "
              f"compressing it {r['fill_s']:.1f}s)", flush=True)
    print(table(results))
    note = (f"SmolLM2-135M fp32, CPU {torch.get_num_threads()} threads (shared, load {load[0]:.1f}); codec: "
            f"{codec_note.split(' (')[0]}; OmniKV budget {args.budget}+{cfg.n_sink}+{args.recent}"
            + "".join(f"; -r{pct}: {pct}% of the history+{cfg.n_sink}+{args.recent}" for pct in args.ratios))
    payload = {"benchmark": "decode_speed_cpu", "backbone": "smollm2-135m", "dtype": "float32", "codec": codec_note,
               "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_average_start": load,
               "load_average_end": os.getloadavg(), "machine": platform.machine(), "torch": torch.__version__,
               "commit": describe(ROOT),
               "values_first_rows": args.values_first, "reuse_rows": args.reuse,
               "lowram_rows": args.lowram_methods.split(",") if args.lowram else False,
               "ratio_rows": [f"{RATIO}{pct}" for pct in args.ratios],
               "omnikv": {"select_budget": args.budget, "n_sink": cfg.n_sink, "n_recent": args.recent,
                          "filter_layers": list(cfg.full_attention_layers)},
               "protocol": {"warmup_steps": args.warmup, "rounds": args.repeats, "steps_per_round": args.steps,
                            "statistic": "median step time", "fill": "ResidualKV cache filled from the full "
                            "prefill's K/V through cache.update; the OmniKV cache is a fork() of it"},
               "results": results, "wall_s": time.perf_counter() - t_all, "plot_note": note}
    out_json.write_text(json.dumps(payload, indent=2))
    plot(results, out_json.with_suffix(".png"), note)
    print(f"wrote {out_json} and {out_json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
