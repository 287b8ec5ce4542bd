"""What storing a decode step's token costs: `torch.cat` onto the stored tensors (the stores before
residualkv.growing) against appending in place (`Growing`), side by side in one process.

One compressed layer's store holds N tokens: an FP8 reference every `stride` tokens, and for every
other token its packed INT4 latent, FP16 mins/scales (groups of 32) and bit-packed reference indices
(k = 4), with the shapes of the real cache. Then S decode steps each store one token, the way
`ResidualStore._code` does (a reference or a code). Per step: median time, and the bytes the step
copies (torch.cat copies every stored byte; `Growing` copies the new token, plus, when it runs out
of room, everything once into a buffer an eighth larger: counted where it happens). The time is the
append alone: encoding, top-k and attention are the same either way.

    python benchmarks/append_cost.py            # SmolLM2-135M (CPU here) and Llama-3.1-8B shapes
    python benchmarks/append_cost.py --quick    # smoke test

Writes benchmarks/results/append_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.growing import Growing  # noqa: E402
from residualkv.quant import Packed, index_bits, pack_indices  # noqa: E402

SHAPES = {  # d_kv = 2 * KV heads * head dim; d_c: the latent; layers: compressed layers of the model
    "smollm2-135m": dict(d_kv=384, d_c=160, stride=11, layers=25),
    "llama-3.1-8b": dict(d_kv=2048, d_c=512, stride=10, layers=27),
}
K, GROUP = 4, 32


def _fields(n_tok: int, d_kv: int, d_c: int, stride: int, dev) -> dict[str, torch.Tensor]:
    R = (n_tok + stride - 1) // stride
    C = n_tok - R
    g = d_c // GROUP
    u8 = dict(dtype=torch.uint8, device=dev)
    return {"refs": torch.randint(0, 255, (1, R, d_kv), **u8),
            "codes": Packed(torch.randint(0, 255, (1, C, d_c // 2), **u8),
                            torch.randn(1, C, g, device=dev).half(), torch.rand(1, C, g, device=dev).half()),
            "ref_idx": pack_indices(torch.randint(0, R, (1, C, K), device=dev), index_bits(R)).data}


def _nbytes(x) -> int:
    ts = list(x) if isinstance(x, tuple) else [x]
    return sum(t.numel() * t.element_size() for t in ts)


def _cat(old, new):
    if isinstance(old, tuple):
        return type(old)(*(torch.cat([a, b], 1) for a, b in zip(old, new)))
    return torch.cat([old, new], 1)


def run_shape(name: str, n_tok: int, steps: int, dev) -> dict:
    s = SHAPES[name]
    d_kv, d_c, stride = s["d_kv"], s["d_c"], s["stride"]
    start = _fields(n_tok, d_kv, d_c, stride, dev)
    ref_tok = start["refs"][:, :1].clone()
    code_tok = {"codes": Packed(*(t[:, :1].clone() for t in start["codes"])), "ref_idx": start["ref_idx"][:, :1].clone()}
    cat_state = {k: (type(v)(*(t.clone() for t in v)) if isinstance(v, tuple) else v.clone()) for k, v in start.items()}
    grow = {k: Growing(dim=1) for k in start}
    for k, v in start.items():
        grow[k].set(type(v)(*(t.clone() for t in v)) if isinstance(v, tuple) else v.clone())

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {"cat": [], "growing": []}
    copied = {"cat": 0, "growing": 0}
    for i in range(steps):
        is_ref = (n_tok + i) % stride == 0
        new = {"refs": ref_tok} if is_ref else code_tok
        # interleaved: the two ways take turns on the same step, under the same load
        sync()
        t0 = time.perf_counter()
        for k, x in new.items():
            cat_state[k] = _cat(cat_state[k], x)
        sync()
        times["cat"].append(time.perf_counter() - t0)
        copied["cat"] += sum(_nbytes(cat_state[k]) for k in new)
        caps = {k: grow[k].bufs[0].shape[1] for k in new}
        held = {k: _nbytes(grow[k].get()) for k in new}
        sync()
        t0 = time.perf_counter()
        for k, x in new.items():
            grow[k].append(x)
        sync()
        times["growing"].append(time.perf_counter() - t0)
        copied["growing"] += sum(_nbytes(x) + (held[k] if grow[k].bufs[0].shape[1] != caps[k] else 0) for k, x in new.items())
    for k in start:  # same bytes either way
        a, b = cat_state[k], grow[k].get()
        assert all(torch.equal(x, y) for x, y in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]))
    stored = sum(_nbytes(grow[k].get()) for k in start)
    spare = sum(grow[k].spare_bytes() for k in start)
    out = {"shape": name, **s, "tokens": n_tok, "steps": steps, "stored_bytes_per_layer": stored,
           "spare_bytes_per_layer": spare}
    for way in ("cat", "growing"):
        med = statistics.median(times[way])
        out[way] = {"median_ms_per_layer_step": med * 1e3, "mean_ms_per_layer_step": statistics.mean(times[way]) * 1e3,
                    "bytes_copied_per_layer_step": copied[way] / steps,
                    "ms_per_step_all_layers": statistics.mean(times[way]) * 1e3 * s["layers"]}
    out["mean_time_ratio_cat_over_growing"] = out["cat"]["mean_ms_per_layer_step"] / out["growing"]["mean_ms_per_layer_step"]
    out["bytes_ratio_cat_over_growing"] = out["cat"]["bytes_copied_per_layer_step"] / out["growing"]["bytes_copied_per_layer_step"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, nargs="*", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    tokens = args.tokens or ([1024, 4096] if args.quick else [8192, 32768, 131072])
    steps = args.steps or (40 if args.quick else 300)
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':14} {'tokens':>7} {'cat ms':>8} {'grow ms':>8} {'x':>6} {'cat MB':>8} {'grow MB':>8} {'spare':>6}"
          "   (per layer and decode step; mean)")
    for name in SHAPES:
        for n in tokens:
            r = run_shape(name, n, steps, dev)
            rows.append(r)
            print(f"{name:14} {n:7d} {r['cat']['mean_ms_per_layer_step']:8.3f} {r['growing']['mean_ms_per_layer_step']:8.3f} "
                  f"{r['mean_time_ratio_cat_over_growing']:5.0f}x {r['cat']['bytes_copied_per_layer_step'] / 1e6:8.2f} "
                  f"{r['growing']['bytes_copied_per_layer_step'] / 1e6:8.3f} "
                  f"{r['spare_bytes_per_layer'] / r['stored_bytes_per_layer']:6.1%}", flush=True)
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()}, {args.threads} thread)"
    tag = "quick" if args.quick else ("cuda" if dev.type == "cuda" else "cpu")
    out = args.out or ROOT / "benchmarks" / "results" / f"append_cost_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "append_cost", "device": device, "torch": torch.__version__,
                               "protocol": "one compressed layer's store holding N tokens; S decode-step appends, "
                                           "torch.cat and Growing interleaved per step; time of the append alone",
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
