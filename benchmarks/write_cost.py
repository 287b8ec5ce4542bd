"""What a decode step's write to one compressed layer costs, for one tree or several side by side.

One ResidualKV layer of SmolLM2-135M's shape (the default codec's dims, untrained: seed 0; the write
does the same work whatever the weights) is filled with N random tokens through the cache, then S
single-token writes follow, as decode steps make them (top-k search over the stored references, the
mean of the chosen ones, encode, quantise and pack, append). Reported: the median write time.
`--part step` times the layer's whole decode step instead: the cache's update (that write, then the
read of every stored token, values latent where the tree has LatentValues) and residualkv's attention
function over what it returns, for one query token.

With several `--tree`s (checkouts of the library, e.g. a `git worktree` of the commit before a change)
each tree runs in its own process, the trees alternating `--runs` times, so that load on the machine
hits them alike:

    python benchmarks/write_cost.py                                   # this checkout
    python benchmarks/write_cost.py --tree /tmp/before --tree . --runs 2

Writes benchmarks/results/write_cost_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trees import HERE, check_tree, describe, use_tree


def measure(tree: str, context: int, steps: int, layer: int, part: str = "write") -> dict:
    root = use_tree(tree)
    import torch

    torch.set_num_threads(1)
    from residualkv.backbones import load_backbone
    from residualkv.cache import ResidualKVCache
    from residualkv.cli import base_config, untrained_codec

    check_tree(root)
    model, _, spec = load_backbone("smollm2-135m")
    cfg = base_config(spec)
    if layer in cfg.full_attention_layers:
        raise SystemExit(f"--layer {layer} is a full-attention (KIVI) layer; pick a compressed one")
    torch.manual_seed(0)
    cache = ResidualKVCache.from_model(model, untrained_codec(model, spec, cfg), cfg, mode="standalone")
    H = model.config.num_key_value_heads
    D = model.config.hidden_size // model.config.num_attention_heads
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, H, context, D, generator=g), torch.randn(1, H, context, D, generator=g)
    with torch.no_grad():
        for s in range(0, context, 1024):
            cache.update(k[:, :, s : s + 1024], v[:, :, s : s + 1024], layer,
                         position_ids=torch.arange(s, min(context, s + 1024))[None])
        store = cache.layers[layer].stores[0]
        times = []
        if part == "step":
            from residualkv.attention import sparse_attention_forward

            attn = model.model.layers[layer].self_attn
            Hq = model.config.num_attention_heads
        for i in range(steps):
            if part == "write":
                kv = torch.randn(1, 1, 2 * H * D, generator=g)
                t0 = time.perf_counter()
                store.write(kv)
            else:
                k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
                q = torch.randn(1, Hq, 1, D, generator=g)
                t0 = time.perf_counter()
                k_all, v_all = cache.update(k1, v1, layer, position_ids=torch.tensor([[context + i]]))
                sparse_attention_forward(attn, q, k_all, v_all, None, scaling=attn.scaling)
            times.append(time.perf_counter() - t0)
    latent = getattr(cache, "latent", None)  # the steps whose values were read latent (LatentValues)
    return {"tree": str(root), "commit": describe(root), "context": context, "steps": steps, "part": part,
            "latent_steps": latent.steps if latent is not None else 0,
            "median_write_ms": statistics.median(times) * 1e3, "p10_write_ms": sorted(times)[len(times) // 10] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append",
                   help="checkout root to import from (repeat to compare; default: this one)")
    p.add_argument("--context", type=int, default=8192, help="tokens stored before the timed writes")
    p.add_argument("--steps", type=int, default=400, help="timed single-token writes")
    p.add_argument("--layer", type=int, default=3, help="a compressed layer of the backbone")
    p.add_argument("--part", choices=("write", "step"), default="write",
                   help="write: the store's write alone; step: the layer's update (write + read) and its attention")
    p.add_argument("--runs", type=int, default=1, help="processes per tree, alternating between the trees")
    p.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "write_cost_cpu.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one tree in this process, print JSON
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.context, args.steps, args.layer, args.part)))
        return
    trees = [str(Path(t).resolve()) for t in (args.tree or [str(HERE)])]
    runs = []
    for r in range(args.runs):
        for t in trees:
            cmd = [sys.executable, __file__, "--one", t, "--context", str(args.context), "--steps", str(args.steps),
                   "--layer", str(args.layer), "--part", args.part]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            res = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"run {r + 1}/{args.runs} {t} ({res['commit']}): median {res['median_write_ms']:.3f} ms per {args.part}",
                  flush=True)
            runs.append(res)
    summary = {f"{t} ({next(x['commit'] for x in runs if x['tree'] == t)})":
               statistics.median(x["median_write_ms"] for x in runs if x["tree"] == t) for t in trees}
    payload = {"benchmark": "write_cost_cpu", "backbone": "smollm2-135m", "threads": 1, "machine": platform.machine(),
               "part": args.part, "context": args.context, "steps": args.steps, "layer": args.layer, "runs": runs,
               "median_write_ms_by_tree": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    for t, ms in summary.items():
        print(f"{t}: {ms:.3f} ms per {args.part} (median over runs)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
