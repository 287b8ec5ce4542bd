"""Rescale a codec's decoder so the stored residual keeps the true residual's energy (diagnostic, CPU).

A least-squares decoder shrinks what it cannot predict towards zero: the Fisher-PCA init keeps only ~90%
of the residual energy (`error_budget.py`, `energy_ratio`), the joint-trained codec all of it. This
writes a copy of CODEC whose decoder rows are scaled per layer and per half (keys, values) so that
‖d̂‖² = ‖d‖² on calibration blocks from the *training* split, so that `rkv eval` can show whether
energy alone is what joint training buys:

    python benchmarks/energy_matched_codec.py CODEC OUT_CODEC [--halves both|keys|values] [--blocks 2]
    rkv eval --codec OUT_CODEC --methods full,residualkv-standalone --context-len 2048 --json OUT.json

The copy keeps CODEC's config and fingerprint; it has the same bytes per token (only W_d changes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.quant import dequantize, quantize  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402
from residualkv.training.warmstart import capture_kv, residual_pairs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codec")
    ap.add_argument("out")
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--halves", choices=("both", "keys", "values"), default="both")
    ap.add_argument("--blocks", type=int, default=2, help="training blocks of --seq-len tokens to calibrate on")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok, _ = load_backbone(args.backbone)
    codec = ResidualCodec.load(args.codec, model.config)
    cfg = codec.config
    packed = pack_documents(resolve_source(None), tok, args.seq_len)
    blocks = torch.tensor(packed.train[: args.blocks]["input_ids"])
    kv = capture_kv(model, blocks, codec.layer_ids)
    for li in codec.layer_ids:
        x, mean = residual_pairs(kv[li], cfg)
        layer = codec.layer(li)
        with torch.no_grad():
            z = layer.encode(x, mean).float()
            d_hat = layer.decode(dequantize(quantize(z, cfg.bits, cfg.group_size), cfg.bits, cfg.group_size)).float()
            d, h = x - mean, x.shape[-1] // 2
            for name, half in (("keys", slice(0, h)), ("values", slice(h, None))):
                if args.halves not in ("both", name):
                    continue
                scale = float((d[:, half].pow(2).sum() / d_hat[:, half].pow(2).sum()).sqrt())
                layer.w_d.weight[half] *= scale
                print(f"layer {li} {name}: decoder x{scale:.3f}")
    codec.save(args.out)
    print(f"energy-matched codec saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
