"""Would another reference search leave less for the codec? (diagnostic, SmolLM2-135M, no codec needed)

The write path picks each token's k references by L2 distance over its whole pre-RoPE key‖value, where the
keys' RMS is 2-4x the values', so the search follows the keys. This captures held-out blocks' true K‖V
of every compressed layer and, through the cache's own write path (schedule, FP8 references, top-k,
mean), measures what the reference mean alone leaves of each half's energy, ||mean - x||^2 / ||x||^2,
when the search distance is taken over
  concat             the stored key‖value (what the cache does)
  halves-normalised  keys and values each divided by their RMS over the layer
  keys-only          the keys alone
  values-only        the values alone (the best any reference choice of this kind can do for values)
The mean is always of the same key‖value rows; only which references are picked changes. References are
held in FP16 here for every search (FP8 would flush a down-weighted half to zero; its own rounding is
0.07% of the energy, see error_budget.py).

    python benchmarks/ref_search_probe.py [--blocks 2] [--out benchmarks/results/diagnostics/ref_search.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.config import load_codec_defaults  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402
from residualkv.training.warmstart import capture_kv, residual_pairs  # noqa: E402

# a half weighted 1e-3 adds a millionth to the distance: the search runs on the other half alone
SEARCHES = {"concat": None, "halves-normalised": "rms", "keys-only": (1.0, 1e-3), "values-only": (1e-3, 1.0)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def layer_rows(x: torch.Tensor, cfg) -> dict:
    d = x.shape[-1] // 2
    rms_k, rms_v = (float(h.pow(2).mean().sqrt()) for h in (x[..., :d], x[..., d:]))
    out = {"rms_keys": rms_k, "rms_values": rms_v}
    for name, how in SEARCHES.items():
        if how is None:
            xs, m = residual_pairs(x, cfg)
        else:
            wk, wv = (1 / rms_k, 1 / rms_v) if how == "rms" else how
            w = torch.cat([torch.full((d,), wk), torch.full((d,), wv)])
            xs, m = residual_pairs(x * w, cfg)  # the mean of the picked rows, scaled back: the same rows' mean
            xs, m = xs / w, m / w
        out[name] = {"keys": rel(m[:, :d], xs[:, :d]), "values": rel(m[:, d:], xs[:, d:])}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2, help="held-out blocks of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/diagnostics/ref_search.json")
    args = ap.parse_args()
    model, tok, spec = load_backbone("smollm2-135m")
    cfg = load_codec_defaults(spec.codec, list(spec.full_attention_layers)).replace(ref_format="fp16")
    blocks = torch.tensor(pack_documents(resolve_source(None), tok, args.seq_len).heldout[: args.blocks]["input_ids"])
    layers = [i for i in range(model.config.num_hidden_layers) if i not in spec.full_attention_layers]
    kv = capture_kv(model, blocks, layers)
    rows = {i: layer_rows(kv[i], cfg) for i in layers}
    mean = {name: {h: sum(r[name][h] for r in rows.values()) / len(rows) for h in ("keys", "values")}
            for name in SEARCHES}
    for name, m in mean.items():
        print(f"{name:18s} reference mean leaves keys {m['keys']:.3f}, values {m['values']:.3f} of their energy")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"backbone": spec.name, "blocks": args.blocks, "seq_len": args.seq_len,
                                    "stride": cfg.stride, "k": cfg.k, "mean_over_layers": mean,
                                    "layers": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
