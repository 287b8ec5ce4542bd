"""How many online steps LowRAM's value fit needs from each start (SmolLM2-135M, CPU).

For held-out blocks of the offline corpus (the ones `rkv lowram-init` measures on), every layer and KV
head's predictor is fitted to that context from Slim's W_K^+ W_V, from the warm start and from the
meta-init of a saved `rkv lowram-init` folder, and its relative value error |f(k) - v|^2 / |v|^2 (mean
over layers and heads, before residuals) is read after each step count. The seconds of one fit per step
(all 30 layers, 1 context, this process's threads) convert steps into prefill time. Writes JSON and a plot.

    python benchmarks/lowram_fit_steps.py [--starts FOLDER] [--heldout 2] [--out benchmarks/results/lowram/fit_steps.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.config import LowRAMConfig  # noqa: E402
from residualkv.lowram.meta import capture_pairs, heldout_errors, slim_starts  # noqa: E402
from residualkv.lowram.starts import PredictorStarts  # noqa: E402
from residualkv.lowram.values import Predictor, fit_predictor  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402


def stacked(per_layer: list[Predictor]) -> Predictor:
    return Predictor(*(torch.cat(ts) for ts in zip(*per_layer)))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, errs in result["relative_value_error"].items():
        steps = [int(k) for k in errs]
        ax.plot([max(k, 0.5) for k in steps], list(errs.values()), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("online Adam steps (0 plotted at 0.5)")
    ax.set_ylabel("relative value error |f(k) - v|² / |v|²")
    ax.set_title(f"LowRAM's value fit by start: {result['backbone']}, {result['heldout_contexts']} held-out × "
                 f"{result['tokens']} tokens", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--starts", default=None, help="an `rkv lowram-init` folder (default: the newest for the model)")
    ap.add_argument("--heldout", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", default="0,1,2,5,10,25,50,100,150")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/lowram/fit_steps.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot of an existing --out")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = [int(s) for s in args.steps.split(",")]
    model, tok, _ = load_backbone(args.backbone)
    saved = PredictorStarts.resolve(args.starts, model)
    ids = torch.tensor(pack_documents(resolve_source("offline"), tok, args.seq_len).heldout.select(
        range(args.heldout))["input_ids"])
    cfg = LowRAMConfig()
    keys, values = capture_pairs(model, ids, cfg)
    starts = {"slim": slim_starts(model, cfg, torch.Generator().manual_seed(0)),
              "warm": stacked(saved.layers["warm"]), "meta": stacked(saved.layers["meta"])}
    t0 = time.perf_counter()
    fit_predictor(keys[0], values[0], starts["meta"], steps=10, lr=cfg.lr)
    s_per_step = (time.perf_counter() - t0) / 10
    errors = heldout_errors(starts, keys, values, steps, cfg.lr)
    result = {"backbone": args.backbone, "starts": saved.meta["path"], "heldout_contexts": args.heldout,
              "tokens": args.seq_len, "relative_value_error": errors, "fit_seconds_per_step": s_per_step,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("steps  " + "  ".join(f"{k:>6}" for k in steps))
    for name, errs in errors.items():
        print(f"{name:5s}  " + "  ".join(f"{errs[str(k)]:6.3f}" for k in steps))
    print(f"one step of all layers' fits: {s_per_step:.3f} s ({torch.get_num_threads()} threads)")

    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
