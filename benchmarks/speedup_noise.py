"""How far the decode speed-up over the full cache moves between timings on one machine: the noise that
`rkv bench-regress`'s speed gate (flows/bench_regress.py, SPEED_TOLERANCE) must stay clear of.

A version stores the speed-up of the pipeline's timing (the profile's throughput section, full cache and the
registered method side by side in one process, its `repeats` rounds); a self-check re-times it with at least
SPEED_ROUNDS rounds and compares. So this alternates the two kinds of timing, nothing cached, and reports per
length how far a re-timing fell below a stored-style timing at worst: what the tolerance has to clear.

    python benchmarks/speedup_noise.py --codec data/codecs/smollm2-135m/<run>/codec                # quick, 5 + 5
    python benchmarks/speedup_noise.py --codec ... --profile default --times 3 --json out.json

Writes the per-timing rows and the summary as JSON (default benchmarks/results/speedup_noise_<profile>.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_matmul import cpu_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", required=True, help="a saved codec directory for the profile's first backbone")
    ap.add_argument("--profile", default="quick", help="configs/pipelines/<profile>.yaml, or a path to one")
    ap.add_argument("--times", type=int, default=5, help="independent timings (default 5)")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args(argv)
    if args.times < 2:
        ap.error("--times needs at least 2 timings to compare")

    from flows.bench_regress import SPEED_TOLERANCE, gate_timing
    from flows.profiles import load_profile
    from tasks.backbones import resolve_backbone
    from tasks.measure import measure_throughput

    prof = load_profile(args.profile)
    ref = resolve_backbone(prof.backbones[0])
    method = prof.registry["method"]
    stored = dict(prof.throughput) | {"methods": ["full", method]}
    gate = gate_timing(prof.throughput, method)
    runs: dict[str, list] = {"stored": [], "gate": []}
    t0 = time.perf_counter()
    for i in range(args.times):
        for kind, timing in (("stored", stored), ("gate", gate)):
            rows = measure_throughput(ref, args.codec, timing, use_cache=False, gpu_bench=False)["rows"]
            ratios = {int(r["context_len"]): r["decode_speedup_vs_full"] for r in rows if r["method"] == method}
            runs[kind].append({"rows": rows, "speedup": ratios})
            print(f"timing {i + 1}/{args.times}, {kind} ({timing['repeats']} round(s)): "
                  + ", ".join(f"{n}: {x:.3f}x" for n, x in sorted(ratios.items())), flush=True)
    summary = {}
    for n in sorted(runs["stored"][0]["speedup"]):
        xs = {kind: [r["speedup"][n] for r in rs] for kind, rs in runs.items()}
        drop = 1 - min(xs["gate"]) / max(xs["stored"])
        summary[n] = {"stored_like": xs["stored"], "re_timed": xs["gate"], "worst_drop": drop}
        print(f"{n} tokens: stored-like {min(xs['stored']):.3f}x .. {max(xs['stored']):.3f}x, re-timed "
              f"{min(xs['gate']):.3f}x .. {max(xs['gate']):.3f}x; a re-timing below a stored one by at most "
              f"{drop:.1%} (the gate allows {SPEED_TOLERANCE:.0%})")
    out = Path(args.json or ROOT / "benchmarks" / "results" / f"speedup_noise_{prof.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"profile": prof.name, "codec": args.codec, "stored_timing": stored, "gate_timing": gate,
                               "times": args.times,
                               "host": platform.node(), "cpu": cpu_model(),
                               "seconds": time.perf_counter() - t0, "tolerance": SPEED_TOLERANCE,
                               "summary": summary, "runs": runs}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
